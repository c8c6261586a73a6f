"""The native model's configuration (`NativeConfig`: dimensions and the architecture's features,
read from a GGUF file by gguf/reader.py or from a Hugging Face config by hf_config.py) and
`KVRow`, one sequence's share of a packed forward."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.backends.native.arch import SUPPORTED_TYPES
from specdec.backends.native.model.hf_config import native_config

DECODE_ATTENTION_MAX = 32  # chains up to this long attend query by query (see attention)


SLIDING = "sliding_attention"


def default_inv_freq(theta: float, head_dim: int) -> torch.Tensor:
    """transformers' default rope frequencies [head_dim / 2] (its compute_default_rope_parameters)."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))


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
    max_positions: int  # the model's context window
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
    # The full layers' inverse frequencies [head_dim / 2] where the rope is scaled (llama3,
    # linear, yarn; a GGUF's rope_freqs divides the default ones), else None: from rope_theta.
    rope_inv_freq: tuple[float, ...] | None = None
    rope_attention_scaling: float = 1.0  # multiplies cos and sin (yarn)

    @classmethod
    def from_hf(cls, config, embedding_dtype: torch.dtype = torch.float32) -> NativeConfig:
        """The config of an HF model (hf_config.native_config: the one reader of HF configs)."""
        return cls(**native_config(config, SUPPORTED_TYPES, embedding_dtype))

    def sliding(self, layer: int) -> bool:
        """Whether `layer` attends through the sliding window."""
        return (self.sliding_window is not None and bool(self.layer_types)
                and self.layer_types[layer] == SLIDING)

    def local_rope(self, layer: int) -> bool:
        """Whether `layer` rotates with the sliding layers' own rope base (gemma3)."""
        return self.rope_local_theta is not None and self.sliding(layer)


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
    window: int | None = None  # a sliding layer's row (attention.windowed): keys older than this are masked
