"""numba kernels for GGUF's Q8_0, Q5_0 and Q5_1 matrices on int8 activations, the blocks of 32
taken in pairs (gguf_kernels_8bit.py wraps them and states the contract; gguf_jit_8bit.py
holds the K-quants', gguf_jit_rows16.py Q4_0's and Q4_1's). Imported on first use; compiled once, cached on disk.

The arithmetic, for one output y[m, n] (`pair_lanes_matmul` in gguf_kernels_8bit.py performs
the same operations in the same order, bit for bit):
- activations (gguf_jit_quant's `quantize_rows`): each block b of 32 of x[m] becomes xs[b] =
  max|x| / 127 and xq = rint(x * (1 / xs[b])), int8; with xsum[b], the block's sum of xq,
  and xsum4, the sums of each 4 consecutive xq;
- weights: the file's integers w (Q8_0 q, Q5_0 q - 16, Q5_1 q) and its fp16 fields as fp32
  (d; Q5_1's m);
- the blocks go in pairs (2p, 2p + 1), an odd last block paired with zeros. 16 int32 lanes
  per pair: lane j < 8 holds w xq summed over elements 4j .. 4j + 3 of block 2p, lane 8 + j
  the same of block 2p + 1 (exact integers). 16 fp32 lanes c (zero at first) take, pair
  after pair, c += s * float(lanes), where s is d[2p] * xs[2p] in lanes 0-7 and d[2p + 1] *
  xs[2p + 1] in lanes 8-15; y = c[0] + c[1] + ... + c[15], left to right;
- Q5_1 then subtracts its min term: two fp32 sums, of the even and of the odd blocks in
  order, of (-m[b] * xs[b]) * float(xsum[b]), added even + odd.
Integer sums are exact and no float operation is reordered or fused (numba compiles without
fastmath), so y[m, n] depends only on x[m] and row n: not on M, nor on the thread count
(threads share out chunks of rows n; each output's reduction runs whole on one thread).

Instructions: a pair is 64 weight bytes against 64 activation bytes, one AVX-512 register
each. The lanes' integers come from gguf_jit_8bit's `_dot4`, whose instructions (`DOT`) are
chosen for the CPU the kernels compile on:
- "vnni" (AVX-512 VNNI): one vpdpbusd, which multiplies unsigned by signed bytes. The
  weights enter as q + offset >= 0 (Q5_0 q, Q8_0 w + 128) and the accumulator starts at
  -offset * xsum4, so each lane ends exactly at its sum of w xq;
- "avx2": pmaddubsw then pmaddwd by ones, per half (Q8_0's signed weights by their sign, as
  llama.cpp does; no pair sum reaches the int16 saturation: |w| <= 128, |xq| <= 127);
- "generic": the products and sums as plain integer vector IR (other CPUs).
All three give the same integers, so the CPU changes the speed, not the bits. Against one
block of 16 pair lanes (the previous design, vpmaddwd on int16), the pair halves the float
work and the unpacking per block: see docs/performance-notes.md.
The IR helpers, gguf_jit_8bit.py's, are not cached themselves; the cached kernels contain them,
and numba re-validates a cached kernel by its own file's time stamp only: a change there
needs this module's cache cleared too.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from specdec.backends.native.gguf_jit_8bit import (
    _CACHE,
    CHUNK,
    DOT_ROWS,
    PREFETCH_ROWS,
    _const,
    _data,
    _dot4,
    _lane_sums,
    _load,
    _prefetch,
    _raw,
    _Rows,
    _splat,
    _vec,
    _vector,
    _widen,
)

_i1, _i8, _i16, _i32, _i64, _f32 = ir.IntType(1), ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64), ir.FloatType()
_f32_2d, _i8_2d, _i32_2d = types.float32[:, ::1], types.int8[:, ::1], types.int32[:, ::1]
WEIGHT_ROWS = 4  # weight rows per pass at one activation row (decode); divides CHUNK
# a decode pass asks for the bytes this many passes ahead: streaming several rows at once,
# the hardware prefetchers alone left a pass slower from memory than one row at a time
PREFETCH_PASSES = 2


def _nibble_pair(qs_at: int, width: int, qh_at: int | None = None):
    """Q5_0 (22 bytes: fp16 d, qh, qs) / Q5_1 (24: d,
    m, qh, qs): element j < 16 of a block is the low nibble of qs[j], j + 16 its high nibble,
    plus 16 where bit j of qh is set (the 5-bit kinds)."""

    def read(b, src, tail: bool):  # -> <64 x i8>, 0..15 or 0..31, block 2p then 2p + 1
        qs0 = _load(b, src, _const(qs_at), _vec(_i8, 16))
        qs1 = ir.Constant(_vec(_i8, 16), None) if tail else _load(b, src, _const(width + qs_at), _vec(_i8, 16))
        both = b.shuffle_vector(qs0, qs1, _vector(list(range(16)) * 2 + list(range(16, 32)) * 2, _i32))
        shifted = b.lshr(b.bitcast(both, _vec(_i16, 32)), _vector(([0] * 8 + [4] * 8) * 2, _i16))
        low = b.and_(b.bitcast(shifted, _vec(_i8, 64)), _splat(15, 64, _i8))
        if qh_at is None:
            return low
        bits = b.zext(_load(b, src, _const(qh_at), _i32), _i64)
        if not tail:
            bits = b.or_(bits, b.shl(b.zext(_load(b, src, _const(width + qh_at), _i32), _i64), _const(32)))
        return b.or_(low, b.select(b.bitcast(bits, _vec(_i1, 64)), _splat(16, 64, _i8), _splat(0, 64, _i8)))

    return read


def _q8_pair(b, src, tail: bool):  # 34 bytes: fp16 d, 32 int8 q -> <64 x i8>, signed
    first = _load(b, src, _const(2), _vec(_i8, 32))
    second = ir.Constant(_vec(_i8, 32), None) if tail else _load(b, src, _const(36), _vec(_i8, 32))
    return b.shuffle_vector(first, second, _vector(list(range(64)), _i32))


# kind: (block bytes, table floats per block, reader, signed weights, offset of unsigned ones)
_KINDS = {"q8_0": (34, 1, _q8_pair, True, 0), "q5_0": (22, 1, _nibble_pair(6, 22, qh_at=2), False, -16),
          "q5_1": (24, 2, _nibble_pair(8, 24, qh_at=4), False, 0)}  # fmt: skip
KIND_CODES = {name: code for code, name in enumerate(_KINDS)}  # matmul's `kind`


class _Acts:
    """An activation row's operands for pair p: xq [M, K] int8, xs and xsum [M, K // 32],
    xsum4 [M, K // 4]; a tail pair (the odd last block) reads its first block only."""

    def __init__(self, b, pointers, k, pick, p, tail: bool):
        qp, sp, np_, fp = pointers
        first = b.mul(p, _const(2))  # block 2p
        blocks = b.udiv(k, _const(32))
        at = lambda ptr, row_len, index: b.gep(ptr, [b.add(b.mul(pick, row_len), index)])  # noqa: E731
        grab = lambda ptr, n, t: b.load(b.bitcast(ptr, _vec(t, n).as_pointer()), align=1)  # noqa: E731
        half = 1 if tail else 2
        self.x = grab(at(qp, k, b.mul(first, _const(32))), 32 * half, _i8)
        self.xsum4 = grab(at(fp, b.udiv(k, _const(4)), b.mul(first, _const(8))), 8 * half, _i32)
        self.xs = grab(at(sp, blocks, first), half, _f32)
        self.xsum = b.sitofp(grab(at(np_, blocks, first), half, _i32), _vec(_f32, half))
        if tail:
            self.x, self.xsum4, self.xs, self.xsum = (_widen(b, v, 2 * v.type.count) for v in
                                                      (self.x, self.xsum4, self.xs, self.xsum))  # fmt: skip


def _pair_step(b, kind, weight_rows, pointers, k, picks, p, accs, mins, ahead, tail: bool):
    """One pair p (or the tail) into the accumulators of each (weight row, activation row)."""
    width, floats, reader, signed, offset = _KINDS[kind]
    acts = [_Acts(b, pointers, k, pick, p, tail) for pick in picks]
    for w_at, (rp, tp) in enumerate(weight_rows):
        src = b.gep(rp, [b.mul(p, _const(2 * width))])
        if ahead is not None:
            _prefetch(b, b.gep(src, [ahead]))
        q = reader(b, src, tail)
        table = _load(b, tp, b.mul(p, _const(2 * floats)), _vec(_f32, floats * (1 if tail else 2)))
        if tail:
            table = _widen(b, table, 2 * floats)
        d = b.shuffle_vector(table, table, _vector([0, floats], _i32))
        if floats == 2:  # Q5_1's -m of both blocks
            m = b.fneg(b.shuffle_vector(table, table, _vector([1, 3], _i32)))
        for r, a in enumerate(acts):
            at = w_at * len(acts) + r
            lanes = b.sitofp(_dot4(b, q, signed, offset, a.x, a.xsum4), _vec(_f32, 16))
            s = b.fmul(d, a.xs)
            scale = b.shuffle_vector(s, s, _vector([0] * 8 + [1] * 8, _i32))
            b.store(b.fadd(b.load(accs[at]), b.fmul(scale, lanes)), accs[at])
            if floats == 2:  # Q5_1: (-m * xs) * xsum, even and odd blocks apart
                b.store(b.fadd(b.load(mins[at]), b.fmul(b.fmul(m, a.xs), a.xsum)), mins[at])


def _pairs_body(b, kind, weight_rows, pointers, k, picks, blocks, ahead):
    """y for each weight row (rp, tp) of `weight_rows` and each activation row of `picks`,
    weight row first: the module docstring's arithmetic."""
    outputs = len(weight_rows) * len(picks)
    accs = [cgutils.alloca_once_value(b, ir.Constant(_vec(_f32, 16), None)) for _ in range(outputs)]
    mins = [cgutils.alloca_once_value(b, ir.Constant(_vec(_f32, 2), None)) for _ in range(outputs)]
    with cgutils.for_range(b, b.lshr(blocks, _const(1))) as loop:
        _pair_step(b, kind, weight_rows, pointers, k, picks, loop.index, accs, mins, ahead, False)
    with b.if_then(b.trunc(blocks, _i1)):  # an odd last block
        _pair_step(b, kind, weight_rows, pointers, k, picks, b.lshr(blocks, _const(1)), accs, mins, None, True)
    totals = _lane_sums(b, [b.load(acc) for acc in accs])
    if _KINDS[kind][1] == 1:  # no min term
        return totals
    out = []
    for total, v in zip(totals, mins, strict=True):
        pair = b.load(v)
        out.append(b.fsub(total, b.fadd(b.extract_element(pair, ir.Constant(_i32, 0)),
                                        b.extract_element(pair, ir.Constant(_i32, 1)))))  # fmt: skip
    return out


def _activation_pointers(context, b, signature, args, first: int):
    return tuple(_data(context, b, signature, args, first + i) for i in range(4))


def _dot_rows(kind: str, rows: int):
    """An intrinsic `dot(row, table, blocks, xq, xs, xsum, xsum4, first, out)`: one weight row
    (bytes, table row) against activation rows first .. first + rows - 1 (those below M; the
    others repeat row M - 1 and are not stored), into out[first:]."""

    @intrinsic
    def dot(typingctx, row, table, blocks, xq, xs, xsum, xsum4, first, out):
        def codegen(context, b, signature, args):
            rp, tp, op = (_data(context, b, signature, args, i) for i in (0, 1, 8))
            shape = context.make_array(signature.args[3])(context, b, args[3]).shape
            m, k = b.extract_value(shape, 0), b.extract_value(shape, 1)
            row_bytes = b.extract_value(context.make_array(signature.args[0])(context, b, args[0]).shape, 0)
            pointers = _activation_pointers(context, b, signature, args, 3)
            passing = _Rows(b, *pointers, m, k, args[7], rows)
            ahead = b.mul(row_bytes, _const(PREFETCH_ROWS))
            passing.store(_pairs_body(b, kind, [(rp, tp)], pointers, k, passing.picks, args[2], ahead), op)
            return context.get_dummy_value()

        return types.void(row, table, blocks, xq, xs, xsum, xsum4, first, out), codegen

    return dot


def _dot_weight_rows(kind: str, count: int, acts: int):
    """An intrinsic `dot_rows(raw, table, n, blocks, xq, xs, xsum, xsum4, out)` at M = `acts`
    activation rows (decode, a two-token chain): weight rows n .. n + count - 1 into
    out[w * acts + r], their independent chains side by side and their final lane sums
    sharing vector adds."""

    @intrinsic
    def dot_rows(typingctx, raw, table, n, blocks, xq, xs, xsum, xsum4, out):
        def codegen(context, b, signature, args):
            raw_a, table_a, xq_a = (context.make_array(signature.args[i])(context, b, args[i]) for i in (0, 1, 4))
            raw_cols, table_cols = (b.extract_value(a.shape, 1) for a in (raw_a, table_a))
            weight_rows = [(b.gep(raw_a.data, [b.mul(b.add(args[2], _const(w)), raw_cols)]),
                            b.gep(table_a.data, [b.mul(b.add(args[2], _const(w)), table_cols)])) for w in range(count)]  # fmt: skip
            pointers = _activation_pointers(context, b, signature, args, 4)
            ahead = b.mul(raw_cols, _const(PREFETCH_PASSES * count))
            k = b.extract_value(xq_a.shape, 1)
            totals = _pairs_body(b, kind, weight_rows, pointers, k, [_const(r) for r in range(acts)], args[3], ahead)
            op = _data(context, b, signature, args, 8)
            for w, total in enumerate(totals):
                b.store(total, b.gep(op, [_const(w)]))
            return context.get_dummy_value()

        return types.void(raw, table, n, blocks, xq, xs, xsum, xsum4, out), codegen

    return dot_rows


_one_q8_0, _one_q5_0, _one_q5_1 = (_dot_rows(kind, 1) for kind in _KINDS)
_two_q8_0, _two_q5_0, _two_q5_1 = (_dot_rows(kind, 2) for kind in _KINDS)
_many_q8_0, _many_q5_0, _many_q5_1 = (_dot_rows(kind, DOT_ROWS) for kind in _KINDS)
# WEIGHT_ROWS weight rows at one activation row; half as many at two
_rows_q8_0, _rows_q5_0, _rows_q5_1 = (_dot_weight_rows(kind, WEIGHT_ROWS, 1) for kind in _KINDS)
_rows2_q8_0, _rows2_q5_0, _rows2_q5_1 = (_dot_weight_rows(kind, WEIGHT_ROWS // 2, 2) for kind in _KINDS)


@njit(cache=_CACHE, nogil=True, inline="always")
def _pass(kind, row, table, blocks, xq, xs, xsum, xsum4, first, width, out):  # pragma: no cover - compiled
    """One pass of `width` (1, 2 or DOT_ROWS) activation rows from `first` over one weight row."""
    if kind == 0:
        if width == 1:
            _one_q8_0(row, table, blocks, xq, xs, xsum, xsum4, first, out)
        elif width == 2:
            _two_q8_0(row, table, blocks, xq, xs, xsum, xsum4, first, out)
        else:
            _many_q8_0(row, table, blocks, xq, xs, xsum, xsum4, first, out)
    elif kind == 1:
        if width == 1:
            _one_q5_0(row, table, blocks, xq, xs, xsum, xsum4, first, out)
        elif width == 2:
            _two_q5_0(row, table, blocks, xq, xs, xsum, xsum4, first, out)
        else:
            _many_q5_0(row, table, blocks, xq, xs, xsum, xsum4, first, out)
    elif width == 1:
        _one_q5_1(row, table, blocks, xq, xs, xsum, xsum4, first, out)
    elif width == 2:
        _two_q5_1(row, table, blocks, xq, xs, xsum, xsum4, first, out)
    else:
        _many_q5_1(row, table, blocks, xq, xs, xsum, xsum4, first, out)


@njit(cache=_CACHE, nogil=True, inline="always")
def _weight_rows_pass(kind, m, raw, table, n, blocks, xq, xs, xsum, xsum4, out):  # pragma: no cover - compiled
    """WEIGHT_ROWS // m weight rows from n at M = m (1 or 2)."""
    if m == 1:
        if kind == 0:
            _rows_q8_0(raw, table, n, blocks, xq, xs, xsum, xsum4, out)
        elif kind == 1:
            _rows_q5_0(raw, table, n, blocks, xq, xs, xsum, xsum4, out)
        else:
            _rows_q5_1(raw, table, n, blocks, xq, xs, xsum, xsum4, out)
    elif kind == 0:
        _rows2_q8_0(raw, table, n, blocks, xq, xs, xsum, xsum4, out)
    elif kind == 1:
        _rows2_q5_0(raw, table, n, blocks, xq, xs, xsum, xsum4, out)
    else:
        _rows2_q5_1(raw, table, n, blocks, xq, xs, xsum, xsum4, out)


@njit(types.void(types.int64, _raw(types.uint8), _f32_2d, types.int64, _i8_2d, _f32_2d, _i32_2d, _i32_2d, _f32_2d,
                 types.int64), cache=_CACHE, nogil=True, parallel=True)  # fmt: skip
def matmul(kind, raw, table, blocks, xq, xs, xsum, xsum4, y, column):  # pragma: no cover - compiled
    """raw [N, bytes per row] (the file's blocks of KIND_CODES' type `kind`), table [N, T] fp32
    (per block d; Q5_1 d, m), `blocks` per row; activations from gguf_jit_quant.quantize_rows
    -> y[:, column : column + N]. Activation rows in passes of DOT_ROWS, the last ones
    narrower; at M = 1 WEIGHT_ROWS weight rows a pass, at M = 2 half as many."""
    rows, m = raw.shape[0], xq.shape[0]
    for chunk in prange((rows + CHUNK - 1) // CHUNK):
        out = np.empty(max(m, WEIGHT_ROWS), np.float32)
        start, stop = chunk * CHUNK, min(rows, chunk * CHUNK + CHUNK)
        if m <= 2:
            step = WEIGHT_ROWS // m
            while start + step <= stop:
                _weight_rows_pass(kind, m, raw, table, start, blocks, xq, xs, xsum, xsum4, out)
                for w in range(step):
                    for r in range(m):
                        y[r, column + start + w] = out[w * m + r]
                start += step
        for n in range(start, stop):
            first = 0
            while first < m:
                width = DOT_ROWS if m - first > 2 else m - first
                _pass(kind, raw[n], table[n], blocks, xq, xs, xsum, xsum4, first, width, out)
                first += width
            for r in range(m):
                y[r, column + n] = out[r]
