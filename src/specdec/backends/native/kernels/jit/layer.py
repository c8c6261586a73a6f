"""A decoder layer whose linears all run on the int8-activation GGUF kernels (Q8_0, Q5_0,
Q5_1, Q4_0, Q4_1, Q6_K, Q5_K, Q4_K), run for the decode rows of a forward (a chain, a token
tree, the chains of a batch of sequences) as one numba call (model/one_call.py wraps it and
says when it runs).

At decode widths a layer's kernels take a few tens of microseconds each, and the Python
around them (tensor conversions, dispatches, one allocation per output) cost about as much
again. Here the same kernels run back to back in compiled code: `decode_layer` calls the
functions the separate path calls (activations.py's quantizers, the matmuls of
jit/tiles16.py and jit/supertiles.py, jit's norms and attention, `glu_mul_f32`) on the same
inputs in the same order, and adds biases and residuals as the separate path's fp32 tensor
adds do, so a row gets the same bits either way. Imported on first use; compiled once,
cached on disk.

A linear is a `group`: (small, parts, bias, width). `small` says whether the parts read
blocks of 32 (Q8_0, Q5_0, Q5_1, Q4_0, Q4_1) or the K-quants' super-blocks; every part of a group
reads that one quantization of the input, as MixedBlockLinear8 does. parts: a tuple of (kind,
tiles, rows, units), each writing its columns side by side (kind: the type's code in
quant_types.py; tiles: its tiles of 16 rows; rows: an [N, 0] array that carries N); bias:
[width] fp32, or empty.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from specdec.backends.native.kernels.jit.activations import quantize_rows, quantize_rows_k
from specdec.backends.native.kernels.jit.attention import attend_packed, begin, norm_rotate_attend
from specdec.backends.native.kernels.jit.norms import exp_nonpositive, rms_norm_f32, split_norm_rotate
from specdec.backends.native.kernels.jit.supertiles import matmul as supertile_matmul
from specdec.backends.native.kernels.jit.tiles16 import matmul as rows16_matmul

GELU_BETA = np.float32(0.7978845608028654)  # sqrt(2 / pi), as PyTorch's tanh approximation
GELU_KAPPA = np.float32(0.044715)


# error_model="numpy": a float division by zero gives IEEE's inf or nan instead of raising, so
# numba emits no check and the loops vectorise (same quotients)
@njit("float32[:, ::1](float32[:, ::1], boolean)", cache=True, nogil=True, error_model="numpy")
def glu_mul_f32(gate_up, gelu):  # pragma: no cover - compiled
    """The activation of gate, times up, from the gate|up projection side by side: fp32 [N, 2 I]
    -> [N, I] fp32, each through one exp (jit.exp_nonpositive) of a non-positive argument.
    - SwiGLU (gelu False): silu(g) = g / (1 + e) for g >= 0, g e / (1 + e) below, e =
      exp(-|g|): jit.silu_mul_bf16's arithmetic without the rounding to bf16;
    - GeGLU (gemma3's gelu_pytorch_tanh): 0.5 g (1 + tanh(u)), u = sqrt(2 / pi) (g + 0.044715
      g^3), tanh(|u|) = (1 - e) / (1 + e) with e = exp(-2 |u|)."""
    rows, inner = gate_up.shape[0], gate_up.shape[1] // 2
    out = np.empty((rows, inner), np.float32)
    u, a, e = np.empty(inner, np.float32), np.empty(inner, np.float32), np.empty(inner, np.float32)
    e_bits = np.empty(inner, np.int32)
    for r in range(rows):
        for i in range(inner):
            g = gate_up[r, i]
            if gelu:
                u[i] = GELU_BETA * (g + GELU_KAPPA * (g * g * g))
                a[i] = np.float32(-2) * abs(u[i])
            else:
                a[i] = -abs(g)
        exp_nonpositive(a, inner, e, e_bits)  # (apart: an in-place call would not vectorise)
        for i in range(inner):
            g = gate_up[r, i]
            if gelu:
                t = (np.float32(1) - e[i]) / (np.float32(1) + e[i])
                t = t if u[i] >= 0 else -t
                out[r, i] = ((np.float32(0.5) * g) * (np.float32(1) + t)) * gate_up[r, inner + i]
            else:
                numerator = np.float32(1) if g >= 0 else e[i]
                out[r, i] = (g * (numerator / (np.float32(1) + e[i]))) * gate_up[r, inner + i]
    return out


@njit(cache=True, nogil=True)
def linear(group, x):  # pragma: no cover - compiled
    """x [M, K] fp32 -> [M, width] fp32 through one group (the module docstring)."""
    small, parts, bias, width = group
    m, k = x.shape
    span = 32 if small else 256
    xq, xs = np.empty((m, k), np.int8), np.empty((m, k // span), np.float32)
    xsum, xsum4 = np.empty((m, k // 32), np.int32), np.empty((m, k // 4), np.int32)
    if small:
        quantize_rows(x, xq, xs, xsum, xsum4)
    else:
        quantize_rows_k(x, xq, xs, xsum, xsum4)
    y = np.empty((m, width), np.float32)
    column = 0
    for kind, tiles, rows, units in parts:
        if small:  # tiles of 16 rows: rows [N, 0] carries N
            rows16_matmul(kind, tiles, rows.shape[0], units, xq, xs, xsum, y, column)
        else:
            supertile_matmul(kind, tiles, rows.shape[0], units, xq, xs, xsum, xsum4, y, column)
        column += rows.shape[0]
    if bias.shape[0]:
        for r in range(m):
            for j in range(width):
                y[r, j] = y[r, j] + bias[j]
    return y


@njit(cache=True, nogil=True, inline="always")
def _add(x, delta):  # pragma: no cover - compiled
    out = np.empty_like(x)
    for r in range(x.shape[0]):
        for j in range(x.shape[1]):
            out[r, j] = x[r, j] + delta[r, j]
    return out


@njit(cache=True, nogil=True)
def attend_rows(mixed, rope, heads, kv_heads, q_norm, k_norm, eps, cache, rows, scale,
                parallel):  # pragma: no cover - compiled
    """Each row's rotation and attention (jit/attention.norm_rotate_attend) on its own tokens of
    the fp32 q|k|v projection mixed [T, (heads + 2 kv_heads) * dim] -> [T, heads * dim]. rows:
    (slots [R], stores [R], offsets [R + 1], limits [T], paths [T, E], starts [T]), as
    kernels/attention.kernel_rows packs them. parallel: (work, threads): where the rows' keys
    times their queries' heads reach `work`, every row's work shares numba's `threads` threads
    (jit/attention.attend_packed); the same bits either way."""
    cos, sin = rope
    k_cache, v_cache = cache
    slots, stores, offsets, limits, paths, starts = rows
    out = np.empty((mixed.shape[0], heads * cos.shape[2]), np.float32)
    work = 0
    for r in range(slots.shape[0]):
        work += limits[offsets[r] : offsets[r + 1]].max() * (offsets[r + 1] - offsets[r]) * heads
    if work < parallel[0]:
        for r in range(slots.shape[0]):
            a, b = offsets[r], offsets[r + 1]
            out[a:b] = norm_rotate_attend(mixed[a:b], cos[a:b], sin[a:b], heads, kv_heads, q_norm, k_norm,
                                          eps, k_cache, v_cache, slots[r], stores[r], limits[a:b],
                                          paths[a:b], starts[a:b], scale)
        return out
    q, k, v = split_norm_rotate(mixed, cos, sin, heads, kv_heads, q_norm, k_norm, eps)
    k_own, v_own = np.empty(k.shape, np.float32), np.empty(v.shape, np.float32)
    for r in range(slots.shape[0]):
        a, b = offsets[r], offsets[r + 1]
        _, k_own[a:b], v_own[a:b] = begin(q[a:b], k[a:b], v[a:b], k_cache, v_cache, slots[r], stores[r])
    packed = attend_packed(q, k_own, v_own, k_cache, v_cache, slots, offsets, limits, paths, starts, scale,
                           parallel[1])
    return packed.reshape(packed.shape[0], packed.shape[1] * packed.shape[2])


@njit(cache=True, nogil=True)
def decode_layer(x, pending, norms, eps, qkv, o, gate_up, down, rope, heads, kv_heads, cache, rows,
                 scale, parallel, gelu):  # fmt: skip  # pragma: no cover - compiled
    """One layer on x [T, hidden] + pending (the previous layer's output not yet added; [0,
    hidden]: none) for the decode rows of a forward (chains of several sequences, or a token
    tree) -> (its input with pending added, its output): the separate path's
    `DecoderLayer.forward_open`. norms: (attn_norm, mlp_norm, q_norm, k_norm, post_attn_norm,
    post_mlp_norm), the last four empty where the layer has none; rope: (cos, signed_sin) [T,
    1, dim]; cache: (k_cache, v_cache); rows and parallel: as `attend_rows` takes them; gelu: GeGLU
    (gemma3), else SwiGLU."""
    attn_norm, mlp_norm, q_norm, k_norm, post_attn_norm, post_mlp_norm = norms
    if pending.shape[0]:
        x = _add(x, pending)
    mixed = linear(qkv, rms_norm_f32(x, attn_norm, eps))
    attn = attend_rows(mixed, rope, heads, kv_heads, q_norm, k_norm, eps, cache, rows, scale, parallel)
    delta = linear(o, attn)
    if post_attn_norm.shape[0]:
        delta = rms_norm_f32(delta, post_attn_norm, eps)
    x = _add(x, delta)
    delta = linear(down, glu_mul_f32(linear(gate_up, rms_norm_f32(x, mlp_norm, eps)), gelu))
    if post_mlp_norm.shape[0]:
        delta = rms_norm_f32(delta, post_mlp_norm, eps)
    return x, delta
