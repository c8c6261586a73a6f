"""The native backend's numba attention: each query on its own over its slot's keys and, for a
token tree, its path's nodes (kernels/attention.py states the contract it shares with the
PyTorch routine; numba_ops.py says when it runs and wraps it for tensors). The chain row's
rotation and attention in one call join norms.py's rotation to it. Imported on first use;
compiled once, cached on disk."""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from specdec.backends.native.kernels.jit.attention_tiles import (
    TILE,
    score_tiles1,
    score_tiles3,
    score_tiles4,
    sum_tiles3,
    sum_tiles4,
)
from specdec.backends.native.kernels.jit.kv import encode, load
from specdec.backends.native.kernels.jit.norms import (
    bf16_rows,
    exp_nonpositive,
    split_norm_rotate,
    split_rotate,
)

LOWEST = np.float32(-3.4e38)  # the score of a key outside a sliding window: never a maximum

vector, matrix = "float32[::1]", "float32[:, ::1]"  # numba signatures
ELEMENTS = ("float32", "uint16")  # a cache's elements: fp32, or bf16 bits (kv.py)


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
    group of 3 has three lanes: a fourth, idle lane cost a quarter of the arithmetic)."""
    lanes, dim = qs.shape
    end = lo + (count - lo) // TILE * TILE
    for r in range(lanes):
        for i in range(end, count):
            s[r, i] = 0
    quads = lanes // 4 * 4
    for r in range(0, quads, 4):
        score_tiles4(keys_t, qs, s, r, lo, end)
        _scores4(keys_t, qs, s, r, end, count)
    if lanes - quads == 3:
        score_tiles3(keys_t, qs, s, quads, lo, end)
        _scores3(keys_t, qs, s, quads, end, count)
    else:
        for r in range(quads, lanes):
            score_tiles1(keys_t, qs, s, r, lo, end)
            _scores1(keys_t, qs, s, r, end, count)


@njit([f"void({e}[:, ::1], {vector}, {vector}, int64, int64)" for e in ELEMENTS], cache=True, nogil=True)
def weighted_sum(values, w, acc, start, count):  # pragma: no cover - compiled
    """acc[c] += sum over start <= i < count, in order, of w[i] * values[i, c]; four keys per
    pass (start is a multiple of four: the passes fall where they would from 0)."""
    columns = values.shape[1]
    i = start
    while i + 4 <= count:
        v0, v1, v2, v3 = values[i], values[i + 1], values[i + 2], values[i + 3]
        w0, w1, w2, w3 = w[i], w[i + 1], w[i + 2], w[i + 3]
        for c in range(columns):
            p0, p1, p2, p3 = load(v0[c]), load(v1[c]), load(v2[c]), load(v3[c])
            acc[c] = (((acc[c] + w0 * p0) + w1 * p1) + w2 * p2) + w3 * p3
        i += 4
    for rest in range(i, count):
        wi, vi = w[rest], values[rest]
        for c in range(columns):
            acc[c] += wi * load(vi[c])


@njit([f"void({e}[:, ::1], {matrix}, {matrix}, int64, int64, int64)" for e in ELEMENTS], cache=True,
      nogil=True)
def weighted_sum4(values, w, acc, r, lo, count):  # pragma: no cover - compiled
    """weighted_sum for lanes r .. r + 3 at once over keys lo .. count - 1 (multiples of four):
    each lane's sums in its own order, while a pass loads the four value rows once for all
    four lanes (the loads, not the multiplies, bound the single-lane loop)."""
    columns = values.shape[1]
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
    columns = values.shape[1]
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


@njit(f"float32({vector}, int64, {vector})", cache=True, nogil=True)
def largest(s, count, tops):  # pragma: no cover - compiled
    """max(s[:count]) (count >= 1) through 16 running maxima: a max is exact in any order,
    and unlike one running maximum this vectorises."""
    for lane in range(16):
        tops[lane] = s[0]
    i = 0
    while i + 16 <= count:
        for lane in range(16):
            tops[lane] = max(tops[lane], s[i + lane])
        i += 16
    top = s[0]
    for lane in range(16):
        top = max(top, tops[lane])
    for rest in range(i, count):
        top = max(top, s[rest])
    return top


@njit(cache=True, nogil=True)
def lane_weights(s, w, bits, qs, tops, r, first, n, path, k_new, h):  # pragma: no cover - compiled
    """Lane r's softmax numerators w[r, :n + E] (E = len(path)) from its scores over the
    cached keys first .. n - 1 and its path's own keys (a tree), less their maximum; keys
    before `first` (outside a sliding window) weigh exactly 0."""
    dim, extra = qs.shape[1], path.shape[0]
    for i in range(first):
        s[r, i] = LOWEST
    for e in range(extra):  # the tree's own keys: the same sums in the same order
        node, x = path[e], np.float32(0)
        for d in range(dim):
            x += qs[r, d] * k_new[node, h, d]
        s[r, n + e] = x
    top = largest(s[r], n + extra, tops)
    for i in range(n + extra):
        s[r, i] -= top
    exp_nonpositive(s[r], n + extra, w[r], bits[r])
    for i in range(first):  # an exact 0: adding 0 * value leaves every later sum's bits as they are
        w[r, i] = 0


@njit(cache=True, nogil=True)
def lane_finish(w, acc, r, n, path, v_new, h, out):  # pragma: no cover - compiled
    """Lane r's output from acc[r] = its weights @ [values | 1] over the cache: its path's own
    values, then the division by the normaliser -> out [dim]."""
    dim = out.shape[0]
    for e in range(path.shape[0]):
        node, wi = path[e], w[r, n + e]
        for c in range(dim):
            acc[r, c] += wi * v_new[node, h, c]
        acc[r, dim] += wi * np.float32(1.0)
    for d in range(dim):
        out[d] = acc[r, d] / acc[r, dim]


@njit(cache=True, nogil=True)
def weighted_sums(values, w, acc, lo, counts):  # pragma: no cover - compiled
    """acc[r] = w[r, :counts[r]] @ values[:counts[r]] for every lane r, from key lo (a multiple
    of four below which every weight is 0: skipping those zero terms leaves the bits as they
    are): four lanes at a time as far as all four have keys (weighted_sum4), each lane on its
    own after that; past the last four, three at a time or one (as `scores`). Where the
    columns before the normaliser's are whole tiles, the shared keys go through sum_tiles."""
    acc[:] = 0
    lanes = acc.shape[0]
    quads = lanes // 4 * 4
    tiles = (values.shape[1] - 1) % TILE == 0  # whole tiles of columns before the normaliser's
    for r in range(0, quads, 4):
        shared = max(lo, min(counts[r], counts[r + 1], counts[r + 2], counts[r + 3]) // 4 * 4)
        if tiles:
            sum_tiles4(values, w, acc, r, lo, shared)
        else:
            weighted_sum4(values, w, acc, r, lo, shared)
        for x in range(r, r + 4):
            weighted_sum(values, w[x], acc[x], shared, counts[x])
    shared = lo
    if lanes - quads == 3:
        shared = max(lo, min(counts[quads], counts[quads + 1], counts[quads + 2]) // 4 * 4)
        if tiles:
            sum_tiles3(values, w, acc, quads, lo, shared)
        else:
            weighted_sum3(values, w, acc, quads, lo, shared)
    for x in range(quads, lanes):
        weighted_sum(values, w[x], acc[x], shared, counts[x])


@njit(cache=True, nogil=True)
def head(q, k_new, v_new, keys_t, values, h, first, last, limits, paths, starts, widest, scale,
         out):  # pragma: no cover - compiled
    """Lanes first .. last - 1 of kv head h (lane r: query r // group, its head r % group of
    the group): their scores and their weighted sums share the passes over its keys_t
    [dim, L] and values [L, dim + 1]. A lane's bits do not depend on which lanes share them."""
    dim, group = q.shape[2], q.shape[1] // k_new.shape[1]
    lanes = last - first
    s = np.empty((lanes, widest + paths.shape[1]), np.float32)
    w = np.empty_like(s)
    bits = np.empty(s.shape, np.int32)
    acc = np.empty((lanes, values.shape[1]), np.float32)
    qs = np.empty((lanes, dim), np.float32)
    tops = np.empty(16, np.float32)
    counts, extras = np.empty(lanes, np.int64), np.zeros(lanes, np.int64)
    begins = np.empty(lanes, np.int64)
    for x in range(lanes):
        j, g = (first + x) // group, (first + x) % group
        counts[x], begins[x] = limits[j], starts[j]
        while extras[x] < paths.shape[1] and paths[j, extras[x]] >= 0:
            extras[x] += 1
        for d in range(dim):
            qs[x, d] = q[j, h * group + g, d] * scale
    reach = counts.max()  # the keys any of these lanes reads (a prompt's first queries read fewer)
    lo = min(begins[:lanes].min(), reach) // 4 * 4  # keys before every lane's window: not read at all
    scores(keys_t, qs, s, lo, reach)  # a lane ignores the keys past its limit
    for x in range(lanes):
        lane_weights(s, w, bits, qs, tops, x, begins[x], counts[x], paths[(first + x) // group, : extras[x]],
                     k_new, h)
    weighted_sums(values, w, acc, lo, counts)
    for x in range(lanes):
        j, g = (first + x) // group, (first + x) % group
        lane_finish(w, acc, x, counts[x], paths[j, : extras[x]], v_new, h, out[j, h * group + g])


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
                key, value = encode(k_new[j, h, d], k_cache), encode(v_new[j, h, d], v_cache)
                k_own[j, h, d], v_own[j, h, d] = load(key), load(value)
                if store >= 0:
                    k_cache[slot, h, d, store + j] = key
                    v_cache[slot, h, store + j, d] = value
    return np.empty(q.shape, np.float32), k_own, v_own


rows = "float32[:, :, :]"  # rows may be strided views; caches are whole
SIGNATURES = [f"float32[:, :, ::1]({rows}, {rows}, {rows}, {e}[:, :, :, ::1], {e}[:, :, :, ::1], int64, "
              "int64, int64[::1], int64[:, ::1], int64[::1], float32)" for e in ELEMENTS]


@njit(SIGNATURES, cache=True, nogil=True)
def attend(q, k_new, v_new, k_cache, v_cache, slot, store, limits, paths, starts,
           scale):  # pragma: no cover - compiled
    """q [T, heads, dim]; k_new, v_new [T, kv_heads, dim]: the row's own keys and values,
    written to the slot at positions store.. first unless store < 0; k_cache [slots,
    kv_heads, dim, L] (keys along the last axis), v_cache [slots, kv_heads, L, dim + 1] (a
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


@njit(SIGNATURES, cache=True, nogil=True, parallel=True)
def attend_parallel(q, k_new, v_new, k_cache, v_cache, slot, store, limits, paths, starts,
                    scale):  # pragma: no cover
    """`attend` on numba's threads, four lanes of a head per work item: the same bits (a
    lane's do not depend on the lanes that share its pass)."""
    (out, k_own, v_own), widest = begin(q, k_new, v_new, k_cache, v_cache, slot, store), limits.max()
    lanes, kv_heads = q.shape[0] * q.shape[1] // k_new.shape[1], k_new.shape[1]
    quads = -(-lanes // 4)
    for item in prange(kv_heads * quads):  # four lanes of one head per item: even shares of work
        h, first = item // quads, item % quads * 4
        head(q, k_own, v_own, k_cache[slot, h], v_cache[slot, h], h, first, min(first + 4, lanes), limits,
             paths, starts, widest, scale, out)
    return out


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
                           paths, starts, scale):  # pragma: no cover - compiled
    """`rotate_attend` on numba's threads (attend_parallel)."""
    q, k, v = split_rotate(qkv, cos, signed_sin, heads, kv_heads)
    return bf16_rows(attend_parallel(q, k, v, k_cache, v_cache, slot, store, limits, paths, starts, scale))


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
                                v_cache, slot, store, limits, paths, starts,
                                scale):  # pragma: no cover - compiled
    """`norm_rotate_attend` on numba's threads (attend_parallel)."""
    q, k, v = split_norm_rotate(qkv, cos, signed_sin, heads, kv_heads, q_weight, k_weight, eps)
    out = attend_parallel(q, k, v, k_cache, v_cache, slot, store, limits, paths, starts, scale)
    return out.reshape(out.shape[0], out.shape[1] * out.shape[2])


@njit(cache=True, nogil=True)
def work_items(offsets, limits, heads, kv_heads, threads):  # pragma: no cover - compiled
    """The attention of packed rows (offsets [R + 1] of their tokens; limits [T]) cut into work
    items (row, kv head, first lane, last lane), four lanes of a head each, dealt to `threads`
    threads, the dearest first to the least loaded (keys x lanes): items [threads, I], -1 past
    a thread's last. Every row's items in one parallel loop keep both threads busy where a
    row's own (three kv heads, say) would leave one idle a third of the time."""
    group, rows = heads // kv_heads, offsets.shape[0] - 1
    count = 0
    for r in range(rows):
        count += kv_heads * -(-((offsets[r + 1] - offsets[r]) * group) // 4)
    table, cost = np.empty((count, 4), np.int64), np.empty(count, np.int64)
    i = 0
    for r in range(rows):
        lanes, keys = (offsets[r + 1] - offsets[r]) * group, limits[offsets[r] : offsets[r + 1]].max()
        for h in range(kv_heads):
            for first in range(0, lanes, 4):
                table[i, 0], table[i, 1], table[i, 2], table[i, 3] = r, h, first, min(first + 4, lanes)
                cost[i] = (keys + 64) * (table[i, 3] - first)
                i += 1
    items = np.full((threads, count), -1, np.int64)
    filled, load = np.zeros(threads, np.int64), np.zeros(threads, np.int64)
    for i in np.argsort(-cost, kind="mergesort"):
        t = np.argmin(load)
        items[t, filled[t]] = i
        filled[t] += 1
        load[t] += cost[i]
    return table, items


@njit(cache=True, nogil=True, parallel=True)
def attend_packed(q, k_own, v_own, k_cache, v_cache, slots, offsets, limits, paths, starts, scale,
                  threads):  # pragma: no cover - compiled
    """`attend` for the packed rows of a forward, after `begin` stored each one's keys: q [T,
    heads, dim], k_own, v_own [T, kv_heads, dim] as `begin` returns them, row r's tokens
    offsets[r] .. offsets[r + 1] - 1 in slot slots[r]; every row's work items on numba's
    threads at once (`work_items`, for `threads` threads: numba's count, numba_ops.numba_threads).
    A lane's bits do not depend on its item or thread."""
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
