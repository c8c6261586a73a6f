"""numba kernel for GGUF Q4_0 and Q4_1 matrices repacked in tiles of 16 rows, on int8
activations (gguf_kernels_8bit.py's BlockLinear8 wraps it; gguf_jit_8bit.py holds the IR
helpers). Imported on first use; compiled once, cached on disk.

Layout (gguf_rows16.py's `repack`): rows n = 16 t .. 16 t + 15 form tile t (the last one
padded with zero blocks). For each block b of 32 a tile holds four vectors of 64 bytes,
vector v giving each row r the 4 bytes qs[4 v .. 4 v + 3] of its block (lane r: elements
4 v .. 4 v + 3 in the low nibbles, 16 + 4 v .. 16 + 4 v + 3 in the high), then the 16 rows'
fp16 d, then (Q4_1) their fp16 m: 288 or 320 bytes, the file's bytes in another order (a
copy, whose mapped pages the loader drops).

The arithmetic, for one output y[m, n] (gguf_rows16.py's `rows16_matmul` performs the same
operations in the same order, bit for bit):
- activations (gguf_jit_quant's `quantize_rows`): per block b of 32, xs[b] = max|x| / 127,
  xq = rint(x * (1 / xs[b])) in int8, and xsum[b], the block's sum of xq;
- per block the exact integer i = sum over its 32 elements of q * xq, less 8 * xsum[b] for
  Q4_0 (whose weights are q - 8);
- from c = 0 in fp32, block after block: c = c + float(i) * (d[b] * xs[b]); Q4_1 also sums
  c_m = c_m + (m[b] * xs[b]) * float(xsum[b]) and ends with y = c + c_m (Q4_0: y = c).
Integer sums are exact and no float operation is reordered or fused, so y[m, n] depends only
on x[m] and row n: not on M, nor on the thread count (threads share out whole tiles).

Instructions: a vector's 16 lanes are the tile's 16 rows, so one `_dot4` (vpdpbusd with
AVX-512 VNNI) takes four elements of 16 rows, and a block's scaling is one vector product
for all of them; the pair kernel (gguf_jit_small.py) spends a convert, two products, a
permute and an add per block pair and row. A tile's block is unpacked once for up to four
activation rows.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from specdec.backends.native.gguf_jit_8bit import (
    _CACHE,
    DOT,
    DOT_ROWS,
    _const,
    _data,
    _dot4,
    _intrinsic,
    _load,
    _raw,
    _Rows,
    _splat,
    _splat_value,
    _vec,
)

_i1, _i8, _i16, _i32, _i64, _f32 = ir.IntType(1), ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64), ir.FloatType()
_f32_2d, _i8_2d, _i32_2d = types.float32[:, ::1], types.int8[:, ::1], types.int32[:, ::1]
TILE = 16  # rows a tile
BLOCK_BYTES = (288, 320)  # a tile's block, Q4_0 and Q4_1: 4 x 64 bytes of nibbles, 16 fp16 d (and 16 m)


def _unpack(b, src, with_min: bool):
    """A tile's block at byte `src` -> the 8 <64 x i8> weight vectors (elements 4 v .. 4 v + 3,
    then 16 + 4 v .. for v = 0..3; q in 0..15), the 16 rows' d as <16 x float>, and Q4_1's m
    likewise (or None)."""
    weights = []
    for v in range(4):
        raw = _load(b, src, _const(64 * v), _vec(_i8, 64))
        high = b.bitcast(b.lshr(b.bitcast(raw, _vec(_i16, 32)), _splat(4, 32, _i16)), _vec(_i8, 64))
        weights.append((b.and_(raw, _splat(15, 64, _i8)), b.and_(high, _splat(15, 64, _i8))))

    def field(at: int):
        half = b.bitcast(_load(b, src, _const(at), _vec(_i16, TILE)), _vec(ir.HalfType(), TILE))
        return b.fpext(half, _vec(_f32, TILE))

    return weights, field(256), field(288) if with_min else None


def _block_dot(b, weights, qrow, at):
    """<16 x i32>: per row, the sum over one block of q * xq (xq of the activation row at
    pointer `qrow`, the block starting at element `at`), exact."""
    acc = ir.Constant(_vec(_i32, TILE), None)
    for v, (low, high) in enumerate(weights):
        for w, offset in ((low, 4 * v), (high, 16 + 4 * v)):
            four = b.load(b.bitcast(b.gep(qrow, [b.add(at, _const(offset))]), _i32.as_pointer()), align=1)
            x = b.bitcast(_splat_value(b, four, TILE), _vec(_i8, 64))
            acc = _dot_add(b, acc, w, x)
    return acc


def _dot_add(b, acc, w, x):
    """acc + the sums of four of w (unsigned) times x (signed), per lane: <16 x i32>."""
    if DOT == "vnni":  # the add inside the instruction
        operands = [acc, b.bitcast(w, _vec(_i32, TILE)), b.bitcast(x, _vec(_i32, TILE))]
        return _intrinsic(b, "llvm.x86.avx512.vpdpbusd.512", _vec(_i32, TILE), operands)
    return b.add(acc, _dot4(b, w, False, 0, x, None))


def _tile_rows(rows: int, with_min: bool):
    """An intrinsic `dot(tile, blocks, xq, xs, xsum, first, out)`: one tile (Q4_0's layout, or
    Q4_1's `with_min`) against activation rows first .. first + rows - 1 (those below M; the
    others repeat row M - 1 and are not stored), out[r * 16 + j] for row r and tile row j."""
    width = BLOCK_BYTES[1 if with_min else 0]

    @intrinsic
    def dot(typingctx, tile, blocks, xq, xs, xsum, first, out):
        def codegen(context, b, signature, args):
            tp, qp, sp, np_, op = (_data(context, b, signature, args, i) for i in (0, 2, 3, 4, 6))
            shape = context.make_array(signature.args[2])(context, b, args[2]).shape
            m, k = b.extract_value(shape, 0), b.extract_value(shape, 1)
            passing = _Rows(b, qp, sp, np_, np_, m, k, args[5], rows)
            per_row = b.udiv(k, _const(32))
            zeros = ir.Constant(_vec(_f32, TILE), None)
            accs = [cgutils.alloca_once_value(b, zeros) for _ in range(rows)]
            mins = [cgutils.alloca_once_value(b, zeros) for _ in range(rows if with_min else 0)]
            with cgutils.for_range(b, args[1]) as loop:
                index = loop.index
                weights, d, mn = _unpack(b, b.gep(tp, [b.mul(index, _const(width))]), with_min)
                for r, pick in enumerate(passing.picks):
                    total = _block_dot(b, weights, b.gep(qp, [b.mul(pick, k)]), b.mul(index, _const(32)))
                    at = b.add(b.mul(pick, per_row), index)
                    xsum = b.load(b.gep(np_, [at]))
                    xs = _splat_value(b, b.load(b.gep(sp, [at])), TILE)
                    if not with_min:  # Q4_0's weights are q - 8
                        total = b.sub(total, b.shl(_splat_value(b, xsum, TILE), _splat(3, TILE, _i32)))
                    scaled = b.fmul(b.sitofp(total, _vec(_f32, TILE)), b.fmul(d, xs))
                    b.store(b.fadd(b.load(accs[r]), scaled), accs[r])
                    if with_min:  # (m * xs) * float(xsum)
                        term = b.fmul(b.fmul(mn, xs), _splat_value(b, b.sitofp(xsum, _f32), TILE))
                        b.store(b.fadd(b.load(mins[r]), term), mins[r])
            for r in range(rows):
                with b.if_then(b.icmp_signed("<", b.add(args[5], _const(r)), m)):
                    ptr = b.bitcast(b.gep(op, [_const(r * TILE)]), _vec(_f32, TILE).as_pointer())
                    result = b.fadd(b.load(accs[r]), b.load(mins[r])) if with_min else b.load(accs[r])
                    b.store(result, ptr, align=4)
            return context.get_dummy_value()

        return types.void(tile, blocks, xq, xs, xsum, first, out), codegen

    return dot


_one_q4_0, _two_q4_0, _many_q4_0 = (_tile_rows(rows, False) for rows in (1, 2, DOT_ROWS))
_one_q4_1, _two_q4_1, _many_q4_1 = (_tile_rows(rows, True) for rows in (1, 2, DOT_ROWS))


@njit(cache=_CACHE, nogil=True, inline="always")
def _pass(kind, tile, blocks, xq, xs, xsum, first, width, out):  # pragma: no cover - compiled
    if kind == 0:
        if width == 1:
            _one_q4_0(tile, blocks, xq, xs, xsum, first, out)
        elif width == 2:
            _two_q4_0(tile, blocks, xq, xs, xsum, first, out)
        else:
            _many_q4_0(tile, blocks, xq, xs, xsum, first, out)
    elif width == 1:
        _one_q4_1(tile, blocks, xq, xs, xsum, first, out)
    elif width == 2:
        _two_q4_1(tile, blocks, xq, xs, xsum, first, out)
    else:
        _many_q4_1(tile, blocks, xq, xs, xsum, first, out)


@njit(types.void(types.int64, _raw(types.uint8), types.int64, types.int64, _i8_2d, _f32_2d, _i32_2d, _f32_2d,
                 types.int64), cache=_CACHE, nogil=True, parallel=True)  # fmt: skip
def matmul(kind, tiles, rows, blocks, xq, xs, xsum, y, column):  # pragma: no cover - compiled
    """kind 0 (Q4_0) or 1 (Q4_1); tiles [ceil(N / 16), blocks * 288 or 320] (the module
    docstring's layout), rows = N, `blocks` per row; activations from
    gguf_jit_quant.quantize_rows -> y[:, column : column + N]. Activation rows in passes of
    DOT_ROWS, the last ones narrower."""
    m = xq.shape[0]
    for t in prange(tiles.shape[0]):
        out = np.empty(DOT_ROWS * 16, np.float32)
        count = min(16, rows - 16 * t)
        first = 0
        while first < m:
            width = DOT_ROWS if m - first > 2 else m - first
            _pass(kind, tiles[t], blocks, xq, xs, xsum, first, width, out)
            for r in range(min(width, m - first)):
                for j in range(count):
                    y[first + r, column + 16 * t + j] = out[r * 16 + j]
            first += width
