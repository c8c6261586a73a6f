"""numba kernels for GGUF's Q8_0, Q6_K, Q5_K, Q5_0 and Q5_1 matrices on int8 activations (see
gguf_kernels_8bit.py, which wraps them and states the contract). Imported on first use;
compiled once, cached on disk.

The arithmetic every kernel shares, for one output y[m, n] (the torch replica in
gguf_kernels_8bit.py performs the same operations in the same order, bit for bit):
- activations: each block of 32 of x[m] becomes xs = max|x| / 127 and xq = rint(x * (1 / xs)),
  int8 values (held in int16);
- weights: the file's integers (Q8_0 q, Q6_K q - 32, Q5_K q, Q5_0 q - 16, Q5_1 q) and fp32
  scales formed from the file's fields exactly (d, d * sc, dmin * m: an fp16 times a small
  integer; Q5_1's m as the offset -m);
- 16 fp32 lanes c[l]; for each activation block b in order, lane l adds s * p, where p is the
  exact integer w[2l] xq[2l] + w[2l + 1] xq[2l + 1] of that block and s = w_scale * xs[b]
  (Q6_K: lanes 0-7 take the first sub-block of 16's scale, lanes 8-15 the second's);
- y = c[0] + c[1] + ... + c[15], left to right; Q5_K then subtracts its min term, summed in
  block order: sum over b of (dmin * m * xs[b]) * (sum of block b's xq); Q5_1 likewise with
  -m in place of dmin * m.
Integer sums are exact and no float operation is reordered or fused (numba compiles without
fastmath), so y[m, n] depends only on x[m] and row n: not on M, nor on the thread count
(threads share out chunks of rows n; each output's reduction runs whole on one thread).

Layout: the kernels are LLVM vector IR built here with llvmlite (`_dot`), inlined into numba's
loops. For one weight row they read each unit of blocks once into registers (`_Unit`: the
bytes loaded as vectors, widened, masked and shifted into the file's integers as int16) and
run the lanes for one activation row (decode) or DOT_ROWS of them at a time (verification,
prompts): pair products that LLVM lowers to vpmaddwd (AVX2, AVX-512; NEON on arm64), then
per lane one fp32 multiply by the block's scale and one add. Q5_K's six-bit scales and the
min terms (Q5_K, Q5_1) are decoded and summed in the same loop: as a separate scalar pass
they cost Q5_K 2-3x Q6_K's time per row. Only plain integer and float
vector operations: no intrinsics, no fusion, so the CPU changes the speed, not the bits.
Written as numba scalar code (a row buffer of unpacked integers, then generated scalar lanes
packed by LLVM's SLP vectoriser) the same arithmetic ran 2-7x slower at one row.
The IR helpers are not cached themselves; the cached kernels contain them, so they live in
this file: numba re-validates a cached kernel by its own file's time stamp only.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

_f32_2d, _i16_2d = types.float32[:, ::1], types.int16[:, ::1]


def _raw(dtype):
    """The file's blocks: a read-only memory map (accepts writable arrays too)."""
    return types.Array(dtype, 2, "C", readonly=True)


LANES = 16
CHUNK = 16  # output rows per parallel work item (scratch buffers are allocated per chunk)
DOT_ROWS = 4  # activation rows per pass over a weight row (at most; 1 or 2 for the last ones)


_i8, _i16, _i32, _i64, _f32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64), ir.FloatType()


def _vector(values, element=_i16):
    return ir.Constant(ir.VectorType(element, len(values)), [ir.Constant(element, v) for v in values])


def _splat(value, count, element=_i16):
    return _vector([value] * count, element)


def _splat_value(b, x, count: int):  # a run-time scalar in every lane of <count x type>
    t = ir.VectorType(x.type, count)
    v = b.insert_element(ir.Constant(t, None), x, ir.Constant(_i32, 0))
    return b.shuffle_vector(v, ir.Constant(t, None), _vector([0] * count, _i32))


class _Unit:
    """Vector IR over one unit of a row: a block of 32 (Q8_0, Q5_0, Q5_1) or a super-block of
    256 (Q6_K, Q5_K) at byte `src`. The kinds below read it into, per block of 32, the file's
    integers as <32 x i16> and (a callable, as unpacking needs none) the weights' fp32 scale per
    lane as <16 x float> (lanes 0-7 and 8-15: the block's halves, which differ only for Q6_K). Plain integer and float vector
    operations (no intrinsics, nothing fused or reordered), which LLVM lowers for the CPU at
    hand (AVX2, AVX-512, NEON)."""

    def __init__(self, builder, src, index, wscale):
        self.b, self.src, self.index, self.wscale = builder, src, index, wscale

    def load(self, offset: int, count: int, signed: bool = False, element=_i16):  # bytes -> <count x element>
        b = self.b
        ptr = b.bitcast(b.gep(self.src, [ir.Constant(_i64, offset)]), ir.VectorType(_i8, count).as_pointer())
        raw = b.load(ptr, align=1)
        return raw if element is _i8 else (b.sext if signed else b.zext)(raw, ir.VectorType(element, count))

    def word_bits(self, offset: int):  # the little-endian uint32 at byte offset -> <32 x i16>: 16 where bit j is set
        b = self.b
        qh = b.load(b.bitcast(b.gep(self.src, [ir.Constant(_i64, offset)]), _i32.as_pointer()), align=1)
        return b.select(b.bitcast(qh, ir.VectorType(ir.IntType(1), 32)), _splat(16, 32), _splat(0, 32))

    def nibbles(self, v, high: bool):
        return self.b.lshr(v, _splat(4, v.type.count)) if high else self.b.and_(v, _splat(15, v.type.count))

    def bits(self, v, shift: int, mask: int):  # ((v >> shift) & mask) << 4: the high bits of a 5- or 6-bit q
        b, n = self.b, v.type.count
        return b.shl(b.and_(b.lshr(v, _splat(shift, n)), _splat(mask, n)), _splat(4, n))

    def table_value(self, position):  # wscale[position]
        return self.b.load(self.b.gep(self.wscale, [position]))

    def table_scale(self, position):  # wscale[position], the same in all 16 lanes
        return _splat_value(self.b, self.table_value(position), 16)

    def block_scales(self, blocks: int, stride: int = 1):  # a table with one scale per block of 32
        first = self.b.mul(self.index, ir.Constant(_i64, blocks))
        return [self.table_scale(self.b.mul(self.b.add(first, ir.Constant(_i64, j)), ir.Constant(_i64, stride)))
                for j in range(blocks)]  # fmt: skip


def _q8_0(u):  # 34 bytes: fp16 d, 32 int8 q; wscale: d per block
    return [u.load(2, 32, signed=True)], lambda: u.block_scales(1), None


def _q5(qh_at: int, qs_at: int, zero: int, stride: int):  # Q5_0 (22 bytes, zero 16) / Q5_1 (24, zero 0):
    def kind(u):  # element j < 16 is qs[j]'s low nibble, j + 16 its high one; bit j of qh adds 16
        qs = u.load(qs_at, 16)
        w = u.b.or_(u.b.shuffle_vector(u.nibbles(qs, False), u.nibbles(qs, True), _vector(list(range(32)), _i32)),
                    u.word_bits(qh_at))  # fmt: skip
        weights = [u.b.sub(w, _splat(zero, 32)) if zero else w]
        if stride == 1:  # Q5_0, wscale: d per block
            return weights, lambda: u.block_scales(1), None
        # Q5_1, wscale: d, m per block; m enters as the min term with offset -m
        return weights, lambda: u.block_scales(1, 2), lambda: [u.b.fneg(u.table_value(u.b.add(u.b.mul(
            u.index, ir.Constant(_i64, 2)), ir.Constant(_i64, 1))))]  # fmt: skip

    return kind


def _q6_k(u):  # 210 bytes: ql[128], qh[64], int8 sc[16], fp16 d; wscale: d per super-block
    b, ws = u.b, []  # element h*128 + t*32 + l: nibble t // 2 of ql[h*64 + (t % 2)*32 + l],
    for h in range(2):  # bits 2t, 2t+1 of qh[h*32 + l]
        ql, qh = u.load(h * 64, 64), u.load(128 + h * 32, 32)
        for t in range(4):
            part = b.shuffle_vector(u.nibbles(ql, t >= 2), ql, _vector(list(range((t & 1) * 32, (t & 1) * 32 + 32)), _i32))
            ws.append(b.sub(b.or_(part, u.bits(qh, 2 * t, 3)), _splat(32, 32)))

    def scales():  # block j: sub-blocks 2j (lanes 0-7) and 2j + 1 (lanes 8-15) of d * sc
        sub = b.fmul(u.table_scale(u.index), b.sitofp(u.load(192, 16, element=_i8), ir.VectorType(_f32, 16)))
        return [b.shuffle_vector(sub, sub, _vector([2 * j] * 8 + [2 * j + 1] * 8, _i32)) for j in range(8)]

    return ws, scales, None


def _q5_k(u):  # 176 bytes: d, dmin, scales[12], qh[32], qs[128]; sub-block 2j + half is the low (half 0)
    qh, ws = u.load(16, 32), []  # or high nibbles of qs[j*32 + l], plus bit 2j + half of qh[l]
    for j in range(4):
        qs = u.load(48 + j * 32, 32)
        ws += [u.b.or_(u.nibbles(qs, half == 1), u.bits(qh, 2 * j + half, 1)) for half in range(2)]
    sc, mn = _q5_k_scale_bytes(u)
    b, two = u.b, ir.Constant(_i64, 2)
    d, dmin = u.table_value(b.mul(u.index, two)), u.table_value(b.add(b.mul(u.index, two), ir.Constant(_i64, 1)))

    def scales():  # d * sc per sub-block of 32 (wscale: d, dmin per super-block)
        return [_splat_value(b, b.fmul(d, b.extract_element(sc, ir.Constant(_i32, j))), 16) for j in range(8)]

    def offsets():  # dmin * m per sub-block: the min term
        return [b.fmul(dmin, b.extract_element(mn, ir.Constant(_i32, j))) for j in range(8)]

    return ws, scales, offsets


def _q5_k_scale_bytes(u):
    """Bytes 4-15 of a K-quant super-block -> its 8 six-bit sc and m as <8 x float>
    (llama.cpp's get_scale_min_k4): sub-block j < 4 takes the low 6 bits of bytes 4 + j and
    8 + j; j >= 4 the nibbles of byte 8 + j and the top 2 bits of bytes j and 4 + j."""
    b, raw = u.b, u.load(4, 12)  # raw[i] is byte 4 + i
    pick = lambda idx: b.shuffle_vector(raw, raw, _vector(idx, _i32))  # noqa: E731
    low_sc, low_m = pick([0, 1, 2, 3, 8, 9, 10, 11]), pick([4, 5, 6, 7, 8, 9, 10, 11])  # bytes 4+j / 8+j; 12+(j-4)
    top_sc, top_m = pick([0, 0, 0, 0, 0, 1, 2, 3]), pick([0, 0, 0, 0, 4, 5, 6, 7])  # bytes j, 4 + j for j >= 4
    upper = _vector([0] * 4 + [1] * 4, _i16)
    tops = lambda v: b.mul(b.shl(b.lshr(v, _splat(6, 8)), _splat(4, 8)), upper)  # noqa: E731
    sc = b.or_(b.and_(low_sc, _vector([63] * 4 + [15] * 4, _i16)), tops(top_sc))
    mn = b.or_(b.lshr(b.and_(low_m, _vector([63] * 4 + [255] * 4, _i16)), _vector([0] * 4 + [4] * 4, _i16)), tops(top_m))
    return b.uitofp(sc, ir.VectorType(_f32, 8)), b.uitofp(mn, ir.VectorType(_f32, 8))


MIN_KINDS = ("q5_k", "q5_1")  # the readers that give offsets: a min term
# kind: (unit bytes, blocks of 32 per unit, reader)
_KINDS = {"q8_0": (34, 1, _q8_0), "q6_k": (210, 8, _q6_k), "q5_k": (176, 8, _q5_k),
          "q5_0": (22, 1, _q5(2, 6, 16, 1)), "q5_1": (24, 1, _q5(4, 8, 0, 2))}  # fmt: skip


def _data(context, builder, signature, args, k: int):
    return context.make_array(signature.args[k])(context, builder, args[k]).data


def _pairs(b, w, a):  # <32 x i16> twice -> <16 x i32>: lane l = w[2l] a[2l] + w[2l + 1] a[2l + 1], exact
    p = b.mul(b.sext(w, ir.VectorType(_i32, 32)), b.sext(a, ir.VectorType(_i32, 32)))
    even = b.shuffle_vector(p, p, _vector(list(range(0, 32, 2)), _i32))
    return b.add(even, b.shuffle_vector(p, p, _vector(list(range(1, 32, 2)), _i32)))


def _dot(kind: str, rows: int):
    """An intrinsic `dot(row, xq, xs, xsum, wscale, units, first, out)`: the outputs of
    activation rows first .. first + rows - 1 (those below M) for one weight row, into
    out[first:], with the row's integers read in registers once for all of them. Per
    activation row the arithmetic of the module docstring, as vectors: c += (wscale * xs[b]) *
    float(pairs(w, xq block b)) per block, then c[0] + ... + c[15], minus the min term (Q5_K,
    Q5_1) summed in block order alongside. xq [M, K] int16, xs [M, K // 32] fp32, xsum
    [M, K // 32] int32, out [M] fp32."""
    width, blocks, reader = _KINDS[kind]
    with_min = kind in MIN_KINDS

    @intrinsic
    def dot(typingctx, row, xq, xs, xsum, wscale, units, first, out):
        def codegen(context, builder, signature, args):
            b = builder
            rp, qp, sp, np_, wp, op = (_data(context, b, signature, args, k) for k in (0, 1, 2, 3, 4, 7))
            shape = context.make_array(signature.args[1])(context, b, args[1]).shape
            m, k = b.extract_value(shape, 0), b.extract_value(shape, 1)
            last = b.sub(m, ir.Constant(_i64, 1))  # rows past M repeat row M - 1 and are not stored
            picks = [b.select(b.icmp_signed("<", v, m), v, last) for v in
                     (b.add(args[6], ir.Constant(_i64, r)) for r in range(rows))]  # fmt: skip
            zero = ir.Constant(ir.VectorType(_f32, 16), [ir.Constant(_f32, 0.0)] * 16)
            accs = [cgutils.alloca_once_value(b, zero) for _ in range(rows)]
            mins = [cgutils.alloca_once_value(b, ir.Constant(_f32, 0.0)) for _ in range(rows)]
            with cgutils.for_range(b, args[5]) as loop:
                weights, scales, offsets = reader(_Unit(b, b.gep(rp, [b.mul(loop.index, ir.Constant(_i64, width))]),
                                                        loop.index, wp))  # fmt: skip
                cs, ms = [b.load(acc) for acc in accs], [b.load(v) for v in mins]
                offs = offsets() if offsets else [None] * len(weights)
                for j, (w, ws, off) in enumerate(zip(weights, scales(), offs, strict=True)):
                    block = b.add(b.mul(loop.index, ir.Constant(_i64, blocks)), ir.Constant(_i64, j))
                    for r, pick in enumerate(picks):
                        at = b.add(b.mul(pick, k), b.mul(block, ir.Constant(_i64, 32)))
                        a = b.load(b.bitcast(b.gep(qp, [at]), ir.VectorType(_i16, 32).as_pointer()), align=2)
                        slot = b.add(b.mul(pick, b.udiv(k, ir.Constant(_i64, 32))), block)
                        x_scale = b.load(b.gep(sp, [slot]))
                        scale = b.fmul(ws, _splat_value(b, x_scale, 16))
                        cs[r] = b.fadd(cs[r], b.fmul(scale, b.sitofp(_pairs(b, w, a), ir.VectorType(_f32, 16))))
                        if off is not None:  # (offset * xs[b]) * sum of block b's xq
                            ms[r] = b.fadd(ms[r], b.fmul(b.fmul(off, x_scale), b.sitofp(b.load(b.gep(np_, [slot])), _f32)))
                for acc, c, v, mn in zip(accs, cs, mins, ms, strict=True):
                    b.store(c, acc)
                    b.store(mn, v)
            for r, pick in enumerate(picks):
                c = b.load(accs[r])
                total = b.extract_element(c, ir.Constant(_i32, 0))
                for lane in range(1, LANES):
                    total = b.fadd(total, b.extract_element(c, ir.Constant(_i32, lane)))
                if with_min:
                    total = b.fsub(total, b.load(mins[r]))
                with b.if_then(b.icmp_signed("<", b.add(args[6], ir.Constant(_i64, r)), m)):
                    b.store(total, b.gep(op, [pick]))
            return context.get_dummy_value()

        return types.void(row, xq, xs, xsum, wscale, units, first, out), codegen

    return dot


# one, two or DOT_ROWS activation rows per pass over a weight row (a pass computes all its
# rows, so the last ones take the narrowest pass that holds them)
_one_q8_0, _one_q6_k, _one_q5_k, _one_q5_0, _one_q5_1 = (_dot(kind, 1) for kind in _KINDS)
_two_q8_0, _two_q6_k, _two_q5_k, _two_q5_0, _two_q5_1 = (_dot(kind, 2) for kind in _KINDS)
_many_q8_0, _many_q6_k, _many_q5_k, _many_q5_0, _many_q5_1 = (_dot(kind, DOT_ROWS) for kind in _KINDS)


@njit("void(float32[:, ::1], int16[:, ::1], float32[:, ::1], int32[:, ::1])", cache=True, nogil=True)
def quantize_rows(x, xq, xs, xsum):  # pragma: no cover - compiled
    """x [M, K] -> xq [M, K] (int8 values), xs [M, K // 32], xsum [M, K // 32] (sum of xq)."""
    rows, blocks = xs.shape
    for m in range(rows):
        for b in range(blocks):
            amax = np.float32(0)
            for i in range(32):
                amax = max(amax, abs(x[m, b * 32 + i]))
            d = amax / np.float32(127)
            inv = np.float32(1) / d if d > 0 else np.float32(0)
            xs[m, b] = d
            total = 0
            for i in range(32):
                q = np.int16(np.rint(x[m, b * 32 + i] * inv))
                xq[m, b * 32 + i] = q
                total += q
            xsum[m, b] = total


KIND_CODES = {name: code for code, name in enumerate(_KINDS)}  # matmul's `kind`


@njit(cache=True, nogil=True, inline="always")
def _pass(kind, row, xq, xs, xsum, table, units, first, width, out):  # pragma: no cover - compiled
    """One pass of `width` (1, 2 or DOT_ROWS) activation rows from `first` over one weight row."""
    if kind == 0:
        if width == 1:
            _one_q8_0(row, xq, xs, xsum, table, units, first, out)
        elif width == 2:
            _two_q8_0(row, xq, xs, xsum, table, units, first, out)
        else:
            _many_q8_0(row, xq, xs, xsum, table, units, first, out)
    elif kind == 1:
        if width == 1:
            _one_q6_k(row, xq, xs, xsum, table, units, first, out)
        elif width == 2:
            _two_q6_k(row, xq, xs, xsum, table, units, first, out)
        else:
            _many_q6_k(row, xq, xs, xsum, table, units, first, out)
    elif kind == 2:
        if width == 1:
            _one_q5_k(row, xq, xs, xsum, table, units, first, out)
        elif width == 2:
            _two_q5_k(row, xq, xs, xsum, table, units, first, out)
        else:
            _many_q5_k(row, xq, xs, xsum, table, units, first, out)
    elif kind == 3:
        if width == 1:
            _one_q5_0(row, xq, xs, xsum, table, units, first, out)
        elif width == 2:
            _two_q5_0(row, xq, xs, xsum, table, units, first, out)
        else:
            _many_q5_0(row, xq, xs, xsum, table, units, first, out)
    elif width == 1:
        _one_q5_1(row, xq, xs, xsum, table, units, first, out)
    elif width == 2:
        _two_q5_1(row, xq, xs, xsum, table, units, first, out)
    else:
        _many_q5_1(row, xq, xs, xsum, table, units, first, out)


@njit(types.void(types.int64, _raw(types.uint8), _f32_2d, types.int64, _i16_2d, _f32_2d, types.int32[:, ::1], _f32_2d),
      cache=True, nogil=True, parallel=True)  # fmt: skip
def matmul(kind, raw, table, units, xq, xs, xsum, y):  # pragma: no cover - compiled
    """raw [N, bytes per row] (the file's blocks of KIND_CODES' type `kind`), table [N, T] fp32:
    per row the fp16 fields as fp32 (Q8_0, Q5_0: d per block; Q5_1: d, m per block; Q6_K: d
    per super-block; Q5_K: d, dmin per super-block), units: blocks (or super-blocks) per row
    -> y [M, N]. Rows of activations in passes of DOT_ROWS, the last ones narrower."""
    rows, m = raw.shape[0], xq.shape[0]
    for chunk in prange((rows + CHUNK - 1) // CHUNK):
        out = np.empty(m, np.float32)
        for n in range(chunk * CHUNK, min(rows, chunk * CHUNK + CHUNK)):
            first = 0
            while first < m:
                width = DOT_ROWS if m - first > 2 else m - first
                _pass(kind, raw[n], xq, xs, xsum, table[n], units, first, width, out)
                first += width
            for r in range(m):
                y[r, n] = out[r]
