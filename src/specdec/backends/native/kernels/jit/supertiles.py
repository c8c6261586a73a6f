"""numba kernel for GGUF's K-quants (quant_types.SUPERBLOCKS: Q6_K, Q5_K, Q4_K) repacked in
tiles of 16 rows (kernels/supertiles.py: the layout and the PyTorch replica), on llama.cpp's
Q8_K activations (activations.quantize_rows_k). Imported on first use; compiled once, cached
on disk.

The arithmetic, for one output y[m, n] (kernels/supertiles.py's `supertile_matmul` performs
the same operations in the same order, bit for bit):
- per super-block u, the exact integer isum = sum over its sub-blocks j of sc[j] * (sum over
  the sub-block of w * xq), w the file's q (Q6_K's q - 32: the kernel sums q * xq and takes
  32 sc[j] times the sub-block's sum of xq off); with mins (Q4_K, Q5_K), mi = sum over j of
  m[j] * xsum[8 u + j]; all below 2^31;
- from c = cm = 0 in fp32, super-block after super-block: c = c + float(isum) * (d * xs[u])
  (and cm = cm + float(mi) * (dmin * xs[u])); then y = c - cm (Q6_K: y = c).
Integer sums are exact and no float operation is reordered or fused, so y[m, n] depends only
on x[m] and row n: not on M, nor on the thread count (threads share out whole tiles).

Instructions: a vector's lanes are a tile's rows, so a sub-block's scale is one vector for its
16 rows and a super-block's scaling one fp32 product for all of them (in the file's layout, a
row at a time, each row needs a horizontal sum). With AVX-512 VNNI the 16 rows are one vector
and a sub-block's products a chain of `vpdpbusd`, times the scales. On AVX2 each half of the
tile (8 rows) takes its own pass over the super-blocks, so that a pass's sums fit the 16
registers (a single activation row takes both halves in one pass, its activations loaded once
for both), and a sub-block's `pmaddubsw` pair sums add in 16 bits
as far as they cannot overflow (q < 2^b: 2 x (2^b - 1) x 128 each), then one `pmaddwd` by the
scales widens and scales them. Q6_K's sums take 32 times the pair sums of xq off in 16 bits
first: sums of (q - 32) * xq, at most 8 x 32 x 127, cover the whole sub-block, and the offset
costs no multiply. Plain IR elsewhere, 16 rows a vector as with VNNI (so the tests, which run
it on any CPU, cover that layout). The three give the same integers.
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
    fp16_lanes,
    load,
    pass_width,
    prefetch,
    raw_array,
    splat,
    splat_value,
    vec,
)
from specdec.backends.native.kernels.supertiles import (
    QS_BYTES,
    TILE,
    d_at,
    scales,
    scales_at,
    tile_bytes,
    whole_bytes,
)
from specdec.backends.native.quant_types import SUPERBLOCKS, Q, QuantType

i8, i16, i32, i64, f32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64), ir.FloatType()
HALVES = 2 if DOT == "avx2" else 1  # passes per tile: AVX2 holds 8 rows a vector (plain IR: 16, as VNNI)
LANES = TILE // HALVES
# Super-blocks ahead that a one-row pass prefetches, for Q5_K, whose high bits lie in a plane of
# their own: its two interleaved streams outran the hardware prefetcher, while one stream (Q4_K,
# Q6_K's whole bytes) does not; passes of several rows measured no faster with it
# (docs/performance-notes.md).
PREFETCH_AHEAD = 4
SIXTEEN_CODE = next(t.code for t in SUPERBLOCKS if t.sub_block == 16)  # Q6_K: sub-blocks of 16


def _bits_to(b, v, bit: int, to: int, mask: int):
    """<LANES x i32> v's bits `bit` .. of each byte moved to `to`, masked: <4 LANES x i8>."""
    moved = b.shl(v, splat(to - bit, LANES, i32)) if bit <= to else b.lshr(v, splat(bit - to, LANES, i32))
    return b.bitcast(b.and_(moved, splat(mask, LANES, i32)), vec(i8, 4 * LANES))


def _again(b, offset: int, apart, times: int = 1):
    """`offset` plus `times` x apart (zero, but not to the compiler): a load of bytes that an
    earlier load of the super-block read is made again where it is used, not held in a register
    from there (which spilled)."""
    return b.add(const(offset), b.mul(apart, const(times))) if times else const(offset)


def _nibbles(b, src, half: int, v: int, high: bool, apart):
    raw = load(b, src, _again(b, 64 * v + 4 * LANES * half, apart, int(high)), vec(i8, 4 * LANES))
    if high:
        words = b.lshr(b.bitcast(raw, vec(i16, 2 * LANES)), splat(4, 2 * LANES, i16))
        raw = b.bitcast(words, vec(i8, 4 * LANES))
    return b.and_(raw, splat(15, 4 * LANES, i8))


def _group(b, src, half: int, qt: QuantType, p: int, apart):
    """Elements 32 p .. 32 p + 31 of the super-block for rows LANES half ..: 8 weight vectors <4
    LANES x i8> (vector g: each lane's elements 32 p + 4 g .. + 3), the file's q (Q4_K 0..15, Q5_K
    0..31, Q6_K 0..63)."""
    out = []
    for g in range(8):
        if whole_bytes(qt):  # Q6_K: vector 8 p + g holds the q themselves
            out.append(load(b, src, const(64 * (8 * p + g) + 4 * LANES * half), vec(i8, 4 * LANES)))
            continue
        chunk, high = divmod(p, 2)
        q = _nibbles(b, src, half, 8 * chunk + g, high, apart)
        if qt.ggml is Q.Q5_K:  # bit p of each of the lane's four qh bytes, moved to bit 4
            qh = load(b, src, _again(b, QS_BYTES + 64 * g + 4 * LANES * half, apart, p), vec(i32, LANES))
            q = b.or_(q, _bits_to(b, qh, p, 4, 0x10101010))
        out.append(q)
    return out


def _products(b, w, x):
    """<LANES x i32>: per lane the sum of its four products w (unsigned) * x (signed), plain IR
    (byte e of each lane widened in place by shifts)."""
    w32, x32 = b.bitcast(w, vec(i32, LANES)), b.bitcast(x, vec(i32, LANES))
    total = None
    for e in range(4):
        up = splat(24 - 8 * e, LANES, i32)
        down = splat(24, LANES, i32)
        p = b.mul(b.lshr(b.shl(w32, up), down), b.ashr(b.shl(x32, up), down))
        total = p if total is None else b.add(total, p)
    return total


def _scaled_dots(b, weights, xs_rows, scale, group: int, offsets=None):
    """Per activation row (xs_rows: its broadcast vectors of the sub-block's activations),
    <LANES x i32> = scale * (the sum over the sub-block of q * xq), exact; on AVX2 `group`
    pmaddubsw results add in 16 bits before each pmaddwd, less the row's `offsets` (<2 LANES x
    i16>, Q6_K's 32 times the pair sums of xq: the sums are then of (q - 32) * xq)."""
    if DOT == "avx2":
        low = b.and_(scale, splat(0xFFFF, LANES, i32))
        pairs = b.bitcast(b.or_(low, b.shl(scale, splat(16, LANES, i32))), vec(i16, 2 * LANES))
        totals = [None] * len(xs_rows)
        for start in range(0, len(weights), group):
            sums = [None] * len(xs_rows)
            for g in range(start, start + group):
                for r, xs in enumerate(xs_rows):
                    p = call_intrinsic(b, "llvm.x86.avx2.pmadd.ub.sw", vec(i16, 16), [weights[g], xs[g]])
                    sums[r] = p if sums[r] is None else b.add(sums[r], p)
            if offsets is not None:  # 16-bit sums wrap: exact wherever the final sum fits
                sums = [b.sub(s, offset) for s, offset in zip(sums, offsets, strict=True)]
            for r in range(len(xs_rows)):
                wide = call_intrinsic(b, "llvm.x86.avx2.pmadd.wd", vec(i32, 8), [sums[r], pairs])
                totals[r] = wide if totals[r] is None else b.add(totals[r], wide)
        return totals
    dots = [ir.Constant(vec(i32, LANES), None) for _ in xs_rows]
    for g, weight in enumerate(weights):
        for r, xs in enumerate(xs_rows):
            if DOT == "vnni":
                w, x = b.bitcast(weight, vec(i32, LANES)), b.bitcast(xs[g], vec(i32, LANES))
                dots[r] = call_intrinsic(b, "llvm.x86.avx512.vpdpbusd.512", vec(i32, LANES), [dots[r], w, x])
            else:
                dots[r] = b.add(dots[r], _products(b, weight, xs[g]))
    return [b.mul(dot, scale) for dot in dots]


def _broadcasts(b, qrow, at):
    """The sub-block at element `at` of one activation row: 8 vectors <4 LANES x i8>, vector g
    holding its elements 4 g .. 4 g + 3 in every lane."""
    out = []
    for g in range(8):
        four = b.load(b.bitcast(b.gep(qrow, [b.add(at, const(4 * g))]), i32.as_pointer()), align=1)
        out.append(b.bitcast(splat_value(b, four, LANES), vec(i8, 4 * LANES)))
    return out


def _unit_sums(b, src, halves: tuple[int, ...], qt: QuantType, qrows, offsets, first_element, apart):
    """Per half of the tile and activation row, a super-block's isum <LANES x i32> (the module
    docstring), as {(half, row): isum}; offsets: per row the pointer to the super-block's
    `offsets` for Q6_K's q - 32 (matmul). Halves share each 32 elements' activations."""
    at, per = scales_at(qt), scales(qt)
    size = 256 // per  # a sub-block's weights
    group = min(size // 4, (1 << 15) // (2 * ((1 << qt.q_bits) - 1) * 128))  # pair sums that fit 16 bits
    centred = qt.ggml is Q.Q6_K and DOT == "avx2"  # q - 32 taken off in 16 bits, before the scales
    if centred:  # |q - 32| <= 32: a sub-block's 8 products a pair sum stay within 16 bits
        group = size // 4
    isums = {}
    for p in range(8):
        xs_rows = [_broadcasts(b, qrow, b.add(first_element, const(32 * p))) for qrow in qrows]
        for half in halves:
            weights = _group(b, src, half, qt, p, apart)
            for part in range(32 // size):
                j = p * 32 // size + part
                scale = b.sext(load(b, src, const(at + TILE * j + LANES * half), vec(i8, LANES)),
                               vec(i32, LANES))
                picked = slice(part * size // 4, (part + 1) * size // 4)
                pair_offsets = [b.bitcast(splat_value(b, b.load(b.gep(row, [const(j)])), LANES),
                                          vec(i16, 2 * LANES)) for row in offsets] if centred else None
                dots = _scaled_dots(b, weights[picked], [xs[picked] for xs in xs_rows], scale, group,
                                    pair_offsets)
                for r, dot in enumerate(dots):
                    if qt.ggml is Q.Q6_K and not centred:  # q - 32: 32 sc times the sub-block's sum of xq
                        offset = b.mul(b.load(b.gep(offsets[r], [const(j)])), ir.Constant(i32, 32))
                        dot = b.sub(dot, b.mul(scale, splat_value(b, offset, LANES)))
                    isums[half, r] = b.add(isums[half, r], dot) if (half, r) in isums else dot
    return isums


def _passes(rows: int) -> list[tuple[int, ...]]:
    """The tile's halves each pass over the super-blocks takes: both at once for a single
    activation row, which then loads its activations once and reads each super-block's bytes
    once (with PREFETCH_AHEAD, ahead of use); one each for more rows, whose sums would not fit
    the registers together."""
    return [tuple(range(HALVES))] if rows == 1 else [(h,) for h in range(HALVES)]


def _tile_rows(rows: int, qt: QuantType):
    """An intrinsic `dot(tile, units, xq, xs, xsum, offsets, first, out)`: one tile of `qt`
    against activation rows first .. first + rows - 1 (those below M; the others repeat row M -
    1 and are not stored), out[r * 16 + j] for row r and tile row j. offsets [M, K // 16]:
    what Q6_K reads for its q - 32 (`_sixteen_offsets`)."""
    width, mins_at, fields_at = tile_bytes(qt), scales_at(qt) + scales(qt) * TILE, d_at(qt)

    @intrinsic
    def dot(typingctx, tile, units, xq, xs, xsum, offsets, first, out):
        def codegen(context, b, signature, args):
            tp, qp, sp, np_, hp, op = (data_pointer(context, b, signature, args, i)
                                       for i in (0, 2, 3, 4, 5, 7))
            shape = context.make_array(signature.args[2])(context, b, args[2]).shape
            m, k = b.extract_value(shape, 0), b.extract_value(shape, 1)
            apart = b.lshr(k, const(63))  # zero (see _again)
            picks = Rows(b, qp, sp, np_, np_, m, k, args[6], rows).picks
            qrows = [b.gep(qp, [b.mul(pick, k)]) for pick in picks]
            per_row, blocks, per_sixteen = b.udiv(k, const(256)), b.udiv(k, const(32)), b.udiv(k, const(16))
            zeros = ir.Constant(vec(f32, LANES), None)
            for halves in _passes(rows):
                accs = {(h, r): cgutils.alloca_once_value(b, zeros) for h in halves for r in range(rows)}
                mins = {(h, r): cgutils.alloca_once_value(b, zeros)
                        for h in halves for r in range(rows if qt.with_min else 0)}
                with cgutils.for_range(b, args[1]) as loop:
                    u = loop.index
                    src = b.gep(tp, [b.mul(u, const(width))])
                    if rows == 1 and qt.q_bits > 4 and not whole_bytes(qt):
                        for line in range(0, width, 64):
                            prefetch(b, b.gep(src, [const(PREFETCH_AHEAD * width + line)]))
                    row_offsets = [b.gep(hp, [b.add(b.mul(pick, per_sixteen), b.mul(u, const(16)))])
                                   for pick in picks]
                    x_scales = [splat_value(b, b.load(b.gep(sp, [b.add(b.mul(pick, per_row), u)])), LANES)
                                for pick in picks]
                    sums = [b.gep(np_, [b.add(b.mul(pick, blocks), b.mul(u, const(8)))]) for pick in picks]
                    isums = _unit_sums(b, src, halves, qt, qrows, row_offsets, b.mul(u, const(256)), apart)
                    for h in halves:
                        d = fp16_lanes(b, src, fields_at + 2 * LANES * h, LANES)
                        for r in range(rows):
                            scaled = b.fmul(b.sitofp(isums[h, r], vec(f32, LANES)), b.fmul(d, x_scales[r]))
                            b.store(b.fadd(b.load(accs[h, r]), scaled), accs[h, r])
                        if qt.with_min:
                            dmin = fp16_lanes(b, src, fields_at + 32 + 2 * LANES * h, LANES)
                            lows = _min_terms(b, src, mins_at + LANES * h, sums, dmin, x_scales)
                            for r, low in enumerate(lows):
                                b.store(b.fadd(b.load(mins[h, r]), low), mins[h, r])
                for h in halves:
                    for r in range(rows):
                        with b.if_then(b.icmp_signed("<", b.add(args[6], const(r)), m)):
                            slot = b.gep(op, [const(r * TILE + LANES * h)])
                            result = b.load(accs[h, r])
                            if qt.with_min:
                                result = b.fsub(result, b.load(mins[h, r]))
                            b.store(result, b.bitcast(slot, vec(f32, LANES).as_pointer()), align=4)
            return context.get_dummy_value()

        return types.void(tile, units, xq, xs, xsum, offsets, first, out), codegen

    return dot


def _min_terms(b, src, at: int, sums, dmin, x_scales):
    """Per activation row: float(mi) * (dmin * xs), mi = the sum over the 8 sub-blocks j of m[j]
    (the lanes' bytes at `at` + 16 j) times the row's xsum[j] (pointers `sums`), exact."""
    mn = [b.zext(load(b, src, const(at + TILE * j), vec(i8, LANES)), vec(i32, LANES)) for j in range(8)]
    out = []
    for row_sums, x_scale in zip(sums, x_scales, strict=True):
        mi = None
        for j in range(8):
            term = b.mul(mn[j], splat_value(b, b.load(b.gep(row_sums, [const(j)])), LANES))
            mi = term if mi is None else b.add(mi, term)
        out.append(b.fmul(b.sitofp(mi, vec(f32, LANES)), b.fmul(dmin, x_scale)))
    return out


def _by_width(qt: QuantType):
    """`run(code, args)`: `qt`'s tile against args = (tile, units, xq, xs, xsum, offsets, first,
    width, out), `width` (1, 2, DOT_ROWS or WIDE_ROWS) activation rows. Inlined into the cached kernel."""
    one, two, four = (_tile_rows(rows, qt) for rows in (1, 2, DOT_ROWS))
    wide = _tile_rows(WIDE_ROWS, qt) if WIDE_ROWS > DOT_ROWS else four

    @njit(nogil=True, inline="always")
    def run(code, args):  # pragma: no cover - compiled
        tile, units, xq, xs, xsum, offsets, first, width, out = args
        if width == 1:
            one(tile, units, xq, xs, xsum, offsets, first, out)
        elif width == 2:
            two(tile, units, xq, xs, xsum, offsets, first, out)
        elif width == DOT_ROWS:
            four(tile, units, xq, xs, xsum, offsets, first, out)
        else:
            wide(tile, units, xq, xs, xsum, offsets, first, out)

    return run


_by_code = dispatch([_by_width(qt) for qt in SUPERBLOCKS])


@njit(cache=CACHE, nogil=True)
def _sixteen_offsets(xq, xsum4):  # pragma: no cover - compiled
    """[M, K // 16] int32, what Q6_K's sub-blocks of 16 read for their q - 32 (exact): on AVX2
    32 times the sub-block's pair sums of xq as two int16 (low: its elements 4 i and 4 i + 1,
    high: 4 i + 2 and 4 i + 3; at most 32 * 8 * 128 each), elsewhere the sum of its 16 xq."""
    m, count = xq.shape[0], xq.shape[1] // 16
    out = np.empty((m, count), np.int32)
    for r in range(m):
        for i in range(count):
            if DOT == "avx2":
                low = high = 0
                for e in range(16 * i, 16 * i + 16, 4):
                    low += np.int32(xq[r, e]) + np.int32(xq[r, e + 1])
                    high += np.int32(xq[r, e + 2]) + np.int32(xq[r, e + 3])
                out[r, i] = ((32 * low) & 0xFFFF) | ((32 * high) << 16)
            else:
                out[r, i] = xsum4[r, 4 * i] + xsum4[r, 4 * i + 1] + xsum4[r, 4 * i + 2] + xsum4[r, 4 * i + 3]
    return out


@njit(cache=CACHE, nogil=True, inline="always")
def _pass(kind, tile, units, xq, xs, xsum, offsets, first, width, out):  # pragma: no cover - compiled
    _by_code(kind, (tile, units, xq, xs, xsum, offsets, first, width, out))


@njit(types.void(types.int64, raw_array(types.uint8), types.int64, types.int64, types.int8[:, ::1],
                 types.float32[:, ::1], types.int32[:, ::1], types.int32[:, ::1], types.float32[:, ::1],
                 types.int64), cache=CACHE, nogil=True, parallel=True)
def matmul(kind, tiles, rows, units, xq, xs, xsum, xsum4, y, column):  # pragma: no cover - compiled
    """kind: the type's code (quant_types.SUPERBLOCKS: Q6_K, Q5_K, Q4_K); tiles [ceil(N / 16), units *
    tile bytes] (kernels/supertiles.py's layout), rows = N; activations from
    activations.quantize_rows_k -> y[:, column : column + N]. Activation rows in passes of
    ir.pass_width's rows."""
    m = xq.shape[0]
    offsets = _sixteen_offsets(xq, xsum4) if kind == SIXTEEN_CODE else np.empty((m, 0), np.int32)
    for t in prange(tiles.shape[0]):
        out = np.empty(WIDE_ROWS * 16, np.float32)
        count = min(16, rows - 16 * t)
        first = 0
        while first < m:
            width = pass_width(m - first)
            _pass(kind, tiles[t], units, xq, xs, xsum, offsets, first, width, out)
            for r in range(min(width, m - first)):
                for j in range(count):
                    y[first + r, column + 16 * t + j] = out[r * 16 + j]
            first += width
