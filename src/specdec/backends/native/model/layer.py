"""One decoder layer of the native backend (`DecoderLayer`) and the row-wise operations it runs
in PyTorch where the numba kernels do not (rope, norms, gated activations).

A forward packs the new tokens of every sequence into one [N, hidden] batch; a `KVRow` says
where one sequence's share of it stores its keys and values and what it attends to. The
eagle drafter runs its head through the same `DecoderLayer`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specdec.backends.native.kernels.attention import attention as batch_invariant_attention
from specdec.backends.native.kernels.attention import kernel_chain_row, kernel_rows
from specdec.backends.native.kernels.linear import FusedLinear, Linear
from specdec.backends.native.kernels.numba_ops import (
    add_rms_norm_bf16,
    fast_layer_usable,
    fast_norms_usable,
    norm_rotate_attend,
    rms_norm_bf16,
    rms_norm_f32,
    rotate_attend,
    silu_mul_bf16,
    split_norm_rotate,
    split_rotate,
)
from specdec.backends.native.model.config import KVRow, NativeConfig
from specdec.backends.native.model.one_call import LayerStep, glu_mul


class DecoderLayer(torch.nn.Module):
    """One decoder layer. A module whose tensors are buffers, so torch.compile traces it once
    and the graph serves all layers (regional compilation).

    Optional parts (None where the architecture has none): q_norm and k_norm [head_dim]
    (qwen3, gemma3: each head's q and k normed before rope), post_attn_norm and post_mlp_norm
    [hidden] (gemma3: the attention's and the MLP's outputs normed before the residual add).
    A gate_up with one part (phi3's fused matrix as a prebuilt layer) is split in halves."""

    def __init__(self, config: NativeConfig, attn_norm: torch.Tensor, qkv: FusedLinear, o: Linear,
                 mlp_norm: torch.Tensor, gate_up: FusedLinear, down: Linear,
                 q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
                 post_attn_norm: torch.Tensor | None = None, post_mlp_norm: torch.Tensor | None = None):
        super().__init__()
        self.register_buffer("attn_norm", attn_norm, persistent=False)  # [hidden]
        self.register_buffer("mlp_norm", mlp_norm, persistent=False)  # [hidden]
        extra = (q_norm, k_norm, post_attn_norm, post_mlp_norm)
        for name, weight in zip(("q_norm", "k_norm", "post_attn_norm", "post_mlp_norm"), extra, strict=True):
            self.register_buffer(name, weight, persistent=False)
        # qkv -> q, k, v; gate_up -> gate, up
        self.qkv, self.o, self.gate_up, self.down = qkv, o, gate_up, down
        self.heads, self.kv_heads, self.dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.eps, self.gqa = config.rms_eps, config.num_heads != config.num_kv_heads
        self.scale, self.gelu = config.attention_scale, config.activation == "gelu_tanh"
        # the dtype the kernels take (bf16 for int4/int8): norms and the activation write it
        # directly, and the kernels' outputs join the fp32 residual stream by type promotion
        self.act_dtype = activation_dtype(qkv)
        # numba's norms and rotation (kernels/numba_ops.py)
        self.fast = fast_layer_usable(attn_norm.device, self.act_dtype)
        # fp32 norms as numba calls where the layer's kernels take fp32 (GGUF 8-bit types)
        norms = (attn_norm, mlp_norm, *(w for w in extra if w is not None))
        self.fast_norms = fast_norms_usable(attn_norm.device) and all(w.dtype == torch.float32 for w in norms)
        # what eager forwards call, as plain attributes: a module's buffers and submodules are
        # found through nn.Module.__getattr__, which costs a layer about 20 slow lookups a step
        self.eager_parts = (attn_norm, qkv.joined, o.forward, mlp_norm, gate_up.forward, down.forward,
                            gate_up.joined, extra)
        self.fused_gate_up = gate_up.fused is not None and self.act_dtype == torch.bfloat16 and not self.gelu
        self.split_gate_up = len(gate_up.sizes) == 1  # one [gate | up] part
        # fp32 layers with numba's norms take its SwiGLU / GeGLU too, in every stack (decode, prompts)
        self.numba_glu = self.fast_norms and self.act_dtype == torch.float32
        # a layer of numba 8-bit kernels runs a forward's decode rows as one call (model/one_call.py)
        self.step = None
        if self.numba_glu:
            self.step = LayerStep.build((attn_norm, mlp_norm, *extra), (qkv, o, gate_up, down), self.eps,
                                        self.heads, self.kv_heads, self.scale or self.dim**-0.5, self.gelu)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, rows: list[KVRow]) -> torch.Tensor:
        # x [N, hidden]; cos, sin [N, 1, dim]; caches [slots, kv_heads, max_length, dim]
        x, delta = self.forward_open(x, None, cos, sin, k_cache, v_cache, rows)
        return x + delta  # fp32 + act_dtype -> fp32

    def forward_open(self, x: torch.Tensor, pending: torch.Tensor | None, cos: torch.Tensor,
                     sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     rows: list[KVRow]) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer on input x + pending (pending: the previous layer's last output, not yet
        added, or None), returning its output the same way, so that each residual add joins
        the norm after it in one call; `forward` adds up."""
        n, heads, kv_heads, dim, act = x.shape[0], self.heads, self.kv_heads, self.dim, self.act_dtype
        compiling = torch.compiler.is_compiling()
        fast, fast_norms = self.fast and not compiling, self.fast_norms and not compiling
        if compiling:  # the registered buffers, so that one compiled graph serves every layer
            parts = (self.attn_norm, self.qkv.joined, self.o.forward, self.mlp_norm, self.gate_up.forward,
                     self.down.forward, self.gate_up.joined,
                     (self.q_norm, self.k_norm, self.post_attn_norm, self.post_mlp_norm))
        else:
            parts = self.eager_parts
        attn_norm, qkv_linear, o_linear, mlp_norm, gate_up_linear, down_linear, gate_up_joined, extra = parts
        step = None if compiling else self.step
        # a token tree runs in one call only with every layer at once (StepStack)
        if step is not None and all(row.tree is None for row in rows):
            arrays = kernel_rows(rows, heads // kv_heads, x.device, k_cache.dtype)
            if arrays is not None:
                return step(x, pending, cos, sin, k_cache, v_cache, arrays)
        q_norm, k_norm, post_attn_norm, post_mlp_norm = extra
        x, h = self._add_norm(x, pending, attn_norm, fast, fast_norms)
        qkv = qkv_linear(h)
        fast_qkv = fast and qkv.dtype == torch.bfloat16 and q_norm is None  # numba's rotation has no q/k norm
        fast_fp32 = fast_norms and qkv.dtype == torch.float32  # GGUF's 8-bit kinds
        row = (kernel_chain_row(rows, heads // kv_heads, x.device, k_cache.dtype) if fast_qkv or fast_fp32
               else None)
        qk_norms = None if q_norm is None else (q_norm, k_norm)
        if row is not None and fast_qkv:  # one chain row: rotation, attention and the cast in one numba call
            attn = rotate_attend(qkv, cos, sin, heads, kv_heads, k_cache, v_cache, row.slot, row.store,
                                 *row.plan.arrays, self.scale)
        elif row is not None:  # the same in fp32, with the q/k norms where the layer has them
            attn = norm_rotate_attend(qkv, cos, sin, heads, kv_heads, qk_norms, self.eps, k_cache, v_cache,
                                      row.slot, row.store, *row.plan.arrays, self.scale)
            attn = attn if attn.dtype == act else attn.to(act)  # a no-op .to() still costs a dispatch
        else:
            attn = self._attention(qkv, cos, sin, k_cache, v_cache, rows, fast_qkv, qk_norms, fast_norms)
            attn = attn.reshape(n, heads * dim).to(act)
        # .forward: the linears are plain modules (no hooks), and __call__ costs each of them
        x, h = self._add_norm(x, self._post_norm(o_linear(attn), post_attn_norm, fast_norms), mlp_norm, fast,
                              fast_norms)
        if fast and self.fused_gate_up:  # one numba call from the fused gate|up output
            return x, self._post_norm(down_linear(silu_mul_bf16(gate_up_joined(h))), post_mlp_norm,
                                      fast_norms)
        # the one-call path's activation: a row's bits do not depend on the path
        if fast_norms and self.numba_glu:
            return x, self._post_norm(down_linear(glu_mul(gate_up_joined(h), self.gelu)), post_mlp_norm,
                                      fast_norms)
        gate, up = gate_up_joined(h).chunk(2, dim=-1) if self.split_gate_up else gate_up_linear(h)
        mixed = gelu_mul(gate, up, act) if self.gelu else silu_mul(gate, up, act)
        return x, self._post_norm(down_linear(mixed), post_mlp_norm, fast_norms)

    def _post_norm(self, delta: torch.Tensor, weight: torch.Tensor | None, fast_norms: bool) -> torch.Tensor:
        # gemma3's norm of a sublayer's output before the residual add, in fp32
        return delta if weight is None else rms_norm(delta.float(), weight, self.eps, torch.float32,
                                                     fast_norms=fast_norms)

    def _add_norm(self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, fast: bool,
                  fast_norms: bool) -> tuple[torch.Tensor, torch.Tensor]:
        # (x + delta, its norm in the kernels' dtype); the add and the norm in one call on the fast path
        if delta is None:
            return x, rms_norm(x, weight, self.eps, self.act_dtype, fast, fast_norms)
        if fast and delta.dtype == torch.bfloat16:
            return add_rms_norm_bf16(x, delta, weight, self.eps)
        x = x + delta  # fp32 + act_dtype -> fp32
        return x, rms_norm(x, weight, self.eps, self.act_dtype, fast, fast_norms)

    def _attention(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, rows: list[KVRow], fast: bool,
                   qk_norms: tuple[torch.Tensor, torch.Tensor] | None, fast_norms: bool) -> torch.Tensor:
        # qkv [N, (heads + 2 kv_heads) * dim] -> [N, heads, dim] in q's dtype
        n, heads, kv_heads, dim = qkv.shape[0], self.heads, self.kv_heads, self.dim
        if fast:
            q, k, v = split_rotate(qkv, cos, sin, heads, kv_heads)
        elif fast_norms:  # the same operations as below in one numba call
            q, k, v = split_norm_rotate(qkv.float(), cos, sin, heads, kv_heads, qk_norms, self.eps)
        else:
            qkv = qkv.float()
            qk = qkv[:, : (heads + kv_heads) * dim].view(n, heads + kv_heads, dim)
            if qk_norms is not None:  # each head's q and k normed over head_dim, before rope
                q_part = F.rms_norm(qk[:, :heads], (dim,), qk_norms[0], self.eps)
                qk = torch.cat([q_part, F.rms_norm(qk[:, heads:], (dim,), qk_norms[1], self.eps)], dim=1)
            qk = rope(qk, cos, sin)  # q and k at once
            q, k = qk[:, :heads], qk[:, heads:]  # [N, heads, dim], [N, kv_heads, dim]
            v = qkv[:, (heads + kv_heads) * dim :].view(n, kv_heads, dim)
        # prompt chunks take SDPA in the layers' own dtype: bf16 for the dense bf16 prompt layers
        # (prompt_precision), about 2x faster than fp32 per chunk; decode rows never take it
        return batch_invariant_attention(q, k, v, k_cache, v_cache, rows, self.gqa, self.act_dtype,
                                         self.scale)


def compiled_layer(layer: DecoderLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, rows: list[KVRow]) -> torch.Tensor:
    """A compiled layer's forward, for one sequence (CachePool.forward_batch runs a compiled
    batch one by one). A compiled graph guards on what it reads at entry, so two things are
    handed in a form that every call shares:
    - the sequence's slot: the layer sees its slot's cache as slot 0 of a one-slot view, or
      each slot (and each pool size) would trace graphs of its own;
    - a token tree's `tree_kv`, where each layer collects its node keys and values: the layer
      gets an empty list, or each layer would trace its own graph for the list's length. What
      it appends joins the tree's list after it (a sliding layer's row shares the list)."""
    (seq_row,) = rows
    slot, seq_row.slot = seq_row.slot, 0
    kept = seq_row.tree_kv
    if kept is not None:
        seq_row.tree_kv = []
    try:
        return layer(x, cos, sin, k_cache[slot : slot + 1], v_cache[slot : slot + 1], rows)
    finally:
        seq_row.slot = slot
        if kept is not None:
            kept.extend(seq_row.tree_kv)
            seq_row.tree_kv = kept


def rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    # x [N, heads, dim]; see NativeModel.rope_tables
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype, fast: bool = False,
             fast_norms: bool = False) -> torch.Tensor:
    # x [N, hidden] fp32 -> [N, hidden] in the kernels' dtype; `fast`: one numba call into bf16,
    # `fast_norms`: one into fp32 (at this width every PyTorch op costs about its dispatch, and
    # F.rms_norm plus a cast is several). Compiled graphs keep F.rms_norm, which Inductor fuses.
    if fast:
        return rms_norm_bf16(x, weight, eps)
    if fast_norms and dtype == torch.float32 and x.dtype == torch.float32:
        return rms_norm_f32(x, weight, eps)
    out = F.rms_norm(x, (x.shape[-1],), weight, eps)
    return out if out.dtype == dtype else out.to(dtype)


def silu_mul(gate: torch.Tensor, up: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # SwiGLU in fp32, rounded once to the kernels' dtype
    out = F.silu(gate.float(), inplace=True).mul_(up)
    return out if out.dtype == dtype else out.to(dtype)


def gelu_mul(gate: torch.Tensor, up: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # GeGLU with the tanh approximation (gemma3's gelu_pytorch_tanh) in fp32, rounded once
    out = F.gelu(gate.float(), approximate="tanh").mul_(up)
    return out if out.dtype == dtype else out.to(dtype)


def activation_dtype(linear) -> torch.dtype:
    return getattr(linear, "act_dtype", torch.float32)
