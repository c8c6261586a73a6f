"""Reading GGUF files as they are: metadata, and each tensor in its own quant type.

The header and the mapping are specdec.gguf_file's (`GGUFFile`). Nothing here dequantizes: a
tensor is a `QuantTensor` over the mapped bytes.

`read_gguf` turns a file of one of the native architectures (arch/: llama incl. Llama 3 and
mistral files, qwen2, qwen3, gemma3, phi3) into NativeConfig's fields, the rope frequencies
and the tensors under Hugging Face names (the native backend's state-dict convention). Where
an architecture differs (names, features, rope, llama's rotary row interleaving), its module
in arch/ says how. state.py builds the native model's state from what this returns.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from specdec.backends.native.arch import BY_GGUF
from specdec.backends.native.arch.base import Architecture
from specdec.backends.native.quant_types import check_type
from specdec.errors import SpecdecError
from specdec.gguf_file import GGUFFile, QuantTensor, gguf_file

TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


@dataclass
class GGUFModel:
    """What the native backend builds from: NativeConfig's fields, the rope, the tensors."""

    path: Path
    architecture: str  # the file's general.architecture
    config: dict  # NativeConfig fields
    rope_inv_freq: tuple[float, ...] | None  # the full layers' [head_dim / 2] where the file scales the rope
    rope_attention_scaling: float  # multiplies cos and sin (phi3's long-context factor)
    tensors: dict[str, QuantTensor]  # HF names -> the file's tensors (q/k rows already un-interleaved)


def read_gguf(path: str | Path) -> GGUFModel:
    """The native model a GGUF file describes, or a one-line SpecdecError for what the native
    backend does not run (an architecture, a rope scaling, a tensor type)."""
    f = gguf_file(path)
    name = f.meta("general.architecture")
    if name not in BY_GGUF:
        raise SpecdecError(f"the native backend reads {', '.join(BY_GGUF)} GGUF files, not {name!r}",
                           "target")
    arch = BY_GGUF[name]
    config = _config(f, arch)
    inv_freq, scaling, max_positions = _rope(f, arch, config)
    config["max_positions"] = max_positions
    tensors = _tensors(f, arch, config)
    return GGUFModel(f.path, name, config, inv_freq, scaling, tensors)


def _meta_reader(f: GGUFFile, arch: Architecture):
    """`meta(key, default)`: the file's `<arch>.<key>`, one number where it is per layer."""

    def meta(key: str, default=None):
        value = f.meta(f"{arch.gguf_name}.{key}", default)
        if isinstance(value, np.ndarray):  # per-layer values (e.g. kv heads) must agree to be one number
            if len(set(value.tolist())) > 1:
                raise SpecdecError(f"{f.path.name}: per-layer {key} {sorted(set(value.tolist()))} is not "
                                   "supported by the native backend", "target")
            value = value.tolist()[0]
        return value

    return meta


def _config(f: GGUFFile, arch: Architecture) -> dict:
    """NativeConfig's fields: one metadata key per field, then the architecture's own."""
    meta = _meta_reader(f, arch)
    if meta("block_count") is None or meta("embedding_length") is None:
        raise SpecdecError(f"{f.path.name}: the {arch.gguf_name} metadata lacks block_count "
                           "or embedding_length", "target")
    hidden, heads = int(meta("embedding_length")), int(meta("attention.head_count"))
    head_dim = int(meta("attention.key_length", hidden // heads))
    _refuse_unsupported(f, meta, head_dim)
    embed = f.tensors.get("token_embd.weight")
    if embed is None:
        raise SpecdecError(f"{f.path.name} has no token_embd.weight tensor", "target")
    layers, window = int(meta("block_count")), meta("attention.sliding_window")
    config = dict(
        model_type=arch.gguf_model_type(window),
        vocab_size=int(f.tensors.get("output.weight", embed).shape[0]),
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(meta("attention.head_count_kv", heads)),
        head_dim=head_dim,
        rms_eps=float(meta("attention.layer_norm_rms_epsilon", 1e-6)),
        max_positions=int(meta("context_length", 2048)),
        rope_theta=float(meta("rope.freq_base", 10000.0)),
        qk_norm="blk.0.attn_q_norm.weight" in f.tensors,
        final_logit_softcap=_optional_float(meta("final_logit_softcapping")),
    )
    config.update(arch.gguf_features(meta, layers, hidden, heads, head_dim))
    if window:
        sliding = arch.sliding_layers(f, layers)
        config.update(sliding_window=int(window),
                      layer_types=tuple("sliding_attention" if s else "full_attention" for s in sliding))
    return config


def _refuse_unsupported(f: GGUFFile, meta, head_dim: int) -> None:
    """A one-line error for each feature of the file the native layers do not compute."""
    if int(meta("attention.value_length", head_dim)) != head_dim:
        raise SpecdecError(f"{f.path.name}: keys and values of different widths are not supported", "target")
    rotary = int(meta("rope.dimension_count", head_dim))
    if rotary != head_dim:
        raise SpecdecError(f"{f.path.name}: a partial rotary embedding ({rotary} of {head_dim} dims) "
                           "is not supported by the native backend", "target")
    if meta("attn_logit_softcapping") is not None:
        raise SpecdecError(f"{f.path.name}: attention logit softcapping is not supported", "target")


def _optional_float(value) -> float | None:
    return None if value in (None, 0, 0.0) else float(value)


def _rope(f: GGUFFile, arch: Architecture, config: dict) -> tuple[tuple[float, ...] | None, float, int]:
    """(the full layers' inverse frequencies where the file changes them, else None, the cos/sin
    scaling, the context the model runs to): the file's linear scaling, then the architecture's."""
    dim, theta, context = config["head_dim"], config["rope_theta"], config["max_positions"]
    # [dim / 2], as transformers
    base = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    kind = f.meta(f"{arch.gguf_name}.rope.scaling.type", "none")
    factor = float(f.meta(f"{arch.gguf_name}.rope.scaling.factor", 1.0) or 1.0)
    inv_freq = None
    if kind == "linear" and factor != 1.0:
        inv_freq = base / factor
    elif kind not in ("none", "linear"):
        raise SpecdecError(f"{f.path.name}: rope scaling {kind!r} is not supported by the native backend "
                           "(it runs none, linear, Llama 3's rope_freqs and phi3's LongRoPE)", "target")
    inv_freq, scaling, context = arch.rope(f, base, (inv_freq, 1.0, context))
    return (None if inv_freq is None else tuple(inv_freq.tolist())), scaling, context


def _tensors(f: GGUFFile, arch: Architecture, config: dict) -> dict[str, QuantTensor]:
    names = arch.names()
    out: dict[str, QuantTensor] = {}
    for name, tensor in f.tensors.items():
        if name in arch.rope_tensors:
            continue  # read by _rope
        parts = name.split(".")  # blk.3.attn_q.weight | output_norm.weight
        if parts[0] == "blk" and len(parts) == 4 and parts[2] in names:
            key, kind = f"model.layers.{parts[1]}.{names[parts[2]]}.{parts[3]}", parts[2]
        elif len(parts) == 2 and parts[0] in TOP_NAMES:
            key, kind = f"{TOP_NAMES[parts[0]]}.{parts[1]}", parts[0]
        else:
            raise SpecdecError(f"{f.path.name}: tensor {name!r} is not part of a {arch.gguf_name} model the "
                               "native backend runs", "target")
        check_type(name, tensor.qtype)
        out[key] = arch.tensor(kind, tensor, config)
    return out
