"""numba kernels for the row-wise parts of a decoder layer: RMSNorm (into fp32 or bf16), the
residual add joined to the next norm, the rotary embedding (with qwen3's and gemma3's q/k
norms), SwiGLU, the rounding to bf16, and the exp the activations share with softmax.py.
Imported on first use; compiled once, cached on disk. numba compiles without fastmath, so
every rounding happens where the code says, as PyTorch's ops round (the tests compare them bit
for bit); each row is computed on its own."""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from specdec.backends.native.kernels.jit.kv import encode

LOG2E = np.float32(1.4426950408889634)
LN2_HI = np.float32(0.693145751953125)  # ln 2 split so that k * LN2_HI is exact (Cody-Waite)
LN2_LO = np.float32(1.4286067653302226e-06)
EXP_FLOOR = np.float32(-87.0)  # exp of less is below float32's normal range: weighs ~1e-38

vector, matrix = "float32[::1]", "float32[:, ::1]"  # numba signatures


@intrinsic
def as_float(typingctx, bits):
    """int32 bits -> the float32 they spell (a numba scalar has no bit view)."""
    if bits != types.int32:
        return None
    return types.float32(bits), lambda context, b, sig, args: b.bitcast(args[0], ir.FloatType())


@njit(cache=True, nogil=True, inline="always")
def exp_terms(x):  # pragma: no cover - compiled
    """exp(x) for x <= 0 as (a degree-7 polynomial of the reduced argument, 2^k as its bits)."""
    x = max(x, EXP_FLOOR)
    k = np.floor(x * LOG2E + np.float32(0.5))
    r = (x - k * LN2_HI) - k * LN2_LO
    p = np.float32(1.0 / 5040)
    p = p * r + np.float32(1.0 / 720)
    p = p * r + np.float32(1.0 / 120)
    p = p * r + np.float32(1.0 / 24)
    p = p * r + np.float32(1.0 / 6)
    p = p * r + np.float32(0.5)
    p = p * r + np.float32(1.0)
    return p * r + np.float32(1.0), (np.int32(k) + np.int32(127)) << np.int32(23)


@njit(f"void({vector}, int64, {vector}, int32[::1])", cache=True, nogil=True)
def exp_nonpositive(s, count, w, bits):  # pragma: no cover - compiled
    """w[i] = exp(s[i]) for i < count, s <= 0: 2^k times a degree-7 polynomial of the
    reduced argument, the power of two assembled from its bits."""
    for i in range(count):
        w[i], bits[i] = exp_terms(s[i])
    scale = bits.view(np.float32)
    for i in range(count):
        w[i] = w[i] * scale[i]


@njit("void(float32[::1], uint16[::1])", cache=True, nogil=True)
def to_bf16_bits(values, out):  # pragma: no cover - compiled
    """fp32 -> bf16 bits rounded to nearest even, as torch's cast (NaN stays NaN): kv.encode."""
    for i in range(values.shape[0]):
        out[i] = encode(values[i], out)


@njit(cache=True, nogil=True)
def inverse_rms(x, eps, partial):  # pragma: no cover - compiled
    """1 / sqrt(mean(x^2) + eps) for one row x [hidden]: the sum of squares in 16 running
    partial sums added in a fixed order, so a row's bits do not depend on other rows.
    partial [16] is scratch."""
    hidden = x.shape[0]
    body = hidden - hidden % 16
    for lane in range(16):
        partial[lane] = 0
    for i in range(0, body, 16):
        for lane in range(16):
            partial[lane] += x[i + lane] * x[i + lane]
    total = np.float32(0)
    for lane in range(16):
        total += partial[lane]
    for i in range(body, hidden):
        total += x[i] * x[i]
    return np.float32(1) / np.sqrt(total / np.float32(hidden) + eps)


@njit(cache=True, nogil=True)
def norm_row(x, weight, eps, y, partial, out):  # pragma: no cover - compiled
    """out = bf16 bits of RMSNorm(x) * weight for one row x [hidden] (inverse_rms). y [hidden]
    float32 is scratch."""
    inv = inverse_rms(x, eps, partial)
    for i in range(x.shape[0]):
        y[i] = (x[i] * inv) * weight[i]
    to_bf16_bits(y, out)


@njit("float32[:, ::1](float32[:, ::1], float32[::1], float32)", cache=True, nogil=True)
def rms_norm_f32(x, weight, eps):  # pragma: no cover - compiled
    """x [N, hidden] fp32 -> RMSNorm(x) * weight [N, hidden] fp32, each row on its own
    (inverse_rms): one call for F.rms_norm's half-dozen ops, which cost their dispatch at
    this width."""
    rows, hidden = x.shape
    out, partial = np.empty((rows, hidden), np.float32), np.empty(16, np.float32)
    for r in range(rows):
        inv = inverse_rms(x[r], eps, partial)
        for i in range(hidden):
            out[r, i] = (x[r, i] * inv) * weight[i]
    return out


@njit("uint16[:, ::1](float32[:, ::1], float32[::1], float32)", cache=True, nogil=True)
def rms_norm_bf16(x, weight, eps):  # pragma: no cover - compiled
    """x [N, hidden] fp32 -> RMSNorm(x) * weight as bf16 bits [N, hidden] (rounded to nearest
    even, as torch's cast), each row on its own (norm_row). One call for what F.rms_norm and
    a cast take several ops to do."""
    rows, hidden = x.shape
    out = np.empty((rows, hidden), np.uint16)
    y, partial = np.empty(hidden, np.float32), np.empty(16, np.float32)
    for r in range(rows):
        norm_row(x[r], weight, eps, y, partial, out[r])
    return out


@njit("Tuple((float32[:, ::1], uint16[:, ::1]))(float32[:, ::1], uint16[:, ::1], float32[::1], float32)",
      cache=True, nogil=True)
def add_rms_norm_bf16(x, delta, weight, eps):  # pragma: no cover - compiled
    """The residual add and the next norm in one call: x [N, hidden] fp32 plus delta as bf16
    bits (widened exactly, then one fp32 add: the bits of PyTorch's promoting add) -> the sum
    and rms_norm_bf16 of it."""
    rows, hidden = x.shape
    total, out = np.empty((rows, hidden), np.float32), np.empty((rows, hidden), np.uint16)
    wide = np.empty(hidden, np.uint32)
    widened = wide.view(np.float32)
    y, partial = np.empty(hidden, np.float32), np.empty(16, np.float32)
    for r in range(rows):
        for i in range(hidden):
            wide[i] = np.uint32(delta[r, i]) << np.uint32(16)  # bf16 -> fp32 is exact
        for i in range(hidden):
            total[r, i] = x[r, i] + widened[i]
        norm_row(total[r], weight, eps, y, partial, out[r])
    return total, out


@njit(cache=True, nogil=True, inline="always")
def rotate(x, cos, signed_sin, out):  # pragma: no cover - compiled
    """out = x * cos + roll(x, dim / 2) * signed_sin for one head [dim], each product and the
    sum rounded as layer.rope's three PyTorch ops round them. Both halves in one loop: an index
    d - half, which numba cannot prove non-negative, kept the loop from vectorising (3x slower)."""
    half = x.shape[0] // 2
    for d in range(half):
        e = d + half
        out[d] = x[d] * cos[d] + x[e] * signed_sin[d]
        out[e] = x[e] * cos[e] + x[d] * signed_sin[e]


@njit("UniTuple(float32[:, :, ::1], 3)(uint16[:, :], float32[:, :, ::1], float32[:, :, ::1], int64, int64)",
      cache=True, nogil=True)
def split_rotate(qkv, cos, signed_sin, heads, kv_heads):  # pragma: no cover - compiled
    """The fused q|k|v projection as bf16 bits [N, (heads + 2 kv_heads) * dim] -> q [N, heads,
    dim], k and v [N, kv_heads, dim] in fp32, q and k rotated: x * cos + roll(x, dim / 2) *
    signed_sin, each product and the sum rounded as PyTorch's three ops round them (the same
    bits as layer.rope). cos, signed_sin: [N, 1, dim]."""
    rows, dim = qkv.shape[0], cos.shape[2]
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
            rotate(x, cos[r, 0], signed_sin[r, 0], q[r, h] if h < heads else k[r, h - heads])
    return q, k, v


@njit("UniTuple(float32[:, :, ::1], 3)(float32[:, ::1], float32[:, :, ::1], float32[:, :, ::1], "
      "int64, int64, float32[::1], float32[::1], float32)", cache=True, nogil=True)
def split_norm_rotate(qkv, cos, signed_sin, heads, kv_heads, q_weight, k_weight,
                      eps):  # pragma: no cover - compiled
    """split_rotate for an fp32 q|k|v projection [N, (heads + 2 kv_heads) * dim], with each head
    of q and k first RMS-normed over dim (inverse_rms) and scaled by q_weight or k_weight [dim]
    where those are not empty (qwen3, gemma3)."""
    rows, dim = qkv.shape[0], cos.shape[2]
    normed = q_weight.shape[0] > 0
    q = np.empty((rows, heads, dim), np.float32)
    k = np.empty((rows, kv_heads, dim), np.float32)
    v = np.empty((rows, kv_heads, dim), np.float32)
    x, partial = np.empty(dim, np.float32), np.empty(16, np.float32)
    for r in range(rows):
        for h in range(heads + 2 * kv_heads):
            src = qkv[r, h * dim : (h + 1) * dim]
            if h >= heads + kv_heads:
                v[r, h - heads - kv_heads] = src
                continue
            if normed:
                weight = q_weight if h < heads else k_weight
                inv = inverse_rms(src, eps, partial)
                for d in range(dim):
                    x[d] = (src[d] * inv) * weight[d]
                src = x
            rotate(src, cos[r, 0], signed_sin[r, 0], q[r, h] if h < heads else k[r, h - heads])
    return q, k, v


@njit("uint16[:, ::1](uint16[:, ::1])", cache=True, nogil=True, error_model="numpy")  # vectorised division
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
    for r in range(rows):
        for i in range(2 * inner):
            bits[i] = np.uint32(gate_up[r, i]) << np.uint32(16)  # bf16 -> fp32 is exact
        for i in range(inner):
            a[i] = -abs(x[i])
        exp_nonpositive(a, inner, e, e_bits)  # exp(-|g|) (apart: an in-place call would not vectorise)
        for i in range(inner):  # sigmoid(g) = 1 / (1 + e) for g >= 0, e / (1 + e) below; no branch
            numerator = np.float32(1) if x[i] >= 0 else e[i]
            y[i] = (x[i] * (numerator / (np.float32(1) + e[i]))) * x[inner + i]
        to_bf16_bits(y, out[r])
    return out


@njit(cache=True, nogil=True)
def bf16_rows(out):  # pragma: no cover - compiled
    """[T, heads, dim] fp32 -> bf16 bits [T, heads * dim], rounded as torch's cast."""
    flat = out.reshape(out.shape[0], out.shape[1] * out.shape[2])
    bits = np.empty(flat.shape, np.uint16)
    for j in range(flat.shape[0]):
        to_bf16_bits(flat[j], bits[j])
    return bits
