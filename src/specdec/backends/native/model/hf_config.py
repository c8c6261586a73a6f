"""Reading a Hugging Face config (and state dict) into the native backend's terms.

`native_config` is the one place that reads an HF config: the architecture's features, the
rope frequencies (transformers' own init functions for scaled ropes), the sliding window and
the fallbacks of fields older configs lack. NativeConfig.from_hf calls it; the eagle drafter
reads its target's dimensions through it too. `hf_state` turns an HF state dict into the
native conventions (Gemma's norms store w where the multiplier is 1 + w).
"""

from __future__ import annotations

import torch

from specdec.backends.native.arch import BY_MODEL_TYPE
from specdec.backends.native.arch.base import rope_frequencies
from specdec.errors import SpecdecError

ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}  # transformers' name -> NativeConfig's


def native_config(config, supported: tuple[str, ...], embedding_dtype: torch.dtype = torch.float32) -> dict:
    """NativeConfig's fields for an HF config, or a one-line SpecdecError naming what the
    native backend does not implement. `embedding_dtype`: the loaded embedding's dtype, to which
    transformers rounds Gemma's embedding scale."""
    model_type = config.model_type
    if model_type not in supported:
        raise SpecdecError(f"the native backend supports {', '.join(supported)} models, not {model_type!r}; "
                           "use the hf backend", "backend")
    _refuse_unsupported(config)
    heads, arch = int(config.num_attention_heads), BY_MODEL_TYPE[model_type]
    fields = dict(
        model_type=model_type,
        vocab_size=int(config.vocab_size),
        hidden_size=int(config.hidden_size),
        num_layers=int(config.num_hidden_layers),
        num_heads=heads,
        num_kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
        head_dim=int(getattr(config, "head_dim", None) or config.hidden_size // heads),
        rms_eps=float(config.rms_norm_eps),
        max_positions=int(getattr(config, "max_position_embeddings", None) or 2048),
        qk_norm=arch.qk_norm_hf,
        activation=ACTIVATIONS[_activation_name(config)],
        final_logit_softcap=getattr(config, "final_logit_softcapping", None),
    )
    nested = "full_attention" in (getattr(config, "rope_parameters", None) or {})  # gemma3: per layer type
    theta, inv_freq, scaling = rope_frequencies(config, "full_attention" if nested else None)
    fields.update(rope_theta=theta, rope_inv_freq=inv_freq, rope_attention_scaling=scaling)
    window, layer_types = _sliding(config, fields["num_layers"])
    fields.update(sliding_window=window, layer_types=layer_types)
    fields.update(arch.hf_features(config, embedding_dtype))
    return fields


def _sliding(config, layers: int) -> tuple[int | None, tuple[str, ...]]:
    """(window, layer types): mistral and phi3 slide on every layer, qwen2/3 and gemma3 on
    the layers their layer_types name; ((), None) where no layer slides."""
    window = getattr(config, "sliding_window", None)
    if not window or getattr(config, "use_sliding_window", True) is False:
        return None, ()
    types = tuple(getattr(config, "layer_types", None) or ("sliding_attention",) * layers)
    if "sliding_attention" not in types:
        return None, ()
    unknown = set(types) - {"sliding_attention", "full_attention"}
    if unknown:
        raise SpecdecError(f"the native backend does not implement layer types {sorted(unknown)}", "backend")
    return int(window), types


def _activation_name(config) -> str:
    name = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu")
    if name not in ACTIVATIONS:
        raise SpecdecError(f"the native backend does not implement the activation {name!r} "
                           f"(it runs {', '.join(ACTIVATIONS)}); use the hf backend", "backend")
    return name


def _refuse_unsupported(config) -> None:
    """A one-line error for each config feature the native layers do not compute."""
    params = getattr(config, "rope_parameters", None) or {}
    partial = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    if partial not in (None, 1.0):
        raise SpecdecError(f"the native backend does not implement partial rotary embeddings "
                           f"(partial_rotary_factor {partial}); use the hf backend", "backend")
    if getattr(config, "attn_logit_softcapping", None) is not None:
        raise SpecdecError("the native backend does not implement attn_logit_softcapping; use the hf backend",
                           "backend")
    if getattr(config, "use_bidirectional_attention", False):
        raise SpecdecError("the native backend does not implement use_bidirectional_attention", "backend")


def hf_state(model_type: str, state: dict) -> dict:
    """An HF state dict in the native conventions: norm weights are the multipliers, so
    Gemma's `1 + w` norms get their one added (a new fp32 tensor each; the rest is shared)."""
    if not BY_MODEL_TYPE[model_type].norms_plus_one:
        return state
    return {name: (1.0 + value.float()) if name.endswith("norm.weight") else value
            for name, value in state.items()}
