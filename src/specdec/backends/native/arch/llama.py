"""llama (Llama 1-3, and mistral's files, which llama.cpp writes as llama with a window), and
qwen2, which differs from llama in nothing the native backend computes."""

from __future__ import annotations

import numpy as np
import torch

from specdec.backends.native.arch.base import Architecture, Rope
from specdec.gguf_file import GGUFFile, QuantTensor


class Llama(Architecture):
    gguf_name = "llama"
    model_types = ("llama", "mistral")
    rope_tensors = ("rope_freqs.weight",)

    def gguf_model_type(self, window: int | None) -> str:
        return "mistral" if window else "llama"

    def rope(self, f: GGUFFile, base: torch.Tensor, rope: Rope) -> Rope:
        inv_freq, scaling, context = rope
        if "rope_freqs.weight" in f.tensors:  # Llama 3: each frequency divided by its factor
            factors = torch.from_numpy(f.tensors["rope_freqs.weight"].dequantize().copy())  # [dim / 2]
            inv_freq = (inv_freq if inv_freq is not None else base) / factors
        return inv_freq, scaling, context

    def tensor(self, kind: str, tensor: QuantTensor, config: dict) -> QuantTensor:
        # llama.cpp interleaves the rotary halves of llama's Q and K rows per head; the native
        # layers (as transformers) rotate halves, so the rows go back, on the raw block rows
        if kind not in ("attn_q", "attn_k"):
            return tensor
        heads = config["num_heads"] if kind == "attn_q" else config["num_kv_heads"]
        return QuantTensor(tensor.name, tensor.qtype, tensor.shape, unpermute_rows(tensor.data, heads))


def unpermute_rows(rows: np.ndarray, n_head: int) -> np.ndarray:
    """[N, ...] rows (block bytes or floats; a bias [N]) per head from llama.cpp's (dim, 2)
    interleaving back to transformers' (2, dim) halves; a copy of these rows only."""
    n = rows.shape[0]
    dim = n // n_head // 2
    return np.ascontiguousarray(rows.reshape(n_head, dim, 2, -1).swapaxes(1, 2).reshape(rows.shape))


class Qwen2(Architecture):
    gguf_name = "qwen2"
    model_types = ("qwen2",)
