"""A lane's softmax numerators over its scores: their maximum (`largest`) and exp(s - top)
(`exp_shifted`), in LLVM vector IR inlined into numba's loops (as attention_tiles.py does).

numba's loops left both slow: the maximum did not vectorise at all, and the exp's vector loop
is one chain of about twenty dependent operations per eight scores, so the CPU's out-of-order
window held too few of them to keep its pipes busy. Here the maximum runs in vectors, and the
exp takes four vectors side by side. Each score's exp is still norms.exp_nonpositive's
arithmetic (the same operations, rounded where it rounds them), and a maximum is exact in any
order, so the bits are the loops' on any CPU. Imported on first use; compiled once, cached on
disk.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from specdec.backends.native.kernels.jit.ir import data_pointer, vec
from specdec.backends.native.kernels.jit.norms import (
    EXP_FLOOR,
    LN2_HI,
    LN2_LO,
    LOG2E,
    as_float,
    exp_terms,
)

WIDTH = 8  # floats per vector
SIDE = 4  # vectors side by side: independent chains for the out-of-order window
STRIDE = WIDTH * SIDE
i32, i64, f32 = ir.IntType(32), ir.IntType(64), ir.FloatType()
V8, I8 = vec(f32, WIDTH), vec(i32, WIDTH)
COEFFICIENTS = (1.0 / 720, 1.0 / 120, 1.0 / 24, 1.0 / 6, 0.5, 1.0)  # after 1 / 5040, as exp_terms


def _splat(value) -> ir.Constant:
    return ir.Constant(V8, [float(np.float32(value))] * WIDTH)


def _floor(b, x):
    fn = cgutils.get_or_insert_function(b.module, ir.FunctionType(V8, [V8]), "llvm.floor.v8f32")
    return b.call(fn, [x])


def _exp8(b, x):
    """exp(x) of eight scores less their maximum, as norms.exp_terms computes one."""
    x = b.select(b.fcmp_ordered("<", x, _splat(EXP_FLOOR)), _splat(EXP_FLOOR), x)
    k = _floor(b, b.fadd(b.fmul(x, _splat(LOG2E)), _splat(0.5)))
    r = b.fsub(b.fsub(x, b.fmul(k, _splat(LN2_HI))), b.fmul(k, _splat(LN2_LO)))
    p = _splat(1.0 / 5040)
    for c in COEFFICIENTS:
        p = b.fadd(b.fmul(p, r), _splat(c))
    p = b.fadd(b.fmul(p, r), _splat(1.0))
    power = b.shl(b.add(b.fptosi(k, I8), ir.Constant(I8, [127] * WIDTH)), ir.Constant(I8, [23] * WIDTH))
    return b.fmul(p, b.bitcast(power, V8))


def _vectors(b, ptr, at, side: int = SIDE):
    return [b.gep(ptr, [b.add(at, ir.Constant(i64, WIDTH * j))]) for j in range(side)]


def _load(b, at):
    return b.load(b.bitcast(at, V8.as_pointer()), align=4)


def _exp_run(side: int):
    """An intrinsic `run(s, top, start, end, w)`: w[i] = exp(s[i] - top) for start <= i < end
    (end - start a multiple of `side` vectors), `side` vectors a pass."""

    @intrinsic
    def run(typingctx, s, top, start, end, w):
        if not (isinstance(s, types.Array) and isinstance(w, types.Array)) or top != types.float32:
            return None

        def codegen(context, b, sig, args):
            sp, wp = data_pointer(context, b, sig, args, 0), data_pointer(context, b, sig, args, 4)
            shift = b.insert_element(ir.Constant(V8, None), args[1], ir.Constant(i32, 0))
            shift = b.shuffle_vector(shift, ir.Constant(V8, None), ir.Constant(I8, [0] * WIDTH))
            body = (args[2], args[3], ir.Constant(i64, WIDTH * side))
            with cgutils.for_range_slice(b, *body, inc=True) as (i, _):
                values = [_exp8(b, b.fsub(_load(b, at), shift)) for at in _vectors(b, sp, i, side)]
                for value, at in zip(values, _vectors(b, wp, i, side), strict=True):
                    b.store(value, b.bitcast(at, V8.as_pointer()), align=4)
            return context.get_dummy_value()

        return types.void(s, top, start, end, w), codegen

    return run


_exp_body, _exp_vector = _exp_run(SIDE), _exp_run(1)  # STRIDE floats a pass, then WIDTH


@intrinsic
def _max_body(typingctx, s, end):
    """max(s[:end]) for end a positive multiple of STRIDE, through SIDE vectors of running maxima."""
    if not isinstance(s, types.Array):
        return None

    def codegen(context, b, sig, args):
        sp = data_pointer(context, b, sig, args, 0)
        first = b.load(sp)
        start = b.insert_element(ir.Constant(V8, None), first, ir.Constant(i32, 0))
        start = b.shuffle_vector(start, ir.Constant(V8, None), ir.Constant(I8, [0] * WIDTH))
        tops = [cgutils.alloca_once_value(b, start) for _ in range(SIDE)]
        body = (ir.Constant(i64, 0), args[1], ir.Constant(i64, STRIDE))
        with cgutils.for_range_slice(b, *body, inc=True) as (i, _):
            for slot, at in zip(tops, _vectors(b, sp, i), strict=True):
                value, held = _load(b, at), b.load(slot)
                b.store(b.select(b.fcmp_ordered(">", value, held), value, held), slot)
        top = first
        for slot in tops:
            held = b.load(slot)
            for lane in range(WIDTH):
                x = b.extract_element(held, ir.Constant(i32, lane))
                top = b.select(b.fcmp_ordered(">", x, top), x, top)
        return top

    return types.float32(s, end), codegen


@intrinsic
def _sum_body(typingctx, w, start, end):
    """The sum of w[start:end] (end - start a multiple of STRIDE) in a fixed order: STRIDE
    running sums, sum j taking the elements at j, j + STRIDE, ... from `start` one after
    another, then the STRIDE sums added in order from 0."""
    if not isinstance(w, types.Array):
        return None

    def codegen(context, b, sig, args):
        wp = data_pointer(context, b, sig, args, 0)
        sums = [cgutils.alloca_once_value(b, ir.Constant(V8, [0.0] * WIDTH)) for _ in range(SIDE)]
        with cgutils.for_range_slice(b, args[1], args[2], ir.Constant(i64, STRIDE), inc=True) as (i, _):
            for slot, at in zip(sums, _vectors(b, wp, i), strict=True):
                b.store(b.fadd(b.load(slot), _load(b, at)), slot)
        total = ir.Constant(f32, 0.0)
        for slot in sums:
            held = b.load(slot)
            for lane in range(WIDTH):
                total = b.fadd(total, b.extract_element(held, ir.Constant(i32, lane)))
        return total

    return types.float32(w, start, end), codegen


@njit("float32(float32[::1], int64, int64)", cache=True, nogil=True)
def weights_total(w, first, count):  # pragma: no cover - compiled
    """The softmax normaliser: the sum of w[first:count] in a fixed order (`_sum_body` from
    `first` rounded down to a multiple of STRIDE, whose elements before `first` must be exact
    zeros, then the elements past the last whole STRIDE one after another). The order depends
    only on first and count, so a query's normaliser has the same bits in a chain, a tree or a
    one-token step."""
    start = first // STRIDE * STRIDE
    end = start + (count - start) // STRIDE * STRIDE
    total = _sum_body(w, start, end)
    for i in range(end, count):
        total += w[i]
    return total


@njit("float32(float32[::1], int64)", cache=True, nogil=True)
def largest(s, count):  # pragma: no cover - compiled
    """max(s[:count]) (count >= 1): exact in any order."""
    body = count // STRIDE * STRIDE
    top = _max_body(s, body) if body else s[0]
    for i in range(body, count):
        top = max(top, s[i])
    return top


@njit("void(float32[::1], float32, int64, float32[::1])", cache=True, nogil=True)
def exp_shifted(s, top, count, w):  # pragma: no cover - compiled
    """w[i] = exp(s[i] - top) for i < count (s[i] <= top): norms.exp_nonpositive's bits for the
    differences, in one pass (softmax numerators)."""
    body = count // STRIDE * STRIDE
    _exp_body(s, top, 0, body, w)
    vectors = count // WIDTH * WIDTH  # a scalar exp costs about what a vector's does
    _exp_vector(s, top, body, vectors, w)
    for i in range(vectors, count):
        p, bits = exp_terms(s[i] - top)
        w[i] = p * as_float(np.int32(bits))
