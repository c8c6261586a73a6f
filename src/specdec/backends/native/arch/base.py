"""What an architecture may change in the native backend, with the defaults (none). Each module
of this package subclasses `Architecture` for one family and says only where it differs; the
GGUF reader (gguf/reader.py) and the HF config reader (model/hf_config.py) ask it."""

from __future__ import annotations

import torch

from specdec.errors import SpecdecError
from specdec.gguf_file import GGUFFile, QuantTensor

# llama.cpp's block tensor names -> Hugging Face names (the native state-dict convention)
BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}

# rope types whose frequencies do not depend on the sequence length ("dynamic" and
# "longrope" recompute them as a sequence grows, which a static cache of tables cannot follow)
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
Rope = tuple[torch.Tensor | None, float, int]  # (inverse frequencies or None, cos/sin scaling, context)


class Architecture:
    gguf_name: str = ""  # the file's general.architecture
    model_types: tuple[str, ...] = ()  # the Hugging Face model types it covers (the first: a GGUF's)
    block_names: dict[str, str] = {}  # its own block tensor names, beside BLOCK_NAMES
    rope_tensors: tuple[str, ...] = ()  # GGUF tensors its rope reads (not model weights)
    qk_norm_hf: bool = False  # an HF config of it norms each head's q and k (the GGUF says by its tensors)
    norms_plus_one: bool = False  # its HF norms store w where the multiplier is 1 + w

    def names(self) -> dict[str, str]:
        return {**BLOCK_NAMES, **self.block_names}

    def gguf_features(self, meta, layers: int, hidden: int, heads: int, head_dim: int) -> dict:
        """NativeConfig fields beyond llama's from a GGUF's metadata (`meta(key, default)` reads
        `<arch>.<key>`)."""
        return {}

    def sliding_layers(self, f: GGUFFile, layers: int) -> list[bool]:
        """Which layers attend through the window where the file has one: all, by default."""
        return [True] * layers

    def gguf_model_type(self, window: int | None) -> str:
        return self.model_types[0]

    def rope(self, f: GGUFFile, base: torch.Tensor, rope: Rope) -> Rope:
        """The rope after the architecture's own scaling; `base` the default inverse frequencies."""
        return rope

    def tensor(self, kind: str, tensor: QuantTensor, config: dict) -> QuantTensor:
        """A block tensor as the native layers read it (`kind`: its llama.cpp name)."""
        return tensor

    def hf_features(self, config, embedding_dtype: torch.dtype) -> dict:
        """NativeConfig fields beyond llama's from a Hugging Face config."""
        return {}


def rope_frequencies(config, layer_type: str | None = None) -> tuple[float, tuple[float, ...] | None, float]:
    """(rope theta, the inverse frequencies where the rope is scaled, else None, the cos/sin
    scaling) of `config`, or of one layer type's rope where the config keeps one per type."""
    params = getattr(config, "rope_parameters", None) or {}
    if layer_type is not None:
        params = params[layer_type] or {}
    theta = float(params.get("rope_theta", getattr(config, "rope_theta", None) or 10000.0))
    kind = params.get("rope_type", "default")
    if kind not in STATIC_ROPE_TYPES:
        raise SpecdecError(f"the native backend does not implement rope_type {kind!r} "
                           f"(it runs {', '.join(STATIC_ROPE_TYPES)}); use the hf backend", "backend")
    if kind == "default":
        return theta, None, 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, scaling = ROPE_INIT_FUNCTIONS[kind](config, torch.device("cpu"), layer_type=layer_type)
    return theta, tuple(inv_freq.float().tolist()), float(scaling)
