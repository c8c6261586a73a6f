"""`layerskip`: self-speculation with a subset of the target's own decoder layers.

The draft is the target with some layers skipped (early exit when the kept layers are the
first L; SWIFT / Draft&Verify style when they are spread out), followed by the target's own
final norm and LM head. It reuses the target's weights with no copy and keeps its own KV
cache, which holds keys/values only for the kept layers and rolls back like any backend.

Method strings:
- `layerskip`: a default subset (see `default_layers`);
- `layerskip:FILE`: the subset chosen by `specdec layerskip search` (a JSON file);
- `layerskip:layers=0-9,12`: explicit layer indices.
"""

from __future__ import annotations

import inspect
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from specdec.drafters import Drafter, DrafterSpec, register
from specdec.drafters.draft_model import ModelDrafter
from specdec.errors import SpecdecError

CONFIG_FORMAT = "specdec-layerskip"


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


class LayerStack:
    """A ModelBackend that runs only `layer_ids` of the target, over its own KV cache."""

    def __init__(self, model: torch.nn.Module, layer_ids: list[int]):
        from transformers import DynamicCache

        self.parts = DecoderParts.of(model)
        self.layer_ids = check_layers(layer_ids, self.parts.num_layers)
        self._cache_cls = DynamicCache
        self.vocab_size = int(self.parts.lm_head.weight.shape[0])
        self.max_length = int(getattr(model.config, "max_position_embeddings", 2048))
        self.device = next(model.parameters()).device
        self.reset()

    @property
    def length(self) -> int:
        return self._length

    def reset(self) -> None:
        # A lazily grown cache: layers are created under their own (sparse) indices.
        self._cache = self._cache_cls()
        self._length = 0

    def prefill(self, token_ids: list[int]) -> torch.Tensor:
        self.reset()
        return self.forward(token_ids)

    @torch.inference_mode()
    def forward(self, token_ids: list[int]) -> torch.Tensor:
        """Append `token_ids`; return logits [len(token_ids), V]."""
        if not token_ids:
            return torch.empty(0, self.vocab_size)
        if self._length + len(token_ids) > self.max_length:
            raise ValueError(f"context overflow: {self._length} + {len(token_ids)} > {self.max_length}")
        ids = torch.tensor([token_ids], dtype=torch.long, device=self.device)
        hidden = self.parts.embed(ids)  # [1, T, H]
        hidden = self.parts.run_layers(hidden, self.layer_ids, self._length, self._cache)
        self._length += len(token_ids)
        return self.parts.logits(self.parts.norm(hidden))[0].float().cpu()

    def rollback(self, length: int) -> None:
        if not 0 <= length <= self._length:
            raise ValueError(f"cannot roll back to {length}; the cache holds {self._length}")
        self._cache.crop(length - self._length)  # uninitialised (skipped) layers are left alone
        self._length = length


def check_layers(layer_ids: list[int], num_layers: int) -> list[int]:
    ids = sorted(set(int(i) for i in layer_ids))
    if not ids:
        raise SpecdecError("layerskip needs at least one layer", "drafter")
    bad = [i for i in ids if not 0 <= i < num_layers]
    if bad:
        raise SpecdecError(f"layer indices {bad} are out of range for a {num_layers}-layer target", "drafter")
    return ids


def default_layers(num_layers: int) -> list[int]:
    """The first third of the layers (at least one): early exit, the cheapest sensible draft."""
    return list(range(max(1, num_layers // 3)))


def parse_layers(text: str) -> list[int]:
    """'0-9,12,14' -> [0..9, 12, 14]."""
    ids: list[int] = []
    try:
        for part in text.split(","):
            lo, dash, hi = part.strip().partition("-")
            ids.extend(range(int(lo), int(hi) + 1) if dash else [int(lo)])
    except ValueError:
        raise SpecdecError(f"bad layer list {text!r}; expected e.g. 0-9,12", "drafter") from None
    return ids


def save_choice(path: str | Path, target_name: str, num_layers: int, layer_ids: list[int], report: dict) -> None:
    data = {
        "format": CONFIG_FORMAT,
        "target": target_name,
        "num_layers": num_layers,
        "layers": list(layer_ids),
        "search": report,
    }
    Path(path).write_text(json.dumps(data, indent=2) + "\n")


def load_choice(path: str | Path, num_layers: int) -> list[int]:
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise SpecdecError(f"layerskip file not found: {path}", "drafter") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SpecdecError(f"layerskip file {path} is not JSON: {e}", "drafter") from None
    if not isinstance(data, dict) or data.get("format") != CONFIG_FORMAT or "layers" not in data:
        raise SpecdecError(f"{path} is not a layerskip file written by `specdec layerskip search`", "drafter")
    if data.get("num_layers") != num_layers:
        raise SpecdecError(
            f"{path} was searched for a {data.get('num_layers')}-layer target; this one has {num_layers}", "drafter"
        )
    return check_layers(data["layers"], num_layers)


class LayerSkipDrafter(ModelDrafter):
    name = "layerskip"


@register("layerskip")
def _make(spec: DrafterSpec, target) -> Drafter:
    num_layers = DecoderParts.of(target.model).num_layers
    if "layers" in spec.options:
        layer_ids = parse_layers(spec.options["layers"])
    elif spec.arg:
        layer_ids = load_choice(spec.arg, num_layers)
    else:
        layer_ids = default_layers(num_layers)
    return LayerSkipDrafter(LayerStack(target.model, layer_ids), target.eos_token_ids)
