"""numba kernels for GGUF's super-block matrices (quant_types.SUPERBLOCKS: Q6_K, Q5_K, Q4_K) on
int8 activations (kernels/int8_blocks.py wraps them and states the contract; tiles16.py holds
the blocks of 32's; ir.py the IR helpers both build on). Imported on first use; compiled
once, cached on disk (see this package's __init__).

The arithmetic, for one output y[m, n] (`superblock_matmul` in kernels/int8_reference.py performs
the same operations in the same order, bit for bit):
- weights: the file's integers (Q6_K q - 32, Q5_K and Q4_K q) and fp32 scales formed from
  the file's fields exactly (d, dmin: fp16 values); the sub-block scales sc (Q6_K's int8 per
  16, Q5_K's and Q4_K's six bits per 32) and their mins m stay integers;
- activations (activations.py's `quantize_rows_k`; llama.cpp's Q8_K): each super-block u of
  256 of x[m] becomes inv = 127 / max|x|, xq = rint(x * inv) in int8, xs = 1 / inv; with the
  sums of each block's and each four's xq;
- 16 exact int32 lanes per super-block: lane j sums, over u's four chunks c of 64 elements,
  sc * (w xq summed over elements 64c + 4j .. 64c + 4j + 3); 16 fp32 lanes c += (d * xs[u]) *
  float(lanes), in super-block order; y = c[0] + c[1] + ... + c[15], left to right; Q5_K and Q4_K then
  subtracts (dmin * xs[u]) * float(sum over its sub-blocks j of m[j] * (sum of block j's
  xq)), summed in order.
Integer sums are exact and no float operation is reordered or fused (numba compiles without
fastmath), so y[m, n] depends only on x[m] and row n: not on M, nor on the thread count
(threads share out chunks of rows n; each output's reduction runs whole on one thread).

Layout: the kernels are LLVM vector IR built here with llvmlite (`_dot`), inlined into numba's
loops. For one weight row they read each super-block once into registers (`_Unit`: its
chunks' bytes loaded, shifted and masked into the file's integers as bytes) and run one
activation row or DOT_ROWS of them at a time, prefetching the row eight rows ahead
(`llvm.prefetch`, a hint). The sums of four products come from `dot4`, with the
instructions `DOT` names for the CPU the kernels compile on (vpdpbusd with AVX-512 VNNI,
pmaddubsw on AVX2, plain IR elsewhere: the same integers, so the CPU changes the speed, not
the bits); the float operations are plain IR, nothing fused or reordered.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from specdec.backends.native.kernels.jit.ir import (
    CACHE,
    DOT,
    DOT_ROWS,
    Rows,
    call_intrinsic,
    const,
    data_pointer,
    dispatch,
    dot4,
    f32,
    i8,
    i16,
    i32,
    i64,
    int_sum,
    lane_sums,
    prefetch,
    raw_array,
    splat,
    splat_value,
    vec,
    vector,
)
from specdec.backends.native.quant_types import SUPERBLOCKS, Q, QuantType

_f32_2d = types.float32[:, ::1]


CHUNK = 16  # output rows per parallel work item (scratch buffers are allocated per chunk)
PREFETCH_ROWS = 8  # a pass asks for the bytes of the row this many rows ahead


class _Unit:
    """Vector IR over one super-block of 256 of a row at byte `src`. The kinds below read it
    into four chunks of 64 elements, each the file's integers q as <64 x i8> (unsigned; the
    weight is q + offset) and its sub-block scales per lane of four elements as <16 x i32>,
    plus d and Q5_K's mins."""

    def __init__(self, builder, src, index, wscale):
        self.b, self.src, self.index, self.wscale = builder, src, index, wscale

    def load(self, offset: int, count: int, signed: bool = False, element=i16):  # bytes -> <count x element>
        b = self.b
        ptr = b.bitcast(b.gep(self.src, [ir.Constant(i64, offset)]), ir.VectorType(i8, count).as_pointer())
        raw = b.load(ptr, align=1)
        return raw if element is i8 else (b.sext if signed else b.zext)(raw, ir.VectorType(element, count))

    def table_value(self, position):  # wscale[position]
        return self.b.load(self.b.gep(self.wscale, [position]))


def _byte_shift(b, v, shifts: list[int]):
    """<64 x i8> v, each 16 bytes' half-words shifted right by their count in `shifts` (per
    pair of bytes): the low bits of each byte are its own (counts below 7)."""
    words = vector([c for c in shifts for _ in range(8)], i16)
    return b.bitcast(b.lshr(b.bitcast(v, vec(i16, 32)), words), vec(i8, 64))


def _twice(b, v):  # <32 x i8> -> <64 x i8>, the 32 bytes twice
    return b.shuffle_vector(v, v, vector(list(range(32)) * 2, i32))


def _q6_k(u):
    """210 bytes: ql[128], qh[64], int8 sc[16], fp16 d; wscale: d per super-block. Element
    h*128 + t*32 + l: nibble t // 2 of ql[h*64 + (t % 2)*32 + l], bits 2t, 2t+1 of qh[h*32 + l];
    weights q - 32 with q in 0..63, sub-block scale sc per 16."""
    b, chunks, scales = u.b, [], []
    sc = u.load(192, 16, element=i8)
    for h in range(2):
        ql, qh = u.load(h * 64, 64, element=i8), _twice(b, u.load(128 + h * 32, 32, element=i8))
        for k in range(2):  # elements h*128 + k*64 + (0..63): t = 2k, then 2k + 1
            low = b.and_(_byte_shift(b, ql, [4 * k] * 4), splat(15, 64, i8))
            high = b.and_(_byte_shift(b, qh, [4 * k] * 2 + [4 * k + 2] * 2), splat(3, 64, i8))
            chunks.append(b.or_(low, b.shl(high, splat(4, 64, i8))))
            first = 8 * h + 4 * k  # the chunk's first sub-block of 16: lanes of 4 elements, 4 a sub-block
            scales.append(b.sext(b.shuffle_vector(sc, sc, vector([first + j // 4 for j in range(16)], i32)),
                                 vec(i32, 16)))
    return chunks, scales, -32, u.table_value(u.index), None


def _q5_k(u):
    """176 bytes: d, dmin, scales[12], qh[32], qs[128]; sub-block 2j + half (of 32): the low
    (half 0) or high nibbles of qs[j*32 + l], plus bit 2j + half of qh[l] as 16."""
    b, chunks = u.b, []
    qh = _twice(b, u.load(16, 32, element=i8))
    for j in range(4):  # elements j*64 + (0..63): sub-blocks 2j, 2j + 1
        qs = _twice(b, u.load(48 + j * 32, 32, element=i8))
        low = b.and_(_byte_shift(b, qs, [0, 0, 4, 4]), splat(15, 64, i8))
        high = b.and_(_byte_shift(b, qh, [2 * j] * 2 + [2 * j + 1] * 2), splat(1, 64, i8))
        chunks.append(b.or_(low, b.shl(high, splat(4, 64, i8))))
    return (chunks, *_k_scales(u))


def _q4_k(u):
    """144 bytes: d, dmin, scales[12], qs[128]; sub-block 2j + half (of 32): the low (half 0)
    or high nibbles of qs[j*32 + l]. Q5_K without the fifth bit."""
    b = u.b
    chunks = [b.and_(_byte_shift(b, _twice(b, u.load(16 + j * 32, 32, element=i8)), [0, 0, 4, 4]),
                     splat(15, 64, i8))
              for j in range(4)]
    return (chunks, *_k_scales(u))


def _k_scales(u):
    """Q5_K's and Q4_K's sub-block scales per lane of four, their offset, d, and the mins with
    dmin."""
    b = u.b
    sc, mn = _q5_k_scale_bytes(u)
    two = ir.Constant(i64, 2)
    d, dmin = (u.table_value(b.mul(u.index, two)),
               u.table_value(b.add(b.mul(u.index, two), ir.Constant(i64, 1))))
    scales = [b.zext(b.shuffle_vector(sc, sc, vector([2 * j] * 8 + [2 * j + 1] * 8, i32)), vec(i32, 16))
              for j in range(4)]
    return scales, 0, d, (b.sext(mn, ir.VectorType(i32, 8)), dmin)


def _q5_k_scale_bytes(u):
    """Bytes 4-15 of a K-quant super-block -> its 8 six-bit sc and m as <8 x i16>
    (llama.cpp's get_scale_min_k4): sub-block j < 4 takes the low 6 bits of bytes 4 + j and
    8 + j; j >= 4 the nibbles of byte 8 + j and the top 2 bits of bytes j and 4 + j."""
    b, raw = u.b, u.load(4, 12)  # raw[i] is byte 4 + i
    pick = lambda idx: b.shuffle_vector(raw, raw, vector(idx, i32))  # noqa: E731
    # bytes 4+j / 8+j; 12+(j-4)
    low_sc, low_m = pick([0, 1, 2, 3, 8, 9, 10, 11]), pick([4, 5, 6, 7, 8, 9, 10, 11])
    # bytes j, 4 + j for j >= 4
    top_sc, top_m = pick([0, 0, 0, 0, 0, 1, 2, 3]), pick([0, 0, 0, 0, 4, 5, 6, 7])
    upper = vector([0] * 4 + [1] * 4, i16)
    tops = lambda v: b.mul(b.shl(b.lshr(v, splat(6, 8)), splat(4, 8)), upper)  # noqa: E731
    sc = b.or_(b.and_(low_sc, vector([63] * 4 + [15] * 4, i16)), tops(top_sc))
    mn = b.or_(b.lshr(b.and_(low_m, vector([63] * 4 + [255] * 4, i16)), vector([0] * 4 + [4] * 4, i16)),
               tops(top_m))
    return sc, mn


# each super-block type's reader (the record's code picks it at run time)
READERS = {Q.Q6_K: _q6_k, Q.Q5_K: _q5_k, Q.Q4_K: _q4_k}


def _super_body(b, rows: Rows, qt: QuantType, rp, wp, units, ahead=None):
    """Q6_K, Q5_K: per super-block u, 16 exact int32 lanes (lane j: over u's four chunks c of
    64 elements, sc * (the sum of w * xq over elements 64c + 4j .. 64c + 4j + 3)), then c +=
    (d * xs[u]) * float(lanes); Q5_K's min term m += (dmin * xs[u]) * float(sum over
    sub-blocks j of mn[j] * xsum[j]) in order; returns c[0] + ... + c[15] (- m)."""
    width, blocks, reader = qt.block_bytes, qt.block // 32, READERS[qt.ggml]
    zero = ir.Constant(ir.VectorType(f32, 16), [ir.Constant(f32, 0.0)] * 16)
    accs = [cgutils.alloca_once_value(b, zero) for _ in rows.picks]
    mins = [cgutils.alloca_once_value(b, ir.Constant(f32, 0.0)) for _ in rows.picks]
    with cgutils.for_range(b, units) as loop:
        unit = _Unit(b, b.gep(rp, [b.mul(loop.index, ir.Constant(i64, width))]), loop.index, wp)
        if ahead is not None:
            prefetch(b, b.gep(unit.src, [ahead]))
        chunks, scales, offset, d, minimum = reader(unit)
        pairs = _scale_pairs(b, qt, scales)
        for r, pick in enumerate(rows.picks):
            dots = [dot4(b, q, False, offset, *rows.chunk(pick, b.add(b.mul(loop.index, const(4)), const(c))))
                    for c, q in enumerate(chunks)]
            isum = _scaled_sum(b, dots, scales, pairs)
            x_scale = b.load(b.gep(rows.sp, [rows.slot(pick, loop.index, 256)]))
            term = b.fmul(splat_value(b, b.fmul(d, x_scale), 16), b.sitofp(isum, ir.VectorType(f32, 16)))
            b.store(b.fadd(b.load(accs[r]), term), accs[r])
            if minimum is not None:
                mn, dmin = minimum
                at = b.gep(rows.np, [rows.slot(pick, b.mul(loop.index, ir.Constant(i64, blocks)), 32)])
                sums = b.load(b.bitcast(at, ir.VectorType(i32, 8).as_pointer()), align=4)
                imin = b.sitofp(int_sum(b, b.mul(mn, sums)), f32)
                b.store(b.fadd(b.load(mins[r]), b.fmul(b.fmul(dmin, x_scale), imin)), mins[r])
    totals = lane_sums(b, [b.load(acc) for acc in accs])
    if not qt.with_min:  # Q6_K: no min term
        return totals
    return [b.fsub(total, b.load(v)) for total, v in zip(totals, mins, strict=True)]


def _scale_pairs(b, qt: QuantType, scales):
    """Q4_K's and Q5_K's sub-block scales of chunks 0 and 1, and of 2 and 3, as the 16-bit
    halves of each lane (for `_scaled_sum`), where the CPU multiplies 16-bit pairs; else None.
    Their chunks' lane sums fit in 16 bits (|sum of four q x| <= 4 * 31 * 127); Q6_K's, whose
    q - 32 takes 32 * xsum4 off them, need not."""
    if qt.ggml is Q.Q6_K or DOT not in ("vnni", "avx2"):
        return None
    high = splat(16, 16, i32)
    return [b.or_(scales[c], b.shl(scales[c + 1], high)) for c in (0, 2)]


def _scaled_sum(b, dots, scales, pairs):
    """<16 x i32>: per lane, the sum over the four chunks of its dot times its sub-block scale,
    exact (|lane| < 2^23, so the grouping does not matter). With `pairs`, two chunks' dots
    share one pmaddwd: their low 16 bits side by side, times the scale pairs, summed."""
    if pairs is None:
        isum = None
        for lanes in (b.mul(dot, sc) for dot, sc in zip(dots, scales, strict=True)):
            isum = lanes if isum is None else b.add(isum, lanes)
        return isum
    sums = []
    for c, pair in zip((0, 2), pairs, strict=True):
        low = b.and_(dots[c], splat(0xFFFF, 16, i32))
        words = b.bitcast(b.or_(low, b.shl(dots[c + 1], splat(16, 16, i32))), vec(i16, 32))
        sums.append(_madd_pairs(b, words, b.bitcast(pair, vec(i16, 32))))
    return b.add(sums[0], sums[1])


def _madd_pairs(b, x, y):  # <32 x i16> twice -> <16 x i32>: x[2j] y[2j] + x[2j+1] y[2j+1]
    if DOT == "vnni":  # AVX-512 VNNI implies AVX-512BW's vpmaddwd
        return call_intrinsic(b, "llvm.x86.avx512.pmaddw.d.512", vec(i32, 16), [x, y])
    halves = []
    for h in range(2):
        pick = vector(list(range(16 * h, 16 * h + 16)), i32)
        halves.append(call_intrinsic(b, "llvm.x86.avx2.pmadd.wd", vec(i32, 8),
                                     [b.shuffle_vector(x, x, pick), b.shuffle_vector(y, y, pick)]))
    return b.shuffle_vector(halves[0], halves[1], vector(list(range(16)), i32))


def _dot(qt: QuantType, rows: int):
    """An intrinsic `dot(row, xq, xs, xsum, xsum4, wscale, units, first, out)`: the outputs of
    activation rows first .. first + rows - 1 (those below M) for one weight row, into
    out[first:], with the row's integers read in registers once for all of them; the
    arithmetic of the module docstring (`_super_body`). xq [M, K] int8, xs [M, K // 256]
    fp32, xsum [M, K // 32] and xsum4 [M, K // 4] int32, out [M] fp32."""

    @intrinsic
    def dot(typingctx, row, xq, xs, xsum, xsum4, wscale, units, first, out):
        def codegen(context, builder, signature, args):
            rp, qp, sp, np_, fp, wp, op = (data_pointer(context, builder, signature, args, k)
                                           for k in (0, 1, 2, 3, 4, 5, 8))
            row_bytes = builder.extract_value(
                context.make_array(signature.args[0])(context, builder, args[0]).shape, 0)
            ahead = builder.mul(row_bytes, ir.Constant(i64, PREFETCH_ROWS))
            shape = context.make_array(signature.args[1])(context, builder, args[1]).shape
            m, k = builder.extract_value(shape, 0), builder.extract_value(shape, 1)
            passing = Rows(builder, qp, sp, np_, fp, m, k, args[7], rows)
            totals = _super_body(builder, passing, qt, rp, wp, args[6], ahead)
            passing.store(totals, op)
            return context.get_dummy_value()

        return types.void(row, xq, xs, xsum, xsum4, wscale, units, first, out), codegen

    return dot


def _by_width(qt: QuantType):
    """`run(code, args)`: one pass of `qt` over one weight row, args = (row, xq, xs, xsum, xsum4,
    table, units, first, width, out), with 1, 2 or DOT_ROWS activation rows (a pass computes
    all its rows, so the last ones take the narrowest pass that holds them). Inlined into the
    cached kernel, so not cached itself."""
    one, two, many = (_dot(qt, rows) for rows in (1, 2, DOT_ROWS))

    @njit(inline="always")
    def run(code, args):  # pragma: no cover - compiled
        row, xq, xs, xsum, xsum4, table, units, first, width, out = args
        if width == 1:
            one(row, xq, xs, xsum, xsum4, table, units, first, out)
        elif width == 2:
            two(row, xq, xs, xsum, xsum4, table, units, first, out)
        else:
            many(row, xq, xs, xsum, xsum4, table, units, first, out)

    return run


_by_code = dispatch([_by_width(qt) for qt in SUPERBLOCKS])


@njit(cache=CACHE, nogil=True, inline="always")
def _pass(kind, row, xq, xs, xsum, xsum4, table, units, first, width, out):  # pragma: no cover - compiled
    """One pass of `width` (1, 2 or DOT_ROWS) activation rows from `first` over one weight row of
    the type whose code is `kind`."""
    _by_code(kind, (row, xq, xs, xsum, xsum4, table, units, first, width, out))


@njit(types.void(types.int64, raw_array(types.uint8), _f32_2d, types.int64, types.int8[:, ::1], _f32_2d,
                 types.int32[:, ::1], types.int32[:, ::1], _f32_2d, types.int64),
      cache=CACHE, nogil=True, parallel=True)
def matmul(kind, raw, table, units, xq, xs, xsum, xsum4, y, column):  # pragma: no cover - compiled
    """raw [N, bytes per row] (the file's super-blocks of the type whose code is `kind`), table [N, T]
    fp32: per row the fp16 fields as fp32 (Q6_K: d per super-block; Q5_K: d, dmin per
    super-block), units: super-blocks per row -> y[:, column : column + N] (several matrices
    of one input write one output side by side). Rows of activations in passes of DOT_ROWS,
    the last ones narrower (several weight rows a pass, as the small-block kinds decode,
    did not fit the K-quants' unpacked super-blocks in the registers: measured slower)."""
    rows, m = raw.shape[0], xq.shape[0]
    for chunk in prange((rows + CHUNK - 1) // CHUNK):
        out = np.empty(m, np.float32)
        for n in range(chunk * CHUNK, min(rows, chunk * CHUNK + CHUNK)):
            first = 0
            while first < m:
                width = DOT_ROWS if m - first > 2 else m - first
                _pass(kind, raw[n], xq, xs, xsum, xsum4, table[n], units, first, width, out)
                first += width
            for r in range(m):
                y[r, column + n] = out[r]
