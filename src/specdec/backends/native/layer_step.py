"""A decoder layer of GGUF 8-bit matrices as one numba call (gguf_jit_layer.decode_layer).

`LayerStep.build` says whether a layer qualifies: every linear runs the numba 8-bit kernels
(BlockLinear8 or MixedBlockLinear8, one activation format per linear) and the norms are
fp32 (gemma3's q/k norms and sublayer output norms included). A qualifying layer runs a
forward of one chain row (decode steps, a speculative chain) as one call; batches and
trees take the separate calls. Both compute the same operations on the same kernels, the
activation included (`glu_mul`: the separate path of an fp32 layer with numba's
norms takes them too), so a row's bits do not depend on the path; tests/test_gguf_loader.py
compares them.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from specdec.backends.native.gguf_kernels import PromptSame
from specdec.backends.native.gguf_kernels_8bit import BlockLinear8, MixedBlockLinear8
from specdec.backends.native.jit_ops import PARALLEL_WORK, fast_norms_usable, numba_threads
from specdec.backends.native.quant import FusedLinear


def _group(linear) -> tuple | None:
    """A layer's linear as gguf_jit_layer's group, or None where it is not made of numba 8-bit
    layers reading one activation format. A FusedLinear's separate parts (each quantizing the
    same input alike) join into one group."""
    if isinstance(linear, FusedLinear):
        parts = [linear.fused] if linear.fused is not None else list(linear.parts)
        groups = [_group(part) for part in parts]
        if any(g is None for g in groups) or len({g[0] for g in groups}) != 1:
            return None
        if len(groups) == 1:
            return groups[0]
        # -0.0 is the exact additive identity (x + -0.0 == x, signed zeros included)
        biases = [g[2] if g[2].shape[0] else np.full(g[3], -0.0, np.float32) for g in groups]
        bias = np.concatenate(biases) if any(g[2].shape[0] for g in groups) else groups[0][2]
        return groups[0][0], sum((g[1] for g in groups), ()), bias, sum(g[3] for g in groups)
    if isinstance(linear, PromptSame):
        linear = linear.layer
    return linear.numba_group() if isinstance(linear, (BlockLinear8, MixedBlockLinear8)) else None


class LayerStep:
    """One qualifying layer's arrays, formed once, and the call that runs it."""

    def __init__(self, norms: tuple[np.ndarray, ...], groups: tuple, eps: float, heads: int, kv_heads: int,
                 scale: float, gelu: bool):  # fmt: skip
        self.norms, self.groups, self.eps = norms, groups, np.float32(eps)
        self.heads, self.kv_heads, self.scale, self.gelu = heads, kv_heads, np.float32(scale), gelu
        self.no_pending = np.empty((0, norms[0].shape[0]), np.float32)

    @classmethod
    def build(cls, norms: tuple[torch.Tensor | None, ...], linears: tuple, eps: float, heads: int, kv_heads: int,
              scale: float, gelu: bool) -> LayerStep | None:  # fmt: skip
        """norms: (attn_norm, mlp_norm, q_norm, k_norm, post_attn_norm, post_mlp_norm), None
        where the layer has none; linears: (qkv, o, gate_up, down). None where the layer does
        not qualify (the module docstring)."""
        weights = [w for w in norms if w is not None]
        if not all(fast_norms_usable(w.device) and w.dtype == torch.float32 for w in weights):
            return None
        groups = tuple(_group(linear) for linear in linears)
        if any(group is None for group in groups):
            return None
        arrays = tuple(np.empty(0, np.float32) if w is None else np.ascontiguousarray(w.detach().numpy()) for w in norms)
        return cls(arrays, groups, eps, heads, kv_heads, scale, gelu)

    def __call__(self, x: torch.Tensor, pending: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                 k_cache: torch.Tensor, v_cache: torch.Tensor, row) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """x [T, hidden] fp32 (+ pending) for one chain row `row` (attention.kernel_chain_row)
        -> (x + pending, the layer's output), as DecoderLayer.forward_open returns them."""
        limits, paths, starts = row.plan.arrays
        parallel = int(limits[-1]) * x.shape[0] * self.heads >= PARALLEL_WORK  # as jit_ops picks its kernel
        x_rows = x.contiguous().numpy()
        pending_rows = self.no_pending if pending is None else pending.contiguous().numpy()
        out, delta = _jit().decode_layer(x_rows, pending_rows, self.norms, self.eps, *self.groups,
                                         (cos.numpy(), sin.numpy()), self.heads, self.kv_heads,
                                         (k_cache.numpy(), v_cache.numpy()), (row.slot, row.store, limits, paths, starts),
                                         self.scale, parallel, self.gelu)  # fmt: skip
        return torch.from_numpy(out), torch.from_numpy(delta)


def glu_mul(gate_up: torch.Tensor, gelu: bool) -> torch.Tensor:
    """[N, 2 I] fp32, gate and up side by side -> silu(gate) * up, or gelu_tanh(gate) * up,
    [N, I] (gguf_jit_layer.glu_mul_f32)."""
    return torch.from_numpy(_jit().glu_mul_f32(gate_up.contiguous().numpy(), gelu))


@functools.cache
def _jit():
    numba_threads()  # the threading layer and count, before the first parallel launch
    import specdec.backends.native.gguf_jit_layer as jit  # compiles, or loads from disk

    return jit
