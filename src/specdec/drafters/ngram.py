"""`ngram`: prompt lookup decoding (Saxena 2023).

Find the longest suffix of the context (between `min` and `max` tokens) that occurred earlier
in the prompt or the generated text, and propose what followed its most recent occurrence.

Example: context [5 6 7 1 2 5 6] with max=2 matches the suffix [5 6] at position 0 and
proposes [7 1 2 ...] up to k tokens.

The index is a dict per n-gram length, updated incrementally as the context grows, so a
step costs O(max) dict operations however long the context is.
"""

from __future__ import annotations

from specdec.drafters import Draft, Drafter, DrafterSpec, register
from specdec.errors import SpecdecError


class NgramDrafter(Drafter):
    name = "ngram"

    def __init__(self, min_n: int = 2, max_n: int = 8, eos_token_ids: set[int] | None = None):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min <= max, got min={min_n} max={max_n}")
        self.min_n, self.max_n = min_n, max_n
        self.eos_token_ids = eos_token_ids or set()
        self._reset([])

    def _reset(self, context: list[int]) -> None:
        # n -> {ngram tuple: start index of the continuation after its latest occurrence}
        self._index: dict[int, dict[tuple[int, ...], int]] = {
            n: {} for n in range(self.min_n, self.max_n + 1)
        }
        self._context: list[int] = []
        self._indexed = 0  # ngrams ending before this position are indexed

    def begin(self, prompt_ids, params, generator) -> None:
        self._reset(prompt_ids)

    def _sync(self, context: list[int]) -> None:
        n_old = len(self._context)
        if context[:n_old] != self._context:  # not an extension of what we indexed: rebuild
            self._reset(context)
        self._context = list(context)
        # Index every ngram that has at least one token after it, i.e. ends before len-1.
        for end in range(self._indexed, len(context) - 1):
            for n in range(self.min_n, min(self.max_n, end + 1) + 1):
                self._index[n][tuple(context[end - n + 1 : end + 1])] = end + 1
        self._indexed = max(self._indexed, len(context) - 1)

    def propose(self, context_ids: list[int], k: int) -> Draft:
        if k <= 0:
            return Draft([])
        self._sync(context_ids)
        for n in range(min(self.max_n, len(context_ids)), self.min_n - 1, -1):
            start = self._index[n].get(tuple(context_ids[-n:]))
            if start is not None:
                tokens = context_ids[start : start + k]
                for i, token in enumerate(tokens):
                    if token in self.eos_token_ids:  # never draft past the end of a turn
                        tokens = tokens[: i + 1]
                        break
                return Draft(tokens)
        return Draft([])


@register("ngram")
def _make(spec: DrafterSpec, target) -> Drafter:
    try:
        min_n = int(spec.options.get("min", 2))
        max_n = int(spec.options.get("max", 8))
        return NgramDrafter(min_n, max_n, getattr(target, "eos_token_ids", set()))
    except ValueError as e:
        raise SpecdecError(f"bad ngram options in {spec.text!r}: {e}", "drafter") from e
