"""Model backends: a causal LM with a KV cache that can be rolled back.

A backend holds one sequence. `forward` appends tokens to the cache and returns one
next-token logit row per input token; `rollback` truncates the cache to an earlier length.
Speculative decoding relies on rollback, so every backend must implement and test it.

`Backend` is the whole contract the engine, the server's scheduler, the drafters and the
benchmarks use (with `FeatureModel` and `DraftHead` for drafters that read the target's
features); both built-in backends (hf.py, native/) implement every member. Adding a backend
is one module with a class that satisfies `Backend` and a factory registered with
`@register("name")` that validates the backend's own options.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
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


class DraftHead(Protocol):
    """A draft head's decoder layer (EAGLE's) on a backend's kernels, over a KV cache of its
    own that a position rolls back, with the target's LM head for logits; `FeatureModel.draft_head`
    builds it."""

    def forward(self, features: torch.Tensor, embeds: torch.Tensor, past: int) -> torch.Tensor:
        """features, embeds [T, H] -> predicted next features [T, H]. Keys and values go to
        positions past..past+T-1; the queries see positions < past + T."""
        ...

    def forward_nodes(self, features: torch.Tensor, embeds: torch.Tensor, positions: list[int], store: int,
                      visible: torch.Tensor) -> torch.Tensor:
        """Draft-tree nodes [T, H] -> their predicted next features [T, H]. Node j is rotated
        for positions[j], its keys and values go to slot store + j, and it attends to the slots
        that visible [T, store + T] marks (the context, its ancestors' slots and its own)."""
        ...

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """features [T, H] -> logits [T, V] fp32, or [T, len(vocab_ids)] over the subset it was built with."""
        ...


class FeatureModel(Protocol):
    """What a drafter that works on the target's features reads of the target: its input
    embeddings and LM head as the backend holds them, and a head layer on its kernels. Two
    sequences of one model give equal FeatureModels, so a drafter builds its head once."""

    @property
    def hidden_size(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Token ids [T] -> [T, H] fp32, the inputs the target's first layer reads."""
        ...

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """Post-norm features [T, H] -> logits [T, V] fp32, soft-capped as the target's are."""
        ...

    def draft_head(self, state: dict[str, torch.Tensor], dims: dict, vocab_ids: torch.Tensor | None,
                   precision: str | None = None) -> DraftHead:
        """A head from its trained weights (`drafters.eagle.EagleHead`'s state_dict names) and
        dimensions (its config); with `vocab_ids` its logits cover only those LM-head rows
        (FR-Spec). precision fp32 | bf16 | int8, or None for the backend's choice."""
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

    def feature_model(self) -> FeatureModel:
        """The target's embedding, LM head and kernels for a drafter that reads `hidden`."""
        ...

    @property
    def compile_seconds(self) -> float:
        """Seconds spent compiling the model behind this backend; 0.0 when it is not compiled."""
        ...


@dataclass(frozen=True)
class KVMemory:
    """The size of a pool's KV cache. Where it is `lazy` (a Linux CPU), memory is committed as
    tokens are written and given back when a slot is cleared, so `committed_bytes` follows the
    tokens held and `limit_bytes` (every slot full) is address space, not memory in use."""

    slots: int
    window: int  # tokens a slot may hold
    dtype: str
    bytes_per_token: int
    limit_bytes: int
    held_tokens: int  # positions the slots have made ready, summed (rounded up per slot)
    committed_bytes: int  # an estimate, page by page
    lazy: bool

    def describe(self) -> str:
        gib = 1024**3
        growth = "committed as tokens are held" if self.lazy else "allocated whole"
        return (f"KV cache: {self.slots} slots x {self.window} tokens, {self.dtype}, "
                f"{self.bytes_per_token / 1024:.1f} KiB a token; {growth}, "
                f"at most {self.limit_bytes / gib:.2f} GiB")


class SlotPool(Protocol):
    """Sequences over one shared KV cache, scored together by one batched forward."""

    def kv_memory(self) -> KVMemory:
        """The cache's size now and at most."""
        ...

    @property
    def free_slots(self) -> int:
        """How many more sequences `new_sequence` can hand out."""
        ...

    def new_sequence(self) -> Backend:
        """A fresh sequence in a free slot."""
        ...

    def fork(self, source: Backend, length: int) -> Backend:
        """A sequence in a free slot holding the first `length` tokens of `source`'s cache (a
        prefix its `prefix_cache` would let a prefill keep), with their bits; `source` keeps
        its own."""
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
    return [seq.forward(tokens, rows)
            for seq, tokens, rows in zip(sequences, token_lists, unscored, strict=True)]


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
