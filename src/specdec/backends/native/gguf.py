"""Reading llama/qwen2 GGUF files into the native backend's HF-named state dict."""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from specdec.backends.native.quant import Int4Linear
from specdec.errors import SpecdecError

_GGUF_NAMES = {
    "token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}  # fmt: skip


def read_gguf(path, int4_blocks: bool = False) -> tuple[dict, dict]:
    """NativeConfig fields and the HF-named state dict of a llama/qwen2 GGUF. Float tensors are
    dequantized; with `int4_blocks`, Q4_0/Q4_1 matrices become `Int4Linear`s as they are."""
    reader = GGUFReader(str(path))

    def meta(key: str, default=None):
        field = reader.fields.get(key)
        return default if field is None else field.contents()

    arch = meta("general.architecture")
    if arch not in ("llama", "qwen2"):
        raise SpecdecError(f"the native backend reads llama and qwen2 GGUFs, not {arch!r}", "target")
    if meta(f"{arch}.rope.scaling.type", "none") not in ("none", None):
        raise SpecdecError("this GGUF uses rope scaling, which the native GGUF reader lacks; use the hf backend",
                           "target")
    heads = int(meta(f"{arch}.attention.head_count"))
    kv_heads = int(meta(f"{arch}.attention.head_count_kv", heads))
    hidden = int(meta(f"{arch}.embedding_length"))
    tensors = {t.name: t for t in reader.tensors}
    config = dict(
        model_type=arch,
        vocab_size=int(tensors["token_embd.weight"].shape[-1]),
        hidden_size=hidden,
        num_layers=int(meta(f"{arch}.block_count")),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=int(meta(f"{arch}.rope.dimension_count", hidden // heads)),
        rms_eps=float(meta(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        max_positions=int(meta(f"{arch}.context_length", 2048)),
        rope_theta=float(meta(f"{arch}.rope.freq_base", 10000.0)),
    )
    state: dict = {}
    for name, t in tensors.items():
        parts = name.split(".")  # blk.3.attn_q.weight | output_norm.weight
        if parts[0] == "blk":
            key = f"model.layers.{parts[1]}.{_GGUF_NAMES[parts[2]]}.{parts[3]}"
            kind = parts[2]
        else:
            key, kind = f"{_GGUF_NAMES[parts[0]]}.{parts[1]}", parts[0]
        data = t.data  # [N, bytes per row] for block formats, [N, K] or [N] for floats
        # llama.cpp interleaves the rotary halves of Q and K rows; transformers' layout is undone here.
        if arch == "llama" and kind in ("attn_q", "attn_k"):
            data = _unpermute_rows(np.asarray(data), heads if kind == "attn_q" else kv_heads)
        qtype = GGMLQuantizationType(t.tensor_type)
        if int4_blocks and qtype.name in ("Q4_0", "Q4_1") and parts[0] == "blk" and parts[-1] == "weight":
            state[key] = Int4Linear.from_gguf_blocks(np.asarray(data), qtype.name)
        else:
            floats = np.ascontiguousarray(dequantize(np.asarray(data), qtype), dtype=np.float32)
            state[key] = torch.from_numpy(floats if floats.flags.writeable else floats.copy())  # not the mmap
    return config, state


def _unpermute_rows(rows, n_head: int):
    # GGUF rows per head are (dim, 2) interleaved; transformers wants (2, dim)
    dim = rows.shape[0] // n_head // 2
    return rows.reshape(n_head, dim, 2, -1).swapaxes(1, 2).reshape(rows.shape)
