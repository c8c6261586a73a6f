"""numba kernel for GGUF's blocks of 32 (quant_types.BLOCKS32: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0)
repacked in tiles of 16 rows, on int8 activations (kernels/int8_blocks.py's BlockLinear8 wraps
it; ir.py holds the IR helpers). Each type's tile kernel is built from its record (nibbles or
int8, a fifth bit, a min, an offset), so a block-of-32 type of that shape needs no code here.
Imported on first use; compiled once, cached on disk.

Layout (kernels/tiles16.py's `repack`): rows n = 16 t .. 16 t + 15 form tile t (the last one
padded with zero blocks). For each block b of 32 a tile holds vectors of 64 bytes, vector v
giving each row r the 4 bytes qs[4 v .. 4 v + 3] of its block: four vectors of nibbles
(lane r: elements 4 v .. 4 v + 3 in the low nibbles, 16 + 4 v .. 16 + 4 v + 3 in the
high), or Q8_0's eight of int8 q (elements 4 v .. 4 v + 3). Q5_0 and Q5_1 add a vector of
the rows' fifth bits (lane r: row r's 32 bits, byte c bit g for element 4 g + c,
`spread_high_bits`). Then the 16 rows' fp16 d, then (Q4_1, Q5_1) their fp16 m: 288, 320,
352, 384 or 544 bytes, the file's bits in another order (a copy, whose mapped pages the
loader drops).

The arithmetic, for one output y[m, n] (kernels/tiles16.py's `rows16_matmul` performs the same
operations in the same order, bit for bit):
- activations (activations.py's `quantize_rows`): per block b of 32, xs[b] = max|x| / 127,
  xq = rint(x * (1 / xs[b])) in int8, and xsum[b], the block's sum of xq;
- per block the exact integer i = sum over its 32 elements of q * xq, less 8 * xsum[b] for
  Q4_0 and 16 * xsum[b] for Q5_0 (whose weights are q - 8 and q - 16; Q8_0's are q, and
  vpdpbusd, which takes unsigned weights, sums (q + 128) * xq and subtracts 128 * xsum[b]);
- from c = 0 in fp32, block after block: c = c + float(i) * (d[b] * xs[b]); Q4_1 and Q5_1
  also sum c_m = c_m + (m[b] * xs[b]) * float(xsum[b]) and end with y = c + c_m (the others:
  y = c).
Integer sums are exact and no float operation is reordered or fused, so y[m, n] depends only
on x[m] and row n: not on M, nor on the thread count (threads share out whole tiles).

Instructions: a vector's 16 lanes are the tile's 16 rows, so one `dot4` (vpdpbusd with
AVX-512 VNNI) takes four elements of 16 rows, and a block's scaling is one vector product
for all of them (one weight row at a time, a block pair's scaling took a convert, two
products, a permute and an add per row). A tile's block is unpacked once for up to WIDE_ROWS
activation rows (8 with VNNI, else 4): a fifth bit costs a shift, a mask and an or per vector
of 64 weights. With VNNI a pass of several rows prefetches the tile's bytes FETCH_AHEAD ahead,
since their compute no longer hides the memory's latency. On AVX2 (16 registers of 8 lanes)
two or more activation rows take each half of the tile (8 rows) in a pass of its own, so that
a pass's sums stay in registers, and pmaddubsw's pair sums add in 16 bits before one pmaddwd
per block (`_half_tile_rows`): the same integers and float operations.
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
    WIDE_ROWS,
    Rows,
    call_intrinsic,
    const,
    data_pointer,
    dispatch,
    dot4,
    fp16_lanes,
    load,
    pass_width,
    prefetch,
    raw_array,
    splat,
    splat_value,
    vec,
)
from specdec.backends.native.kernels.tiles16 import fields_at, tile_bytes
from specdec.backends.native.quant_types import BLOCKS32, QuantType

i1, i8, i16, i32, i64, f32 = (ir.IntType(1), ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64),
                              ir.FloatType())
_f32_2d, _i8_2d, _i32_2d = types.float32[:, ::1], types.int8[:, ::1], types.int32[:, ::1]
TILE = 16  # rows a tile
FETCH_AHEAD = 4096  # bytes ahead that a pass of several rows prefetches (13 blocks of a Q4_1 tile)


def _unpack(b, src, qt: QuantType):
    """A tile's block at byte `src` -> its 8 weight vectors <64 x i8> with the element each
    lane's four bytes start at (nibbles: the low ones of vector v at 4 v, its high ones at
    16 + 4 v; q in 0..15, Q5's in 0..31; Q8_0: vector v at 4 v, its int8 q, as q + 128 where
    the dot is vpdpbusd), the 16 rows' d as <16 x float>, and the m of Q4_1 and Q5_1 likewise
    (or None)."""
    fifth = load(b, src, const(256), vec(i32, TILE)) if qt.high_bits else None

    def high_bits(group: int):  # elements 4 g .. 4 g + 3 of each lane's four bytes: bit 4 of each
        shifted = (b.shl(fifth, splat(4 - group, TILE, i32)) if group < 4
                   else b.lshr(fifth, splat(group - 4, TILE, i32)))
        return b.bitcast(b.and_(shifted, splat(0x10101010, TILE, i32)), vec(i8, 64))

    weights = []
    for v in range(qt.qs_bytes // 4):
        raw = load(b, src, const(64 * v), vec(i8, 64))
        if qt.qs_bytes == 32:  # int8 q
            weights.append((b.xor(raw, splat(-128, 64, i8)) if DOT == "vnni" else raw, 4 * v))
            continue
        high = b.bitcast(b.lshr(b.bitcast(raw, vec(i16, 32)), splat(4, 32, i16)), vec(i8, 64))
        low, high = b.and_(raw, splat(15, 64, i8)), b.and_(high, splat(15, 64, i8))
        if fifth is not None:
            low, high = b.or_(low, high_bits(v)), b.or_(high, high_bits(4 + v))
        weights += [(low, 4 * v), (high, 16 + 4 * v)]

    at = fields_at(qt)
    return weights, fp16_lanes(b, src, at, TILE), fp16_lanes(b, src, at + 32, TILE) if qt.with_min else None


def _block_dot(b, weights, qrow, at, signed: bool):
    """<16 x i32>: per row, the sum over one block of q * xq (xq of the activation row at
    pointer `qrow`, the block starting at element `at`), exact; Q8_0's (`signed`) on
    vpdpbusd is the sum of (q + 128) * xq."""
    acc = ir.Constant(vec(i32, TILE), None)
    for w, offset in weights:
        four = b.load(b.bitcast(b.gep(qrow, [b.add(at, const(offset))]), i32.as_pointer()), align=1)
        x = b.bitcast(splat_value(b, four, TILE), vec(i8, 64))
        acc = _dot_add(b, acc, w, x, signed)
    return acc


def _dot_add(b, acc, w, x, signed: bool):
    """acc + the sums of four of w (unsigned, or `signed` except on vpdpbusd, which takes
    Q8_0's as q + 128) times x (signed), per lane: <16 x i32>."""
    if DOT == "vnni":  # the add inside the instruction
        operands = [acc, b.bitcast(w, vec(i32, TILE)), b.bitcast(x, vec(i32, TILE))]
        return call_intrinsic(b, "llvm.x86.avx512.vpdpbusd.512", vec(i32, TILE), operands)
    return b.add(acc, dot4(b, w, signed, 0, x, None))


def _operands(context, b, signature, args):
    """The intrinsics' (tile, blocks, xq, xs, xsum, first, out): the data pointers of tile, xq,
    xs, xsum and out, and xq's M and K."""
    pointers = tuple(data_pointer(context, b, signature, args, i) for i in (0, 2, 3, 4, 6))
    shape = context.make_array(signature.args[2])(context, b, args[2]).shape
    return pointers, b.extract_value(shape, 0), b.extract_value(shape, 1)


def _tile_rows(rows: int, qt: QuantType):
    """An intrinsic `dot(tile, blocks, xq, xs, xsum, first, out)`: one tile of `qtype`
    against activation rows first .. first + rows - 1 (those below M; the others repeat row
    M - 1 and are not stored), out[r * 16 + j] for row r and tile row j."""
    width, with_min, signed = tile_bytes(qt), qt.with_min, qt.qs_bytes == 32
    offset = 128 if signed and DOT == "vnni" else qt.offset  # vpdpbusd's Q8_0 weights are q + 128

    @intrinsic
    def dot(typingctx, tile, blocks, xq, xs, xsum, first, out):
        def codegen(context, b, signature, args):
            (tp, qp, sp, np_, op), m, k = _operands(context, b, signature, args)
            passing = Rows(b, qp, sp, np_, np_, m, k, args[5], rows)
            per_row = b.udiv(k, const(32))
            zeros = ir.Constant(vec(f32, TILE), None)
            accs = [cgutils.alloca_once_value(b, zeros) for _ in range(rows)]
            mins = [cgutils.alloca_once_value(b, zeros) for _ in range(rows if with_min else 0)]
            with cgutils.for_range(b, args[1]) as loop:
                index = loop.index
                src = b.gep(tp, [b.mul(index, const(width))])
                if rows > 1 and DOT == "vnni":  # several rows' compute no longer hides the latency
                    for line in range(0, width, 64):
                        prefetch(b, b.gep(src, [const(FETCH_AHEAD + line)]))
                weights, d, mn = _unpack(b, src, qt)
                for r, pick in enumerate(passing.picks):
                    total = _block_dot(b, weights, b.gep(qp, [b.mul(pick, k)]), b.mul(index, const(32)),
                                       signed)
                    at = b.add(b.mul(pick, per_row), index)
                    _accumulate(b, total, (d, mn), (b.gep(np_, [at]), b.gep(sp, [at])), (accs[r], mins),
                                r, offset)
            _store_rows(b, accs, mins, args[5], m, op, 0)
            return context.get_dummy_value()

        return types.void(tile, blocks, xq, xs, xsum, first, out), codegen

    return dot


HALF = 8  # an AVX2 vector's int32 lanes: half a tile's rows


def _half_weights(b, src, half: int, qt: QuantType):
    """AVX2: a tile's block at byte `src`, rows 8 half .. 8 half + 7 -> (weights <32 x i8>, the
    element each lane's four bytes start at), in _unpack's order and values (Q8_0's int8 q
    as they are)."""
    fifth = load(b, src, const(256 + 32 * half), vec(i32, HALF)) if qt.high_bits else None

    def high_bits(group: int):
        shifted = (b.shl(fifth, splat(4 - group, HALF, i32)) if group < 4
                   else b.lshr(fifth, splat(group - 4, HALF, i32)))
        return b.bitcast(b.and_(shifted, splat(0x10101010, HALF, i32)), vec(i8, 32))

    for v in range(qt.qs_bytes // 4):
        raw = load(b, src, const(64 * v + 32 * half), vec(i8, 32))
        if qt.qs_bytes == 32:
            yield raw, 4 * v
            continue
        high = b.bitcast(b.lshr(b.bitcast(raw, vec(i16, 16)), splat(4, 16, i16)), vec(i8, 32))
        low, high = b.and_(raw, splat(15, 32, i8)), b.and_(high, splat(15, 32, i8))
        if fifth is not None:
            low, high = b.or_(low, high_bits(v)), b.or_(high, high_bits(4 + v))
        yield low, 4 * v
        yield high, 16 + 4 * v


def _half_sums(b, src, half: int, qt: QuantType, qrows, at):
    """AVX2: <8 x i32> per activation row (pointers `qrows`, the block at element `at`): the
    exact sums over the block of q * xq for rows 8 half .. + 7. pmaddubsw's 16-bit pair sums
    are added in 16 bits while they cannot overflow (4-bit q: 8 x 2 x 15 x 128 < 2^15; 5-bit:
    4 x 2 x 31 x 128), then widened by pmaddwd: the same integers as a pmaddwd each."""
    group = 1 if qt.qs_bytes == 32 else 4 if qt.high_bits else 8
    ones = splat(1, 16)
    pairs, totals = [None] * len(qrows), [None] * len(qrows)
    for count, (w, offset) in enumerate(_half_weights(b, src, half, qt), start=1):
        wu = call_intrinsic(b, "llvm.x86.avx2.psign.b", vec(i8, 32), [w, w]) if qt.qs_bytes == 32 else w
        for r, qrow in enumerate(qrows):
            four = b.load(b.bitcast(b.gep(qrow, [b.add(at, const(offset))]), i32.as_pointer()), align=1)
            x = b.bitcast(splat_value(b, four, HALF), vec(i8, 32))
            if qt.qs_bytes == 32:  # |q| times xq with q's sign
                x = call_intrinsic(b, "llvm.x86.avx2.psign.b", vec(i8, 32), [x, w])
            p = call_intrinsic(b, "llvm.x86.avx2.pmadd.ub.sw", vec(i16, 16), [wu, x])
            pairs[r] = p if pairs[r] is None else b.add(pairs[r], p)
        if count % group == 0:
            for r in range(len(qrows)):
                wide = call_intrinsic(b, "llvm.x86.avx2.pmadd.wd", vec(i32, 8), [pairs[r], ones])
                totals[r], pairs[r] = wide if totals[r] is None else b.add(totals[r], wide), None
    return totals


def _half_tile_rows(rows: int, qt: QuantType):
    """AVX2's form of _tile_rows' intrinsic, the same arguments and results: each half of the
    tile (8 rows, one vector) in its own pass over the blocks, so that a pass's sums fit the 16
    vector registers; per lane the same operations in the same order."""
    width, with_min, offset, at_fields = tile_bytes(qt), qt.with_min, qt.offset, fields_at(qt)

    @intrinsic
    def dot(typingctx, tile, blocks, xq, xs, xsum, first, out):
        def codegen(context, b, signature, args):
            (tp, qp, sp, np_, op), m, k = _operands(context, b, signature, args)
            picks = Rows(b, qp, sp, np_, np_, m, k, args[5], rows).picks
            per_row = b.udiv(k, const(32))
            zeros = ir.Constant(vec(f32, HALF), None)
            qrows = [b.gep(qp, [b.mul(pick, k)]) for pick in picks]
            for half in range(2):
                accs = [cgutils.alloca_once_value(b, zeros) for _ in range(rows)]
                mins = [cgutils.alloca_once_value(b, zeros) for _ in range(rows if with_min else 0)]
                with cgutils.for_range(b, args[1]) as loop:
                    index = loop.index
                    src = b.gep(tp, [b.mul(index, const(width))])
                    totals = _half_sums(b, src, half, qt, qrows, b.mul(index, const(32)))
                    d = fp16_lanes(b, src, at_fields + 16 * half, HALF)
                    mn = fp16_lanes(b, src, at_fields + 32 + 16 * half, HALF) if with_min else None
                    for r, pick in enumerate(picks):
                        at = b.add(b.mul(pick, per_row), index)
                        row = (b.gep(np_, [at]), b.gep(sp, [at]))
                        _accumulate(b, totals[r], (d, mn), row, (accs[r], mins), r, offset)
                _store_rows(b, accs, mins, args[5], m, op, HALF * half)
            return context.get_dummy_value()

        return types.void(tile, blocks, xq, xs, xsum, first, out), codegen

    return dot


def _accumulate(b, total, fields, row, sums, r: int, offset: int):
    """One block for activation row r: acc = acc + float(total - offset * xsum) * (d * xs), and
    with a min mins[r] = mins[r] + (m * xs) * float(xsum). total <n x i32>; fields (d, m or None)
    <n x float>; row: pointers to the row's xsum and xs; sums: (acc, mins)."""
    d, mn = fields
    acc, mins = sums
    lanes = total.type.count
    xsum, xs = b.load(row[0]), splat_value(b, b.load(row[1]), lanes)
    if offset:  # Q4_0's weights are q - 8, Q5_0's q - 16; Q8_0's on vpdpbusd q + 128
        total = b.sub(total, b.mul(splat_value(b, xsum, lanes), splat(offset, lanes, i32)))
    b.store(b.fadd(b.load(acc), b.fmul(b.sitofp(total, vec(f32, lanes)), b.fmul(d, xs))), acc)
    if mn is not None:  # (m * xs) * float(xsum)
        term = b.fmul(b.fmul(mn, xs), splat_value(b, b.sitofp(xsum, f32), lanes))
        b.store(b.fadd(b.load(mins[r]), term), mins[r])


def _store_rows(b, accs, mins, first, m, op, column: int):
    """out[r * 16 + column ..] = acc (+ mins) for each pass row below M."""
    lanes = accs[0].type.pointee.count
    for r, acc in enumerate(accs):
        with b.if_then(b.icmp_signed("<", b.add(first, const(r)), m)):
            ptr = b.bitcast(b.gep(op, [const(r * TILE + column)]), vec(f32, lanes).as_pointer())
            result = b.fadd(b.load(acc), b.load(mins[r])) if mins else b.load(acc)
            b.store(result, ptr, align=4)


def _by_width(qt: QuantType):
    """`run(code, args)`: `qt`'s tile against args = (tile, blocks, xq, xs, xsum, first, width,
    out), `width` (1, 2, DOT_ROWS or WIDE_ROWS) activation rows. Inlined into the cached kernel, so not
    cached itself."""
    several = _half_tile_rows if DOT == "avx2" else _tile_rows  # one row: no registers to spare
    one, two, four = _tile_rows(1, qt), several(2, qt), several(DOT_ROWS, qt)
    wide = several(WIDE_ROWS, qt) if WIDE_ROWS > DOT_ROWS else four

    @njit(nogil=True, inline="always")
    def run(code, args):  # pragma: no cover - compiled
        tile, blocks, xq, xs, xsum, first, width, out = args
        if width == 1:
            one(tile, blocks, xq, xs, xsum, first, out)
        elif width == 2:
            two(tile, blocks, xq, xs, xsum, first, out)
        elif width == DOT_ROWS:
            four(tile, blocks, xq, xs, xsum, first, out)
        else:
            wide(tile, blocks, xq, xs, xsum, first, out)

    return run


_by_code = dispatch([_by_width(qt) for qt in BLOCKS32])


@njit(cache=CACHE, nogil=True, inline="always")
def _pass(kind, tile, blocks, xq, xs, xsum, first, width, out):  # pragma: no cover - compiled
    _by_code(kind, (tile, blocks, xq, xs, xsum, first, width, out))


@njit(types.void(types.int64, raw_array(types.uint8), types.int64, types.int64, _i8_2d, _f32_2d, _i32_2d,
                 _f32_2d, types.int64), cache=CACHE, nogil=True, parallel=True)
def matmul(kind, tiles, rows, blocks, xq, xs, xsum, y, column):  # pragma: no cover - compiled
    """kind: the type's code (quant_types.BLOCKS32: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0); tiles [ceil(N / 16),
    blocks * TILE_BYTES] (the module docstring's layout), rows = N, `blocks` per row; activations from
    activations.quantize_rows -> y[:, column : column + N]. Activation rows in passes of
    ir.pass_width's rows."""
    m = xq.shape[0]
    for t in prange(tiles.shape[0]):
        out = np.empty(WIDE_ROWS * 16, np.float32)
        count = min(16, rows - 16 * t)
        first = 0
        while first < m:
            width = pass_width(m - first)
            _pass(kind, tiles[t], blocks, xq, xs, xsum, first, width, out)
            for r in range(min(width, m - first)):
                for j in range(count):
                    y[first + r, column + 16 * t + j] = out[r * 16 + j]
            first += width
