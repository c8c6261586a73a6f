"""phi3: gate and up stacked in one matrix, a window on every layer, and LongRoPE."""

from __future__ import annotations

import math

import torch

from specdec.backends.native.arch.base import Architecture, Rope
from specdec.gguf_file import GGUFFile


class Phi3(Architecture):
    gguf_name = "phi3"
    model_types = ("phi3",)
    block_names = {"ffn_up": "mlp.gate_up_proj"}  # phi3's ffn_up holds gate and up, stacked
    rope_tensors = ("rope_factors_short.weight", "rope_factors_long.weight")

    def rope(self, f: GGUFFile, base: torch.Tensor, rope: Rope) -> Rope:
        inv_freq, scaling, context = rope
        if "rope_factors_short.weight" not in f.tensors:
            return rope
        original = int(f.meta("phi3.rope.scaling.original_context_length", context))
        short = torch.from_numpy(f.tensors["rope_factors_short.weight"].dequantize().copy())
        default = (math.sqrt(1 + math.log(context / original) / math.log(original)) if context > original
                   else 1.0)
        scaling = float(f.meta("phi3.rope.scaling.attn_factor", default))
        # the short factors hold up to the original context; past it the model switches to
        # the long ones, which a static table cannot follow: the model runs to `original`
        return base / short, scaling, original
