"""Reading GGUF files as they are: metadata, and each tensor in its own quant type.

`GGUFFile` parses the header itself and maps the file: the gguf package's `GGUFReader` turns
every element of the tokenizer's arrays into a numpy object, which takes seconds to a minute
for a 50k-260k vocabulary, while the header holds a few thousand scalars and a tensor table.
Nothing here dequantizes: a tensor is a `QuantTensor` over the mapped bytes.

`read_gguf` turns a file of one of the native architectures (llama incl. Llama 3 and
mistral files, qwen2, qwen3, gemma3, phi3) into NativeConfig's fields, the rope frequencies
and the tensors under Hugging Face names (the native backend's state-dict convention), with
llama's rotary row interleaving undone on the raw block rows. `quant_state` builds the state
dict the native model takes: linear layers (`linear_from_quant`), the embedding lookup
(`embedding_from_quant`) and fp32 norm vectors.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from specdec.backends.native.gguf_tensors import (
    QuantTensor,
    check_type,
    embedding_from_quant,
    linear_from_quant,
)
from specdec.errors import SpecdecError

# GGUF metadata value types: fixed-size scalars (struct format), 8 = string, 9 = array
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32, 7: np.bool_,
          10: np.uint64, 11: np.int64, 12: np.float64}  # fmt: skip
# types held as numpy floats; every other (BF16 included, as the gguf package reads it) is raw
# bytes, [N, bytes per row]
_FLOAT_DTYPES = {"F32": np.float32, "F16": np.float16}


@dataclass
class StringArray:
    """A metadata array of strings, decoded on first use (a tokenizer's 262k tokens cost time)."""

    blob: np.ndarray = field(repr=False)
    offset: int
    count: int

    def values(self) -> list[str]:
        out, pos = [], self.offset
        for _ in range(self.count):
            value, pos = _string(self.blob, pos)
            out.append(value)
        return out


class GGUFFile:
    """A GGUF file's metadata (`meta`) and tensors (`tensor`), memory-mapped."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            self.blob = np.memmap(self.path, dtype=np.uint8, mode="r")
        except (OSError, ValueError) as e:
            raise SpecdecError(f"cannot read GGUF file {str(path)!r}: {e}", "target") from None
        try:
            self.metadata, self.tensors = self._parse()
        except (struct.error, ValueError, IndexError, UnicodeDecodeError) as e:
            raise SpecdecError(f"{self.path.name} is not a readable GGUF file ({e})", "target") from None

    def meta(self, key: str, default=None):
        """A metadata value: a scalar, a str, a numpy array, or a StringArray."""
        return self.metadata.get(key, default)

    def _parse(self) -> tuple[dict, dict[str, QuantTensor]]:
        blob = self.blob
        if bytes(blob[:4]) != b"GGUF":
            raise ValueError("no GGUF magic")
        version, tensor_count, kv_count = struct.unpack_from("<IQQ", blob, 4)
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version}")
        metadata, pos = {}, 24
        for _ in range(kv_count):
            key, pos = _string(blob, pos)
            (kind,), pos = struct.unpack_from("<I", blob, pos), pos + 4
            metadata[key], pos = _value(blob, pos, kind)
        infos = []
        for _ in range(tensor_count):
            name, pos = _string(blob, pos)
            (dims,), pos = struct.unpack_from("<I", blob, pos), pos + 4
            ne = struct.unpack_from(f"<{dims}Q", blob, pos)
            kind, offset = struct.unpack_from("<IQ", blob, pos + 8 * dims)
            infos.append((name, ne, kind, offset))
            pos += 8 * dims + 12
        align = int(metadata.get("general.alignment", 32))
        start = -(-pos // align) * align
        return metadata, {name: self._tensor(name, ne, kind, start + offset) for name, ne, kind, offset in infos}

    def _tensor(self, name: str, ne: tuple[int, ...], kind: int, offset: int) -> QuantTensor:
        try:
            qtype = GGMLQuantizationType(kind)
        except ValueError:
            raise SpecdecError(f"tensor {name!r} has unknown GGUF type id {kind}", "target") from None
        shape = tuple(int(n) for n in reversed(ne))  # PyTorch order: rows last in the file's ne
        rows, width = math.prod(shape[:-1]), shape[-1]
        block, size = GGML_QUANT_SIZES[qtype]
        row_bytes = width // block * size
        data = self.blob[offset : offset + rows * row_bytes]
        if qtype.name in _FLOAT_DTYPES:
            data = data.view(_FLOAT_DTYPES[qtype.name]).reshape(shape)  # [N, K] (or [K]) of the float type
        else:
            data = data.reshape(rows, row_bytes)  # [N, bytes per row]
        return QuantTensor(name, qtype, shape, data)


def _string(blob: np.ndarray, pos: int) -> tuple[str, int]:
    (n,) = struct.unpack_from("<Q", blob, pos)
    return bytes(blob[pos + 8 : pos + 8 + n]).decode("utf-8"), pos + 8 + n


def _value(blob: np.ndarray, pos: int, kind: int):
    if kind in _SCALARS:
        return struct.unpack_from(_SCALARS[kind], blob, pos)[0], pos + struct.calcsize(_SCALARS[kind])
    if kind == 8:
        return _string(blob, pos)
    if kind != 9:
        raise ValueError(f"metadata type {kind}")
    item, count = struct.unpack_from("<IQ", blob, pos)
    pos += 12
    if item in _NUMPY:
        width = np.dtype(_NUMPY[item]).itemsize
        return np.asarray(blob[pos : pos + count * width]).view(_NUMPY[item]), pos + count * width
    if item == 8:
        array, end = StringArray(blob, pos, count), pos
        for _ in range(count):  # only the lengths are read to find the end
            (n,) = struct.unpack_from("<Q", blob, end)
            end += 8 + n
        return array, end
    raise ValueError(f"metadata array of type {item}")


@cache
def open_gguf(path: str, size: int, mtime_ns: int) -> GGUFFile:
    """One parsed file per path and version (a target and its draft may name the same file)."""
    return GGUFFile(path)


def gguf_file(path: str | Path) -> GGUFFile:
    stat = Path(path).stat()
    return open_gguf(str(Path(path).resolve()), stat.st_size, stat.st_mtime_ns)


# ---- native architectures ----------------------------------------------------------------------

# GGUF architecture -> the Hugging Face model_type the native backend knows it by
MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3_text", "phi3": "phi3"}

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


def quant_state(model: GGUFModel) -> dict:
    """The native model's state from the file's tensors as they are: each matrix a layer from
    `linear_from_quant` (its bias inside), the embedding from `embedding_from_quant`, norms fp32.
    A file without an output matrix ties the head to the embedding's tensor."""
    state: dict = {}
    for key, tensor in model.tensors.items():
        if key.endswith(".bias"):
            continue  # inside its layer
        if key == "model.embed_tokens.weight":
            state[key] = embedding_from_quant(tensor)
        elif len(tensor.shape) == 2:
            bias = model.tensors.get(key[: -len("weight")] + "bias")
            state[key] = linear_from_quant(tensor, None if bias is None else _floats(bias))
        else:
            state[key] = _floats(tensor)  # a norm's multipliers [hidden] (gemma files store 1 + w)
    if "lm_head.weight" not in state:
        state["lm_head.weight"] = linear_from_quant(model.tensors["model.embed_tokens.weight"])
    return state


def float_state(model: GGUFModel) -> dict:
    """The same state with every tensor dequantized to fp32 (for precisions other than the
    file's own, e.g. bf16 on an accelerator): the native model then quantizes or casts them."""
    state = {key: _floats(tensor) for key, tensor in model.tensors.items()}
    state.setdefault("lm_head.weight", state["model.embed_tokens.weight"])
    return state


def _floats(tensor: QuantTensor) -> torch.Tensor:
    return torch.from_numpy(tensor.dequantize().copy())  # fp32 in tensor.shape, off the mapped file
