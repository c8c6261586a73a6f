"""Reading GGUF files as they are: metadata, and each tensor in its own quant type.

The header and the mapping are specdec.gguf_file's (`GGUFFile`). Nothing here dequantizes: a tensor is a `QuantTensor` over the mapped bytes.

`read_gguf` turns a file of one of the native architectures (llama incl. Llama 3 and
mistral files, qwen2, qwen3, gemma3, phi3) into NativeConfig's fields, the rope frequencies
and the tensors under Hugging Face names (the native backend's state-dict convention), with
llama's rotary row interleaving undone on the raw block rows. `quant_state` builds the state
dict the native model takes: linear layers (`linear_from_quant`), the embedding lookup
(`embedding_from_quant`) and fp32 norm vectors.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from specdec.backends.native.gguf_kernels import (
    copies_weights,
    embedding_from_quant,
    head_copies_weights,
    head_from_quant,
    linear_from_quant,
)
from specdec.backends.native.gguf_tensors import QuantTensor, check_type
from specdec.errors import SpecdecError
from specdec.gguf_file import MODEL_TYPES, GGUFFile, gguf_file

# ---- native architectures ----------------------------------------------------------------------


# llama.cpp's block tensor names -> Hugging Face names (the native state-dict convention)
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj", "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}  # fmt: skip
_ARCH_BLOCK_NAMES = {
    # gemma3's four norms: before and after attention, before and after the MLP
    "gemma3": {"ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
               "post_ffw_norm": "post_feedforward_layernorm"},
    "phi3": {"ffn_up": "mlp.gate_up_proj"},  # phi3's ffn_up holds gate and up, stacked
}  # fmt: skip
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_short.weight", "rope_factors_long.weight")
GEMMA3_SLIDING_PATTERN = 6  # every sixth gemma3 layer attends globally, the rest through the window
GEMMA3_LOCAL_ROPE_BASE = 10000.0  # the sliding layers' rope base where the file does not say


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
    arch = f.meta("general.architecture")
    if arch not in MODEL_TYPES:
        raise SpecdecError(f"the native backend reads {', '.join(MODEL_TYPES)} GGUF files, not {arch!r}", "target")
    config = _config(f, arch)
    inv_freq, scaling, max_positions = _rope(f, arch, config)
    config["max_positions"] = max_positions
    tensors = _tensors(f, arch, config)
    return GGUFModel(f.path, arch, config, inv_freq, scaling, tensors)


def _config(f: GGUFFile, arch: str) -> dict:
    """long: one metadata key per field, in NativeConfig's order, and each architecture's features."""

    def meta(key: str, default=None):
        value = f.meta(f"{arch}.{key}", default)
        if isinstance(value, np.ndarray):  # per-layer values (e.g. kv heads) must agree to be one number
            if len(set(value.tolist())) > 1:
                raise SpecdecError(f"{f.path.name}: per-layer {key} {sorted(set(value.tolist()))} is not "
                                   "supported by the native backend", "target")  # fmt: skip
            value = value.tolist()[0]
        return value

    if meta("block_count") is None or meta("embedding_length") is None:
        raise SpecdecError(f"{f.path.name}: the {arch} metadata lacks block_count or embedding_length", "target")
    hidden, heads = int(meta("embedding_length")), int(meta("attention.head_count"))
    head_dim = int(meta("attention.key_length", hidden // heads))
    if int(meta("attention.value_length", head_dim)) != head_dim:
        raise SpecdecError(f"{f.path.name}: keys and values of different widths are not supported", "target")
    rotary = int(meta("rope.dimension_count", head_dim))
    if rotary != head_dim:
        raise SpecdecError(f"{f.path.name}: a partial rotary embedding ({rotary} of {head_dim} dims) "
                           "is not supported by the native backend", "target")  # fmt: skip
    if meta("attn_logit_softcapping") is not None:
        raise SpecdecError(f"{f.path.name}: attention logit softcapping is not supported", "target")
    embed = f.tensors.get("token_embd.weight")
    head = f.tensors.get("output.weight", embed)
    if embed is None:
        raise SpecdecError(f"{f.path.name} has no token_embd.weight tensor", "target")
    layers = int(meta("block_count"))
    config = dict(
        model_type=MODEL_TYPES[arch],
        vocab_size=int(head.shape[0]),
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
    window = meta("attention.sliding_window")
    if arch == "gemma3":
        pattern = f.meta("gemma3.attention.sliding_window_pattern")  # per layer: True = sliding
        sliding = ([bool(v) for v in pattern] if pattern is not None
                   else [(i + 1) % GEMMA3_SLIDING_PATTERN != 0 for i in range(layers)])  # fmt: skip
        # llama.cpp's rule: the 27B (62 layers) scales queries by hidden / heads, the others by head_dim
        scale = (hidden / heads if layers == 62 else head_dim) ** -0.5
        config.update(
            sandwich_norms=True, activation="gelu_tanh", attention_scale=scale,
            embedding_scale=float(np.float32(math.sqrt(hidden))),
            rope_local_theta=float(meta("rope.freq_base_swa", GEMMA3_LOCAL_ROPE_BASE)),
        )  # fmt: skip
    else:
        sliding = [True] * layers  # mistral (llama files with a window) and phi3 slide on every layer
    if window:
        config.update(sliding_window=int(window),
                      layer_types=tuple("sliding_attention" if s else "full_attention" for s in sliding))
        if arch == "llama":
            config["model_type"] = "mistral"
    return config


def _optional_float(value) -> float | None:
    return None if value in (None, 0, 0.0) else float(value)


def _rope(f: GGUFFile, arch: str, config: dict) -> tuple[tuple[float, ...] | None, float, int]:
    """(the full layers' inverse frequencies where the file changes them, else None, the cos/sin
    scaling, the context the model runs to)."""
    dim, theta, context = config["head_dim"], config["rope_theta"], config["max_positions"]
    base = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))  # [dim / 2], as transformers
    kind = f.meta(f"{arch}.rope.scaling.type", "none")
    factor = float(f.meta(f"{arch}.rope.scaling.factor", 1.0) or 1.0)
    inv_freq, scaling = None, 1.0
    if kind == "linear" and factor != 1.0:
        inv_freq = base / factor
    elif kind not in ("none", "linear"):
        raise SpecdecError(f"{f.path.name}: rope scaling {kind!r} is not supported by the native backend "
                           "(it runs none, linear and Llama 3's rope_freqs)", "target")  # fmt: skip
    if "rope_freqs.weight" in f.tensors:  # Llama 3: each frequency divided by its factor
        factors = torch.from_numpy(f.tensors["rope_freqs.weight"].dequantize().copy())  # [dim / 2]
        inv_freq = (inv_freq if inv_freq is not None else base) / factors
    if "rope_factors_short.weight" in f.tensors:  # phi3's long-context rope (LongRoPE)
        original = int(f.meta(f"{arch}.rope.scaling.original_context_length", context))
        short = torch.from_numpy(f.tensors["rope_factors_short.weight"].dequantize().copy())
        inv_freq = base / short
        default = math.sqrt(1 + math.log(context / original) / math.log(original)) if context > original else 1.0
        scaling = float(f.meta(f"{arch}.rope.scaling.attn_factor", default))
        # the short factors hold up to the original context; past it the model switches to
        # the long ones, which a static table cannot follow: the model runs to `original`
        context = original
    return (None if inv_freq is None else tuple(inv_freq.tolist())), scaling, context


def _tensors(f: GGUFFile, arch: str, config: dict) -> dict[str, QuantTensor]:
    names = {**_BLOCK_NAMES, **_ARCH_BLOCK_NAMES.get(arch, {})}
    out: dict[str, QuantTensor] = {}
    for name, tensor in f.tensors.items():
        if name in _ROPE_TENSORS:
            continue  # read by _rope
        parts = name.split(".")  # blk.3.attn_q.weight | output_norm.weight
        if parts[0] == "blk" and len(parts) == 4 and parts[2] in names:
            key, kind = f"model.layers.{parts[1]}.{names[parts[2]]}.{parts[3]}", parts[2]
        elif len(parts) == 2 and parts[0] in _TOP_NAMES:
            key, kind = f"{_TOP_NAMES[parts[0]]}.{parts[1]}", parts[0]
        else:
            raise SpecdecError(f"{f.path.name}: tensor {name!r} is not part of a {arch} model the native "
                               "backend runs", "target")  # fmt: skip
        check_type(name, tensor.qtype)
        # llama.cpp interleaves the rotary halves of llama's Q and K rows per head; the native
        # layers (as transformers) rotate halves, so the rows go back, on the raw block rows
        if arch == "llama" and kind in ("attn_q", "attn_k"):
            heads = config["num_heads"] if kind == "attn_q" else config["num_kv_heads"]
            tensor = QuantTensor(tensor.name, tensor.qtype, tensor.shape, unpermute_rows(tensor.data, heads))
        out[key] = tensor
    return out


def unpermute_rows(rows: np.ndarray, n_head: int) -> np.ndarray:
    """[N, ...] rows (block bytes or floats; a bias [N]) per head from llama.cpp's (dim, 2)
    interleaving back to transformers' (2, dim) halves; a copy of these rows only."""
    n = rows.shape[0]
    dim = n // n_head // 2
    return np.ascontiguousarray(rows.reshape(n_head, dim, 2, -1).swapaxes(1, 2).reshape(rows.shape))


# ---- the native state dict ---------------------------------------------------------------------


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
    state["lm_head.rows"] = embedding_from_quant(model.tensors.get("lm_head.weight", model.tensors["model.embed_tokens.weight"]))
    # the copied matrices' mapped pages, read once to build them, would stay resident (and
    # counted as this process's) while the cached GGUFFile maps the file: drop them. A tied
    # embedding's rows fault back in from the page cache as lookups read them.
    copied = [t.name for key, t in model.tensors.items() if len(t.shape) == 2 and (key in fused_copies or copies_weights(t))]
    head = model.tensors.get("lm_head.weight", model.tensors["model.embed_tokens.weight"])
    if head_copies_weights(head, lm_head):  # a tied embedding's rows fault back in as lookups read them
        copied.append(head.name)
    gguf_file(model.path).release(copied)
    _trim_heap()
    return state


# matrices that read one input, run as one kernel over their rows side by side when they share a type
_FUSED = (("self_attn.qkv_proj", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
          ("mlp.gate_up_proj", ("mlp.gate_proj", "mlp.up_proj")))  # fmt: skip


def _fused_state(model: GGUFModel) -> tuple[dict, set[str], set[str]]:
    """Each layer's q/k/v and gate/up as one FusedLinear under the fused name (the layer
    splits its output), so a step makes four kernel calls a layer, not seven: one kernel over
    the rows side by side where they share a type, shared activations where 8-bit types mix
    (gguf_kernels.build_linear), else a part per tensor. Returns the state so far, the keys of
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
            state[f"{prefix}{joined}.weight"] = linear_from_quant(tensors, [None if b is None else _floats(b) for b in biases])
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
