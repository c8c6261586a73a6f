"""LLVM vector IR helpers for the int8-activation kernels (tiles16.py, supertiles.py), built
with llvmlite and inlined into numba's loops through `numba.extending.intrinsic`.

`DOT` names the instructions the sums of four products use on the CPU the kernels compile
for: vpdpbusd with AVX-512 VNNI, pmaddubsw on AVX2, plain IR elsewhere. All three give the
same integers, so the CPU changes the speed, not the bits. `SPECDEC_INT8_DOT` forces one
(the tests compile each path); a forced path is not written to the shared cache (`CACHE`).
"""

from __future__ import annotations

import os

from llvmlite import binding, ir
from numba import njit, types
from numba.core import cgutils, config


def raw_array(dtype):
    """The file's blocks: a read-only memory map (accepts writable arrays too)."""
    return types.Array(dtype, 2, "C", readonly=True)


LANES = 16


DOT_ROWS = 4  # activation rows of a narrow pass over a tile (WIDE_ROWS below: the widest)


i8, i16, i32, i64, f32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64), ir.FloatType()


def vector(values, element=i16):
    return ir.Constant(ir.VectorType(element, len(values)), [ir.Constant(element, v) for v in values])


def splat(value, count, element=i16):
    return vector([value] * count, element)


def splat_value(b, x, count: int):  # a run-time scalar in every lane of <count x type>
    t = ir.VectorType(x.type, count)
    v = b.insert_element(ir.Constant(t, None), x, ir.Constant(i32, 0))
    return b.shuffle_vector(v, ir.Constant(t, None), vector([0] * count, i32))


DOTS = ("vnni", "avx2", "generic")


def vec(element, count: int) -> ir.VectorType:
    return ir.VectorType(element, count)


def const(value: int) -> ir.Constant:
    return ir.Constant(i64, value)


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
BF16_DOT_ENV = "SPECDEC_BF16_DOT"


def _target_bf16_dot() -> bool:
    """Whether the attention's bf16 score tiles use vdpbf16ps (AVX-512 BF16) or its replica in
    fp32 multiplies and adds (the same bits: jit/attention_tiles.py). SPECDEC_BF16_DOT=0 or 1
    forces one (the tests compile both; the cache folder's name includes it, jit/__init__.py)."""
    forced = os.environ.get(BF16_DOT_ENV)
    if forced:
        if forced not in ("0", "1"):
            raise ValueError(f"{BF16_DOT_ENV}={forced!r}: expected 0 or 1")
        return forced == "1"
    if config.CPU_FEATURES is not None:
        return bf16_dot_for(config.CPU_FEATURES)
    if config.CPU_NAME is not None:
        return False
    return bf16_dot_for(binding.get_host_cpu_features().flatten())


def bf16_dot_for(features: str) -> bool:
    """Whether an LLVM feature string ("+avx512bf16,-amx-tile,...") has vdpbf16ps."""
    return "+avx512bf16" in features.split(",")


BF16_DOT = _target_bf16_dot()

CACHE = "SPECDEC_INT8_DOT" not in os.environ  # a forced path must not land in the shared cache

# activation rows of the widest pass over a tile: AVX-512's 32 registers hold 8 rows' sums beside
# a block's weights; AVX2's 16 registers keep DOT_ROWS
WIDE_ROWS = 8 if DOT == "vnni" else DOT_ROWS


@njit(cache=CACHE, nogil=True, inline="always")
def pass_width(left):  # pragma: no cover - compiled
    """Rows of a tile's next pass with `left` activation rows to go: WIDE_ROWS while they last,
    then DOT_ROWS (3 rows take it, one repeated), then 1 or 2. Rows share no arithmetic, so the
    split never changes a bit."""
    if left >= WIDE_ROWS:
        return WIDE_ROWS
    return DOT_ROWS if left > 2 else left


def load(b, ptr, offset, vector_type):
    return b.load(b.bitcast(b.gep(ptr, [offset]), vector_type.as_pointer()), align=1)


def fp16_lanes(b, ptr, offset: int, count: int):
    """<count x float>: the fp16 values at byte `offset` of ptr, widened exactly."""
    raw = load(b, ptr, const(offset), vec(i16, count))
    return b.fpext(b.bitcast(raw, vec(ir.HalfType(), count)), vec(f32, count))


def widen(b, v, count: int):  # <n x T> -> <count x T>, zeros above n
    n = v.type.count
    zeros = ir.Constant(v.type, None)
    return b.shuffle_vector(v, zeros, vector(list(range(n)) + [n] * (count - n), i32))


def call_intrinsic(b, name: str, result, operands):
    fn = cgutils.get_or_insert_function(b.module, ir.FunctionType(result, [o.type for o in operands]), name)
    return b.call(fn, operands)


def dot4(b, w, signed: bool, offset: int, x, xsum4):
    """<64 x i8> weights and activations -> <16 x i32>: lane j = the sum over elements 4j ..
    4j + 3 of w * x, exact. Signed weights are themselves; unsigned ones u stand for u +
    offset (Q5_0: q - 16), with xsum4 the activations' sums of four."""
    zero = ir.Constant(vec(i32, 16), None)
    if DOT == "vnni":
        if signed:  # vpdpbusd wants unsigned weights: w + 128, less 128 * xsum4
            w, offset = b.xor(w, splat(-128, 64, i8)), -128
        init = b.mul(xsum4, splat(offset, 16, i32)) if offset else zero
        return call_intrinsic(b, "llvm.x86.avx512.vpdpbusd.512", vec(i32, 16),
                          [init, b.bitcast(w, vec(i32, 16)), b.bitcast(x, vec(i32, 16))])
    if DOT == "avx2":
        halves = []
        for h in range(2):
            pick = vector(list(range(32 * h, 32 * h + 32)), i32)
            wh, xh = b.shuffle_vector(w, w, pick), b.shuffle_vector(x, x, pick)
            if signed:  # |w| times x with w's sign
                xh = call_intrinsic(b, "llvm.x86.avx2.psign.b", vec(i8, 32), [xh, wh])
                wh = call_intrinsic(b, "llvm.x86.avx2.psign.b", vec(i8, 32), [wh, wh])
            pairs = call_intrinsic(b, "llvm.x86.avx2.pmadd.ub.sw", vec(i16, 16), [wh, xh])
            halves.append(call_intrinsic(b, "llvm.x86.avx2.pmadd.wd", vec(i32, 8), [pairs, splat(1, 16)]))
        lanes = b.shuffle_vector(halves[0], halves[1], vector(list(range(16)), i32))
    else:
        # byte e of each lane's four, widened in place by shifts (no shuffles: wide strided
        # shuffles made the backend's instruction selection take minutes for the kernels)
        w32, x32 = b.bitcast(w, vec(i32, 16)), b.bitcast(x, vec(i32, 16))
        widen_w = b.ashr if signed else b.lshr
        lanes = None
        for e in range(4):
            up = splat(24 - 8 * e, 16, i32)
            p = b.mul(widen_w(b.shl(w32, up), splat(24, 16, i32)), b.ashr(b.shl(x32, up), splat(24, 16, i32)))
            lanes = p if lanes is None else b.add(lanes, p)
    return b.add(lanes, b.mul(xsum4, splat(offset, 16, i32))) if offset and not signed else lanes


def data_pointer(context, builder, signature, args, k: int):
    return context.make_array(signature.args[k])(context, builder, args[k]).data


def int_sum(b, v):  # <n x i32> -> i32, halving: integer, so exact in any order
    n = v.type.count
    while n > 1:
        n //= 2
        v = b.add(b.shuffle_vector(v, v, vector(list(range(n)), i32)),
                  b.shuffle_vector(v, v, vector(list(range(n, 2 * n)), i32)))
    return b.extract_element(v, ir.Constant(i32, 0))


class Rows:
    """The activation rows one pass reads (rows past M repeat row M - 1 and are not stored)."""

    def __init__(self, b, qp, sp, np_, fp, m, k, first, rows: int):
        self.b, self.qp, self.sp, self.np, self.fp, self.m, self.k, self.first = (
            b, qp, sp, np_, fp, m, k, first)
        last = b.sub(m, ir.Constant(i64, 1))
        self.picks = [b.select(b.icmp_signed("<", v, m), v, last) for v in
                      (b.add(first, ir.Constant(i64, r)) for r in range(rows))]

    def chunk(self, pick, chunk):  # xq[pick, 64 chunk : 64 chunk + 64] <64 x i8>, its xsum4 <16 x i32>
        b = self.b
        at = b.add(b.mul(pick, self.k), b.mul(chunk, const(64)))
        fours = b.add(b.mul(pick, b.udiv(self.k, const(4))), b.mul(chunk, const(16)))
        return load(b, self.qp, at, vec(i8, 64)), load(b, self.fp, fours, vec(i32, 16))

    def slot(self, pick, index, span: int):  # pick * (K // span) + index
        return self.b.add(self.b.mul(pick, self.b.udiv(self.k, ir.Constant(i64, span))), index)

    def store(self, totals, op):
        for r, (pick, total) in enumerate(zip(self.picks, totals, strict=True)):
            with self.b.if_then(self.b.icmp_signed("<", self.b.add(self.first, ir.Constant(i64, r)), self.m)):
                self.b.store(total, self.b.gep(op, [pick]))


def prefetch(b, ptr):  # a hint to fetch the cache line at ptr: no effect on results, and never faults
    fn = cgutils.get_or_insert_function(b.module,
                                        ir.FunctionType(ir.VoidType(), [i8.as_pointer(), i32, i32, i32]),
                                        "llvm.prefetch.p0i8")
    b.call(fn, [ptr, ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])


def lane_sums(b, cs):
    """<16 x float> accumulators -> for each, c[0] + c[1] + ... + c[15], left to right. With
    several, lane l of all of them is gathered into one vector and the vectors are added in
    lane order: each output takes the same additions in the same order as alone, and the
    sums run side by side instead of one scalar chain after another."""
    if len(cs) == 1:
        total = b.extract_element(cs[0], ir.Constant(i32, 0))
        for lane in range(1, LANES):
            total = b.fadd(total, b.extract_element(cs[0], ir.Constant(i32, lane)))
        return [total]
    count = 1 << (len(cs) - 1).bit_length()  # padded to a power of two (the extra lanes are unused)
    rows = cs + [cs[-1]] * (count - len(cs))
    while len(rows) > 1:  # interleave pairs: lane l of every accumulator ends up side by side
        span = LANES * count // len(rows)  # elements per row so far; group = span // LANES
        group = span // LANES
        order = [half * span + lane * group + g
                 for lane in range(LANES) for half in range(2) for g in range(group)]
        rows = [b.shuffle_vector(rows[i], rows[i + 1], vector(order, i32)) for i in range(0, len(rows), 2)]
    table = rows[0]  # element l * count + i: lane l of accumulator i
    lanes = [b.shuffle_vector(table, table, vector(list(range(lane * count, lane * count + count)), i32))
             for lane in range(LANES)]
    total = lanes[0]
    for lane in lanes[1:]:
        total = b.fadd(total, lane)
    return [b.extract_element(total, ir.Constant(i32, i)) for i in range(len(cs))]


def dispatch(runners: list):
    """An inlined numba function `run(code, args)` that calls `runners[code](code, args)` for a
    run-time code 0 .. n - 1 (numba cannot index a sequence of functions at run time, so the
    calls form a chain of comparisons, what an if / elif ladder compiles to). A runner takes
    (code, args), its arguments as one tuple."""
    return _chain(list(runners), 0)


def _chain(runners: list, base: int):
    first = runners[0]
    if len(runners) == 1:
        return first
    rest = _chain(runners[1:], base + 1)

    @njit(inline="always")
    def run(code, args):  # pragma: no cover - compiled
        if code == base:
            first(code, args)
        else:
            rest(code, args)

    return run
