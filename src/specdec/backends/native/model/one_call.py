"""A decoder layer of GGUF 8-bit matrices as one numba call (kernels/jit/layer.decode_layer).

`LayerStep.build` says whether a layer qualifies: every linear runs the numba 8-bit kernels
(BlockLinear8 or MixedBlockLinear8, one activation format per linear) and the norms are
fp32 (gemma3's q/k norms and sublayer output norms included). A qualifying layer runs the
decode rows of a forward as one call: a decode step, a speculative chain, a token tree, the
chains of a batch of sequences (kernels/attention.kernel_rows packs them); prompt chunks
take the separate calls. Both compute the same operations on the same kernels, the
activation included (`glu_mul`: the separate path of an fp32 layer with numba's
norms takes them too), so a row's bits do not depend on the path; tests/test_gguf_loader.py
compares them. Where every layer qualifies, `StepStack` runs them back to back for the model,
the per-forward work (the arrays of the rope tables and of the row's plan) done once, not
once a layer.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from specdec.backends.native.kernels.int8_blocks import BlockLinear8, MixedBlockLinear8
from specdec.backends.native.kernels.linear import FusedLinear, PromptSame
from specdec.backends.native.kernels.numba_ops import (
    PARALLEL_WORK,
    cache_array,
    fast_norms_usable,
    numba_threads,
)


def _group(linear) -> tuple | None:
    """A layer's linear as kernels/jit/layer.py's group, or None where it is not made of numba 8-bit
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
    def build(cls, norms: tuple[torch.Tensor | None, ...], linears: tuple, eps: float, heads: int,
              kv_heads: int,
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
        arrays = tuple(np.empty(0, np.float32) if w is None else np.ascontiguousarray(w.detach().numpy())
                       for w in norms)
        return cls(arrays, groups, eps, heads, kv_heads, scale, gelu)

    def __call__(self, x: torch.Tensor, pending: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                 k_cache: torch.Tensor, v_cache: torch.Tensor,
                 rows: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] fp32 (+ pending) for the decode rows `rows` (attention.kernel_rows' arrays)
        -> (x + pending, the layer's output), as DecoderLayer.forward_open returns them."""
        pending_rows = self.no_pending if pending is None else pending.contiguous().numpy()
        out, delta = self.run(x.contiguous().numpy(), pending_rows, (cos.numpy(), sin.numpy()),
                              (cache_array(k_cache), cache_array(v_cache)), rows)
        return torch.from_numpy(out), torch.from_numpy(delta)

    def run(self, x: np.ndarray, pending: np.ndarray, rope: tuple, cache: tuple, rows: tuple) -> tuple:
        """The call on arrays: x [T, hidden], pending [T or 0, hidden], rope (cos, signed sin),
        cache (keys, values), rows (attention.kernel_rows) -> (x + pending, output)."""
        return _jit().decode_layer(x, pending, self.norms, self.eps, *self.groups, rope, self.heads,
                                   self.kv_heads, cache, rows, self.scale, (PARALLEL_WORK, numba_threads()),
                                   self.gelu)


class StepStack:
    """Every layer's LayerStep, run back to back for the decode rows of a forward: the views of
    the rope tables and the rows' arrays are formed once a forward, not once a layer, and the
    activations stay arrays between layers. The same calls on the same arrays as each layer's
    own `LayerStep.__call__`, so the same bits."""

    def __init__(self, steps: list[LayerStep], local_rope: list[bool], sliding: list[bool]):
        self.steps, self.local_rope, self.sliding = steps, local_rope, sliding

    @classmethod
    def build(cls, steps: list[LayerStep | None], local_rope: list[bool],
              sliding: list[bool]) -> StepStack | None:
        """None unless every layer has its step."""
        if not steps or any(step is None for step in steps):
            return None
        return cls(list(steps), list(local_rope), list(sliding))

    def __call__(self, x: torch.Tensor, tables: list[tuple[torch.Tensor, torch.Tensor]], rows: tuple,
                 caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:  # fmt: skip
        """x [T, hidden] fp32 through every layer, residual included; tables: the (cos, signed
        sin) [T, 1, dim] of each rope (global, local); rows: attention.kernel_rows' arrays of each
        row set (all layers, sliding ones)."""
        ropes = [(cos.numpy(), sin.numpy()) for cos, sin in tables]
        x_rows, pending = x.contiguous().numpy(), self.steps[0].no_pending
        for step, local, sliding, (k_cache, v_cache) in zip(self.steps, self.local_rope, self.sliding, caches,
                                                            strict=True):  # fmt: skip
            cache = (cache_array(k_cache), cache_array(v_cache))
            x_rows, pending = step.run(x_rows, pending, ropes[local], cache, rows[sliding])
        return torch.from_numpy(x_rows) + torch.from_numpy(pending)


def glu_mul(gate_up: torch.Tensor, gelu: bool) -> torch.Tensor:
    """[N, 2 I] fp32, gate and up side by side -> silu(gate) * up, or gelu_tanh(gate) * up,
    [N, I] (kernels/jit/layer.glu_mul_f32)."""
    return torch.from_numpy(_jit().glu_mul_f32(gate_up.contiguous().numpy(), gelu))


@functools.cache
def _jit():
    numba_threads()  # the threading layer and count, before the first parallel launch
    import specdec.backends.native.kernels.jit.layer as jit  # compiles, or loads from disk

    return jit
