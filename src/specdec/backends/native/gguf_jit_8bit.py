"""numba kernels for GGUF's Q6_K and Q5_K matrices on int8 activations (see
gguf_kernels_8bit.py, which wraps them and states the contract; gguf_jit_small.py holds Q8_0,
Q5_0 and Q5_1's). Imported on first use; compiled once, cached on disk.

The arithmetic, for one output y[m, n] (the torch replica in gguf_kernels_8bit.py performs
the same operations in the same order, bit for bit):
- weights: the file's integers (Q6_K q - 32, Q5_K q) and fp32 scales formed from the file's
  fields exactly (d, dmin: fp16 values); the sub-block scales sc (Q6_K's int8 per 16, Q5_K's
  six bits per 32) and Q5_K's mins m stay integers;
- activations (gguf_jit_quant's `quantize_rows_k`; llama.cpp's Q8_K): each super-block u of
  256 of x[m] becomes inv = 127 / max|x|, xq = rint(x * inv), xs = 1 / inv;
- isum = sum over u's elements of (w * sc) * xq, 16 exact int32 lanes (lane l: the pairs 2l,
  2l + 1 of each of u's blocks of 32); 16 fp32 lanes c += (d * xs[u]) * float(lanes), in
  super-block order; y = c[0] + c[1] + ... + c[15], left to right; Q5_K then subtracts
  (dmin * xs[u]) * float(sum over its sub-blocks j of m[j] * (sum of block j's xq)), summed
  in order.
Integer sums are exact and no float operation is reordered or fused (numba compiles without
fastmath), so y[m, n] depends only on x[m] and row n: not on M, nor on the thread count
(threads share out chunks of rows n; each output's reduction runs whole on one thread).

Layout: the kernels are LLVM vector IR built here with llvmlite (`_dot`), inlined into numba's
loops. For one weight row they read each super-block once into registers (`_Unit`: the
bytes loaded as vectors, widened, masked and shifted into the file's integers as int16) and
run one activation row or DOT_ROWS of them at a time. Each pass prefetches the bytes a few
rows ahead (`llvm.prefetch`, a hint). Pair products that LLVM lowers to vpmaddwd (AVX2,
AVX-512, where VNNI fuses the adds into vpdpwssd; NEON on arm64), then integer adds until the
super-block's end (w * sc is formed once per pass for all its rows). Q5_K's six-bit scales
and the min terms are decoded and summed in the same loop: as a separate scalar pass they
cost Q5_K 2-3x Q6_K's time per row. Only plain integer and float vector operations (no
arithmetic intrinsics, no fusion), so the CPU changes the speed, not the bits.
Written as numba scalar code (a row buffer of unpacked integers, then generated scalar lanes
packed by LLVM's SLP vectoriser) the same arithmetic ran 2-7x slower at one row.
The IR helpers are not cached themselves; the cached kernels contain them, so they live in
this file: numba re-validates a cached kernel by its own file's time stamp only
(gguf_jit_small.py imports some of them: a change here needs its cache cleared too).
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
PREFETCH_ROWS = 8  # a pass asks for the bytes of the row this many rows ahead


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
    """Vector IR over one super-block of 256 of a row at byte `src`. The kinds below read it
    into, per block of 32, the file's integers as <32 x i16> and each element's integer
    sub-block scale as <32 x i16>, and d. Plain integer and float vector operations (no
    intrinsics, nothing fused or reordered), which LLVM lowers for the CPU at hand (AVX2,
    AVX-512, NEON)."""

    def __init__(self, builder, src, index, wscale):
        self.b, self.src, self.index, self.wscale = builder, src, index, wscale

    def load(self, offset: int, count: int, signed: bool = False, element=_i16):  # bytes -> <count x element>
        b = self.b
        ptr = b.bitcast(b.gep(self.src, [ir.Constant(_i64, offset)]), ir.VectorType(_i8, count).as_pointer())
        raw = b.load(ptr, align=1)
        return raw if element is _i8 else (b.sext if signed else b.zext)(raw, ir.VectorType(element, count))

    def nibbles(self, v, high: bool):
        return self.b.lshr(v, _splat(4, v.type.count)) if high else self.b.and_(v, _splat(15, v.type.count))

    def bits(self, v, shift: int, mask: int):  # ((v >> shift) & mask) << 4: the high bits of a 5- or 6-bit q
        b, n = self.b, v.type.count
        return b.shl(b.and_(b.lshr(v, _splat(shift, n)), _splat(mask, n)), _splat(4, n))

    def table_value(self, position):  # wscale[position]
        return self.b.load(self.b.gep(self.wscale, [position]))



def _q6_k(u):  # 210 bytes: ql[128], qh[64], int8 sc[16], fp16 d; wscale: d per super-block
    b, ws = u.b, []  # element h*128 + t*32 + l: nibble t // 2 of ql[h*64 + (t % 2)*32 + l],
    for h in range(2):  # bits 2t, 2t+1 of qh[h*32 + l]
        ql, qh = u.load(h * 64, 64), u.load(128 + h * 32, 32)
        for t in range(4):
            part = b.shuffle_vector(u.nibbles(ql, t >= 2), ql, _vector(list(range((t & 1) * 32, (t & 1) * 32 + 32)), _i32))
            ws.append(b.sub(b.or_(part, u.bits(qh, 2 * t, 3)), _splat(32, 32)))
    sc = u.load(192, 16, signed=True)  # <16 x i16>: sub-block j of 16 elements
    scales = [b.shuffle_vector(sc, sc, _vector([2 * j] * 16 + [2 * j + 1] * 16, _i32)) for j in range(8)]
    return ws, scales, u.table_value(u.index), None


def _q5_k(u):  # 176 bytes: d, dmin, scales[12], qh[32], qs[128]; sub-block 2j + half is the low (half 0)
    qh, ws = u.load(16, 32), []  # or high nibbles of qs[j*32 + l], plus bit 2j + half of qh[l]
    for j in range(4):
        qs = u.load(48 + j * 32, 32)
        ws += [u.b.or_(u.nibbles(qs, half == 1), u.bits(qh, 2 * j + half, 1)) for half in range(2)]
    sc, mn = _q5_k_scale_bytes(u)
    b, two = u.b, ir.Constant(_i64, 2)
    d, dmin = u.table_value(b.mul(u.index, two)), u.table_value(b.add(b.mul(u.index, two), ir.Constant(_i64, 1)))
    scales = [b.shuffle_vector(sc, sc, _vector([j] * 32, _i32)) for j in range(8)]
    return ws, scales, d, (b.sext(mn, ir.VectorType(_i32, 8)), dmin)


def _q5_k_scale_bytes(u):
    """Bytes 4-15 of a K-quant super-block -> its 8 six-bit sc and m as <8 x i16>
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
    return sc, mn


# kind: (super-block bytes, blocks of 32 per super-block, reader)
_KINDS = {"q6_k": (210, 8, _q6_k), "q5_k": (176, 8, _q5_k)}


def _data(context, builder, signature, args, k: int):
    return context.make_array(signature.args[k])(context, builder, args[k]).data


def _pairs(b, w, a):  # <32 x i16> twice -> <16 x i32>: lane l = w[2l] a[2l] + w[2l + 1] a[2l + 1], exact
    p = b.mul(b.sext(w, ir.VectorType(_i32, 32)), b.sext(a, ir.VectorType(_i32, 32)))
    even = b.shuffle_vector(p, p, _vector(list(range(0, 32, 2)), _i32))
    return b.add(even, b.shuffle_vector(p, p, _vector(list(range(1, 32, 2)), _i32)))


def _int_sum(b, v):  # <n x i32> -> i32, halving: integer, so exact in any order
    n = v.type.count
    while n > 1:
        n //= 2
        v = b.add(b.shuffle_vector(v, v, _vector(list(range(n)), _i32)),
                  b.shuffle_vector(v, v, _vector(list(range(n, 2 * n)), _i32)))  # fmt: skip
    return b.extract_element(v, ir.Constant(_i32, 0))


class _Rows:
    """The activation rows one pass reads (rows past M repeat row M - 1 and are not stored)."""

    def __init__(self, b, qp, sp, np_, m, k, first, rows: int):
        self.b, self.qp, self.sp, self.np, self.m, self.k, self.first = b, qp, sp, np_, m, k, first
        last = b.sub(m, ir.Constant(_i64, 1))
        self.picks = [b.select(b.icmp_signed("<", v, m), v, last) for v in
                      (b.add(first, ir.Constant(_i64, r)) for r in range(rows))]  # fmt: skip

    def block(self, pick, block):  # xq[pick, 32 block : 32 block + 32] as <32 x i16>
        b = self.b
        at = b.add(b.mul(pick, self.k), b.mul(block, ir.Constant(_i64, 32)))
        return b.load(b.bitcast(b.gep(self.qp, [at]), ir.VectorType(_i16, 32).as_pointer()), align=2)

    def slot(self, pick, index, span: int):  # pick * (K // span) + index
        return self.b.add(self.b.mul(pick, self.b.udiv(self.k, ir.Constant(_i64, span))), index)

    def store(self, totals, op):
        for r, (pick, total) in enumerate(zip(self.picks, totals, strict=True)):
            with self.b.if_then(self.b.icmp_signed("<", self.b.add(self.first, ir.Constant(_i64, r)), self.m)):
                self.b.store(total, self.b.gep(op, [pick]))


def _prefetch(b, ptr):  # a hint to fetch the cache line at ptr: no effect on results, and never faults
    fn = cgutils.get_or_insert_function(b.module, ir.FunctionType(ir.VoidType(), [_i8.as_pointer(), _i32, _i32, _i32]),
                                        "llvm.prefetch.p0i8")
    b.call(fn, [ptr, ir.Constant(_i32, 0), ir.Constant(_i32, 3), ir.Constant(_i32, 1)])


def _lane_sums(b, cs):
    """<16 x float> accumulators -> for each, c[0] + c[1] + ... + c[15], left to right. With
    several, lane l of all of them is gathered into one vector and the vectors are added in
    lane order: each output takes the same additions in the same order as alone, and the
    sums run side by side instead of one scalar chain after another."""
    if len(cs) == 1:
        total = b.extract_element(cs[0], ir.Constant(_i32, 0))
        for lane in range(1, LANES):
            total = b.fadd(total, b.extract_element(cs[0], ir.Constant(_i32, lane)))
        return [total]
    count = 1 << (len(cs) - 1).bit_length()  # padded to a power of two (the extra lanes are unused)
    rows = cs + [cs[-1]] * (count - len(cs))
    while len(rows) > 1:  # interleave pairs: lane l of every accumulator ends up side by side
        span = LANES * count // len(rows)  # elements per row so far; group = span // LANES
        group = span // LANES
        order = [half * span + lane * group + g for lane in range(LANES) for half in range(2) for g in range(group)]
        rows = [b.shuffle_vector(rows[i], rows[i + 1], _vector(order, _i32)) for i in range(0, len(rows), 2)]
    table = rows[0]  # element l * count + i: lane l of accumulator i
    lanes = [b.shuffle_vector(table, table, _vector(list(range(lane * count, lane * count + count)), _i32))
             for lane in range(LANES)]  # fmt: skip
    total = lanes[0]
    for lane in lanes[1:]:
        total = b.fadd(total, lane)
    return [b.extract_element(total, ir.Constant(_i32, i)) for i in range(len(cs))]


def _super_body(b, rows: _Rows, kind: str, rp, wp, units, ahead=None):
    """Q6_K, Q5_K: per super-block u, 16 exact int32 lanes (lane l: the pairs 2l, 2l + 1 of
    each of u's blocks, of (w * sc) * xq), then c += (d * xs[u]) * float(lanes); Q5_K's min
    term m += (dmin * xs[u]) * float(sum over sub-blocks j of mn[j] * xsum[j]) in
    order; returns c[0] + ... + c[15] (- m)."""
    width, blocks, reader = _KINDS[kind]
    zero = ir.Constant(ir.VectorType(_f32, 16), [ir.Constant(_f32, 0.0)] * 16)
    accs = [cgutils.alloca_once_value(b, zero) for _ in rows.picks]
    mins = [cgutils.alloca_once_value(b, ir.Constant(_f32, 0.0)) for _ in rows.picks]
    with cgutils.for_range(b, units) as loop:
        unit = _Unit(b, b.gep(rp, [b.mul(loop.index, ir.Constant(_i64, width))]), loop.index, wp)
        if ahead is not None:
            _prefetch(b, b.gep(unit.src, [ahead]))
        weights, scales, d, minimum = reader(unit)
        scaled = [b.mul(w, sc) for w, sc in zip(weights, scales, strict=True)]  # <32 x i16>, exact: |w sc| <= 4096
        for r, pick in enumerate(rows.picks):
            isum = None
            for j, w in enumerate(scaled):
                p = _pairs(b, w, rows.block(pick, b.add(b.mul(loop.index, ir.Constant(_i64, blocks)), ir.Constant(_i64, j))))
                isum = p if isum is None else b.add(isum, p)
            x_scale = b.load(b.gep(rows.sp, [rows.slot(pick, loop.index, 256)]))
            term = b.fmul(_splat_value(b, b.fmul(d, x_scale), 16), b.sitofp(isum, ir.VectorType(_f32, 16)))
            b.store(b.fadd(b.load(accs[r]), term), accs[r])
            if minimum is not None:
                mn, dmin = minimum
                at = b.gep(rows.np, [rows.slot(pick, b.mul(loop.index, ir.Constant(_i64, blocks)), 32)])
                sums = b.load(b.bitcast(at, ir.VectorType(_i32, 8).as_pointer()), align=4)
                imin = b.sitofp(_int_sum(b, b.mul(mn, sums)), _f32)
                b.store(b.fadd(b.load(mins[r]), b.fmul(b.fmul(dmin, x_scale), imin)), mins[r])
    totals = _lane_sums(b, [b.load(acc) for acc in accs])
    if kind != "q5_k":
        return totals
    return [b.fsub(total, b.load(v)) for total, v in zip(totals, mins, strict=True)]


def _dot(kind: str, rows: int):
    """An intrinsic `dot(row, xq, xs, xsum, wscale, units, first, out)`: the outputs of
    activation rows first .. first + rows - 1 (those below M) for one weight row, into
    out[first:], with the row's integers read in registers once for all of them; the
    arithmetic of the module docstring (`_super_body`). xq [M, K] int16, xs [M, K // 256]
    fp32, xsum [M, K // 32] int32, out [M] fp32."""

    @intrinsic
    def dot(typingctx, row, xq, xs, xsum, wscale, units, first, out):
        def codegen(context, builder, signature, args):
            rp, qp, sp, np_, wp, op = (_data(context, builder, signature, args, k) for k in (0, 1, 2, 3, 4, 7))
            row_bytes = builder.extract_value(context.make_array(signature.args[0])(context, builder, args[0]).shape, 0)
            ahead = builder.mul(row_bytes, ir.Constant(_i64, PREFETCH_ROWS))
            shape = context.make_array(signature.args[1])(context, builder, args[1]).shape
            m, k = builder.extract_value(shape, 0), builder.extract_value(shape, 1)
            passing = _Rows(builder, qp, sp, np_, m, k, args[6], rows)
            totals = _super_body(builder, passing, kind, rp, wp, args[5], ahead)
            passing.store(totals, op)
            return context.get_dummy_value()

        return types.void(row, xq, xs, xsum, wscale, units, first, out), codegen

    return dot


# one, two or DOT_ROWS activation rows per pass over a weight row (a pass computes all its
# rows, so the last ones take the narrowest pass that holds them)
_one_q6_k, _one_q5_k = (_dot(kind, 1) for kind in _KINDS)
_two_q6_k, _two_q5_k = (_dot(kind, 2) for kind in _KINDS)
_many_q6_k, _many_q5_k = (_dot(kind, DOT_ROWS) for kind in _KINDS)


KIND_CODES = {name: code for code, name in enumerate(_KINDS)}  # matmul's `kind`


@njit(cache=True, nogil=True, inline="always")
def _pass(kind, row, xq, xs, xsum, table, units, first, width, out):  # pragma: no cover - compiled
    """One pass of `width` (1, 2 or DOT_ROWS) activation rows from `first` over one weight row."""
    if kind == 0:
        if width == 1:
            _one_q6_k(row, xq, xs, xsum, table, units, first, out)
        elif width == 2:
            _two_q6_k(row, xq, xs, xsum, table, units, first, out)
        else:
            _many_q6_k(row, xq, xs, xsum, table, units, first, out)
    elif width == 1:
        _one_q5_k(row, xq, xs, xsum, table, units, first, out)
    elif width == 2:
        _two_q5_k(row, xq, xs, xsum, table, units, first, out)
    else:
        _many_q5_k(row, xq, xs, xsum, table, units, first, out)


@njit(types.void(types.int64, _raw(types.uint8), _f32_2d, types.int64, _i16_2d, _f32_2d, types.int32[:, ::1], _f32_2d,
                 types.int64), cache=True, nogil=True, parallel=True)  # fmt: skip
def matmul(kind, raw, table, units, xq, xs, xsum, y, column):  # pragma: no cover - compiled
    """raw [N, bytes per row] (the file's super-blocks of KIND_CODES' type `kind`), table [N, T]
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
                _pass(kind, raw[n], xq, xs, xsum, table[n], units, first, width, out)
                first += width
            for r in range(m):
                y[r, column + n] = out[r]
