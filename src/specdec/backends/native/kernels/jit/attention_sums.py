"""Attention's two reductions over a kv head's keys, for several lanes (query heads) at once:
the scores (queries x keys) and the weighted sums (weights x values; the normaliser is the
softmax's own, softmax.weights_total). Every sum adds its products one after another in a fixed order,
so a lane's bits do not depend on which lanes share the pass (jit/attention.py relies on it).

The keys come in the cache's blocks of TILE keys, [blocks, dim, TILE] (kv_layout.py): a block
is one stretch of memory, so a pass over a head's keys is one stream the CPU's prefetcher follows
(keys transposed whole, [dim, length], were head_dim streams, more than it follows). A bf16
cache's blocks hold pairs of dims, and its scores add a pair's odd product first over queries
rounded to bf16 (`pair_operand`, `dim_order`, `key_at`; the pair tiles of attention_tiles.py).
Its weighted sums take bf16 weights, and where vdpbf16ps exists `paired_sums` pairs the value
rows of two keys for it: the bits of the fp32 loops below, which every other CPU runs. Two
forms of each reduction, with the same bits:
- `scores` and `weighted_sums` pass over the cache's own keys and values, up to four lanes at
  a time (the register tiles of jit/attention_tiles.py widen bf16 elements as they load them);
- `scores_blocked` and `weighted_sums_blocked`, for many lanes (a chain, a prompt, a tree),
  widen KEY_BLOCK keys or value rows to fp32 once into a block that stays in L1 while every
  lane's tiles pass over it: the widening is paid once per block instead of once per four lanes.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from specdec.backends.native.kernels.jit.attention_tiles import (
    TILE,
    block_score_tiles1,
    block_score_tiles3,
    block_score_tiles4,
    block_sum_tiles1,
    block_sum_tiles3,
    block_sum_tiles4,
    pair_score_tiles1,
    pair_score_tiles3,
    pair_score_tiles4,
    pair_score_tiles8,
    pair_sum_tiles1,
    pair_sum_tiles3,
    pair_sum_tiles4,
    pair_sum_tiles8,
    sum_tiles3,
    sum_tiles4,
)
from specdec.backends.native.kernels.jit.ir import BF16_DOT
from specdec.backends.native.kernels.jit.kv import encode, load

KEY_BLOCK = 64  # keys or value rows widened (or paired) at a time: 64 x 64 fp32 is 16 KiB, half an L1
BLOCKED_LANES = 12  # lanes from which a widened block pays for its copy (below, the tiles widen as they load)
# From FP32_STREAM_KEYS values of an fp32 cache on (from memory, not the caches), weighted_sums
# takes the loops of weighted_sum4 rather than the column tiles: the tiles made a two-token step
# after 4,000 tokens about 1.3x dearer than those loops, while over a short context they are faster.
FP32_STREAM_KEYS = 2048
# From PAIRED_LANES lanes a bf16 cache's weighted sums take vdpbf16ps pairs: below, a decode row's
# three lanes over values from memory (a cache past the L3) ran 0.051 ms an item on the fp32
# tiles against 0.059 on pairs, level at four lanes, 0.093 against 0.059 at eight.
PAIRED_LANES = 4

vector, matrix = "float32[::1]", "float32[:, ::1]"  # numba signatures
ELEMENTS = ("float32", "uint16")  # a cache's elements: fp32, or bf16 bits (kv.py)


@njit(cache=True, nogil=True, inline="always")
def _long_fp32(cache, keys):  # pragma: no cover - compiled
    """Whether `keys` values of an fp32 cache take the loops (FP32_STREAM_KEYS)."""
    return cache.itemsize == 4 and keys >= FP32_STREAM_KEYS


PAIR_FLOOR = np.float32(2.0**-56)  # kv_layout.PAIR_FLOOR: a bf16 cache's operands below it are 0


@njit(cache=True, nogil=True, inline="always")
def stored_element(x, cache):  # pragma: no cover - compiled
    """The element `cache` stores for a key's or a value's x: over a bf16 cache, 0 below
    PAIR_FLOOR (no product of a score or a weighted sum is then subnormal, nor any sum of them),
    else torch's cast (kv.encode)."""
    if cache.itemsize == 2 and abs(x) < PAIR_FLOOR:
        x = np.float32(0)
    return encode(x, cache)


@njit(cache=True, nogil=True, inline="always")
def pair_operand(x, cache):  # pragma: no cover - compiled
    """A scaled query's element as the scores take it: itself over an fp32 cache; over a bf16
    one, rounded to bf16 like a key (stored_element), since vdpbf16ps multiplies bf16 by bf16."""
    if cache.itemsize == 4:
        return x
    return load(stored_element(x, cache))


FLOOR_BITS = np.uint32(0x23800000)  # PAIR_FLOOR's bits


@njit(cache=True, nogil=True, inline="always")
def round_weights(w):  # pragma: no cover - compiled
    """Softmax weights w (each >= 0, or NaN) in place, as the weighted sums over a bf16 cache
    take them: 0 below PAIR_FLOOR, else rounded to bf16, ties to even (pair_operand's bits), in
    integer steps without branches, so the loop vectorises (pair_operand a weight at a time cost a
    prompt's attention more than the vdpbf16ps sums saved)."""
    bits = w.view(np.uint32)
    for i in range(bits.shape[0]):
        x = bits[i]
        rounded = (x + np.uint32(0x7FFF) + ((x >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)
        bits[i] = rounded if x >= FLOOR_BITS else np.uint32(0)


@njit(cache=True, nogil=True, inline="always")
def key_slot(d, column):  # pragma: no cover - compiled
    """(row, column) of a bf16 block [dim, TILE] that holds key `column`'s dim d (key_at)."""
    flat = (d // 2) * 2 * TILE + 2 * column + (d & 1)
    return flat // TILE, flat % TILE


@njit(cache=True, nogil=True, inline="always")
def dim_order(d, paired):  # pragma: no cover - compiled
    """The d-th dim a score adds: in order, or over a bf16 cache each pair's odd dim first
    (vdpbf16ps's order: attention_tiles._pair_products)."""
    return d ^ 1 if paired else d


@njit(cache=True, nogil=True, inline="always")
def key_at(block, column, d):  # pragma: no cover - compiled
    """Key `column`'s dim d of a block [dim, TILE] of the cache, as fp32: an fp32 block holds
    dim d in row d; a bf16 block holds pairs, row 2p .. 2p + 1 the TILE keys' dims 2p and
    2p + 1 side by side (kv_layout.py)."""
    if block.itemsize == 4:
        return load(block[d, column])
    row, at = key_slot(d, column)
    return load(block[row, at])


@njit(cache=True, nogil=True, inline="always")
def _score_keys(keys, qs, s, lo, count):  # pragma: no cover - compiled
    """s[r, i] for every lane r and the keys lo <= i < count one at a time (the keys outside
    whole blocks): a tile's sums, in its order."""
    paired = keys.itemsize == 2
    for r in range(qs.shape[0]):
        for i in range(lo, count):
            block, column, x = i // TILE, i % TILE, np.float32(0)
            for n in range(qs.shape[1]):
                d = dim_order(n, paired)
                x += qs[r, d] * key_at(keys[block], column, d)
            s[r, i] = x


@njit(cache=True, nogil=True)
def query_pairs(qs):  # pragma: no cover - compiled
    """qs [lanes, dim] (each a bf16 value) -> [lanes, dim / 2] uint32: dims 2p and 2p + 1 as
    one pair of bf16, the even dim in the low half (vdpbf16ps's operand)."""
    bits, half = qs.view(np.uint32), qs.shape[1] // 2
    pairs = np.empty((qs.shape[0], half), np.uint32)
    for r in range(qs.shape[0]):
        for p in range(half):
            pairs[r, p] = (bits[r, 2 * p] >> np.uint32(16)) | (bits[r, 2 * p + 1] & np.uint32(0xFFFF0000))
    return pairs


@njit(cache=True, nogil=True, inline="always")
def _score_pair_block(block, pairs, s, first):  # pragma: no cover - compiled
    """Every lane's scores over one block of a bf16 cache, keys first .. first + TILE - 1: eight
    lanes a tile with vdpbf16ps, then four, then the last three together or one at a time."""
    lanes = pairs.shape[0]
    octets = lanes // 8 * 8 if BF16_DOT else 0  # 8 lanes' sums fit zmm registers, not ymm ones
    for r in range(0, octets, 8):
        pair_score_tiles8(block, pairs, s, r, first)
    quads = octets + (lanes - octets) // 4 * 4
    for r in range(octets, quads, 4):
        pair_score_tiles4(block, pairs, s, r, first)
    if lanes - quads == 3:
        pair_score_tiles3(block, pairs, s, quads, first)
    else:
        for r in range(quads, lanes):
            pair_score_tiles1(block, pairs, s, r, first)


@njit(cache=True, nogil=True, inline="always")
def _score_block(tile, qs, s, n, first):  # pragma: no cover - compiled
    """Every lane's scores over a block [dim, >= n] of keys first .. first + n - 1 (n a multiple
    of TILE): four lanes a tile, then the last three together or one at a time."""
    lanes = qs.shape[0]
    quads = lanes // 4 * 4
    for r in range(0, quads, 4):
        block_score_tiles4(tile, qs, s, r, 0, n, first)
    if lanes - quads == 3:
        block_score_tiles3(tile, qs, s, quads, 0, n, first)
    else:
        for r in range(quads, lanes):
            block_score_tiles1(tile, qs, s, r, 0, n, first)


@njit(cache=True, nogil=True, inline="always")
def _tiled(lo, count, width):  # pragma: no cover - compiled
    """The keys first .. last - 1 (whole blocks) that cover lo .. count - 1 as far as a score
    row of `width` columns holds their tiles' scores."""
    last = -(-count // TILE) * TILE
    if last > width:
        last = count // TILE * TILE
    return min(lo // TILE * TILE, last), last


@njit([f"void({e}[:, :, ::1], {matrix}, {matrix}, int64, int64)" for e in ELEMENTS], cache=True, nogil=True)
def scores(keys, qs, s, lo, count):  # pragma: no cover - compiled
    """s[r, i] = sum over d, in order, of qs[r, d] * key i's dim d for lo <= i < count; keys
    [blocks, dim, TILE]: the blocks that hold them in register tiles (attention_tiles.py), a
    block at a time, the same sums. A tile also writes the scores of its block's other keys
    (no query reads those); where s ends inside the last block, that block's keys go one at a
    time."""
    first, last = _tiled(lo, count, s.shape[1])
    if keys.itemsize == 2:  # a bf16 cache's pairs
        pairs = query_pairs(qs)
        for block in range(first // TILE, last // TILE):
            _score_pair_block(keys[block], pairs, s, block * TILE)
    else:
        for block in range(first // TILE, last // TILE):
            _score_block(keys[block], qs, s, TILE, block * TILE)
    _score_keys(keys, qs, s, max(lo, last), count)


@njit([f"void({e}[:, ::1], {vector}, {vector}, int64, int64, int64, int64)" for e in ELEMENTS], cache=True,
      nogil=True)
def weighted_sum(values, w, acc, start, count, c0, c1):  # pragma: no cover - compiled
    """acc[c] += sum over start <= i < count, in order, of w[i] * values[i, c] for the columns
    c0 <= c < c1 (never the last, the cache's ones); four keys per pass (start is a multiple of
    four: the passes fall where they would from 0)."""
    columns, out = c1 - c0, acc[c0:c1]  # loops from 0 over sliced rows: LLVM vectorises those best
    i = start
    while i + 4 <= count:
        v0, v1, v2, v3 = values[i, c0:c1], values[i + 1, c0:c1], values[i + 2, c0:c1], values[i + 3, c0:c1]
        w0, w1, w2, w3 = w[i], w[i + 1], w[i + 2], w[i + 3]
        for c in range(columns):
            p0, p1, p2, p3 = load(v0[c]), load(v1[c]), load(v2[c]), load(v3[c])
            out[c] = (((out[c] + w0 * p0) + w1 * p1) + w2 * p2) + w3 * p3
        i += 4
    for rest in range(i, count):
        wi, vi = w[rest], values[rest, c0:c1]
        for c in range(columns):
            out[c] += wi * load(vi[c])


@njit([f"void({e}[:, ::1], {matrix}, {matrix}, int64, int64, int64)" for e in ELEMENTS], cache=True,
      nogil=True)
def weighted_sum4(values, w, acc, r, lo, count):  # pragma: no cover - compiled
    """weighted_sum for lanes r .. r + 3 at once over keys lo .. count - 1 (multiples of four):
    each lane's sums in its own order, while a pass loads the four value rows once for all
    four lanes (the loads, not the multiplies, bound the single-lane loop)."""
    columns = values.shape[1] - 1  # not the cache's ones column
    a0, a1, a2, a3 = acc[r], acc[r + 1], acc[r + 2], acc[r + 3]
    w0, w1, w2, w3 = w[r], w[r + 1], w[r + 2], w[r + 3]
    for i in range(lo, count, 4):
        v0, v1, v2, v3 = values[i], values[i + 1], values[i + 2], values[i + 3]
        x00, x01, x02, x03 = w0[i], w0[i + 1], w0[i + 2], w0[i + 3]
        x10, x11, x12, x13 = w1[i], w1[i + 1], w1[i + 2], w1[i + 3]
        x20, x21, x22, x23 = w2[i], w2[i + 1], w2[i + 2], w2[i + 3]
        x30, x31, x32, x33 = w3[i], w3[i + 1], w3[i + 2], w3[i + 3]
        for c in range(columns):
            p0, p1, p2, p3 = load(v0[c]), load(v1[c]), load(v2[c]), load(v3[c])
            a0[c] = (((a0[c] + x00 * p0) + x01 * p1) + x02 * p2) + x03 * p3
            a1[c] = (((a1[c] + x10 * p0) + x11 * p1) + x12 * p2) + x13 * p3
            a2[c] = (((a2[c] + x20 * p0) + x21 * p1) + x22 * p2) + x23 * p3
            a3[c] = (((a3[c] + x30 * p0) + x31 * p1) + x32 * p2) + x33 * p3


@njit(cache=True, nogil=True)
def weighted_sum3(values, w, acc, r, lo, count):  # pragma: no cover - compiled
    """weighted_sum4 for the three lanes r .. r + 2 (a GQA group of three, or the last three)."""
    columns = values.shape[1] - 1  # not the cache's ones column
    a0, a1, a2 = acc[r], acc[r + 1], acc[r + 2]
    w0, w1, w2 = w[r], w[r + 1], w[r + 2]
    for i in range(lo, count, 4):
        v0, v1, v2, v3 = values[i], values[i + 1], values[i + 2], values[i + 3]
        x00, x01, x02, x03 = w0[i], w0[i + 1], w0[i + 2], w0[i + 3]
        x10, x11, x12, x13 = w1[i], w1[i + 1], w1[i + 2], w1[i + 3]
        x20, x21, x22, x23 = w2[i], w2[i + 1], w2[i + 2], w2[i + 3]
        for c in range(columns):
            p0, p1, p2, p3 = load(v0[c]), load(v1[c]), load(v2[c]), load(v3[c])
            a0[c] = (((a0[c] + x00 * p0) + x01 * p1) + x02 * p2) + x03 * p3
            a1[c] = (((a1[c] + x10 * p0) + x11 * p1) + x12 * p2) + x13 * p3
            a2[c] = (((a2[c] + x20 * p0) + x21 * p1) + x22 * p2) + x23 * p3


@njit(cache=True, nogil=True, inline="always")
def _pair_group(lanes, r):  # pragma: no cover - compiled
    """The lanes r .. r + size - 1 whose sums share a pair tile: eight, four, the last three, or one."""
    left = lanes - r
    return 8 if left >= 8 else (4 if left >= 4 else (3 if left == 3 else 1))


@njit(cache=True, nogil=True, inline="always")
def _shared_ends(lanes, lo, counts, paired):  # pragma: no cover - compiled
    """Where each lane's group (_pair_group's where `paired`, else _group's) stops taking keys
    together: the fewest keys any of them reads, down to a multiple of four, and not below lo."""
    ends = np.empty(lanes, np.int64)
    r = 0
    while r < lanes:
        size = _pair_group(lanes, r) if paired else _group(lanes, r)
        ends[r : r + size] = max(lo, counts[r : r + size].min() // 4 * 4)
        r += size
    return ends


@njit(cache=True, nogil=True, inline="always")
def _weight_pairs(bits, x, first, n, pairs):  # pragma: no cover - compiled
    """pairs[x, p] = lane x's bf16 weights of keys first + 2p (high half) and first + 2p + 1
    (low half), from their fp32 bits (bf16 values: the low halves are 0), for p < n / 2."""
    row, out = bits[x, first : first + n], pairs[x]  # sliced from 0: the loop vectorises
    for p in range(n // 2):
        out[p] = (row[2 * p] & np.uint32(0xFFFF0000)) | (row[2 * p + 1] >> np.uint32(16))


@njit(cache=True, nogil=True, inline="always")
def _pair_tiles(values, pairs, acc, r, size, p0, p1, shift, c0, c1):  # pragma: no cover - compiled
    """pair_sum_tiles for the `size` lanes r .. (8, 4, 3 or 1) over the pairs p0 .. p1 - 1."""
    if size == 8:
        pair_sum_tiles8(values, pairs, acc, r, p0, p1, shift, c0, c1)
    elif size == 4:
        pair_sum_tiles4(values, pairs, acc, r, p0, p1, shift, c0, c1)
    elif size == 3:
        pair_sum_tiles3(values, pairs, acc, r, p0, p1, shift, c0, c1)
    else:
        pair_sum_tiles1(values, pairs, acc, r, p0, p1, shift, c0, c1)


@njit(cache=True, nogil=True)
def paired_sums(values, w, acc, lo, counts, c0, c1):  # pragma: no cover - compiled
    """`weighted_sums` over a bf16 cache with vdpbf16ps, the same bits as its fp32 loops given
    bf16 weights (lane_weights rounds them, and no product or sum is subnormal: PAIR_FLOOR): each
    group of up to eight lanes takes the keys all of them read (to a multiple of four) a pair of
    keys at a time, in order (the pair's high half first), KEY_BLOCK keys at a time (which stay
    in L1 while every tile of columns passes), then each lane its own last keys. The tiles pair
    the cache's rows as they load them (a block of rows paired once for every lane measured
    slower at any lane count)."""
    acc[:, c0:c1] = 0
    lanes = acc.shape[0]
    ends = _shared_ends(lanes, lo, counts, True)  # each lane's keys taken in pairs: lo .. ends[x] - 1
    top, bits = ends.max(), w.view(np.uint32)
    pairs = np.empty((lanes, (top - lo) // 2), np.uint32)  # pair p - lo / 2: keys 2p and 2p + 1
    for x in range(lanes):
        _weight_pairs(bits, x, lo, ends[x] - lo, pairs)
    for first in range(lo, top, KEY_BLOCK):
        r = 0
        while r < lanes:
            size, last = _pair_group(lanes, r), min(first + KEY_BLOCK, ends[r])
            if last > first:
                _pair_tiles(values, pairs, acc, r, size, first // 2, last // 2, lo // 2, c0, c1)
            r += size
    for x in range(lanes):
        weighted_sum(values, w[x], acc[x], ends[x], counts[x], c0, c1)


@njit(cache=True, nogil=True, inline="always")
def _pairs_suit(values, lanes, c0, c1):  # pragma: no cover - compiled
    """Whether the weighted sums of these lanes and columns take paired_sums: a bf16 cache, whole
    tiles of columns, vdpbf16ps (elsewhere the fp32 loops give the same bits, and faster than a
    replica), and PAIRED_LANES lanes or more."""
    return (BF16_DOT and values.itemsize == 2 and lanes >= PAIRED_LANES and (values.shape[1] - 1) % TILE == 0
            and c0 % TILE == 0 and c1 % TILE == 0)


@njit(cache=True, nogil=True)
def weighted_sums(values, w, acc, lo, counts, c0, c1):  # pragma: no cover - compiled
    """acc[r, c] = w[r, :counts[r]] @ values[:counts[r], c] for every lane r and the columns
    c0 <= c < c1 (acc [lanes, dim]; the values' last column, the cache's ones, is not read;
    a range other than all of them must be whole tiles), from key lo (a multiple of four below
    which every weight is 0: skipping those zero terms leaves the bits as they are): four lanes
    at a time as far as all four have keys (weighted_sum4), each lane on its own after that;
    past the last four, three at a time or one (as `scores`). Where the columns are whole
    tiles, the shared keys go through sum_tiles (from FP32_STREAM_KEYS keys of an fp32 cache,
    only for a part of the columns). A column's sums do not depend on the range. Over a bf16
    cache, from PAIRED_LANES lanes, paired_sums with the same bits."""
    if _pairs_suit(values, acc.shape[0], c0, c1):
        paired_sums(values, w, acc, lo, counts, c0, c1)
        return
    acc[:, c0:c1] = 0
    lanes = acc.shape[0]
    quads = lanes // 4 * 4
    columns = values.shape[1] - 1
    # whole tiles of columns; an fp32 cache's long values take the loops over all of them
    tiles = columns % TILE == 0 and (not _long_fp32(values, counts.max() - lo) or c1 - c0 < columns)
    for r in range(0, quads, 4):
        shared = max(lo, min(counts[r], counts[r + 1], counts[r + 2], counts[r + 3]) // 4 * 4)
        if tiles:
            sum_tiles4(values, w, acc, r, lo, shared, c0, c1)
        else:
            weighted_sum4(values, w, acc, r, lo, shared)
        for x in range(r, r + 4):
            weighted_sum(values, w[x], acc[x], shared, counts[x], c0, c1)
    shared = lo
    if lanes - quads == 3:
        shared = max(lo, min(counts[quads], counts[quads + 1], counts[quads + 2]) // 4 * 4)
        if tiles:
            sum_tiles3(values, w, acc, quads, lo, shared, c0, c1)
        else:
            weighted_sum3(values, w, acc, quads, lo, shared)
    for x in range(quads, lanes):
        weighted_sum(values, w[x], acc[x], shared, counts[x], c0, c1)


@njit(cache=True, nogil=True, inline="always")
def _widen_keys(keys, first, n, block):  # pragma: no cover - compiled
    """block[d, i] = key first + i's dim d as fp32 for i < n (exact: kv.load); first and n
    whole blocks of the cache's."""
    for b in range(n // TILE):
        tile = keys[first // TILE + b]
        for d in range(tile.shape[0]):
            row, out = tile[d], block[d, b * TILE : (b + 1) * TILE]
            for c in range(TILE):
                out[c] = load(row[c])


@njit(cache=True, nogil=True, inline="always")
def _widen_values(values, first, n, block):  # pragma: no cover - compiled
    """block[i, c] = values[first + i, c] as fp32 for i < n and every column but the ones (the
    rows are one stream, which the CPU's prefetcher follows)."""
    columns = block.shape[1]
    for i in range(n):
        row, out = values[first + i], block[i]
        for c in range(columns):
            out[c] = load(row[c])


@njit(cache=True, nogil=True)
def scores_blocked(keys, qs, s, lo, count):  # pragma: no cover - compiled
    """`scores`, with the same bits: its blocks of keys widened to fp32 KEY_BLOCK keys at a
    time, once for every lane (an fp32 cache; a bf16 cache's pair tiles widen nothing)."""
    if keys.itemsize == 2:
        scores(keys, qs, s, lo, count)
        return
    first, last = _tiled(lo, count, s.shape[1])
    block = np.empty((qs.shape[1], KEY_BLOCK), np.float32)
    for start in range(first, last, KEY_BLOCK):
        n = min(KEY_BLOCK, last - start)
        _widen_keys(keys, start, n, block)
        _score_block(block, qs, s, n, start)
    scores(keys, qs, s, max(lo, last), count)


@njit(cache=True, nogil=True, inline="always")
def _group(lanes, r):  # pragma: no cover - compiled
    """The lanes r .. r + size - 1 that pass together: four, or the last three, or one."""
    left = lanes - r
    return 4 if left >= 4 else (3 if left == 3 else 1)


@njit(cache=True, nogil=True)
def weighted_sums_blocked(values, w, acc, lo, counts):  # pragma: no cover - compiled
    """`weighted_sums`, with the same bits: each group of lanes takes the keys all of them read
    (to a multiple of four) from blocks of KEY_BLOCK value rows widened to fp32 once for every
    lane, then each lane its own last keys."""
    lanes, dim = acc.shape[0], values.shape[1] - 1
    if dim % TILE or _pairs_suit(values, lanes, 0, dim):
        weighted_sums(values, w, acc, lo, counts, 0, dim)
        return
    acc[:] = 0
    ends = _shared_ends(lanes, lo, counts, False)  # each lane's keys taken in blocks: lo .. ends[x] - 1
    block = np.empty((KEY_BLOCK, dim), np.float32)
    top = ends.max()
    for first in range(lo, top, KEY_BLOCK):
        n = min(KEY_BLOCK, top - first)
        _widen_values(values, first, n, block)
        r = 0
        while r < lanes:
            size, m = _group(lanes, r), min(n, ends[r] - first)
            if m > 0 and size == 4:
                block_sum_tiles4(block, w, acc, r, m, first)
            elif m > 0 and size == 3:
                block_sum_tiles3(block, w, acc, r, m, first)
            elif m > 0:
                block_sum_tiles1(block, w, acc, r, m, first)
            r += size
    for x in range(lanes):
        weighted_sum(values, w[x], acc[x], ends[x], counts[x], 0, dim)
