"""Model backends: a causal LM with a KV cache that can be rolled back.

A backend holds one sequence. `forward` appends tokens to the cache and returns one
next-token logit row per input token; `rollback` truncates the cache to an earlier length.
Speculative decoding relies on rollback, so every backend must implement and test it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Protocol

import torch

from specdec.errors import SpecdecError


class ModelBackend(Protocol):
    vocab_size: int
    max_length: int  # context window in tokens

    @property
    def length(self) -> int:
        """Number of tokens held in the KV cache."""
        ...

    def prefill(self, token_ids: list[int], all_logits: bool = True, keep: int = 0) -> torch.Tensor:
        """Reset the cache, feed `token_ids`; return logits [len(token_ids) - keep, V], or only
        the last row [1, V] with all_logits=False (skips the LM head over a long prompt).
        With keep > 0 the first `keep` tokens stay cached from an earlier prefill (see
        `cached_prefix`) and only the rest is fed."""
        ...

    def cached_prefix(self, token_ids: list[int]) -> int:
        """How many leading `token_ids` this cache holds from earlier prefills: the `keep`
        a prefill of `token_ids` may pass."""
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


def forward_batch(sequences: list[ModelBackend], token_lists: list[list[int]]) -> list[torch.Tensor]:
    """One scoring pass for several sequences: returns logits [len(tokens_i), V] for each.

    Backends whose sequences share a batched pool (attribute `pool` with `forward_batch`)
    run one batched forward; others fall back to one forward per sequence.
    """
    pool = getattr(sequences[0], "pool", None) if sequences else None
    if pool is not None and all(getattr(s, "pool", None) is pool for s in sequences):
        return pool.forward_batch(sequences, token_lists)
    return [seq.forward(tokens) for seq, tokens in zip(sequences, token_lists, strict=True)]


# A factory builds a fresh backend (its own KV cache) over a loaded target's weights from
# the options a user gave (None values already dropped); it rejects options it does not know.
BackendFactory = Callable[..., ModelBackend]
REGISTRY: dict[str, BackendFactory] = {}
_BUILTIN_MODULES = ("hf", "native")


def register(name: str) -> Callable[[BackendFactory], BackendFactory]:
    def wrap(factory: BackendFactory) -> BackendFactory:
        REGISTRY[name] = factory
        return factory

    return wrap


def _load_builtins() -> None:
    for module in _BUILTIN_MODULES:
        importlib.import_module(f"{__name__}.{module}")


def available() -> list[str]:
    _load_builtins()
    return sorted(REGISTRY)


def make_backend(kind: str, target, **options) -> ModelBackend:
    """A fresh backend (its own KV cache) over the loaded target's weights.

    Options (None values are ignored) are the backend's own: `specdec generate --help` lists
    them; native takes precision (fp32|bf16|int8|int4), device, max_length, slots and compile.
    """
    _load_builtins()
    factory = REGISTRY.get(kind)
    if factory is None:
        raise SpecdecError(f"unknown backend {kind!r}; choose one of: {', '.join(available())}", "backend")
    return factory(target, **{key: value for key, value in options.items() if value is not None})
