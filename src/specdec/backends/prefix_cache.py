"""Prefix caching: a later prompt that starts with what a KV cache already holds keeps it.

Every backend owns a `PrefixCache`, the record of what its KV cache holds from prefills, and
runs its `prefill` through `chunked_prefill`, which consults and updates that record.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from specdec.errors import SpecdecError

PREFILL_CHUNK = 128  # prompts are fed in chunks that start at multiples of this position
PREFIX_CACHE_MODES = ("prompt", "decoded", "off")


def prefix_cache_mode(value: bool | str) -> str:
    """prompt: reuse prefilled prompt tokens, bit-exact against a cold start (the default);
    decoded: also the previous answers of a conversation; off: prefill every prompt whole.
    True and False stand for prompt and off."""
    mode = {True: "prompt", False: "off"}[value] if isinstance(value, bool) else value
    if mode not in PREFIX_CACHE_MODES:
        raise SpecdecError(f"prefix_cache must be one of {', '.join(PREFIX_CACHE_MODES)}, got {value!r}",
                           "prefix_cache")
    return mode


def prefill_chunks(token_ids: list[int], start: int) -> list[list[int]]:
    """Split the tokens that go at positions start.. into chunks cut at multiples of
    PREFILL_CHUNK. Chunk boundaries depend on positions only, so a prompt's keys and values
    come out of the same passes whether it is prefilled cold or after a cached prefix."""
    chunks, pos, i = [], start, 0
    while i < len(token_ids):
        n = PREFILL_CHUNK - pos % PREFILL_CHUNK
        chunks.append(list(token_ids[i : i + n]))
        i, pos = i + n, pos + n
    return chunks


def chunk_end(start: int, stop: int, budget: int | None) -> int:
    """Where a prefill of positions start..stop pauses when it may feed `budget` more tokens
    (None: no limit): on a chunk boundary, and at least one chunk on, so that a prefill fed
    over several scheduler steps runs the very chunks, and gives the very bits, of a whole one."""
    if budget is None or stop - start <= budget:
        return stop
    end = start + budget
    next_boundary = start + PREFILL_CHUNK - start % PREFILL_CHUNK
    return min(stop, max(end - end % PREFILL_CHUNK, next_boundary))


class PrefixCache:
    """Remembers which cached tokens came from prefills, so that a later prompt starting with
    them keeps their keys and values and prefills only the rest: prefix caching with one
    entry per KV cache. Multi-turn agents resend their conversation and share system prompts
    and tool lists, so most of a prompt is usually cached already.

    Reuse changes no bits: only prefilled tokens count (not decoded ones, which a drafter's
    chunks computed), the kept prefix ends at a chunk boundary, and prefills cut their chunks
    at fixed positions (`prefill_chunks`), so a prompt's keys and values are those of a cold
    prefill whatever the cache held before.

    A backend whose prompt rows carry the bits of one-token steps (`steps_exact`: the native
    backend on its int8-activation kernels) writes every cached token, prompt or answer, as a
    cold prefill would, whatever the chunks: there every mode but "off" keeps all a prompt
    shares with the cache, answers included, with no chunk grid, and stays bit-exact.

    In mode "decoded" (`--prefix-cache decoded`), a finished request's answer counts too
    (`mark_decoded`): the next turn of a conversation skips re-reading the answer, as vLLM's
    and SGLang's prefix caches do. A prompt that shares only cold-prefilled tokens with the
    cache is kept as above, bit-exact; one that reaches into the decoded answer keeps all it
    shares, and then reads keys written by decode steps, so a warm conversation may continue
    differently from a cold one. Speculative and plain decoding still agree: the native
    backend writes a decoded token's keys with the same bits whether it was scored alone,
    among drafts or in a tree, and a request ends with its cache holding exactly the tokens
    plain decoding would have fed. In mode "off" nothing is kept.

    The owning backend tells the record what happens to its cache: `truncate` after every
    rollback or reset, `start_prefill` before it feeds a prompt, `require_hidden` once it
    keeps hidden states.
    """

    def __init__(self, mode: str = "prompt", steps_exact: Callable[[], bool] | None = None):
        self.mode = prefix_cache_mode(mode)
        self._steps_exact = steps_exact  # None: prompt chunks have bits of their own
        self._tokens: list[int] = []  # the cache's first tokens, written by prefills (or marked)
        self._cold = 0  # how many of them hold the bits of a cold prefill
        self._tokens_hidden = False  # whether their hidden states were kept too
        self._need_hidden = False  # the backend keeps hidden states: a kept prefix must have them

    @property
    def steps_exact(self) -> bool:
        """Whether the backend writes a prompt's tokens with the bits of one-token steps now."""
        return self._steps_exact is not None and self._steps_exact()

    @property
    def reuse_decoded(self) -> bool:
        """Whether finished answers count as cached (mode "decoded", or any mode but "off"
        where the backend's prompts are steps_exact)."""
        return self.mode == "decoded" or (self.mode == "prompt" and self.steps_exact)

    def cached_prefix(self, token_ids: list[int]) -> int:
        """How many leading `token_ids` the cache holds from earlier prefills: the `keep` a
        prefill of `token_ids` may pass (0 in mode "off")."""
        if self.mode == "off" or (self._need_hidden and not self._tokens_hidden):
            return 0  # off, or a drafter needs features that the cached prefix did not keep
        n = 0
        for a, b in zip(self._tokens, token_ids, strict=False):
            if a != b:
                break
            n += 1
        return n if self._off_grid_ok(n) else n - n % PREFILL_CHUNK

    def _off_grid_ok(self, n: int) -> bool:
        """Whether a kept prefix of n tokens may end off the chunk grid: every token holds a
        cold prefill's bits (steps_exact), or it reaches into a decoded answer that counts."""
        return self.steps_exact or (self.reuse_decoded and n > self._cold)

    def extended_by(self, token_ids: list[int]) -> bool:
        """Whether `token_ids` start with every token the cache holds: a prefill of them (the
        conversation's next turn) loses nothing the cache holds but its chunk's tail."""
        return self._tokens == list(token_ids[: len(self._tokens)])

    def adopt(self, other: PrefixCache, length: int) -> None:
        """This cache now holds the first `length` tokens of `other`'s (a copy of its keys and
        values), with their bits as they were there."""
        self._tokens, self._cold = other._tokens[:length], min(other._cold, length)
        self._tokens_hidden = other._tokens_hidden

    def mark_decoded(self, token_ids: list[int], cache_length: int) -> None:
        """Record that the cache, `cache_length` tokens long, holds exactly `token_ids` (a
        finished request's prompt and answer, all but its last token); in mode "decoded"
        later prompts may keep them. Refused when the lengths differ."""
        if (self.reuse_decoded and cache_length == len(token_ids)
                and self._tokens == list(token_ids[: len(self._tokens)])):
            self._tokens = list(token_ids)

    def require_hidden(self) -> None:
        """The backend keeps hidden states from now on: only a prefix prefilled with them counts."""
        self._need_hidden = True

    def check_keep(self, token_ids: list[int], keep: int) -> None:
        """Raise ValueError unless the cache holds the first `keep` of `token_ids` on the chunk
        grid (or off it, where `_off_grid_ok`)."""
        off_grid = keep % PREFILL_CHUNK and not self._off_grid_ok(keep)
        if off_grid or keep > len(self._tokens) or self._tokens[:keep] != list(token_ids[:keep]):
            raise ValueError(f"keep={keep}: the cache does not hold these tokens up to a chunk boundary")

    def start_prefill(self, token_ids: list[int], keep: int) -> None:
        """Record a prefill of `token_ids` that keeps `keep` cached tokens; the backend has
        already rolled back to them (or reset, for keep 0)."""
        # the rest is prefilled on the chunk grid: cold bits too, if what it follows has them
        # (after the rollback, _cold == keep exactly when the kept tokens are all cold)
        if (self._cold == keep and keep % PREFILL_CHUNK == 0) or self.steps_exact:
            self._cold = len(token_ids)
        self._tokens_hidden = self._need_hidden and (self._tokens_hidden or not keep)
        self._tokens = list(token_ids)  # written once the backend's forward has run

    def truncate(self, length: int) -> None:
        """The cache now holds only its first `length` tokens (a rollback or a reset)."""
        del self._tokens[length:]
        self._cold = min(self._cold, length)


def chunk_groups(chunks: list[list[int]], group_tokens: int | None) -> list[list[list[int]]]:
    """Consecutive chunks gathered into groups of at most `group_tokens` tokens (at least one
    chunk each); None: one chunk a group."""
    if group_tokens is None:
        return [[chunk] for chunk in chunks]
    groups: list[list[list[int]]] = []
    size = 0
    for chunk in chunks:
        if not groups or size + len(chunk) > group_tokens:
            groups.append([])
            size = 0
        groups[-1].append(chunk)
        size += len(chunk)
    return groups


class Prefilled(Protocol):
    """What `chunked_prefill` uses of a backend (backends.Backend has it)."""

    prefix_cache: PrefixCache
    vocab_size: int

    def reset(self) -> None: ...

    def rollback(self, length: int) -> None: ...


def chunked_prefill(backend: Prefilled, feed: Callable[[list[list[int]], bool], torch.Tensor],
                    token_ids: list[int], all_logits: bool, keep: int,
                    group_tokens: int | None = None) -> torch.Tensor:
    """A backend's `prefill`: reset (or roll back to `keep` cached tokens, as its prefix cache
    allows) and feed the rest of `token_ids` with feed(chunks, last_only): one chunk of
    `prefill_chunks` at a time, or with `group_tokens` consecutive chunks of up to that many
    tokens, for a backend that gives each chunk of a group the bits it would get alone. Returns
    logits [T - keep, V], or with all_logits=False only [1, V] of the last token, which skips
    the LM head for the rest of a long prompt."""
    record = backend.prefix_cache
    if keep:
        try:
            record.check_keep(token_ids, keep)
        except ValueError:
            backend.reset()
            raise
        backend.rollback(keep)
    else:
        backend.reset()
    record.start_prefill(token_ids, keep)
    try:
        chunks = prefill_chunks(list(token_ids[keep:]), keep)
        logits = [feed(group, not all_logits) for group in chunk_groups(chunks, group_tokens)]
    except BaseException:
        backend.reset()  # a half-written prefix must not be reused
        raise
    if not logits:
        return torch.empty(0, backend.vocab_size)
    return torch.cat(logits) if all_logits else logits[-1]
