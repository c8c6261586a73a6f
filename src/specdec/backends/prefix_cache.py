"""Prefix caching: a later prompt that starts with what a KV cache already holds keeps it."""

from __future__ import annotations

import torch

PREFILL_CHUNK = 128  # prompts are fed in chunks that start at multiples of this position


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


class PrefixCache:
    """Remembers which cached tokens came from prefills, so that a later prompt starting with
    them keeps their keys and values and prefills only the rest: prefix caching with one
    entry per KV cache. Multi-turn agents resend their conversation and share system prompts
    and tool lists, so most of a prompt is usually cached already.

    Reuse changes no bits: only prefilled tokens count (not decoded ones, which a drafter's
    chunks computed), the kept prefix ends at a chunk boundary, and prefills cut their chunks
    at fixed positions (`prefill_chunks`), so a prompt's keys and values are those of a cold
    prefill whatever the cache held before.

    With `reuse_decoded` set (`--prefix-cache decoded`), a finished request's answer counts
    too (`mark_decoded`): the next turn of a conversation skips re-reading the answer, as
    vLLM's and SGLang's prefix caches do. A prompt that shares only cold-prefilled tokens
    with the cache is kept as above, bit-exact; one that reaches into the decoded answer keeps
    all it shares, and then reads keys written by decode steps, so a warm conversation may
    continue differently from a cold one. Speculative and plain decoding still agree: the
    native backend writes a decoded token's keys with the same bits whether it was scored
    alone, among drafts or in a tree, and a request ends with its cache holding exactly the
    tokens plain decoding would have fed.
    """

    reuse_decoded = False

    def _init_prefix(self) -> None:
        self._prefilled: list[int] = []  # the cache's first tokens, written by prefills (or marked)
        self._cold = 0  # how many of them hold the bits of a cold prefill
        self._prefilled_hidden = False  # whether their hidden states were kept too

    def cached_prefix(self, token_ids: list[int]) -> int:
        if self.keep_hidden and not self._prefilled_hidden:
            return 0  # a drafter needs features that the cached prefix did not keep
        n, cached = 0, self._prefilled
        for a, b in zip(cached, token_ids, strict=False):
            if a != b:
                break
            n += 1
        if self.reuse_decoded and n > self._cold:
            return n  # it reaches into a decoded answer: keep all of it
        return n - n % PREFILL_CHUNK

    def mark_decoded(self, token_ids: list[int]) -> None:
        """Record that the cache holds exactly `token_ids` (a finished request's prompt and
        answer, all but its last token); with `reuse_decoded`, later prompts may keep them."""
        if self.reuse_decoded and self.length == len(token_ids) and self._prefilled == list(token_ids[: len(self._prefilled)]):
            self._prefilled = list(token_ids)

    def _start_prefill(self, token_ids: list[int], keep: int) -> list[int]:
        """Roll back to `keep` cached tokens (or reset); return the tokens left to feed."""
        if keep:
            off_grid = keep % PREFILL_CHUNK and not (self.reuse_decoded and keep > self._cold)
            if off_grid or keep > len(self._prefilled) or self._prefilled[:keep] != list(token_ids[:keep]):
                self.reset()
                raise ValueError(f"keep={keep}: the cache does not hold these tokens up to a chunk boundary")
            cold = self._cold
            self.rollback(keep)
            # the rest is prefilled on the chunk grid: cold bits too, if what it follows has them
            self._cold = len(token_ids) if keep <= cold and keep % PREFILL_CHUNK == 0 else min(keep, cold)
        else:
            self.reset()
            self._cold = len(token_ids)
        self._prefilled_hidden = self.keep_hidden and (self._prefilled_hidden or not keep)
        self._prefilled = list(token_ids)  # written once the caller's forward has run
        return list(token_ids[keep:])

    def _drop_prefix(self, length: int) -> None:  # after rollback(length) or reset()
        del self._prefilled[length:]
        self._cold = min(self._cold, length)

    def prefill(self, token_ids: list[int], all_logits: bool = True, keep: int = 0) -> torch.Tensor:
        """Reset (or keep `keep` cached tokens) and feed the rest of `token_ids` chunk by chunk;
        logits [T, V], or with all_logits=False only [1, V] of the last token, which skips the
        LM head for the rest of a long prompt."""
        rest = self._start_prefill(token_ids, keep)
        try:
            logits = [self._prefill_chunk(chunk, not all_logits) for chunk in prefill_chunks(rest, keep)]
        except BaseException:
            self.reset()  # a half-written prefix must not be reused
            raise
        if not logits:
            return torch.empty(0, self.vocab_size)
        return torch.cat(logits) if all_logits else logits[-1]

    def _prefill_chunk(self, chunk: list[int], last_only: bool) -> torch.Tensor:
        raise NotImplementedError
