"""Pieces the drafters share: the parts of a target model a partial forward needs, its
causal mask, and the common-prefix test that lets a draft cache keep what the target accepted."""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

from specdec.errors import SpecdecError


def common_prefix(a: list[int], b: list[int], limit: int) -> int:
    """How many leading tokens a and b share, at most `limit`. A draft model asks this every
    step over the whole context, where they differ in the last few tokens if at all: all but
    the last 64 are compared in one C loop first."""
    n = min(len(a), len(b), limit)
    start = max(0, n - 64)
    if start and a[:start] != b[:start]:
        start = 0
    for i in range(start, n):
        if a[i] != b[i]:
            return i
    return n


@dataclass
class DecoderParts:
    """The pieces of a transformers causal LM that a partial forward needs, shared, not copied."""

    embed: torch.nn.Module
    layers: list[torch.nn.Module]
    norm: torch.nn.Module
    rotary: torch.nn.Module
    lm_head: torch.nn.Module
    layer_types: list[str]  # "full_attention" or "sliding_attention" per layer
    sliding_window: int | None
    softcap: float | None  # Gemma's final logit soft-capping
    rotary_by_type: bool  # Gemma 3 keeps one rotary table per layer type

    @classmethod
    def of(cls, model: torch.nn.Module) -> DecoderParts:
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        base = model.get_decoder()
        needed = ("embed_tokens", "layers", "norm", "rotary_emb")
        if not all(hasattr(base, name) for name in needed):
            raise SpecdecError(
                f"{type(model).__name__} does not expose embed_tokens/layers/norm/rotary_emb; "
                "layer skipping needs a Llama-family model", "drafter"
            )
        layers = list(base.layers)
        types = list(getattr(config, "layer_types", None) or ["full_attention"] * len(layers))
        rotary_params = inspect.signature(base.rotary_emb.forward).parameters
        return cls(
            embed=base.embed_tokens,
            layers=layers,
            norm=base.norm,
            rotary=base.rotary_emb,
            lm_head=model.get_output_embeddings(),
            layer_types=types,
            sliding_window=getattr(config, "sliding_window", None),
            softcap=getattr(config, "final_logit_softcapping", None),
            rotary_by_type="layer_type" in rotary_params,
        )

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def position_embeddings(self, hidden: torch.Tensor, positions: torch.Tensor, layer_type: str):
        if self.rotary_by_type:
            return self.rotary(hidden, positions, layer_type)
        return self.rotary(hidden, positions)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Post-norm hidden [..., H] -> logits [..., V], with the target's soft-capping."""
        logits = self.lm_head(hidden)
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def run_layers(
        self,
        hidden: torch.Tensor,
        layer_ids: list[int],
        past: int,
        cache=None,
    ) -> torch.Tensor:
        """Run `layer_ids` in order over hidden [1, T, H] at positions past..past+T-1.

        With a cache, each layer appends its keys/values under its own index; without one,
        the T tokens attend only to each other (a teacher-forced forward of a whole sequence).
        """
        t = hidden.shape[1]
        positions = torch.arange(past, past + t, device=hidden.device).unsqueeze(0)  # [1, T]
        keys = past + t if cache is not None else t
        masks: dict[str, torch.Tensor | None] = {}
        rotaries: dict[str, tuple] = {}
        for i in layer_ids:
            kind = self.layer_types[i]
            if kind not in masks:
                window = self.sliding_window if kind == "sliding_attention" else None
                masks[kind] = causal_mask(t, keys, hidden.dtype, hidden.device, window)
                rotaries[kind] = self.position_embeddings(hidden, positions, kind)
            out = self.layers[i](
                hidden,
                attention_mask=masks[kind],
                position_ids=positions,
                cache=cache,
                use_cache=cache is not None,
                position_embeddings=rotaries[kind],
            )
            hidden = out[0] if isinstance(out, tuple) else out
        return hidden


def causal_mask(
    queries: int, keys: int, dtype: torch.dtype, device: torch.device, window: int | None = None
) -> torch.Tensor | None:
    """Additive mask [1, 1, queries, keys] for the last `queries` of `keys` positions.

    None when every query may see every key (one query, no window), which lets attention
    skip the mask. Additive floats work for both the eager and the SDPA attention paths.
    """
    past = keys - queries
    if queries == 1 and (window is None or keys <= window):
        return None
    q = torch.arange(past, keys, device=device).unsqueeze(1)  # [Q, 1] absolute positions
    k = torch.arange(keys, device=device).unsqueeze(0)  # [1, K]
    allowed = k <= q
    if window is not None:
        allowed &= q - k < window
    mask = torch.zeros(queries, keys, dtype=dtype, device=device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None]
