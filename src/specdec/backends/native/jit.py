"""The native backend's numba kernels (attention, RMSNorm): imported on first use, as it
imports numba, compiled once and cached on disk. jit_ops.py says when they run and wraps
them for tensors; attention.py states the attention's contract."""

from __future__ import annotations

import numpy as np
from numba import njit, prange

LOG2E = np.float32(1.4426950408889634)
LN2_HI = np.float32(0.693145751953125)  # ln 2 split so that k * LN2_HI is exact (Cody-Waite)
LN2_LO = np.float32(1.4286067653302226e-06)
EXP_FLOOR = np.float32(-87.0)  # exp of less is below float32's normal range: weighs ~1e-38

vector, matrix = "float32[::1]", "float32[:, ::1]"  # numba signatures


@njit(f"void({vector}, int64, {vector}, int32[::1])", cache=True, nogil=True)
def exp_nonpositive(s, count, w, bits):  # pragma: no cover - compiled
    """w[i] = exp(s[i]) for i < count, s <= 0: 2^k times a degree-7 polynomial of the
    reduced argument, the power of two assembled from its bits."""
    for i in range(count):
        x = max(s[i], EXP_FLOOR)
        k = np.floor(x * LOG2E + np.float32(0.5))
        r = (x - k * LN2_HI) - k * LN2_LO
        p = np.float32(1.0 / 5040)
        p = p * r + np.float32(1.0 / 720)
        p = p * r + np.float32(1.0 / 120)
        p = p * r + np.float32(1.0 / 24)
        p = p * r + np.float32(1.0 / 6)
        p = p * r + np.float32(0.5)
        p = p * r + np.float32(1.0)
        w[i] = p * r + np.float32(1.0)
        bits[i] = (np.int32(k) + np.int32(127)) << np.int32(23)
    scale = bits.view(np.float32)
    for i in range(count):
        w[i] = w[i] * scale[i]


@njit(f"void({matrix}, {matrix}, {matrix}, int64)", cache=True, nogil=True)
def scores(keys_t, qs, s, count):  # pragma: no cover - compiled
    """s[r, i] = sum over d, in order, of qs[r, d] * keys_t[d, i] for i < count. Four
    dims per pass over the scores (unroll and jam): the same roundings, a quarter of the
    loads and stores."""
    lanes, dim = qs.shape
    for r in range(lanes):
        for i in range(count):
            s[r, i] = 0
    d = 0
    while d + 4 <= dim:
        k0, k1, k2, k3 = keys_t[d], keys_t[d + 1], keys_t[d + 2], keys_t[d + 3]
        for r in range(lanes):
            q0, q1, q2, q3 = qs[r, d], qs[r, d + 1], qs[r, d + 2], qs[r, d + 3]
            row = s[r]
            for i in range(count):
                row[i] = (((row[i] + q0 * k0[i]) + q1 * k1[i]) + q2 * k2[i]) + q3 * k3[i]
        d += 4
    for rest in range(d, dim):
        for r in range(lanes):
            qd, row, kd = qs[r, rest], s[r], keys_t[rest]
            for i in range(count):
                row[i] += qd * kd[i]


@njit(f"void({matrix}, {vector}, {vector}, int64)", cache=True, nogil=True)
def weighted_sum(values, w, acc, count):  # pragma: no cover - compiled
    """acc[c] += sum over i < count, in order, of w[i] * values[i, c]; four keys per pass."""
    columns = values.shape[1]
    i = 0
    while i + 4 <= count:
        v0, v1, v2, v3 = values[i], values[i + 1], values[i + 2], values[i + 3]
        w0, w1, w2, w3 = w[i], w[i + 1], w[i + 2], w[i + 3]
        for c in range(columns):
            acc[c] = (((acc[c] + w0 * v0[c]) + w1 * v1[c]) + w2 * v2[c]) + w3 * v3[c]
        i += 4
    for rest in range(i, count):
        wi, vi = w[rest], values[rest]
        for c in range(columns):
            acc[c] += wi * vi[c]


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
def lane(s, w, bits, acc, qs, tops, r, n, path, k_new, v_new, values, h, out):  # pragma: no cover - compiled
    """One query head (lane r) from its scores over the n cached keys: its path's own keys
    (a tree), the softmax's weights, and weights @ [values | 1] -> out [dim]."""
    dim, extra = out.shape[0], path.shape[0]
    for e in range(extra):  # the tree's own keys: the same sums in the same order
        node, x = path[e], np.float32(0)
        for d in range(dim):
            x += qs[r, d] * k_new[node, h, d]
        s[r, n + e] = x
    top = largest(s[r], n + extra, tops)
    for i in range(n + extra):
        s[r, i] -= top
    exp_nonpositive(s[r], n + extra, w[r], bits[r])
    for c in range(acc.shape[1]):
        acc[r, c] = 0
    weighted_sum(values, w[r], acc[r], n)
    for e in range(extra):
        node, wi = path[e], w[r, n + e]
        for c in range(dim):
            acc[r, c] += wi * v_new[node, h, c]
        acc[r, dim] += wi * np.float32(1.0)
    for d in range(dim):
        out[d] = acc[r, d] / acc[r, dim]


@njit(cache=True, nogil=True)
def head(q, k_new, v_new, keys_t, values, h, limits, paths, widest, scale, out):  # pragma: no cover - compiled
    """The lanes of kv head h: their scores share the passes over its keys_t [dim, L] and
    values [L, dim + 1]; each lane then runs on its own."""
    t, dim, group = q.shape[0], q.shape[2], q.shape[1] // k_new.shape[1]
    lanes = t * group
    s = np.empty((lanes, widest + paths.shape[1]), np.float32)
    w = np.empty_like(s)
    bits = np.empty(s.shape, np.int32)
    acc = np.empty((lanes, values.shape[1]), np.float32)
    qs = np.empty((lanes, dim), np.float32)
    tops = np.empty(16, np.float32)
    for j in range(t):
        for g in range(group):
            for d in range(dim):
                qs[j * group + g, d] = q[j, h * group + g, d] * scale
    scores(keys_t, qs, s, widest)  # a lane ignores the keys past its limit
    for j in range(t):
        extra = 0
        while extra < paths.shape[1] and paths[j, extra] >= 0:
            extra += 1
        for g in range(group):
            lane(s, w, bits, acc, qs, tops, j * group + g, limits[j], paths[j, :extra], k_new, v_new, values, h,
                 out[j, h * group + g])  # fmt: skip


@njit(cache=True, nogil=True)
def begin(q, k_new, v_new, k_cache, v_cache, slot, store):  # pragma: no cover - compiled
    """Write the row's keys and values at store.. (unless store < 0); the output [T, heads, dim]."""
    if store >= 0:
        for j in range(k_new.shape[0]):
            for h in range(k_new.shape[1]):
                for d in range(k_new.shape[2]):
                    k_cache[slot, h, d, store + j] = k_new[j, h, d]
                    v_cache[slot, h, store + j, d] = v_new[j, h, d]
    return np.empty(q.shape, np.float32)


rows, cache = "float32[:, :, :]", "float32[:, :, :, ::1]"  # rows may be strided views; caches are whole
SIGNATURE = f"float32[:, :, ::1]({rows}, {rows}, {rows}, {cache}, {cache}, int64, int64, int64[::1], int64[:, ::1], float32)"


@njit(SIGNATURE, cache=True, nogil=True)
def attend(q, k_new, v_new, k_cache, v_cache, slot, store, limits, paths, scale):  # pragma: no cover - compiled
    """q [T, heads, dim]; k_new, v_new [T, kv_heads, dim]: the row's own keys and values,
    written to the slot at positions store.. first unless store < 0; k_cache [slots,
    kv_heads, dim, L] (keys along the last axis), v_cache [slots, kv_heads, L, dim + 1] (a
    last column of ones: the normaliser); limits [T]: the slot's keys query j reads;
    paths [T, E]: the row's own tokens it reads next, a tree path (-1: none).
    Returns [T, heads, dim]. A lane is one query head."""
    out, widest = begin(q, k_new, v_new, k_cache, v_cache, slot, store), limits.max()
    for h in range(k_new.shape[1]):
        head(q, k_new, v_new, k_cache[slot, h], v_cache[slot, h], h, limits, paths, widest, scale, out)
    return out


@njit(SIGNATURE, cache=True, nogil=True, parallel=True)
def attend_parallel(q, k_new, v_new, k_cache, v_cache, slot, store, limits, paths, scale):  # pragma: no cover
    """`attend` with its kv heads on numba's threads: the same bits (heads share nothing)."""
    out, widest = begin(q, k_new, v_new, k_cache, v_cache, slot, store), limits.max()
    for h in prange(k_new.shape[1]):
        head(q, k_new, v_new, k_cache[slot, h], v_cache[slot, h], h, limits, paths, widest, scale, out)
    return out


@njit("void(uint32[::1], uint16[::1])", cache=True, nogil=True)
def to_bf16_bits(bits, out):  # pragma: no cover - compiled
    """fp32 bits -> bf16 bits rounded to nearest even, as torch's cast (NaN stays NaN)."""
    for i in range(bits.shape[0]):
        b = bits[i]
        rounded = (b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
        quiet = (b >> np.uint32(16)) | np.uint32(0x40)
        out[i] = np.uint16(quiet if (b & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000) else rounded)


@njit("uint16[:, ::1](float32[:, ::1], float32[::1], float32)", cache=True, nogil=True)
def rms_norm_bf16(x, weight, eps):  # pragma: no cover - compiled
    """x [N, hidden] fp32 -> RMSNorm(x) * weight as bf16 bits [N, hidden] (rounded to nearest
    even, as torch's cast), each row on its own: the sum of squares in 16 running partial sums
    added in a fixed order, so a row's bits do not depend on the other rows. One call for what
    F.rms_norm and a cast take several ops to do."""
    rows, hidden = x.shape
    out = np.empty((rows, hidden), np.uint16)
    y = np.empty(hidden, np.float32)
    bits = y.view(np.uint32)
    partial = np.empty(16, np.float32)
    body = hidden - hidden % 16
    for r in range(rows):
        for lane in range(16):
            partial[lane] = 0
        for i in range(0, body, 16):
            for lane in range(16):
                partial[lane] += x[r, i + lane] * x[r, i + lane]
        total = np.float32(0)
        for lane in range(16):
            total += partial[lane]
        for i in range(body, hidden):
            total += x[r, i] * x[r, i]
        inv = np.float32(1) / np.sqrt(total / np.float32(hidden) + eps)
        for i in range(hidden):
            y[i] = (x[r, i] * inv) * weight[i]
        to_bf16_bits(bits, out[r])
    return out


@njit("UniTuple(float32[:, :, ::1], 3)(uint16[:, :], float32[:, :, ::1], float32[:, :, ::1], int64, int64)",
      cache=True, nogil=True)  # fmt: skip
def split_rotate(qkv, cos, signed_sin, heads, kv_heads):  # pragma: no cover - compiled
    """The fused q|k|v projection as bf16 bits [N, (heads + 2 kv_heads) * dim] -> q [N, heads,
    dim], k and v [N, kv_heads, dim] in fp32, q and k rotated: x * cos + roll(x, dim / 2) *
    signed_sin, each product and the sum rounded as PyTorch's three ops round them (the same
    bits as layer.rope). cos, signed_sin: [N, 1, dim]."""
    rows, dim = qkv.shape[0], cos.shape[2]
    half = dim // 2
    q = np.empty((rows, heads, dim), np.float32)
    k = np.empty((rows, kv_heads, dim), np.float32)
    v = np.empty((rows, kv_heads, dim), np.float32)
    bits = np.empty(dim, np.uint32)
    x = bits.view(np.float32)
    for r in range(rows):
        for h in range(heads + 2 * kv_heads):
            for d in range(dim):
                bits[d] = np.uint32(qkv[r, h * dim + d]) << np.uint32(16)  # bf16 -> fp32 is exact
            if h >= heads + kv_heads:
                for d in range(dim):
                    v[r, h - heads - kv_heads, d] = x[d]
                continue
            out = q[r, h] if h < heads else k[r, h - heads]
            for d in range(half):
                out[d] = x[d] * cos[r, 0, d] + x[d + half] * signed_sin[r, 0, d]
            for d in range(half, dim):
                out[d] = x[d] * cos[r, 0, d] + x[d - half] * signed_sin[r, 0, d]
    return q, k, v


@njit("uint16[:, ::1](uint16[:, ::1])", cache=True, nogil=True)
def silu_mul_bf16(gate_up):  # pragma: no cover - compiled
    """SwiGLU from the fused gate|up projection as bf16 bits [N, 2 I]: silu(gate) * up in
    fp32, rounded once to bf16 bits [N, I]. exp as in exp_nonpositive, of -|g|."""
    rows, inner = gate_up.shape[0], gate_up.shape[1] // 2
    out = np.empty((rows, inner), np.uint16)
    bits = np.empty(2 * inner, np.uint32)
    x = bits.view(np.float32)
    a = np.empty(inner, np.float32)
    e = np.empty(inner, np.float32)
    e_bits = np.empty(inner, np.int32)
    y = np.empty(inner, np.float32)
    y_bits = y.view(np.uint32)
    for r in range(rows):
        for i in range(2 * inner):
            bits[i] = np.uint32(gate_up[r, i]) << np.uint32(16)  # bf16 -> fp32 is exact
        for i in range(inner):
            a[i] = -abs(x[i])
        exp_nonpositive(a, inner, e, e_bits)  # exp(-|g|) (apart: an in-place call would not vectorise)
        for i in range(inner):  # sigmoid(g) = 1 / (1 + e) for g >= 0, e / (1 + e) below; no branch
            numerator = np.float32(1) if x[i] >= 0 else e[i]
            y[i] = (x[i] * (numerator / (np.float32(1) + e[i]))) * x[inner + i]
        to_bf16_bits(y_bits, out[r])
    return out
