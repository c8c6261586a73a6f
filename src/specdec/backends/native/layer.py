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

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, rows: list[KVRow]) -> torch.Tensor:
        # x [N, hidden]; cos, sin [N, 1, dim]; caches [slots, kv_heads, max_length, dim]
        n, heads, kv_heads, dim = x.shape[0], self.heads, self.kv_heads, self.dim
        qkv = self.qkv.joined(rms_norm(x, self.attn_norm, self.eps, self.act_dtype)).float()
        qk = rope(qkv[:, : (heads + kv_heads) * dim].view(n, heads + kv_heads, dim), cos, sin)  # q and k at once
        q, k = qk[:, :heads], qk[:, heads:]  # [N, heads, dim], [N, kv_heads, dim]
        v = qkv[:, (heads + kv_heads) * dim :].view(n, kv_heads, dim)
        attn = batch_invariant_attention(q, k, v, k_cache, v_cache, rows, self.gqa)
        # .forward: the linears are plain modules (no hooks), and __call__ costs each of them
        x = x + self.o.forward(attn.reshape(n, heads * dim).to(self.act_dtype))  # fp32 + act_dtype -> fp32
        gate, up = self.gate_up.forward(rms_norm(x, self.mlp_norm, self.eps, self.act_dtype))
        return x + self.down.forward(silu_mul(gate, up, self.act_dtype))


def rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    # x [N, heads, dim]; see NativeModel.rope_tables
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype) -> torch.Tensor:
    # x [N, hidden] fp32 -> [N, hidden] in the kernels' dtype. Hand-written variants with fewer
    # reductions measured no faster on one core: at this width every op costs its dispatch.
    out = F.rms_norm(x, (x.shape[-1],), weight, eps)
    return out if out.dtype == dtype else out.to(dtype)


def silu_mul(gate: torch.Tensor, up: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # SwiGLU in fp32, rounded once to the kernels' dtype
    return F.silu(gate.float(), inplace=True).mul_(up).to(dtype)


def activation_dtype(linear) -> torch.dtype:
    return getattr(linear, "act_dtype", torch.float32)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              rows: list[KVRow], gqa: bool) -> torch.Tensor:
    """Store each row's new keys and values, then let its queries attend to its cache prefix.
    q [N, heads, dim], k, v [N, kv_heads, dim], caches [slots, kv_heads, max_length, dim].

    A row without a mask is a short chain: each of its queries attends exactly as a one-token
    decode step would (keys sliced to its position, no mask), because SDPA's results depend
    on the query count and the mask. Scoring k drafts then gives each the bits a plain step
    would, so speculation reproduces plain greedy decoding exactly.
    """
    outs = []
    for row in rows:
        t = row.end - row.start
        if row.tree is not None:
            outs.append(tree_attention(q, k, v, k_cache, v_cache, row, gqa))
            continue
        k_cache[row.slot, :, row.store : row.store + t] = k[row.start : row.end].transpose(0, 1)
        v_cache[row.slot, :, row.store : row.store + t] = v[row.start : row.end].transpose(0, 1)
        q_row = q[row.start : row.end].transpose(0, 1).unsqueeze(0)  # [1, heads, T, dim]
        if q_row.dtype != k_cache.dtype:
            q_row = q_row.to(k_cache.dtype)
        k_row = k_cache[row.slot : row.slot + 1, :, : row.kv_len]  # [1, kv_heads, S, dim]
        v_row = v_cache[row.slot : row.slot + 1, :, : row.kv_len]
        if row.mask is not None:
            outs.append(F.scaled_dot_product_attention(q_row, k_row, v_row, attn_mask=row.mask, enable_gqa=gqa))
            continue
        for j in range(t):  # query j sits at cache position kv_len - t + j
            end = row.kv_len - t + j + 1
            outs.append(F.scaled_dot_product_attention(
                q_row[:, :, j : j + 1], k_row[:, :, :end], v_row[:, :, :end], enable_gqa=gqa))  # fmt: skip
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)  # [1, heads, N, dim]
    out = out[0].transpose(0, 1)  # [N, heads, dim]
    return out if out.dtype == q.dtype else out.to(q.dtype)


def tree_attention(q, k, v, k_cache, v_cache, row: KVRow, gqa: bool) -> torch.Tensor:
    """A token tree, query by query: node i at depth d attends to the cache, its ancestors
    and itself laid out at positions base..base+d, exactly as a chain would hold them, so a
    tree scores each path with the bits of a one-token-per-step decode. Walking the nodes in
    depth-first order keeps a node's ancestors in place: it only writes its own keys at
    base+d. Returns [1, heads, T, dim] in node order."""
    order, depths = row.tree
    t, base = row.end - row.start, row.store
    k_nodes, v_nodes = k[row.start : row.end], v[row.start : row.end]  # [T, kv_heads, dim]
    row.tree_kv.append((k_nodes, v_nodes))  # for keep(), one entry per layer
    outs: list[torch.Tensor | None] = [None] * t
    for i in order:
        pos = base + depths[i]
        k_cache[row.slot, :, pos] = k_nodes[i]
        v_cache[row.slot, :, pos] = v_nodes[i]
        q_i = q[row.start + i].unsqueeze(0).unsqueeze(2)  # [1, heads, 1, dim]
        if q_i.dtype != k_cache.dtype:
            q_i = q_i.to(k_cache.dtype)
        outs[i] = F.scaled_dot_product_attention(
            q_i, k_cache[row.slot : row.slot + 1, :, : pos + 1], v_cache[row.slot : row.slot + 1, :, : pos + 1],
            enable_gqa=gqa)  # fmt: skip
    return torch.cat(outs, dim=2)
