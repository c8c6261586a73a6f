"""Incremental detokenization with stop strings that may end inside a multi-token block."""

from __future__ import annotations


class TextTracker:
    """Follows generated ids, finds stop strings, and hands out text deltas that are final.

    A delta never includes text that could still turn out to be the start of a stop string,
    nor a half-decoded UTF-8 character.
    """

    def __init__(self, tokenizer, stop: list[str] | None = None):
        self.tokenizer = tokenizer
        self.stop = [s for s in (stop or []) if s]
        self.ids: list[int] = []
        self.text = ""
        self.sent = 0  # characters already handed out as deltas
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, new_ids: list[int]) -> int | None:
        """Append ids. If a stop string completes, return how many of `new_ids` to keep."""
        before = len(self.ids)
        searched_from = max(0, len(self.text) - max((len(s) for s in self.stop), default=0))
        self.ids.extend(new_ids)
        self.text = self._decode(self.ids)
        if not self.stop:
            return None
        hits = [(pos, s) for s in self.stop if (pos := self.text.find(s, searched_from)) >= 0]
        if not hits:
            return None
        pos, stop = min(hits)
        end = pos + len(stop)
        keep = len(new_ids)
        for j in range(before + 1, len(self.ids) + 1):  # first token that completes the stop string
            if len(self._decode(self.ids[:j])) >= end:
                keep = j - before
                break
        self.ids = self.ids[: before + keep]
        self.text = self.text[:pos]
        self.stopped = True
        return keep

    def truncate(self, num_ids: int) -> None:
        self.ids = self.ids[:num_ids]
        self.text = self._decode(self.ids)

    def delta(self, final: bool = False) -> str:
        end = len(self.text)
        if not final and not self.stopped:
            end -= self._held_back()
        if end <= self.sent:
            return ""
        out = self.text[self.sent : end]
        self.sent = end
        return out

    def _held_back(self) -> int:
        text = self.text
        if text.endswith("\ufffd"):  # an incomplete multi-byte character
            return 1
        longest = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:n]):
                    longest = max(longest, n)
                    break
        return longest
