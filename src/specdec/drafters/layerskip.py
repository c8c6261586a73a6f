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

import json
from pathlib import Path

import torch

from specdec.drafters import Drafter, DrafterSpec, register
from specdec.drafters.common import DecoderParts
from specdec.drafters.draft_model import ModelDrafter
from specdec.errors import SpecdecError

CONFIG_FORMAT = "specdec-layerskip"


class LayerStack:
    """A `RollbackLM` (what a draft model needs of a backend) that runs only `layer_ids` of the
    target, over its own KV cache."""

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


def save_choice(path: str | Path, target_name: str, num_layers: int, layer_ids: list[int],
                report: dict) -> None:
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
            f"{path} was searched for a {data.get('num_layers')}-layer target; this one has {num_layers}",
            "drafter",
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
