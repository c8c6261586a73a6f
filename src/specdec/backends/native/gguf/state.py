"""The native model's state from a GGUF file's tensors (reader.py's `GGUFModel`): linear layers
over the file's blocks (layers.py), the embedding lookup, fp32 norms; or, for another precision,
every tensor dequantized to fp32. The loader drops the mapped pages of what it copied."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

import torch

from specdec.backends.native.gguf.layers import (
    copies_weights,
    embedding_from_quant,
    head_copies_weights,
    head_from_quant,
    linear_from_quant,
)
from specdec.backends.native.gguf.reader import GGUFModel
from specdec.gguf_file import QuantTensor, gguf_file


def quant_state(model: GGUFModel, lm_head: str = "auto") -> dict:
    """The native model's state from the file's tensors as they are: each matrix a layer from
    `linear_from_quant` (its bias inside), the embedding from `embedding_from_quant`, norms fp32.
    A file without an output matrix ties the head to the embedding's tensor."""
    state, fused, fused_copies = _fused_state(model)
    for key, tensor in model.tensors.items():
        if key.endswith(".bias") or key in fused:
            continue  # inside its layer
        if key == "model.embed_tokens.weight":
            state[key] = embedding_from_quant(tensor)
        elif key == "lm_head.weight" and key[: -len("weight")] + "bias" not in model.tensors:
            state[key] = head_from_quant(tensor, lm_head)
        elif len(tensor.shape) == 2:
            bias = model.tensors.get(key[: -len("weight")] + "bias")
            state[key] = linear_from_quant(tensor, None if bias is None else _floats(bias))
        else:
            state[key] = _floats(tensor)  # a norm's multipliers [hidden] (gemma files store 1 + w)
    if "lm_head.weight" not in state:
        state["lm_head.weight"] = head_from_quant(model.tensors["model.embed_tokens.weight"], lm_head)
    # the head's rows decoded from its blocks (NativeModel.head_rows), a lookup like the embedding's
    state["lm_head.rows"] = embedding_from_quant(model.tensors.get("lm_head.weight",
                                                                   model.tensors["model.embed_tokens.weight"]))
    # the copied matrices' mapped pages, read once to build them, would stay resident (and
    # counted as this process's) while the cached GGUFFile maps the file: drop them. A tied
    # embedding's rows fault back in from the page cache as lookups read them.
    copied = [t.name for key, t in model.tensors.items()
              if len(t.shape) == 2 and (key in fused_copies or copies_weights(t))]
    head = model.tensors.get("lm_head.weight", model.tensors["model.embed_tokens.weight"])
    if head_copies_weights(head, lm_head):  # a tied embedding's rows fault back in as lookups read them
        copied.append(head.name)
    gguf_file(model.path).release(copied)
    _trim_heap()
    return state


# matrices that read one input, run as one kernel over their rows side by side when they share a type
_FUSED = (("self_attn.qkv_proj", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
          ("mlp.gate_up_proj", ("mlp.gate_proj", "mlp.up_proj")))


def _fused_state(model: GGUFModel) -> tuple[dict, set[str], set[str]]:
    """Each layer's q/k/v and gate/up as one FusedLinear under the fused name (the layer
    splits its output), so a step makes four kernel calls a layer, not seven: one kernel over
    the rows side by side where they share a type, shared activations where 8-bit types mix
    (gguf/layers.build_linear), else a part per tensor. Returns the state so far, the keys of
    the tensors it consumed and of those whose bytes it copied (the loader drops their mapped
    pages)."""
    state: dict = {}
    consumed: set[str] = set()
    copied: set[str] = set()
    for i in range(model.config["num_layers"]):
        prefix = f"model.layers.{i}."
        for joined, names in _FUSED:
            keys = [f"{prefix}{name}.weight" for name in names]
            tensors = [model.tensors.get(key) for key in keys]
            if any(t is None for t in tensors):
                continue
            biases = [model.tensors.get(key[: -len("weight")] + "bias") for key in keys]
            state[f"{prefix}{joined}.weight"] = linear_from_quant(tensors, [None if b is None else _floats(b)
                                                                            for b in biases])
            consumed.update(keys)
            one_type = len({t.qtype for t in tensors}) == 1  # their rows copied side by side
            copied.update(key for key, t in zip(keys, tensors, strict=True) if one_type or copies_weights(t))
    return state, consumed, copied


def float_state(model: GGUFModel) -> dict:
    """The same state with every tensor dequantized to fp32 (for precisions other than the
    file's own, e.g. bf16 on an accelerator): the native model then quantizes or casts them."""
    state = {key: _floats(tensor) for key, tensor in model.tensors.items()}
    state.setdefault("lm_head.weight", state["model.embed_tokens.weight"])
    gguf_file(model.path).release([t.name for t in model.tensors.values()])  # all copied to fp32
    return state


def _trim_heap() -> None:
    """Hand the heap's free pages back to the OS: the repacking's transients (int32 nibbles,
    fp32 scales, the per-tile packs) interleave with the kept copies, and glibc keeps the
    freed space between them resident (~13 MB on SmolLM2) unless asked. No-op elsewhere."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim():
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # not glibc (musl, macOS)
        return None


def _floats(tensor: QuantTensor) -> torch.Tensor:
    return torch.from_numpy(tensor.dequantize().copy())  # fp32 in tensor.shape, off the mapped file
