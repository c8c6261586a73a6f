"""The emitted tokens' logprobs (specdec/logprobs.py) in OpenAI's response shapes.

- chat: `{"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}`,
  `top_logprobs` holding the request's `top_logprobs` likeliest tokens of the row;
- completions (legacy): `{tokens, token_logprobs, top_logprobs: [{token: logprob}], text_offset}`,
  each dict the `logprobs` likeliest tokens plus the chosen one, `text_offset` the offset in
  the completion's text of the first character each token adds to.
Streamed, each chunk carries the tokens generated since the previous chunk; the chunks'
lists concatenate to the non-streamed one. A token's `bytes` are its exact bytes (from
llguidance's view of the tokenizer, which grammar.py builds anyway), its string their UTF-8
text; a token holding part of a character reads "bytes:\\xe2\\x80" as in OpenAI's API (so
two such tokens never share a key of the legacy top_logprobs dicts).
"""

from __future__ import annotations

import codecs
import threading

from specdec.errors import SpecdecError
from specdec.grammar import ll_tokenizer
from specdec.logprobs import TokenLogprob


class LogprobFormatter:
    """Token strings and bytes for one tokenizer; built when a request first asks for logprobs."""

    def __init__(self, tokenizer, eos_token_ids: set[int], lock: threading.Lock):
        self.tokenizer, self.eos_token_ids, self._lock = tokenizer, eos_token_ids, lock
        self._ll = None
        self._ready = False
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def prepare(self) -> None:
        """Build llguidance's tokenizer view (slow on a large vocabulary): call off the event loop."""
        with self._lock:  # the tokenizer is not safe to share between threads
            if not self._ready:
                try:
                    self._ll = ll_tokenizer(self.tokenizer, self.eos_token_ids)
                except SpecdecError:  # a slow tokenizer: fall back to decoding one id
                    self._ll = None
                self._ready = True

    def token(self, token_id: int) -> tuple[str, list[int]]:
        if token_id not in self._cache:
            self.prepare()
            if self._ll is not None:
                raw = self._ll.decode_bytes([token_id])
            else:
                with self._lock:
                    raw = self.tokenizer.decode([token_id]).encode("utf-8")
            self._cache[token_id] = (_token_text(raw), list(raw))
        return self._cache[token_id]

    def raw(self, token_id: int) -> bytes:
        return bytes(self.token(token_id)[1])

    def request(self, chat: bool, top_n: int) -> RequestLogprobs:
        return RequestLogprobs(self, chat, top_n)


class RequestLogprobs:
    """One request's logprobs: the whole list, or chunk by chunk as tokens arrive."""

    def __init__(self, formatter: LogprobFormatter, chat: bool, top_n: int):
        self.formatter, self.chat, self.top_n = formatter, chat, top_n
        self.pending: list[TokenLogprob] = []
        self.text_offset = 0  # completions: characters of the text before the next token
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")  # the text, as bytes arrive

    def add(self, entries: list[TokenLogprob]) -> None:
        self.pending.extend(entries)

    def take(self) -> dict | None:
        """The pending tokens' logprobs for the next chunk (None when there are none)."""
        entries, self.pending = self.pending, []
        if not entries:
            return None
        return self._chat(entries) if self.chat else self._completion(entries)

    def whole(self, entries: list[TokenLogprob] | None) -> dict | None:
        if entries is None:
            return None
        return self._chat(entries) if self.chat else self._completion(entries)

    def _chat(self, entries: list[TokenLogprob]) -> dict:
        token = self.formatter.token

        def one(token_id: int, logprob: float) -> dict:
            text, raw = token(token_id)
            return {"token": text, "logprob": logprob, "bytes": raw}

        content = [{**one(e.token, e.logprob), "top_logprobs": [one(i, lp) for i, lp in e.top[: self.top_n]]}
                   for e in entries]
        return {"content": content}

    def _completion(self, entries: list[TokenLogprob]) -> dict:
        token = self.formatter.token
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for e in entries:
            text = token(e.token)[0]
            top = {token(i)[0]: lp for i, lp in e.top[: self.top_n]}
            top.setdefault(text, e.logprob)
            out["tokens"].append(text)
            out["token_logprobs"].append(e.logprob)
            out["top_logprobs"].append(top)
            out["text_offset"].append(self.text_offset)
            self.text_offset += len(self._utf8.decode(self.formatter.raw(e.token)))
        return out


def _token_text(raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
