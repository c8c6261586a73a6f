"""Model backends: a causal LM with a KV cache that can be rolled back.

A backend holds one sequence. `forward` appends tokens to the cache and returns one
next-token logit row per input token; `rollback` truncates the cache to an earlier length.
Speculative decoding relies on rollback, so every backend must implement and test it.

`Backend` is the whole contract the engine, the server's scheduler, the drafters and the
benchmarks use; both built-in backends (hf.py, native/) implement every member. Adding a
backend is one module with a class that satisfies `Backend` and a factory registered with
`@register("name")` that validates the backend's own options.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

import torch

from specdec.backends.prefix_cache import PrefixCache, prefix_cache_mode
from specdec.registry import Registry


@runtime_checkable
class RollbackLM(Protocol):
    """A causal LM over a KV cache that rolls back: what a draft model needs."""

    vocab_size: int
    max_length: int  # context window in tokens

    @property
    def length(self) -> int:
        """Number of tokens held in the KV cache."""
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


@runtime_checkable
class Backend(RollbackLM, Protocol):
    """A target model's backend: a RollbackLM plus prompts, token trees, batching and features."""

    prefix_cache: PrefixCache  # what the cache holds from prefills; `cached_prefix` gives a prefill's keep

    def forward(self, token_ids: list[int], unscored: list[int] | tuple = ()) -> torch.Tensor:
        """RollbackLM.forward; the rows `unscored` (a grammar allows one token there, so no one
        reads their logits) may come back as zeros, their LM head skipped."""
        ...

    def reset(self) -> None:
        """Empty the cache."""
        ...

    def prefill(self, token_ids: list[int], all_logits: bool = True, keep: int = 0) -> torch.Tensor:
        """Reset the cache, feed `token_ids`; return logits [len(token_ids) - keep, V], or only
        the last row [1, V] with all_logits=False (skips the LM head over a long prompt).
        With keep > 0 the first `keep` tokens stay cached from an earlier prefill (see
        `prefix_cache.cached_prefix`) and only the rest is fed."""
        ...

    @property
    def supports_tree(self) -> bool:
        """Whether `forward_tree` can score token trees; when False it raises ValueError."""
        ...

    def forward_tree(self, token_ids: list[int], parents: list[int]) -> torch.Tensor:
        """Append a token tree (parents[i] < i, or -1 below the last cached token); return
        logits [T, V]. Token i sits at position length + depth(i) and attends to the cache,
        its ancestors and itself. Follow with `keep` or `rollback` before appending."""
        ...

    def keep(self, indices: list[int]) -> None:
        """After `forward_tree`, keep only the tree nodes `indices` (a root-to-leaf path)."""
        ...

    @property
    def pool(self) -> SlotPool | None:
        """The pool whose batched forward scores this sequence with its siblings, or None."""
        ...

    def enable_hidden_states(self) -> None:
        """Keep the final post-norm hidden state of every cached token from now on (for
        drafters that read the target's features); they roll back with the cache."""
        ...

    @property
    def hidden(self) -> torch.Tensor | None:
        """[length, H] hidden states of the cached tokens; None until enable_hidden_states()."""
        ...

    @property
    def compile_seconds(self) -> float:
        """Seconds spent compiling the model behind this backend; 0.0 when it is not compiled."""
        ...


class SlotPool(Protocol):
    """Sequences over one shared KV cache, scored together by one batched forward."""

    @property
    def free_slots(self) -> int:
        """How many more sequences `new_sequence` can hand out."""
        ...

    def new_sequence(self) -> Backend:
        """A fresh sequence in a free slot."""
        ...

    def forward_batch(self, sequences: list[Backend], token_lists: list[list[int]],
                      unscored: list[list[int]] | None = None) -> list[torch.Tensor]:
        """Append token_lists[i] to sequences[i] (all of this pool); logits [len_i, V] each
        (unscored[i] as Backend.forward's `unscored`)."""
        ...


def forward_batch(sequences: list[Backend], token_lists: list[list[int]],
                  unscored: list[list[int]] | None = None) -> list[torch.Tensor]:
    """One scoring pass for several sequences: returns logits [len(tokens_i), V] for each
    (unscored[i]: rows of sequence i whose logits nobody reads, see Backend.forward).

    Sequences of one pool run one batched forward; others fall back to one forward each.
    """
    unscored = unscored or [[] for _ in sequences]
    pool = sequences[0].pool if sequences else None
    if pool is not None and all(s.pool is pool for s in sequences):
        return pool.forward_batch(sequences, token_lists, unscored)
    return [seq.forward(tokens, rows) for seq, tokens, rows in zip(sequences, token_lists, unscored, strict=True)]


# A factory builds a fresh backend (its own KV cache) over a loaded target's weights, with a
# PrefixCache in the given mode, from the options a user gave (None values already dropped);
# it raises a one-line SpecdecError for an option it does not know.
BackendFactory = Callable[..., Backend]
REGISTRY: Registry[BackendFactory] = Registry("backend", __name__, ("hf", "native", "auto"), "backend")
register, available = REGISTRY.register, REGISTRY.available


def make_backend(kind: str, target, prefix_cache: bool | str = "prompt", **options) -> Backend:
    """A fresh backend (its own KV cache) over the loaded target's weights.

    `kind` is hf, native or auto (native where it runs the target's architecture, else hf:
    backends/auto.py). `prefix_cache` is the PrefixCache mode (prompt|decoded|off; True and
    False stand for prompt and off). Options (None values are ignored) are the backend's own:
    `specdec generate --help` lists them; native takes precision (fp32|bf16|int8|int4),
    device, max_length, slots and compile.
    """
    factory = REGISTRY.lookup(kind)
    mode = prefix_cache_mode(prefix_cache)
    return factory(target, mode, **{key: value for key, value in options.items() if value is not None})
