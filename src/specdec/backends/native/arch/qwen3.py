"""qwen3: llama's layers with an RMSNorm over each head's q and k before the rope."""

from __future__ import annotations

from specdec.backends.native.arch.base import Architecture


class Qwen3(Architecture):
    gguf_name = "qwen3"
    model_types = ("qwen3",)
    qk_norm_hf = True  # a GGUF says so by its attn_q_norm / attn_k_norm tensors
