"""Closing completions: from any grammar state, a short run of tokens that completes the reply.

A structured reply (grammar.Constraint.closes) must stay valid whatever max_tokens allows, so
the engine keeps, at every step, a completion that ends it from the current grammar state
(grammar.GrammarMatcher.closing). `find_closing` searches for one with llguidance's own
matcher, trying tokens and rolling back, over a small vocabulary of structural and
minimal-value tokens (`ClosingVocab`); it is not a second grammar engine: the grammar decides
what each token may be, this module only decides which allowed token to try first. At each
state of the search:

1. the tokens the grammar forces (keys, punctuation, the rest of an enum value) are taken;
2. inside a string (a letter or a space is allowed), a token that closes it: `"` followed by
   closing brackets, longest first, then a filler letter (a string with minLength);
3. elsewhere: closing brackets (`}`, `]`, `}}`, ...), longest first; a comma (the next
   required key or array item); an empty string `""`, `0`, `null`, `false`, `true` as a
   minimal value; an opening quote; the rest of a number (`-`, `.`, `e`, digits); an opening
   bracket;
4. when none of them is allowed (a key name, a pattern), the allowed token with the lowest id.

The search stops once the grammar accepts. It is deterministic: a completion depends only on
the grammar state. It is not the shortest one, only one whose length is known before it
starts, capped at MAX_CLOSING tokens (none found: the state has no known completion).
"""

from __future__ import annotations

from dataclasses import dataclass

import llguidance
import numpy as np

# The longest completion searched for; a state that needs more (a reply nested very deep) has
# no known completion, so the engine never enters it while the budget is finite.
MAX_CLOSING = 512
_BRACKETS = frozenset("}]")
_VALUES = ('""', "0", "null", "false", "true", "{}", "[]")  # one-token minimal values, shortest first
_NUMBER = ("-", ".", "e", "1", "2", "3", "4", "5", "6", "7", "8", "9", "+")
_FILLERS = ("a", "x", "0", " ")  # string content for a minLength


@dataclass(frozen=True)
class ClosingVocab:
    """The tokens the search tries, in order of preference (one tokenizer's ids)."""

    string_probes: tuple[int, ...]  # allowed only inside a string: a letter, a space
    in_string: tuple[int, ...]  # `"` then brackets, longest first; then fillers
    elsewhere: tuple[int, ...]  # brackets, comma, minimal values, quote, number parts, openers
    eos: frozenset[int]


def closing_vocab(ll: llguidance.LLTokenizer, eos_token_ids: set[int]) -> ClosingVocab:
    """The search's tokens for one llguidance tokenizer: a pass over the vocabulary, in numpy-free
    Python (grammar.closing_vocab keeps one per tokenizer)."""
    by_text: dict[str, int] = {}
    quote_closers, bracket_closers = [], []
    for token in range(ll.vocab_size):
        if ll.is_special_token(token) or token in eos_token_ids:
            continue
        text = ll.decode_bytes([token]).decode("utf-8", "replace")
        by_text.setdefault(text, token)  # the lowest id of each text
        if text and set(text) <= _BRACKETS:
            bracket_closers.append((-len(text), token))
        elif text[:1] == '"' and len(text) > 1 and set(text[1:]) <= _BRACKETS:
            quote_closers.append((-len(text), token))
    ids = [by_text[t] for t in ("a", " ") if t in by_text]
    brackets = [t for _, t in sorted(bracket_closers)]

    def known(texts) -> list[int]:
        return [by_text[t] for t in texts if t in by_text]

    in_string = [t for _, t in sorted(quote_closers)] + known(['"', *_FILLERS])
    elsewhere = brackets + known([",", *_VALUES, '"', *_NUMBER, "[", "{"])
    return ClosingVocab(tuple(ids), tuple(dict.fromkeys(in_string)), tuple(dict.fromkeys(elsewhere)),
                        frozenset(eos_token_ids))


def find_closing(matcher: llguidance.LLMatcher, vocab: ClosingVocab,
                 limit: int = MAX_CLOSING) -> list[int] | None:
    """Tokens that take `matcher` from its state to an accepting one (empty when it accepts
    already), or None when none is found within `limit` tokens. The matcher ends as it began."""
    out: list[int] = []
    try:
        while not matcher.is_accepting():
            if len(out) >= limit or matcher.is_stopped() or matcher.is_error():
                return None
            step = matcher.compute_ff_tokens()[: limit - len(out)] or _choose(matcher, vocab)
            taken = matcher.try_consume_tokens(step) if step else 0
            if not taken:
                return None
            out += step[:taken]
        return out
    finally:
        if out:
            matcher.rollback(len(out))


def _allows(matcher: llguidance.LLMatcher, token: int) -> bool:
    if matcher.try_consume_tokens([token]):
        matcher.rollback(1)
        return True
    return False


def _choose(matcher: llguidance.LLMatcher, vocab: ClosingVocab) -> list[int]:
    """The next token of a completion where the grammar forces none: [token], or [] if none."""
    in_string = any(_allows(matcher, t) for t in vocab.string_probes)
    for token in vocab.in_string if in_string else vocab.elsewhere:
        if _allows(matcher, token):
            return [token]
    bits = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
    allowed = np.flatnonzero(np.unpackbits(bits, bitorder="little"))
    return next(([int(t)] for t in allowed if int(t) not in vocab.eos), [])
