"""Reading a Hugging Face config (and state dict) into the native backend's terms.

`native_config` is the one place that reads an HF config: the architecture's features, the
rope frequencies (transformers' own init functions for scaled ropes), the sliding window and
the fallbacks of fields older configs lack. NativeConfig.from_hf calls it; the eagle drafter
reads its target's dimensions through it too. `hf_state` turns an HF state dict into the
native conventions (Gemma's norms store w where the multiplier is 1 + w).
"""

from __future__ import annotations

import torch

from specdec.errors import SpecdecError

GEMMA_TYPES = ("gemma3_text",)
QK_NORM_TYPES = ("qwen3", *GEMMA_TYPES)
# rope types whose frequencies do not depend on the sequence length ("dynamic" and
# "longrope" recompute them as a sequence grows, which a static cache of tables cannot follow)
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}  # transformers' name -> NativeConfig's


def native_config(config, supported: tuple[str, ...], embedding_dtype: torch.dtype = torch.float32) -> dict:
    """NativeConfig's fields for an HF config, or a one-line SpecdecError naming what the
    native backend does not implement. `embedding_dtype`: the loaded embedding's dtype, to which
    transformers rounds Gemma's embedding scale."""
    model_type = config.model_type
    if model_type not in supported:
        raise SpecdecError(f"the native backend supports {', '.join(supported)} models, not {model_type!r}; "
                           "use the hf backend", "backend")  # fmt: skip
    _refuse_unsupported(config)
    heads = int(config.num_attention_heads)
    gemma = model_type in GEMMA_TYPES
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
        qk_norm=model_type in QK_NORM_TYPES,
        sandwich_norms=gemma,
        activation=ACTIVATIONS[_activation_name(config)],
        final_logit_softcap=getattr(config, "final_logit_softcapping", None),
    )
    nested = "full_attention" in (getattr(config, "rope_parameters", None) or {})  # gemma3: per layer type
    theta, inv_freq, scaling = rope_frequencies(config, "full_attention" if nested else None)
    fields.update(rope_theta=theta, rope_inv_freq=inv_freq, rope_attention_scaling=scaling)
    window, layer_types = _sliding(config, fields["num_layers"])
    fields.update(sliding_window=window, layer_types=layer_types)
    if gemma:
        local_theta, local_freq, _ = rope_frequencies(config, "sliding_attention")
        if local_freq is not None:
            raise SpecdecError("the native backend runs gemma3's sliding layers with the default rope only", "backend")
        fields.update(
            rope_local_theta=local_theta,
            # transformers keeps the scale as a tensor cast to the embedding's dtype (bf16 rounds it)
            embedding_scale=float(torch.tensor(config.hidden_size**0.5).to(embedding_dtype)),
            attention_scale=float(config.query_pre_attn_scalar) ** -0.5,
        )
    return fields


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
                           f"(it runs {', '.join(STATIC_ROPE_TYPES)}); use the hf backend", "backend")  # fmt: skip
    if kind == "default":
        return theta, None, 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, scaling = ROPE_INIT_FUNCTIONS[kind](config, torch.device("cpu"), layer_type=layer_type)
    return theta, tuple(inv_freq.float().tolist()), float(scaling)


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
                           f"(it runs {', '.join(ACTIVATIONS)}); use the hf backend", "backend")  # fmt: skip
    return name


def _refuse_unsupported(config) -> None:
    """A one-line error for each config feature the native layers do not compute."""
    params = getattr(config, "rope_parameters", None) or {}
    partial = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    if partial not in (None, 1.0):
        raise SpecdecError(f"the native backend does not implement partial rotary embeddings "
                           f"(partial_rotary_factor {partial}); use the hf backend", "backend")  # fmt: skip
    if getattr(config, "attn_logit_softcapping", None) is not None:
        raise SpecdecError("the native backend does not implement attn_logit_softcapping; use the hf backend",
                           "backend")  # fmt: skip
    if getattr(config, "use_bidirectional_attention", False):
        raise SpecdecError("the native backend does not implement use_bidirectional_attention", "backend")


def hf_state(model_type: str, state: dict) -> dict:
    """An HF state dict in the native conventions: norm weights are the multipliers, so
    Gemma's `1 + w` norms get their one added (a new fp32 tensor each; the rest is shared)."""
    if model_type not in GEMMA_TYPES:
        return state
    return {name: (1.0 + value.float()) if name.endswith("norm.weight") else value for name, value in state.items()}
