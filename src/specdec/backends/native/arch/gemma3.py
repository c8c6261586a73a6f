"""gemma3: four norms a layer (around attention and the MLP), GeGLU, a scaled embedding, an
attention scale of its own, q/k norms, and sliding layers with their own rope base between
every sixth global one."""

from __future__ import annotations

import math

import numpy as np
import torch

from specdec.backends.native.arch.base import Architecture, rope_frequencies
from specdec.errors import SpecdecError
from specdec.gguf_file import GGUFFile

SLIDING_PATTERN = 6  # every sixth layer attends globally, the rest through the window
LOCAL_ROPE_BASE = 10000.0  # the sliding layers' rope base where the file does not say


class Gemma3(Architecture):
    gguf_name = "gemma3"
    model_types = ("gemma3_text",)
    # before and after attention, before and after the MLP
    block_names = {
        "ffn_norm": "pre_feedforward_layernorm",
        "post_attention_norm": "post_attention_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    }
    qk_norm_hf = True
    norms_plus_one = True

    def gguf_features(self, meta, layers: int, hidden: int, heads: int, head_dim: int) -> dict:
        # llama.cpp's rule: the 27B (62 layers) scales queries by hidden / heads, the others by head_dim
        scale = (hidden / heads if layers == 62 else head_dim) ** -0.5
        return dict(sandwich_norms=True, activation="gelu_tanh", attention_scale=scale,
                    embedding_scale=float(np.float32(math.sqrt(hidden))),
                    rope_local_theta=float(meta("rope.freq_base_swa", LOCAL_ROPE_BASE)))

    def sliding_layers(self, f: GGUFFile, layers: int) -> list[bool]:
        pattern = f.meta("gemma3.attention.sliding_window_pattern")  # per layer: True = sliding
        if pattern is not None:
            return [bool(v) for v in pattern]
        return [(i + 1) % SLIDING_PATTERN != 0 for i in range(layers)]

    def hf_features(self, config, embedding_dtype: torch.dtype) -> dict:
        local_theta, local_freq, _ = rope_frequencies(config, "sliding_attention")
        if local_freq is not None:
            raise SpecdecError("the native backend runs gemma3's sliding layers with the default rope only",
                               "backend")
        return dict(
            sandwich_norms=True,
            rope_local_theta=local_theta,
            # transformers keeps the scale as a tensor cast to the embedding's dtype (bf16 rounds it)
            embedding_scale=float(torch.tensor(config.hidden_size**0.5).to(embedding_dtype)),
            attention_scale=float(config.query_pre_attn_scalar) ** -0.5,
        )
