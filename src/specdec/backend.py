"""Model backends: a causal LM with a KV cache that can be rolled back.

A backend holds one sequence. `forward` appends tokens to the cache and returns one
next-token logit row per input token; `rollback` truncates the cache to an earlier length.
Speculative decoding relies on rollback, so every backend must implement and test it.
"""

from __future__ import annotations

from typing import Protocol

import torch


class ModelBackend(Protocol):
    vocab_size: int
    max_length: int  # context window in tokens

    @property
    def length(self) -> int:
        """Number of tokens held in the KV cache."""
        ...

    def prefill(self, token_ids: list[int]) -> torch.Tensor:
        """Reset the cache, feed `token_ids`; return logits [len(token_ids), V]."""
        ...

    def forward(self, token_ids: list[int]) -> torch.Tensor:
        """Append `token_ids` after the cached ones; return logits [len(token_ids), V].

        Row i is the next-token distribution after token i, so k drafts plus the pending
        token give the k+1 distributions verification needs.
        """
        ...

    def rollback(self, length: int) -> None:
        """Truncate the cache to its first `length` tokens."""
        ...


class HFBackend:
    """A transformers causal LM over a DynamicCache; rollback is `DynamicCache.crop`."""

    def __init__(self, model: torch.nn.Module):
        from transformers import DynamicCache

        self._cache_cls = DynamicCache
        self.model = model.eval()
        config = model.config
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.max_length = int(getattr(config, "max_position_embeddings", 2048))
        self.device = next(model.parameters()).device
        self._length = 0
        self.reset()
        self.last_hidden: torch.Tensor | None = None  # [T, H] of the last forward, for drafters

    @property
    def length(self) -> int:
        return self._length

    def reset(self) -> None:
        self._cache = self._cache_cls(config=self.model.config)
        # Sliding-window layers keep their full past until `crop`, so rollback stays possible.
        if hasattr(self._cache, "activate_past_recording"):
            self._cache.activate_past_recording()
        self._length = 0

    def prefill(self, token_ids: list[int]) -> torch.Tensor:
        self.reset()
        return self.forward(token_ids)

    @torch.inference_mode()
    def forward(self, token_ids: list[int]) -> torch.Tensor:
        if not token_ids:
            return torch.empty(0, self.vocab_size)
        if self._length + len(token_ids) > self.max_length:
            raise ValueError(f"context overflow: {self._length} + {len(token_ids)} > {self.max_length}")
        input_ids = torch.tensor([token_ids], dtype=torch.long, device=self.device)
        positions = torch.arange(self._length, self._length + len(token_ids), device=self.device)
        out = self.model(
            input_ids=input_ids,
            cache=self._cache,
            use_cache=True,
            cache_position=positions,
            position_ids=positions.unsqueeze(0),
        )
        self._length += len(token_ids)
        return out.logits[0].float().cpu()

    def rollback(self, length: int) -> None:
        if not 0 <= length <= self._length:
            raise ValueError(f"cannot roll back to {length}; the cache holds {self._length}")
        self._cache.crop(length - self._length)  # a negative count removes that many tokens
        self._length = length


def forward_batch(sequences: list[ModelBackend], token_lists: list[list[int]]) -> list[torch.Tensor]:
    """One scoring pass for several sequences: returns logits [len(tokens_i), V] for each.

    Backends whose sequences share a batched pool (attribute `pool` with `forward_batch`)
    run one batched forward; others fall back to one forward per sequence.
    """
    pool = getattr(sequences[0], "pool", None) if sequences else None
    if pool is not None and all(getattr(s, "pool", None) is pool for s in sequences):
        return pool.forward_batch(sequences, token_lists)
    return [seq.forward(tokens) for seq, tokens in zip(sequences, token_lists, strict=True)]


BACKENDS = ("hf",)


def make_backend(kind: str, target) -> ModelBackend:
    """A fresh backend (its own KV cache) over the loaded target's weights."""
    if kind == "hf":
        return HFBackend(target.model)
    from .errors import SpecdecError

    raise SpecdecError(f"unknown backend {kind!r}; choose one of: {', '.join(BACKENDS)}", "backend")
