"""One decoder layer of the native backend and its attention over a slotted KV cache.

A forward packs the new tokens of every sequence into one [N, hidden] batch; a `KVRow` says
where one sequence's share of it stores its keys and values and what it attends to. The
eagle drafter runs its head through the same `DecoderLayer`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specdec.backends.native.attention import attention as batch_invariant_attention
from specdec.backends.native.attention import kernel_chain_row
from specdec.backends.native.jit_ops import (
    add_rms_norm_bf16,
    fast_layer_usable,
    rms_norm_bf16,
    rotate_attend,
    silu_mul_bf16,
    split_rotate,
)
from specdec.backends.native.quant import FusedLinear, Linear
from specdec.errors import SpecdecError

SUPPORTED_TYPES = ("llama", "mistral", "qwen2")
DECODE_ATTENTION_MAX = 32  # chains up to this long attend query by query (see attention)


@dataclass(frozen=True)
class NativeConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_eps: float
    max_positions: int  # the model's context window (already capped by any sliding window)
    rope_theta: float
    # Architecture features; the defaults are Llama's. Norm weights in the state dict are the
    # multipliers themselves (Gemma's HF `1 + w` is added by the loader, as GGUF files store it).
    qk_norm: bool = False  # qwen3, gemma3: an RMSNorm over each head's q and k before rope
    sandwich_norms: bool = False  # gemma3: norms after attention and around the MLP
    activation: str = "silu"  # "silu" or "gelu_tanh" (gemma3), between gate and up
    embedding_scale: float = 1.0  # gemma3: sqrt(hidden_size), applied to looked-up rows
    attention_scale: float | None = None  # None: head_dim ** -0.5; gemma3: query_pre_attn_scalar ** -0.5
    sliding_window: int | None = None  # keys a sliding layer sees, the query's own included
    layer_types: tuple[str, ...] = ()  # per layer "full_attention" | "sliding_attention"; (): all full
    rope_local_theta: float | None = None  # gemma3: the sliding layers' own rope base
    final_logit_softcap: float | None = None

    @classmethod
    def from_hf(cls, config) -> NativeConfig:
        if config.model_type not in SUPPORTED_TYPES:
            raise SpecdecError(
                f"the native backend supports {', '.join(SUPPORTED_TYPES)} models, not "
                f"{config.model_type!r}; use the hf backend",
                "backend",
            )
        rope = getattr(config, "rope_parameters", None) or {}
        max_positions = int(getattr(config, "max_position_embeddings", 2048))
        window = getattr(config, "sliding_window", None)
        if window and getattr(config, "use_sliding_window", True):
            max_positions = min(max_positions, int(window))  # never past the window: exact
        return cls(
            model_type=config.model_type,
            vocab_size=int(config.vocab_size),
            hidden_size=int(config.hidden_size),
            num_layers=int(config.num_hidden_layers),
            num_heads=int(config.num_attention_heads),
            num_kv_heads=int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads),
            head_dim=int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads),
            rms_eps=float(config.rms_norm_eps),
            max_positions=max_positions,
            rope_theta=float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))),
        )


@dataclass
class KVRow:
    """One sequence's share of a packed forward."""

    slot: int
    start: int  # its tokens are packed rows start:end
    end: int
    store: int  # their keys and values go to cache[slot, :, store : store + end - start]
    kv_len: int  # they attend to cache[slot, :, :kv_len]
    mask: torch.Tensor | None  # [end - start, kv_len] bool, True = attend; None = attend to all
    # A token tree: (nodes in depth-first order, depth of each node), attended query by query
    # (see tree_attention); the nodes' keys and values of every layer are kept in tree_kv.
    tree: tuple[list[int], list[int]] | None = None
    tree_kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    plan: object = None  # attention.KeyPlan: the keys each query sees, shared by all layers


class DecoderLayer(torch.nn.Module):
    """One decoder layer. A module whose tensors are buffers, so torch.compile traces it once
    and the graph serves all layers (regional compilation)."""

    def __init__(self, config: NativeConfig, attn_norm: torch.Tensor, qkv: FusedLinear, o: Linear,
                 mlp_norm: torch.Tensor, gate_up: FusedLinear, down: Linear):
        super().__init__()
        self.register_buffer("attn_norm", attn_norm, persistent=False)  # [hidden]
        self.register_buffer("mlp_norm", mlp_norm, persistent=False)  # [hidden]
        self.qkv, self.o, self.gate_up, self.down = qkv, o, gate_up, down  # qkv -> q, k, v; gate_up -> gate, up
        self.heads, self.kv_heads, self.dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.eps, self.gqa = config.rms_eps, config.num_heads != config.num_kv_heads
        # the dtype the kernels take (bf16 for int4/int8): norms and the activation write it
        # directly, and the kernels' outputs join the fp32 residual stream by type promotion
        self.act_dtype = activation_dtype(qkv)
        self.fast = fast_layer_usable(attn_norm.device, self.act_dtype)  # numba's norms and rotation (jit_ops.py)
        # what eager forwards call, as plain attributes: a module's buffers and submodules are
        # found through nn.Module.__getattr__, which costs a layer about 20 slow lookups a step
        self.eager_parts = (attn_norm, qkv.joined, o.forward, mlp_norm, gate_up.forward, down.forward, gate_up.joined)
        self.fused_gate_up = gate_up.fused is not None and self.act_dtype == torch.bfloat16  # its output is bf16

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, rows: list[KVRow]) -> torch.Tensor:
        # x [N, hidden]; cos, sin [N, 1, dim]; caches [slots, kv_heads, max_length, dim]
        x, delta = self.forward_open(x, None, cos, sin, k_cache, v_cache, rows)
        return x + delta  # fp32 + act_dtype -> fp32

    def forward_open(self, x: torch.Tensor, pending: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                     k_cache: torch.Tensor, v_cache: torch.Tensor,
                     rows: list[KVRow]) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """The layer on input x + pending (pending: the previous layer's last output, not yet
        added, or None), returning its output the same way, so that each residual add joins
        the norm after it in one call; `forward` adds up."""
        n, heads, kv_heads, dim, act = x.shape[0], self.heads, self.kv_heads, self.dim, self.act_dtype
        compiling = torch.compiler.is_compiling()
        fast = self.fast and not compiling
        if compiling:  # the registered buffers, so that one compiled graph serves every layer
            parts = (self.attn_norm, self.qkv.joined, self.o.forward, self.mlp_norm, self.gate_up.forward,
                     self.down.forward, self.gate_up.joined)  # fmt: skip
        else:
            parts = self.eager_parts
        attn_norm, qkv_linear, o_linear, mlp_norm, gate_up_linear, down_linear, gate_up_joined = parts
        x, h = self._add_norm(x, pending, attn_norm, fast)
        qkv = qkv_linear(h)
        fast_qkv = fast and qkv.dtype == torch.bfloat16
        row = kernel_chain_row(rows, heads // kv_heads, x.device, k_cache.dtype) if fast_qkv else None
        if row is not None:  # one chain row: rotation, attention and the cast in one numba call
            attn = rotate_attend(qkv, cos, sin, heads, kv_heads, k_cache, v_cache, row.slot, row.store,
                                 *row.plan.arrays)  # fmt: skip
        else:
            attn = self._attention(qkv, cos, sin, k_cache, v_cache, rows, fast_qkv).reshape(n, heads * dim).to(act)
        # .forward: the linears are plain modules (no hooks), and __call__ costs each of them
        x, h = self._add_norm(x, o_linear(attn), mlp_norm, fast)
        if fast and self.fused_gate_up:  # one numba call from the fused gate|up output
            return x, down_linear(silu_mul_bf16(gate_up_joined(h)))
        gate, up = gate_up_linear(h)
        return x, down_linear(silu_mul(gate, up, act))

    def _add_norm(self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                  fast: bool) -> tuple[torch.Tensor, torch.Tensor]:
        # (x + delta, its norm in the kernels' dtype); the add and the norm in one call on the fast path
        if delta is None:
            return x, rms_norm(x, weight, self.eps, self.act_dtype, fast)
        if fast and delta.dtype == torch.bfloat16:
            return add_rms_norm_bf16(x, delta, weight, self.eps)
        x = x + delta  # fp32 + act_dtype -> fp32
        return x, rms_norm(x, weight, self.eps, self.act_dtype, fast)

    def _attention(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, rows: list[KVRow], fast: bool) -> torch.Tensor:
        # qkv [N, (heads + 2 kv_heads) * dim] -> [N, heads, dim] in q's dtype
        n, heads, kv_heads, dim = qkv.shape[0], self.heads, self.kv_heads, self.dim
        if fast:
            q, k, v = split_rotate(qkv, cos, sin, heads, kv_heads)
        else:
            qkv = qkv.float()
            qk = rope(qkv[:, : (heads + kv_heads) * dim].view(n, heads + kv_heads, dim), cos, sin)  # q and k at once
            q, k = qk[:, :heads], qk[:, heads:]  # [N, heads, dim], [N, kv_heads, dim]
            v = qkv[:, (heads + kv_heads) * dim :].view(n, kv_heads, dim)
        # prompt chunks take SDPA in the layers' own dtype: bf16 for the dense bf16 prompt layers
        # (prompt_precision), about 2x faster than fp32 per chunk; decode rows never take it
        return batch_invariant_attention(q, k, v, k_cache, v_cache, rows, self.gqa, self.act_dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    # x [N, heads, dim]; see NativeModel.rope_tables
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype, fast: bool = False) -> torch.Tensor:
    # x [N, hidden] fp32 -> [N, hidden] in the kernels' dtype; `fast`: one numba call into bf16
    # (at this width every PyTorch op costs about its dispatch, and F.rms_norm plus a cast is
    # several). Compiled graphs keep F.rms_norm, which Inductor fuses.
    if fast:
        return rms_norm_bf16(x, weight, eps)
    out = F.rms_norm(x, (x.shape[-1],), weight, eps)
    return out if out.dtype == dtype else out.to(dtype)


def silu_mul(gate: torch.Tensor, up: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # SwiGLU in fp32, rounded once to the kernels' dtype
    return F.silu(gate.float(), inplace=True).mul_(up).to(dtype)


def activation_dtype(linear) -> torch.dtype:
    return getattr(linear, "act_dtype", torch.float32)
