"""The native backend's numba attention: each query head (a lane) on its own over its slot's
keys and, for a token tree, its path's nodes: its scores and its weighted sums of the values
(attention_sums.py), its softmax numerators and their normaliser (softmax.py), each in a fixed
order, so a lane's bits do not depend on the lanes that share its passes, its work item or its
thread (kernels/attention.py states the contract it shares with the PyTorch routine;
numba_ops.py says when it runs and wraps it for tensors). The chain row's rotation and
attention in one call join norms.py's rotation to it. Imported on first use; compiled once,
cached on disk."""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from specdec.backends.native.kernels.jit.attention_sums import (
    BLOCKED_LANES,
    KEY_BLOCK,
    dim_order,
    key_slot,
    pair_operand,
    round_weights,
    scores,
    scores_blocked,
    stored_element,
    weighted_sums,
    weighted_sums_blocked,
)
from specdec.backends.native.kernels.jit.attention_tiles import TILE
from specdec.backends.native.kernels.jit.kv import load
from specdec.backends.native.kernels.jit.norms import (
    bf16_rows,
    split_norm_rotate,
    split_rotate,
)
from specdec.backends.native.kernels.jit.softmax import exp_shifted, largest, weights_total

LOWEST = np.float32(-3.4e38)  # the score of a key outside a sliding window: never a maximum
ITEM_QUADS = 6  # at most 24 lanes a work item: their scores stay in L2 while each widened block serves all
WIDEN_SHARE = 0.3  # a lane's cost in a blocked item of m groups of four: about 1 + WIDEN_SHARE / m (measured)
SPLIT_LANES = 4  # lanes of a (row, kv head) item that attend_split takes: one register tile

vector, matrix = "float32[::1]", "float32[:, ::1]"  # numba signatures
ELEMENTS = ("float32", "uint16")  # a cache's elements: fp32, or bf16 bits (kv.py)


@njit(cache=True, nogil=True)
def lane_weights(s, qs, r, first, n, path, k_new, h, cache):  # pragma: no cover - compiled
    """Lane r's softmax numerators, in place of its scores s[r, :n + E] (E = len(path)) over
    the cached keys first .. n - 1 and its path's own keys (a tree), less their maximum; keys
    before `first` (outside a sliding window) weigh exactly 0. Returns their sum, the
    normaliser (softmax.weights_total). Over a bf16 `cache` (the keys' or the values'), a
    score adds pairs of dims in dim_order, and the weights are rounded to bf16 (round_weights)
    before they are summed: the weighted sums multiply them by bf16 values."""
    dim, extra, paired = qs.shape[1], path.shape[0], cache.itemsize == 2
    for i in range(first):
        s[r, i] = LOWEST
    for e in range(extra):  # the tree's own keys: the same sums in the same order
        node, x = path[e], np.float32(0)
        for n_ in range(dim):
            d = dim_order(n_, paired)
            x += qs[r, d] * k_new[node, h, d]
        s[r, n + e] = x
    exp_shifted(s[r], largest(s[r], n + extra), n + extra, s[r])
    for i in range(first):  # an exact 0: adding 0 * value leaves every later sum's bits as they are
        s[r, i] = 0
    if paired:
        round_weights(s[r, first : n + extra])
    return weights_total(s[r], first, n + extra)


# error_model="numpy": no zero-divisor check, so the divisions vectorise (the same quotients)
@njit(cache=True, nogil=True, error_model="numpy")
def lane_finish(w, acc, r, n, path, v_new, h, total, out):  # pragma: no cover - compiled
    """Lane r's output from acc[r] = its weights @ values over the cache: its path's own values,
    then the division by the normaliser `total` (lane_weights') -> out [dim]."""
    dim = out.shape[0]
    for e in range(path.shape[0]):
        node, wi = path[e], w[r, n + e]
        for c in range(dim):
            acc[r, c] += wi * v_new[node, h, c]
    for d in range(dim):
        out[d] = acc[r, d] / total


@njit(cache=True, nogil=True)
def _cut(offsets, limits, group, kv_heads, span):  # pragma: no cover - compiled
    """Every row's lanes cut into items of `span` lanes of a head: table [I, 4] of (row, kv
    head, first lane, last lane) and each item's cost (its keys x its lanes)."""
    rows, count = offsets.shape[0] - 1, 0
    for r in range(rows):
        count += kv_heads * -(-((offsets[r + 1] - offsets[r]) * group) // span)
    table, cost = np.empty((count, 4), np.int64), np.empty(count, np.int64)
    i = 0
    for r in range(rows):
        lanes, keys = (offsets[r + 1] - offsets[r]) * group, limits[offsets[r] : offsets[r + 1]].max()
        for h in range(kv_heads):
            for first in range(0, lanes, span):
                table[i, 0], table[i, 1], table[i, 2], table[i, 3] = r, h, first, min(first + span, lanes)
                cost[i] = (keys + 64) * (table[i, 3] - first)
                i += 1
    return table, cost


@njit(cache=True, nogil=True)
def _deal(cost, threads):  # pragma: no cover - compiled
    """Items dealt to threads, the dearest first to the least loaded: (items [threads, I], -1
    past a thread's last; the most any thread got)."""
    items = np.full((threads, cost.shape[0]), -1, np.int64)
    filled, load = np.zeros(threads, np.int64), np.zeros(threads, np.int64)
    for i in np.argsort(-cost, kind="mergesort"):
        t = np.argmin(load)
        items[t, filled[t]] = i
        filled[t] += 1
        load[t] += cost[i]
    return items, load.max()


@njit(cache=True, nogil=True)
def work_items(offsets, limits, heads, kv_heads, threads):  # pragma: no cover - compiled
    """The attention of packed rows (offsets [R + 1] of their tokens; limits [T]) cut into work
    items (row, kv head, first lane, last lane) of up to ITEM_QUADS groups of four lanes of a
    head, and dealt to `threads` threads (`_deal`): (table [I, 4], items [threads, I]). The size
    is the one whose busiest thread finishes first, counting that larger items widen each key
    for more lanes. Every row's items in one parallel loop keep both threads busy where a row's
    own (three kv heads, say) would leave one idle a third of the time."""
    group = heads // kv_heads
    best, span = np.inf, 4
    for quads in range(1, ITEM_QUADS + 1):
        _, most = _deal(_cut(offsets, limits, group, kv_heads, 4 * quads)[1], threads)
        finish = most * (1 + WIDEN_SHARE / (quads if 4 * quads >= BLOCKED_LANES else 1))
        if finish < best:
            best, span = finish, 4 * quads
    table, cost = _cut(offsets, limits, group, kv_heads, span)
    return table, _deal(cost, threads)[0]


@njit(cache=True, nogil=True)
def head(q, k_new, v_new, keys, values, h, first, last, limits, paths, starts, widest, scale,
         out):  # pragma: no cover - compiled
    """Lanes first .. last - 1 of kv head h (lane r: query r // group, its head r % group of
    the group): their scores and their weighted sums share the passes over its keys [L / TILE,
    dim, TILE] and values [L, dim + 1]. A lane's bits do not depend on which lanes share them."""
    dim, group = q.shape[2], q.shape[1] // k_new.shape[1]
    lanes = last - first
    # scores (and a block's worth past them: a score tile's), then in their place the weights
    w = np.empty((lanes, widest + paths.shape[1] + TILE), np.float32)
    acc = np.empty((lanes, dim), np.float32)
    totals = np.empty(lanes, np.float32)
    qs = np.empty((lanes, dim), np.float32)
    counts, extras = np.empty(lanes, np.int64), np.zeros(lanes, np.int64)
    begins = np.empty(lanes, np.int64)
    for x in range(lanes):
        j, g = (first + x) // group, (first + x) % group
        counts[x], begins[x] = limits[j], starts[j]
        while extras[x] < paths.shape[1] and paths[j, extras[x]] >= 0:
            extras[x] += 1
        for d in range(dim):
            qs[x, d] = pair_operand(q[j, h * group + g, d] * scale, keys)
    reach = counts.max()  # the keys any of these lanes reads (a prompt's first queries read fewer)
    lo = min(begins[:lanes].min(), reach) // 4 * 4  # keys before every lane's window: not read at all
    blocked = lanes >= BLOCKED_LANES  # the same bits either way (attention_sums.py)
    if blocked:
        scores_blocked(keys, qs, w, lo, reach)  # a lane ignores the keys past its limit
    else:
        scores(keys, qs, w, lo, reach)
    for x in range(lanes):
        totals[x] = lane_weights(w, qs, x, begins[x], counts[x], paths[(first + x) // group, : extras[x]],
                                 k_new, h, keys)
    if blocked:
        weighted_sums_blocked(values, w, acc, lo, counts)
    else:
        weighted_sums(values, w, acc, lo, counts, 0, acc.shape[1])
    for x in range(lanes):
        j, g = (first + x) // group, (first + x) % group
        lane_finish(w, acc, x, counts[x], paths[j, : extras[x]], v_new, h, totals[x], out[j, h * group + g])


@njit(cache=True, nogil=True)
def begin(q, k_new, v_new, k_cache, v_cache, slot, store):  # pragma: no cover - compiled
    """Write the row's keys and values at store.. (unless store < 0); returns the output [T,
    heads, dim] and the row's keys and values as the cache holds them (rounded to bf16 for a
    bf16 cache): a tree path reads its nodes' from there, so they weigh as a chain's cached
    ones would."""
    k_own, v_own = np.empty(k_new.shape, np.float32), np.empty(v_new.shape, np.float32)
    for j in range(k_new.shape[0]):
        for h in range(k_new.shape[1]):
            for d in range(k_new.shape[2]):
                key, value = stored_element(k_new[j, h, d], k_cache), stored_element(v_new[j, h, d], v_cache)
                k_own[j, h, d], v_own[j, h, d] = load(key), load(value)
                if store >= 0:
                    row, column = d, (store + j) % TILE
                    if k_cache.itemsize == 2:  # a bf16 cache's pairs of dims
                        row, column = key_slot(d, column)
                    k_cache[slot, h, (store + j) // TILE, row, column] = key
                    v_cache[slot, h, store + j, d] = value
    return np.empty(q.shape, np.float32), k_own, v_own


rows = "float32[:, :, :]"  # rows may be strided views; caches are whole
SIGNATURES = [f"float32[:, :, ::1]({rows}, {rows}, {rows}, {e}[:, :, :, :, ::1], {e}[:, :, :, ::1], int64, "
              "int64, int64[::1], int64[:, ::1], int64[::1], float32)" for e in ELEMENTS]


@njit(SIGNATURES, cache=True, nogil=True)
def attend(q, k_new, v_new, k_cache, v_cache, slot, store, limits, paths, starts,
           scale):  # pragma: no cover - compiled
    """q [T, heads, dim]; k_new, v_new [T, kv_heads, dim]: the row's own keys and values,
    written to the slot at positions store.. first unless store < 0; k_cache [slots,
    kv_heads, L / TILE, dim, TILE] (blocks of TILE keys), v_cache [slots, kv_heads, L, dim + 1] (a
    last column of ones: the normaliser), both fp32 or both bf16 bits (kv.py); limits [T]:
    the slot's keys query j reads; paths [T, E]: the row's own tokens it reads next, a tree
    path (-1: none); starts [T]: the first cached key query j reads (0, or where its sliding
    window begins). Returns [T, heads, dim]. A lane is one query head."""
    (out, k_own, v_own), widest = begin(q, k_new, v_new, k_cache, v_cache, slot, store), limits.max()
    lanes = q.shape[0] * q.shape[1] // k_new.shape[1]
    for h in range(k_new.shape[1]):
        head(q, k_own, v_own, k_cache[slot, h], v_cache[slot, h], h, 0, lanes, limits, paths, starts, widest,
             scale, out)
    return out


@njit(cache=True, nogil=True)
def splits(offsets, paths, group, kv_heads, dim, threads):  # pragma: no cover - compiled
    """Whether `attend_split` suits these rows: fewer (row, kv head) items than threads (a decode
    step of a model with one kv head), each of one token whose lanes fit a register tile, no
    tree, whole tiles of columns. Three items on two threads measured 6-25% slower split than
    dealt whole: the passes' cost outweighs the idle third."""
    tokens = offsets[1:] - offsets[:-1]
    tree = paths.size > 0 and paths.max() >= 0
    return (threads > 1 and (offsets.shape[0] - 1) * kv_heads < threads and dim % TILE == 0 and not tree
            and tokens.min() == tokens.max() and tokens[0] * group <= SPLIT_LANES)


@njit(cache=True, nogil=True, inline="always")
def _part(lo, hi, part, parts, unit):  # pragma: no cover - compiled
    """The part-th of `parts` slices of lo .. hi, cut at multiples of `unit` (so a part's keys
    start and end on the cache's blocks, but for lo and hi)."""
    base = lo // unit * unit
    step = -(-(hi - base) // parts // unit) * unit
    return min(hi, max(lo, base + part * step)), min(hi, max(lo, base + (part + 1) * step))


@njit(cache=True, nogil=True, parallel=True, error_model="numpy")  # as lane_finish
def attend_split(q, k_own, v_own, k_cache, v_cache, slots, offsets, limits, starts, scale,
                 threads):  # pragma: no cover - compiled
    """`attend_packed` for rows that `splits` suits, in three passes that each cut every (row,
    kv head) item across the `threads` threads: its keys for the scores (a score is its own
    sum, whoever computes the others), its lanes for their weights (lane_weights), its columns
    for the weighted sums and their division (a column's sum runs over the keys in order). A
    lane's bits are `head`'s."""
    heads, dim, kv_heads = q.shape[1], q.shape[2], k_own.shape[1]
    group, items = heads // kv_heads, (offsets.shape[0] - 1) * kv_heads
    lanes = (offsets[1] - offsets[0]) * group
    qs = np.empty((items, lanes, dim), np.float32)
    counts, begins = np.empty((items, lanes), np.int64), np.empty((items, lanes), np.int64)
    los = np.empty(items, np.int64)  # keys before every lane's window: not read (as `head`)
    for i in range(items):
        r, h = i // kv_heads, i % kv_heads
        for x in range(lanes):
            j = offsets[r] + x // group
            counts[i, x], begins[i, x] = limits[j], starts[j]
            for d in range(dim):
                qs[i, x, d] = pair_operand(q[j, h * group + x % group, d] * scale, k_cache)
        los[i] = min(begins[i].min(), counts[i].max()) // 4 * 4
    w = np.empty((items, lanes, limits.max() + TILE), np.float32)  # room for the last block's tile
    acc, totals = np.empty((items, lanes, dim), np.float32), np.empty((items, lanes), np.float32)
    out, no_path = np.empty(q.shape, np.float32), np.empty(0, np.int64)
    for t in prange(threads):
        for i in range(items):
            a, b = _part(los[i], counts[i].max(), t, threads, KEY_BLOCK)
            scores(k_cache[slots[i // kv_heads], i % kv_heads], qs[i], w[i], a, b)
    for t in prange(threads):
        for n in range(t, items * lanes, threads):
            i, x = n // lanes, n % lanes
            h = i % kv_heads
            totals[i, x] = lane_weights(w[i], qs[i], x, begins[i, x], counts[i, x], no_path, k_own, h,
                                        k_cache)
    for t in prange(threads):
        for i in range(items):
            r, h = i // kv_heads, i % kv_heads
            c0, c1 = _part(0, dim, t, threads, TILE)
            weighted_sums(v_cache[slots[r], h], w[i], acc[i], los[i], counts[i], c0, c1)
            for x in range(lanes):
                j, g = offsets[r] + x // group, h * group + x % group
                for c in range(c0, c1):
                    out[j, g, c] = acc[i, x, c] / totals[i, x]
    return out


@njit(cache=True, nogil=True, parallel=True)
def attend_packed(q, k_own, v_own, k_cache, v_cache, slots, offsets, limits, paths, starts, scale,
                  threads):  # pragma: no cover - compiled
    """`attend` for the packed rows of a forward, after `begin` stored each one's keys: q [T,
    heads, dim], k_own, v_own [T, kv_heads, dim] as `begin` returns them, row r's tokens
    offsets[r] .. offsets[r + 1] - 1 in slot slots[r]; every row's work items on numba's
    threads at once (`work_items`, for `threads` threads: numba's count, numba_ops.numba_threads),
    or `attend_split`'s passes where those items would leave a thread idle. A lane's bits do not
    depend on its item or thread."""
    group, kv_heads = q.shape[1] // k_own.shape[1], k_own.shape[1]
    if splits(offsets, paths, group, kv_heads, q.shape[2], threads):
        return attend_split(q, k_own, v_own, k_cache, v_cache, slots, offsets, limits, starts, scale, threads)
    out = np.empty(q.shape, np.float32)
    table, items = work_items(offsets, limits, q.shape[1], k_own.shape[1], threads)
    for t in prange(items.shape[0]):
        for n in range(items.shape[1]):
            i = items[t, n]
            if i < 0:
                break
            r, h = table[i, 0], table[i, 1]
            a, b = offsets[r], offsets[r + 1]
            head(q[a:b], k_own[a:b], v_own[a:b], k_cache[slots[r], h], v_cache[slots[r], h], h, table[i, 2],
                 table[i, 3], limits[a:b], paths[a:b], starts[a:b], limits[a:b].max(), scale, out[a:b])
    return out


@njit([s[:-1] + ", int64)" for s in SIGNATURES], cache=True, nogil=True)
def attend_parallel(q, k_new, v_new, k_cache, v_cache, slot, store, limits, paths, starts, scale,
                    threads):  # pragma: no cover
    """`attend` on numba's `threads` threads: one row's `attend_packed`, the same bits (a lane's
    do not depend on the lanes that share its pass)."""
    _, k_own, v_own = begin(q, k_new, v_new, k_cache, v_cache, slot, store)
    slots, offsets = np.full(1, slot, np.int64), np.array([0, q.shape[0]], np.int64)
    return attend_packed(q, k_own, v_own, k_cache, v_cache, slots, offsets, limits, paths, starts, scale,
                         threads)


@njit(cache=True, nogil=True)
def rotate_attend(qkv, cos, signed_sin, heads, kv_heads, k_cache, v_cache, slot, store, limits, paths, starts,
                  scale):  # pragma: no cover - compiled
    """split_rotate, attend and the cast of its output to bf16 in one call, for one chain row:
    qkv bf16 bits [T, (heads + 2 kv_heads) * dim] -> bf16 bits [T, heads * dim]. The same
    functions as the three separate steps, so the same bits."""
    q, k, v = split_rotate(qkv, cos, signed_sin, heads, kv_heads)
    return bf16_rows(attend(q, k, v, k_cache, v_cache, slot, store, limits, paths, starts, scale))


@njit(cache=True, nogil=True)
def rotate_attend_parallel(qkv, cos, signed_sin, heads, kv_heads, k_cache, v_cache, slot, store, limits,
                           paths, starts, scale, threads):  # pragma: no cover - compiled
    """`rotate_attend` on numba's threads (attend_parallel)."""
    q, k, v = split_rotate(qkv, cos, signed_sin, heads, kv_heads)
    return bf16_rows(attend_parallel(q, k, v, k_cache, v_cache, slot, store, limits, paths, starts, scale,
                                     threads))


@njit(cache=True, nogil=True)
def norm_rotate_attend(qkv, cos, signed_sin, heads, kv_heads, q_weight, k_weight, eps, k_cache, v_cache,
                       slot, store, limits, paths, starts, scale):  # pragma: no cover - compiled
    """split_norm_rotate and attend in one call, for one chain row: qkv fp32 [T, (heads + 2
    kv_heads) * dim] -> fp32 [T, heads * dim]. The same functions as the two steps, so the
    same bits."""
    q, k, v = split_norm_rotate(qkv, cos, signed_sin, heads, kv_heads, q_weight, k_weight, eps)
    out = attend(q, k, v, k_cache, v_cache, slot, store, limits, paths, starts, scale)
    return out.reshape(out.shape[0], out.shape[1] * out.shape[2])


@njit(cache=True, nogil=True)
def norm_rotate_attend_parallel(qkv, cos, signed_sin, heads, kv_heads, q_weight, k_weight, eps, k_cache,
                                v_cache, slot, store, limits, paths, starts, scale,
                                threads):  # pragma: no cover - compiled
    """`norm_rotate_attend` on numba's threads (attend_parallel)."""
    q, k, v = split_norm_rotate(qkv, cos, signed_sin, heads, kv_heads, q_weight, k_weight, eps)
    out = attend_parallel(q, k, v, k_cache, v_cache, slot, store, limits, paths, starts, scale, threads)
    return out.reshape(out.shape[0], out.shape[1] * out.shape[2])
