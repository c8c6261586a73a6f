"""numba kernels for GGUF's Q6_K, Q5_K and Q4_K matrices on int8 activations (see
gguf_kernels_8bit.py, which wraps them and states the contract; gguf_jit_rows16.py holds the
blocks of 32's), and the IR helpers both modules build them from. Imported on first use;
compiled once, cached on disk.

The arithmetic, for one output y[m, n] (`superblock_matmul` in gguf_kernels_8bit.py performs
the same operations in the same order, bit for bit):
- weights: the file's integers (Q6_K q - 32, Q5_K and Q4_K q) and fp32 scales formed from
  the file's fields exactly (d, dmin: fp16 values); the sub-block scales sc (Q6_K's int8 per
  16, Q5_K's and Q4_K's six bits per 32) and their mins m stay integers;
- activations (gguf_jit_quant's `quantize_rows_k`; llama.cpp's Q8_K): each super-block u of
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
(`llvm.prefetch`, a hint). The sums of four products come from `_dot4`, with the
instructions `DOT` names for the CPU the kernels compile on (vpdpbusd with AVX-512 VNNI,
pmaddubsw on AVX2, plain IR elsewhere: the same integers, so the CPU changes the speed, not
the bits); the float operations are plain IR, nothing fused or reordered.
The IR helpers are not cached themselves; the cached kernels contain them, and numba
re-validates a cached kernel by its own file's time stamp only: a change here needs
gguf_jit_rows16.py's cache cleared too.
"""

from __future__ import annotations

import os

import numpy as np
from llvmlite import binding, ir
from numba import njit, prange, types
from numba.core import cgutils, config
from numba.extending import intrinsic

_f32_2d = types.float32[:, ::1]


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


DOTS = ("vnni", "avx2", "generic")


def _vec(element, count: int) -> ir.VectorType:
    return ir.VectorType(element, count)


def _const(value: int) -> ir.Constant:
    return ir.Constant(_i64, value)


def dot_for(features: str) -> str:
    """The lanes' instructions for an LLVM feature string ("+avx2,+avx512vnni,-sse4a,...")."""
    have = {f[1:] for f in features.split(",") if f.startswith("+")}
    if {"avx512vnni", "avx512bw"} <= have:
        return "vnni"
    return "avx2" if "avx2" in have else "generic"


def _target_dot() -> str:
    forced = os.environ.get("SPECDEC_INT8_DOT")  # tests compile each path (uncached)
    if forced:
        if forced not in DOTS:
            raise ValueError(f"SPECDEC_INT8_DOT={forced!r}: expected one of {', '.join(DOTS)}")
        return forced
    if config.CPU_FEATURES is not None:  # numba compiles for these, not the host's
        return dot_for(config.CPU_FEATURES)
    if config.CPU_NAME is not None:
        return "generic"
    return dot_for(binding.get_host_cpu_features().flatten())


DOT = _target_dot()
_CACHE = "SPECDEC_INT8_DOT" not in os.environ  # a forced path must not land in the shared cache


def _load(b, ptr, offset, vector_type):
    return b.load(b.bitcast(b.gep(ptr, [offset]), vector_type.as_pointer()), align=1)


def _widen(b, v, count: int):  # <n x T> -> <count x T>, zeros above n
    n = v.type.count
    zeros = ir.Constant(v.type, None)
    return b.shuffle_vector(v, zeros, _vector(list(range(n)) + [n] * (count - n), _i32))


def _intrinsic(b, name: str, result, operands):
    fn = cgutils.get_or_insert_function(b.module, ir.FunctionType(result, [o.type for o in operands]), name)
    return b.call(fn, operands)


def _dot4(b, w, signed: bool, offset: int, x, xsum4):
    """<64 x i8> weights and activations -> <16 x i32>: lane j = the sum over elements 4j ..
    4j + 3 of w * x, exact. Signed weights are themselves; unsigned ones u stand for u +
    offset (Q5_0: q - 16), with xsum4 the activations' sums of four."""
    zero = ir.Constant(_vec(_i32, 16), None)
    if DOT == "vnni":
        if signed:  # vpdpbusd wants unsigned weights: w + 128, less 128 * xsum4
            w, offset = b.xor(w, _splat(-128, 64, _i8)), -128
        init = b.mul(xsum4, _splat(offset, 16, _i32)) if offset else zero
        return _intrinsic(b, "llvm.x86.avx512.vpdpbusd.512", _vec(_i32, 16),
                          [init, b.bitcast(w, _vec(_i32, 16)), b.bitcast(x, _vec(_i32, 16))])  # fmt: skip
    if DOT == "avx2":
        halves = []
        for h in range(2):
            pick = _vector(list(range(32 * h, 32 * h + 32)), _i32)
            wh, xh = b.shuffle_vector(w, w, pick), b.shuffle_vector(x, x, pick)
            if signed:  # |w| times x with w's sign
                xh = _intrinsic(b, "llvm.x86.avx2.psign.b", _vec(_i8, 32), [xh, wh])
                wh = _intrinsic(b, "llvm.x86.avx2.psign.b", _vec(_i8, 32), [wh, wh])
            pairs = _intrinsic(b, "llvm.x86.avx2.pmadd.ub.sw", _vec(_i16, 16), [wh, xh])
            halves.append(_intrinsic(b, "llvm.x86.avx2.pmadd.wd", _vec(_i32, 8), [pairs, _splat(1, 16)]))
        lanes = b.shuffle_vector(halves[0], halves[1], _vector(list(range(16)), _i32))
    else:
        p = b.mul((b.sext if signed else b.zext)(w, _vec(_i32, 64)), b.sext(x, _vec(_i32, 64)))
        parts = [b.shuffle_vector(p, p, _vector(list(range(j, 64, 4)), _i32)) for j in range(4)]
        lanes = b.add(b.add(parts[0], parts[1]), b.add(parts[2], parts[3]))
    return b.add(lanes, b.mul(xsum4, _splat(offset, 16, _i32))) if offset and not signed else lanes


class _Unit:
    """Vector IR over one super-block of 256 of a row at byte `src`. The kinds below read it
    into four chunks of 64 elements, each the file's integers q as <64 x i8> (unsigned; the
    weight is q + offset) and its sub-block scales per lane of four elements as <16 x i32>,
    plus d and Q5_K's mins."""

    def __init__(self, builder, src, index, wscale):
        self.b, self.src, self.index, self.wscale = builder, src, index, wscale

    def load(self, offset: int, count: int, signed: bool = False, element=_i16):  # bytes -> <count x element>
        b = self.b
        ptr = b.bitcast(b.gep(self.src, [ir.Constant(_i64, offset)]), ir.VectorType(_i8, count).as_pointer())
        raw = b.load(ptr, align=1)
        return raw if element is _i8 else (b.sext if signed else b.zext)(raw, ir.VectorType(element, count))

    def table_value(self, position):  # wscale[position]
        return self.b.load(self.b.gep(self.wscale, [position]))



def _byte_shift(b, v, shifts: list[int]):
    """<64 x i8> v, each 16 bytes' half-words shifted right by their count in `shifts` (per
    pair of bytes): the low bits of each byte are its own (counts below 7)."""
    words = _vector([c for c in shifts for _ in range(8)], _i16)
    return b.bitcast(b.lshr(b.bitcast(v, _vec(_i16, 32)), words), _vec(_i8, 64))


def _twice(b, v):  # <32 x i8> -> <64 x i8>, the 32 bytes twice
    return b.shuffle_vector(v, v, _vector(list(range(32)) * 2, _i32))


def _q6_k(u):
    """210 bytes: ql[128], qh[64], int8 sc[16], fp16 d; wscale: d per super-block. Element
    h*128 + t*32 + l: nibble t // 2 of ql[h*64 + (t % 2)*32 + l], bits 2t, 2t+1 of qh[h*32 + l];
    weights q - 32 with q in 0..63, sub-block scale sc per 16."""
    b, chunks, scales = u.b, [], []
    sc = u.load(192, 16, element=_i8)
    for h in range(2):
        ql, qh = u.load(h * 64, 64, element=_i8), _twice(b, u.load(128 + h * 32, 32, element=_i8))
        for k in range(2):  # elements h*128 + k*64 + (0..63): t = 2k, then 2k + 1
            low = b.and_(_byte_shift(b, ql, [4 * k] * 4), _splat(15, 64, _i8))
            high = b.and_(_byte_shift(b, qh, [4 * k] * 2 + [4 * k + 2] * 2), _splat(3, 64, _i8))
            chunks.append(b.or_(low, b.shl(high, _splat(4, 64, _i8))))
            first = 8 * h + 4 * k  # the chunk's first sub-block of 16: lanes of 4 elements, 4 a sub-block
            scales.append(b.sext(b.shuffle_vector(sc, sc, _vector([first + j // 4 for j in range(16)], _i32)), _vec(_i32, 16)))
    return chunks, scales, -32, u.table_value(u.index), None


def _q5_k(u):
    """176 bytes: d, dmin, scales[12], qh[32], qs[128]; sub-block 2j + half (of 32): the low
    (half 0) or high nibbles of qs[j*32 + l], plus bit 2j + half of qh[l] as 16."""
    b, chunks = u.b, []
    qh = _twice(b, u.load(16, 32, element=_i8))
    for j in range(4):  # elements j*64 + (0..63): sub-blocks 2j, 2j + 1
        qs = _twice(b, u.load(48 + j * 32, 32, element=_i8))
        low = b.and_(_byte_shift(b, qs, [0, 0, 4, 4]), _splat(15, 64, _i8))
        high = b.and_(_byte_shift(b, qh, [2 * j] * 2 + [2 * j + 1] * 2), _splat(1, 64, _i8))
        chunks.append(b.or_(low, b.shl(high, _splat(4, 64, _i8))))
    return (chunks, *_k_scales(u))


def _q4_k(u):
    """144 bytes: d, dmin, scales[12], qs[128]; sub-block 2j + half (of 32): the low (half 0)
    or high nibbles of qs[j*32 + l]. Q5_K without the fifth bit."""
    b = u.b
    chunks = [b.and_(_byte_shift(b, _twice(b, u.load(16 + j * 32, 32, element=_i8)), [0, 0, 4, 4]), _splat(15, 64, _i8))
              for j in range(4)]  # fmt: skip
    return (chunks, *_k_scales(u))


def _k_scales(u):
    """Q5_K's and Q4_K's sub-block scales per lane of four, their offset, d, and the mins with dmin."""
    b = u.b
    sc, mn = _q5_k_scale_bytes(u)
    two = ir.Constant(_i64, 2)
    d, dmin = u.table_value(b.mul(u.index, two)), u.table_value(b.add(b.mul(u.index, two), ir.Constant(_i64, 1)))
    scales = [b.zext(b.shuffle_vector(sc, sc, _vector([2 * j] * 8 + [2 * j + 1] * 8, _i32)), _vec(_i32, 16))
              for j in range(4)]  # fmt: skip
    return scales, 0, d, (b.sext(mn, ir.VectorType(_i32, 8)), dmin)


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
_KINDS = {"q6_k": (210, 8, _q6_k), "q5_k": (176, 8, _q5_k), "q4_k": (144, 8, _q4_k)}


def _data(context, builder, signature, args, k: int):
    return context.make_array(signature.args[k])(context, builder, args[k]).data


def _int_sum(b, v):  # <n x i32> -> i32, halving: integer, so exact in any order
    n = v.type.count
    while n > 1:
        n //= 2
        v = b.add(b.shuffle_vector(v, v, _vector(list(range(n)), _i32)),
                  b.shuffle_vector(v, v, _vector(list(range(n, 2 * n)), _i32)))  # fmt: skip
    return b.extract_element(v, ir.Constant(_i32, 0))


class _Rows:
    """The activation rows one pass reads (rows past M repeat row M - 1 and are not stored)."""

    def __init__(self, b, qp, sp, np_, fp, m, k, first, rows: int):
        self.b, self.qp, self.sp, self.np, self.fp, self.m, self.k, self.first = b, qp, sp, np_, fp, m, k, first
        last = b.sub(m, ir.Constant(_i64, 1))
        self.picks = [b.select(b.icmp_signed("<", v, m), v, last) for v in
                      (b.add(first, ir.Constant(_i64, r)) for r in range(rows))]  # fmt: skip

    def chunk(self, pick, chunk):  # xq[pick, 64 chunk : 64 chunk + 64] <64 x i8>, its xsum4 <16 x i32>
        b = self.b
        at = b.add(b.mul(pick, self.k), b.mul(chunk, _const(64)))
        fours = b.add(b.mul(pick, b.udiv(self.k, _const(4))), b.mul(chunk, _const(16)))
        return _load(b, self.qp, at, _vec(_i8, 64)), _load(b, self.fp, fours, _vec(_i32, 16))

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
    """Q6_K, Q5_K: per super-block u, 16 exact int32 lanes (lane j: over u's four chunks c of
    64 elements, sc * (the sum of w * xq over elements 64c + 4j .. 64c + 4j + 3)), then c +=
    (d * xs[u]) * float(lanes); Q5_K's min term m += (dmin * xs[u]) * float(sum over
    sub-blocks j of mn[j] * xsum[j]) in order; returns c[0] + ... + c[15] (- m)."""
    width, blocks, reader = _KINDS[kind]
    zero = ir.Constant(ir.VectorType(_f32, 16), [ir.Constant(_f32, 0.0)] * 16)
    accs = [cgutils.alloca_once_value(b, zero) for _ in rows.picks]
    mins = [cgutils.alloca_once_value(b, ir.Constant(_f32, 0.0)) for _ in rows.picks]
    with cgutils.for_range(b, units) as loop:
        unit = _Unit(b, b.gep(rp, [b.mul(loop.index, ir.Constant(_i64, width))]), loop.index, wp)
        if ahead is not None:
            _prefetch(b, b.gep(unit.src, [ahead]))
        chunks, scales, offset, d, minimum = reader(unit)
        for r, pick in enumerate(rows.picks):
            isum = None
            for c, (q, sc) in enumerate(zip(chunks, scales, strict=True)):
                x, xsum4 = rows.chunk(pick, b.add(b.mul(loop.index, _const(4)), _const(c)))
                lanes = b.mul(_dot4(b, q, False, offset, x, xsum4), sc)  # exact: |lane| < 2^23
                isum = lanes if isum is None else b.add(isum, lanes)
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
    if kind == "q6_k":  # no min term
        return totals
    return [b.fsub(total, b.load(v)) for total, v in zip(totals, mins, strict=True)]


def _dot(kind: str, rows: int):
    """An intrinsic `dot(row, xq, xs, xsum, xsum4, wscale, units, first, out)`: the outputs of
    activation rows first .. first + rows - 1 (those below M) for one weight row, into
    out[first:], with the row's integers read in registers once for all of them; the
    arithmetic of the module docstring (`_super_body`). xq [M, K] int8, xs [M, K // 256]
    fp32, xsum [M, K // 32] and xsum4 [M, K // 4] int32, out [M] fp32."""

    @intrinsic
    def dot(typingctx, row, xq, xs, xsum, xsum4, wscale, units, first, out):
        def codegen(context, builder, signature, args):
            rp, qp, sp, np_, fp, wp, op = (_data(context, builder, signature, args, k) for k in (0, 1, 2, 3, 4, 5, 8))
            row_bytes = builder.extract_value(context.make_array(signature.args[0])(context, builder, args[0]).shape, 0)
            ahead = builder.mul(row_bytes, ir.Constant(_i64, PREFETCH_ROWS))
            shape = context.make_array(signature.args[1])(context, builder, args[1]).shape
            m, k = builder.extract_value(shape, 0), builder.extract_value(shape, 1)
            passing = _Rows(builder, qp, sp, np_, fp, m, k, args[7], rows)
            totals = _super_body(builder, passing, kind, rp, wp, args[6], ahead)
            passing.store(totals, op)
            return context.get_dummy_value()

        return types.void(row, xq, xs, xsum, xsum4, wscale, units, first, out), codegen

    return dot


# one, two or DOT_ROWS activation rows per pass over a weight row (a pass computes all its
# rows, so the last ones take the narrowest pass that holds them)
_one_q6_k, _one_q5_k, _one_q4_k = (_dot(kind, 1) for kind in _KINDS)
_two_q6_k, _two_q5_k, _two_q4_k = (_dot(kind, 2) for kind in _KINDS)
_many_q6_k, _many_q5_k, _many_q4_k = (_dot(kind, DOT_ROWS) for kind in _KINDS)


KIND_CODES = {name: code for code, name in enumerate(_KINDS)}  # matmul's `kind`


@njit(cache=_CACHE, nogil=True, inline="always")
def _pass(kind, row, xq, xs, xsum, xsum4, table, units, first, width, out):  # pragma: no cover - compiled
    """One pass of `width` (1, 2 or DOT_ROWS) activation rows from `first` over one weight row."""
    if kind == 0:
        if width == 1:
            _one_q6_k(row, xq, xs, xsum, xsum4, table, units, first, out)
        elif width == 2:
            _two_q6_k(row, xq, xs, xsum, xsum4, table, units, first, out)
        else:
            _many_q6_k(row, xq, xs, xsum, xsum4, table, units, first, out)
    elif kind == 1:
        if width == 1:
            _one_q5_k(row, xq, xs, xsum, xsum4, table, units, first, out)
        elif width == 2:
            _two_q5_k(row, xq, xs, xsum, xsum4, table, units, first, out)
        else:
            _many_q5_k(row, xq, xs, xsum, xsum4, table, units, first, out)
    elif width == 1:
        _one_q4_k(row, xq, xs, xsum, xsum4, table, units, first, out)
    elif width == 2:
        _two_q4_k(row, xq, xs, xsum, xsum4, table, units, first, out)
    else:
        _many_q4_k(row, xq, xs, xsum, xsum4, table, units, first, out)


@njit(types.void(types.int64, _raw(types.uint8), _f32_2d, types.int64, types.int8[:, ::1], _f32_2d, types.int32[:, ::1],
                 types.int32[:, ::1], _f32_2d, types.int64), cache=_CACHE, nogil=True, parallel=True)  # fmt: skip
def matmul(kind, raw, table, units, xq, xs, xsum, xsum4, y, column):  # pragma: no cover - compiled
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
                _pass(kind, raw[n], xq, xs, xsum, xsum4, table[n], units, first, width, out)
                first += width
            for r in range(m):
                y[r, column + n] = out[r]
