"""Attention's two reductions over a kv head's keys, for several lanes (query heads) at once:
the scores (queries x keys) and the weighted sums (weights x values; the normaliser is the
softmax's own, softmax.weights_total). Every sum adds its products one after another in a fixed order,
so a lane's bits do not depend on which lanes share the pass (jit/attention.py relies on it).

Two forms of each, with the same bits:
- `scores` and `weighted_sums` pass over the cache's own keys and values, up to four lanes at
  a time (the register tiles of jit/attention_tiles.py widen bf16 elements as they load them);
- `scores_blocked` and `weighted_sums_blocked`, for many lanes (a chain, a prompt, a tree),
  widen KEY_BLOCK keys or value rows to fp32 once into a block that stays in L1 while every
  lane's tiles pass over it: the widening is paid once per block instead of once per four lanes,
  and the tiles read a 16 KiB block instead of 64 strided rows of the cache.
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
    fetch,
    score_tiles1,
    score_tiles3,
    score_tiles4,
    sum_tiles3,
    sum_tiles4,
)
from specdec.backends.native.kernels.jit.kv import load

KEY_BLOCK = 64  # keys (or value rows) widened at a time: 64 x 64 dims in fp32 is 16 KiB, half an L1
BLOCKED_LANES = 12  # lanes from which a widened block pays for its copy (below, the tiles widen as they load)
# Up to this many lanes of up to STREAM_DIMS dims (a decode step of SmolLM2), the scores pass over
# all the keys four dims at a time rather than in tiles: a tile reads its keys' 64 dims at once, 64
# streams from memory, more than the prefetchers follow, and a decode step's keys come from memory
# (its layers' caches and weights pass through the L3). At 256 dims (gemma3) the 64 passes over the
# scores cost more than that saves; 128 is not measured. From FP32_STREAM_KEYS keys on (from memory,
# not the caches), an fp32 cache's keys take those passes at any lane count, and its values the
# loops of weighted_sum4 rather than the column tiles: the tiles made a two-token step after 4,000
# tokens about 1.3x dearer than those loops, while over a short context they are the faster.
STREAM_LANES, STREAM_DIMS, FP32_STREAM_KEYS = 4, 64, 2048

vector, matrix = "float32[::1]", "float32[:, ::1]"  # numba signatures
ELEMENTS = ("float32", "uint16")  # a cache's elements: fp32, or bf16 bits (kv.py)


@njit(cache=True, nogil=True, inline="always")
def _long_fp32(cache, keys):  # pragma: no cover - compiled
    """Whether `keys` keys of an fp32 cache (keys_t or values) take the loops (FP32_STREAM_KEYS)."""
    return cache.itemsize == 4 and keys >= FP32_STREAM_KEYS


@njit(cache=True, nogil=True, inline="always")
def _score_rest(keys_t, qs, s, first, last, d, lo, count):  # pragma: no cover - compiled
    for rest in range(d, qs.shape[1]):  # the dims past the last four, one at a time
        for x in range(first, last):
            qd, row, kd = qs[x, rest], s[x], keys_t[rest]
            for i in range(lo, count):
                row[i] += qd * load(kd[i])


@njit(cache=True, nogil=True, inline="always")
def _scores4(keys_t, qs, s, r, lo, count):  # pragma: no cover - compiled
    dim, n = qs.shape[1], count - lo  # loops from 0 over rows sliced at lo: LLVM vectorises those best
    s0, s1, s2, s3 = s[r, lo:count], s[r + 1, lo:count], s[r + 2, lo:count], s[r + 3, lo:count]
    d = 0
    while d + 4 <= dim:
        k0, k1, k2, k3 = (keys_t[d, lo:count], keys_t[d + 1, lo:count], keys_t[d + 2, lo:count],
                          keys_t[d + 3, lo:count])
        a0, a1, a2, a3 = qs[r, d], qs[r, d + 1], qs[r, d + 2], qs[r, d + 3]
        b0, b1, b2, b3 = qs[r + 1, d], qs[r + 1, d + 1], qs[r + 1, d + 2], qs[r + 1, d + 3]
        c0, c1, c2, c3 = qs[r + 2, d], qs[r + 2, d + 1], qs[r + 2, d + 2], qs[r + 2, d + 3]
        e0, e1, e2, e3 = qs[r + 3, d], qs[r + 3, d + 1], qs[r + 3, d + 2], qs[r + 3, d + 3]
        for i in range(n):
            x0, x1, x2, x3 = load(k0[i]), load(k1[i]), load(k2[i]), load(k3[i])
            s0[i] = (((s0[i] + a0 * x0) + a1 * x1) + a2 * x2) + a3 * x3
            s1[i] = (((s1[i] + b0 * x0) + b1 * x1) + b2 * x2) + b3 * x3
            s2[i] = (((s2[i] + c0 * x0) + c1 * x1) + c2 * x2) + c3 * x3
            s3[i] = (((s3[i] + e0 * x0) + e1 * x1) + e2 * x2) + e3 * x3
        d += 4
    _score_rest(keys_t, qs, s, r, r + 4, d, lo, count)


@njit(cache=True, nogil=True, inline="always")
def _scores3(keys_t, qs, s, r, lo, count):  # pragma: no cover - compiled
    dim, n = qs.shape[1], count - lo
    s0, s1, s2 = s[r, lo:count], s[r + 1, lo:count], s[r + 2, lo:count]
    d = 0
    while d + 4 <= dim:
        k0, k1, k2, k3 = (keys_t[d, lo:count], keys_t[d + 1, lo:count], keys_t[d + 2, lo:count],
                          keys_t[d + 3, lo:count])
        a0, a1, a2, a3 = qs[r, d], qs[r, d + 1], qs[r, d + 2], qs[r, d + 3]
        b0, b1, b2, b3 = qs[r + 1, d], qs[r + 1, d + 1], qs[r + 1, d + 2], qs[r + 1, d + 3]
        c0, c1, c2, c3 = qs[r + 2, d], qs[r + 2, d + 1], qs[r + 2, d + 2], qs[r + 2, d + 3]
        for i in range(n):
            x0, x1, x2, x3 = load(k0[i]), load(k1[i]), load(k2[i]), load(k3[i])
            s0[i] = (((s0[i] + a0 * x0) + a1 * x1) + a2 * x2) + a3 * x3
            s1[i] = (((s1[i] + b0 * x0) + b1 * x1) + b2 * x2) + b3 * x3
            s2[i] = (((s2[i] + c0 * x0) + c1 * x1) + c2 * x2) + c3 * x3
        d += 4
    _score_rest(keys_t, qs, s, r, r + 3, d, lo, count)


@njit(cache=True, nogil=True, inline="always")
def _scores1(keys_t, qs, s, r, lo, count):  # pragma: no cover - compiled
    dim, n = qs.shape[1], count - lo
    s0 = s[r, lo:count]
    d = 0
    while d + 4 <= dim:
        k0, k1, k2, k3 = (keys_t[d, lo:count], keys_t[d + 1, lo:count], keys_t[d + 2, lo:count],
                          keys_t[d + 3, lo:count])
        a0, a1, a2, a3 = qs[r, d], qs[r, d + 1], qs[r, d + 2], qs[r, d + 3]
        for i in range(n):
            s0[i] = (((s0[i] + a0 * load(k0[i])) + a1 * load(k1[i])) + a2 * load(k2[i])) + a3 * load(k3[i])
        d += 4
    _score_rest(keys_t, qs, s, r, r + 1, d, lo, count)


@njit([f"void({e}[:, ::1], {matrix}, {matrix}, int64, int64)" for e in ELEMENTS], cache=True, nogil=True)
def scores(keys_t, qs, s, lo, count):  # pragma: no cover - compiled
    """s[r, i] = sum over d, in order, of qs[r, d] * keys_t[d, i] for lo <= i < count: whole
    tiles of keys with the sums in registers (attention_tiles.py), the keys past the last tile
    four dims per pass over the scores and four lanes per pass over the keys (unroll and jam).
    The lanes past the last four go three at a time, or one at a time (a decode step of a GQA
    group of 3 has three lanes: a fourth, idle lane cost a quarter of the arithmetic). Up to
    STREAM_LANES lanes (any number over FP32_STREAM_KEYS keys of an fp32 cache) of up to
    STREAM_DIMS dims take every key in those passes, the same bits."""
    lanes, dim = qs.shape
    streamed = (lanes <= STREAM_LANES or _long_fp32(keys_t, count - lo)) and dim <= STREAM_DIMS
    end = lo if streamed else lo + (count - lo) // TILE * TILE
    for r in range(lanes):
        for i in range(end, count):
            s[r, i] = 0
    quads = lanes // 4 * 4
    for r in range(0, quads, 4):
        score_tiles4(keys_t, qs, s, r, lo, end, 0)
        _scores4(keys_t, qs, s, r, end, count)
    if lanes - quads == 3:
        score_tiles3(keys_t, qs, s, quads, lo, end, 0)
        _scores3(keys_t, qs, s, quads, end, count)
    else:
        for r in range(quads, lanes):
            score_tiles1(keys_t, qs, s, r, lo, end, 0)
            _scores1(keys_t, qs, s, r, end, count)


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


@njit(cache=True, nogil=True)
def weighted_sums(values, w, acc, lo, counts, c0, c1):  # pragma: no cover - compiled
    """acc[r, c] = w[r, :counts[r]] @ values[:counts[r], c] for every lane r and the columns
    c0 <= c < c1 (acc [lanes, dim]; the values' last column, the cache's ones, is not read;
    a range other than all of them must be whole tiles), from key lo (a multiple of four below
    which every weight is 0: skipping those zero terms leaves the bits as they are): four lanes
    at a time as far as all four have keys (weighted_sum4), each lane on its own after that;
    past the last four, three at a time or one (as `scores`). Where the columns are whole
    tiles, the shared keys go through sum_tiles (from FP32_STREAM_KEYS keys of an fp32 cache,
    only for a part of the columns). A column's sums do not depend on the range."""
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
def _widen_keys(keys_t, first, n, block):  # pragma: no cover - compiled
    """block[d, i] = keys_t[d, first + i] as fp32 for i < n (exact: kv.load), fetching the next
    block's keys: its head_dim rows are as many streams, more than the CPU's prefetcher follows
    (from memory, each block would otherwise wait on every row)."""
    line = 64 // keys_t.itemsize
    for d in range(keys_t.shape[0]):
        row, out = keys_t[d, first : first + n], block[d]
        for c in range(0, KEY_BLOCK, line):
            fetch(keys_t, d, first + KEY_BLOCK + c)
        for i in range(n):
            out[i] = load(row[i])


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
def scores_blocked(keys_t, qs, s, lo, count):  # pragma: no cover - compiled
    """`scores`, with the same bits: its whole tiles of keys from blocks of KEY_BLOCK keys
    widened to fp32 once for every lane, the keys past the last tile as `scores` takes them."""
    lanes, dim = qs.shape
    end = lo + (count - lo) // TILE * TILE
    block = np.empty((dim, KEY_BLOCK), np.float32)
    quads = lanes // 4 * 4
    for first in range(lo, end, KEY_BLOCK):
        n = min(KEY_BLOCK, end - first)
        _widen_keys(keys_t, first, n, block)
        for r in range(0, quads, 4):
            block_score_tiles4(block, qs, s, r, 0, n, first)
        if lanes - quads == 3:
            block_score_tiles3(block, qs, s, quads, 0, n, first)
        else:
            for r in range(quads, lanes):
                block_score_tiles1(block, qs, s, r, 0, n, first)
    scores(keys_t, qs, s, end, count)


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
    if dim % TILE:
        weighted_sums(values, w, acc, lo, counts, 0, dim)
        return
    acc[:] = 0
    ends = np.empty(lanes, np.int64)  # each lane's keys taken in blocks: lo .. ends[x] - 1
    r = 0
    while r < lanes:
        size = _group(lanes, r)
        ends[r : r + size] = max(lo, counts[r : r + size].min() // 4 * 4)
        r += size
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
