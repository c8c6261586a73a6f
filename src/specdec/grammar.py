"""Structured outputs: a grammar constrains what the target may say, exactly under speculation.

llguidance compiles the constraint (any JSON object, a JSON schema, a Lark grammar or a
regex) and matches it token by token. A constrained step (`Sequence.plan` / `advance`):

- `forced()`: the tokens the grammar forces next (llguidance's fast-forward tokens: keys,
  punctuation, the rest of an enum value) lead the draft for free. llguidance's mask at a
  forced position allows exactly the forced token, so they are always accepted.
- `draft(forced, tokens, probs)`: the drafter's chain continues after them and is cut at the
  first token the grammar rejects, before scoring. That token is kept for verification
  without a row of its own: the target gives it probability 0, so it is rejected for certain
  and the replacement is drawn from the residual, as speculative sampling requires (drawing
  from the target instead would skew a sampling drafter's output).
- `mask_logits(logits, tokens)`: each of the k+1 scored rows keeps only the tokens the
  grammar allows after the drafts before it (-inf elsewhere), so greedy picks the best
  allowed token and sampling draws from the constrained distribution. Plain decoding uses
  the same masks, so speculation is lossless against plain constrained decoding.
- `advance(emitted)`: the matcher consumes exactly what the step emitted.

EOS is allowed exactly when the grammar is accepting. Once the grammar is stopped (nothing
but EOS could follow) the reply ends there, without generating the EOS.

Valid by construction under any budget: when the whole reply is structure (a JSON object or
schema, a required or named tool call: `Constraint.closes`), the matcher keeps a closing
completion of the current state (closing.py: a run of tokens that completes the reply, its
length known before it starts) and the engine passes each step's token budget (max_tokens
and the context's room). Where fewer than MAX_CLOSING tokens are left:

- a row whose budget equals its state's closing length allows only the completion's next
  token, so from there the completion is emitted: every token fixed by the grammar state
  alone, drafted as forced tokens, the same under plain and speculative decoding;
- a token whose state could not be closed within what is left after it (opening a nested
  object one token before the end) is replaced by the completion's next token, and the step
  ends there (`fit`): the same rule on the same state under plain and speculative decoding;
- a reply whose budget ends where the grammar accepts is complete.

So the reply ends valid, with `finish_reason` "stop" (or "tool_calls"), and the request
knows it was closed by the budget. `require_budget` refuses a request whose budget cannot
hold even the completion from the start. See docs/structured-budget.md.
"""

from __future__ import annotations

import json
import weakref
from dataclasses import dataclass, replace

import llguidance
import torch

from specdec.closing import MAX_CLOSING, ClosingVocab, closing_vocab, find_closing
from specdec.errors import SpecdecError

# JSON is generated compact, with Python's json.dumps separators: free whitespace lets a
# small model wander (newlines forever) and turns forced keys into choices. A schema may
# override this with llguidance's "x-guidance" options.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# Forced tokens scored in one step, at most. Each saves a whole forward, while it widens the
# forward by one row; this bounds the width like AdaptiveK.k_max bounds a draft.
MAX_FORCED = 16
_BITS = torch.arange(32, dtype=torch.int32)


@dataclass(frozen=True)
class Constraint:
    """A compiled-to-text llguidance grammar; build one with the functions below."""

    grammar: str  # what llguidance.LLMatcher takes
    kind: str  # "json_object", "json_schema" or "grammar"
    name: str | None = None  # the schema's name in an OpenAI response_format
    # the whole reply is structure (JSON, a required tool call), so it is closed within its
    # budget (see the module doc); not for grammars that allow free text
    closes: bool = False


def _one_line(message: str) -> str:
    return " ".join(message.split())


def _checked(grammar: str, kind: str, name: str | None = None) -> Constraint:
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise SpecdecError(f"invalid {kind.replace('_', ' ')}: {_one_line(messages[0])}", "response_format")
    return Constraint(grammar, kind, name)


def json_object() -> Constraint:
    """Any JSON object (OpenAI's JSON mode)."""
    return replace(_checked(llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, JSON_OPTIONS),
                            "json_object"), closes=True)


def json_schema(schema: dict | str, strict: bool = False, name: str | None = None) -> Constraint:
    """A JSON schema. strict=True: a keyword llguidance cannot enforce is an error; otherwise
    it is ignored (best effort, like a non-strict OpenAI schema) and the rest is enforced."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise SpecdecError(f"invalid json schema: not JSON ({e})", "response_format") from None
    if not isinstance(schema, dict):
        raise SpecdecError(f"invalid json schema: expected an object, got {type(schema).__name__}",
                           "response_format")
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, JSON_OPTIONS, {"lenient": not strict})
    return replace(_checked(grammar, "json_schema", name), closes=True)


def grammar(text: str, syntax: str = "lark") -> Constraint:
    """A raw grammar: Lark syntax (llguidance's dialect), a regex, or llguidance's JSON form."""
    if syntax == "lark":
        compiled = llguidance.LLMatcher.grammar_from_lark(text)
    elif syntax == "regex":
        compiled = llguidance.LLMatcher.grammar_from_regex(text)
    elif syntax == "llguidance":
        compiled = text
    else:
        raise SpecdecError(f"grammar syntax must be lark, regex or llguidance, got {syntax!r}",
                           "response_format")
    return _checked(compiled, "grammar")


def constraint_from_response_format(response_format: dict | Constraint | None) -> Constraint | None:
    """OpenAI's `response_format`: {"type": "text"} (no constraint), {"type": "json_object"},
    {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}; and, beyond OpenAI,
    {"type": "grammar", "grammar": LARK} and {"type": "regex", "regex": PATTERN}."""
    if response_format is None or isinstance(response_format, Constraint):
        return response_format
    if not isinstance(response_format, dict):
        raise SpecdecError("response_format must be an object with a 'type'", "response_format")
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return json_object()
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise SpecdecError("response_format json_schema needs {'name', 'schema'}", "response_format")
        return json_schema(spec["schema"], bool(spec.get("strict", False)), spec.get("name"))
    if kind in ("grammar", "regex") and isinstance(response_format.get(kind), str):
        return grammar(response_format[kind], "lark" if kind == "grammar" else "regex")
    raise SpecdecError(
        f"unsupported response_format {kind!r}; use text, json_object, json_schema, grammar or regex",
        "response_format",
    )


def request_constraint(response_format: dict | Constraint | None = None,
                       schema: dict | None = None) -> Constraint | None:
    """Engine.generate's two ways to ask for structure: an OpenAI `response_format` (or a
    Constraint), or a bare JSON schema, enforced strictly."""
    if response_format is not None and schema is not None:
        raise SpecdecError("give response_format or json_schema, not both", "response_format")
    if schema is not None:
        return json_schema(schema, strict=True)
    return constraint_from_response_format(response_format)


_TOKENIZERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_CLOSING: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> {EOS ids: ClosingVocab}


def closing_vocabulary(tokenizer, eos_token_ids: set[int]) -> ClosingVocab:
    """The tokens closing completions are made of (closing.py), built once per tokenizer and
    EOS set (a pass over the vocabulary: the server builds it before a step needs it)."""
    per_tokenizer = _CLOSING.setdefault(tokenizer, {})
    key = tuple(sorted(eos_token_ids))
    if key not in per_tokenizer:
        per_tokenizer[key] = closing_vocab(ll_tokenizer(tokenizer, eos_token_ids), set(eos_token_ids))
    return per_tokenizer[key]


def ll_tokenizer(tokenizer, eos_token_ids: set[int]) -> llguidance.LLTokenizer:
    """llguidance's view of a Hugging Face fast tokenizer; built once per tokenizer (it takes
    a while on a large vocabulary) and EOS set."""
    import llguidance.hf  # here: it imports transformers, which `import specdec` does not

    per_eos = _TOKENIZERS.setdefault(tokenizer, {})
    key = tuple(sorted(eos_token_ids))
    if key not in per_eos:
        try:
            per_eos[key] = llguidance.hf.from_tokenizer(tokenizer, eos_token=list(key) or None)
        except ValueError as e:
            raise SpecdecError(f"structured output needs a fast tokenizer: {e}", "response_format") from None
    return per_eos[key]


@dataclass
class ConstrainedDraft:
    """One step's draft under a grammar: what is scored, plus the rejected token."""

    tokens: list[int]  # forced tokens, then the drafter's tokens the grammar accepts
    probs: torch.Tensor | None  # [len(tokens), V], one-hot on forced tokens; None: deterministic
    num_forced: int
    rejected: int | None = None  # the drafter's first token the grammar rejects
    rejected_probs: torch.Tensor | None = None  # [V] the distribution it was sampled from

    def for_verification(self) -> tuple[list[int], torch.Tensor | None]:
        """The scored tokens plus the rejected one, which verification rejects for certain
        from the last scored row (its masked target probability is 0)."""
        if self.rejected is None:
            return self.tokens, self.probs
        probs = self.probs
        if probs is not None and self.rejected_probs is not None:
            probs = torch.cat([probs, self.rejected_probs.unsqueeze(0)])
        return [*self.tokens, self.rejected], probs


class GrammarMatcher:
    """One request's grammar state. It holds the tokens the request emitted so far; `masks`
    and `valid_prefix` look ahead tentatively and roll back."""

    def __init__(self, constraint: Constraint, tokenizer, eos_token_ids: set[int]):
        self.constraint = constraint
        self.tokenizer, self.eos_token_ids = tokenizer, set(eos_token_ids)
        self._eos = torch.tensor(sorted(self.eos_token_ids), dtype=torch.long)
        self.ll = ll_tokenizer(tokenizer, self.eos_token_ids)
        self.vocab_size = self.ll.vocab_size
        self.matcher = llguidance.LLMatcher(self.ll, constraint.grammar, log_level=0)
        self.history: list[int] = []  # the tokens consumed: what the request emitted
        self._check("invalid " + constraint.kind.replace("_", " "))
        # closing completions (closing.py) by state: the tokens past `history` that lead to it
        self._closings: dict[tuple[int, ...], list[int] | None] = {}
        self._vocab = closing_vocabulary(tokenizer, self.eos_token_ids) if constraint.closes else None

    def _check(self, what: str) -> None:
        if self.matcher.is_error():
            raise SpecdecError(f"{what}: {_one_line(self.matcher.get_error())}", "response_format")

    @property
    def is_stopped(self) -> bool:
        return self.matcher.is_stopped()

    @property
    def is_accepting(self) -> bool:
        return self.matcher.is_accepting()

    def forced(self) -> list[int]:
        """The tokens the grammar forces next (possibly none)."""
        return [] if self.matcher.is_stopped() else list(self.matcher.compute_ff_tokens())

    # ---- closing within the budget (see the module doc) ------------------------------------

    def closing(self) -> list[int] | None:
        """A closing completion of the current state ([] when it accepts), None if none is known."""
        return self._closing_at(()) if self.constraint.closes else None

    def _closing_at(self, ahead: tuple[int, ...]) -> list[int] | None:
        """The completion of the state after `history` + `ahead`, where the matcher is now.
        Cached per state, along with the states on the completion's path, so that after its
        first token the completion is the rest of this one: its length then drops by one."""
        if ahead not in self._closings:
            found = find_closing(self.matcher, self._vocab)
            self._closings[ahead] = found
            for i in range(1, len(found or ())):
                self._closings.setdefault(ahead + tuple(found[:i]), found[i:])
        return self._closings[ahead]

    def _due(self, ahead: tuple[int, ...], left: int) -> list[int] | None:
        """The completion where it is due: `left` tokens may still be emitted and the completion
        needs them all (or more). Only looked for in the last MAX_CLOSING + 1 tokens: before
        them any known completion fits."""
        if not self.constraint.closes or not 0 < left <= MAX_CLOSING + 1:
            return None
        completion = self._closing_at(ahead)
        return completion if completion and len(completion) >= left else None

    def closing_due(self, budget: int) -> list[int] | None:
        """The completion to emit now, when the step's `budget` leaves no room for anything else."""
        return self._due((), budget)

    def require_budget(self, budget: int, param: str, context: bool = False) -> None:
        """Refuse (SpecdecError naming `param`) a budget that cannot hold the completion from the
        start. context=True: the budget is what the context leaves, `param` names the prompt."""
        completion = self.closing()
        need = max(1, len(completion)) if completion is not None else 0
        if budget >= need:
            return
        kind = self.constraint.kind.replace("_", " ") if self.constraint.kind != "grammar" else "tool call"
        if context:
            raise SpecdecError(f"the context leaves {budget} tokens for the reply, but a complete {kind} "
                               f"needs at least {need}; shorten the {param}", param)
        raise SpecdecError(f"{param} is {budget}, but a complete {kind} needs at least {need} tokens; "
                           f"set {param} to {need} or more", param)

    def fit(self, tokens: list[int], budget: int) -> tuple[list[int], str | None]:
        """A step's emitted tokens, fitted to its `budget` (the tokens the reply may still emit).
        The first token after which the state could not be closed within what is left is
        replaced by the current completion's next token and the step ends there ("closed");
        where the grammar accepts already, the reply ends before it instead ("ended").
        None: the tokens are kept. Nothing is consumed."""
        if not self.constraint.closes:
            return tokens, None
        consumed: list[int] = []
        try:
            for token in tokens:
                left = budget - len(consumed)  # for this token and what follows it
                if token in self.eos_token_ids or left <= 0:
                    break
                here = self._closing_at(tuple(consumed)) if left <= MAX_CLOSING + 1 else None
                if not self.matcher.try_consume_tokens([token]):
                    break  # rejected or stopped: advance() deals with it
                consumed.append(token)
                if here is None:  # far from the limit, or no known completion: nothing to check
                    continue
                after = self._closing_at(tuple(consumed))
                if after is not None and len(after) <= left - 1:
                    continue
                consumed.pop()
                self.matcher.rollback(1)
                return ([*consumed, here[0]], "closed") if here else (list(consumed), "ended")
            return tokens, None
        finally:
            if consumed:
                self.matcher.rollback(len(consumed))

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many leading tokens the grammar accepts from the current state. An EOS counts
        when the grammar is accepting there; nothing after it does."""
        end = next((i for i, t in enumerate(tokens)
                    if t in self.eos_token_ids or not 0 <= t < self.vocab_size), len(tokens))
        n = self.matcher.validate_tokens(tokens[:end]) if end else 0
        if n == end < len(tokens) and tokens[end] in self.eos_token_ids:
            self.matcher.consume_tokens(tokens[:n])
            n += int(self.matcher.is_accepting())
            self.matcher.rollback(end)
        return n

    def draft(self, forced: list[int], tokens: list[int], probs: torch.Tensor | None) -> ConstrainedDraft:
        """Join the forced tokens and the drafter's chain after them ([len(tokens), V] probs,
        or None), cut at the first drafter token the grammar rejects."""
        n = self.valid_prefix([*forced, *tokens]) if tokens else len(forced)
        keep = max(0, n - len(forced))  # drafter tokens kept
        rejected = tokens[keep] if keep < len(tokens) else None
        end = next((i for i, t in enumerate(tokens[:keep]) if t in self.eos_token_ids), None)
        if end is not None:  # nothing after an EOS is ever emitted: no token to verify there
            keep, rejected = end + 1, None
        rejected_probs = probs[keep] if rejected is not None and probs is not None else None
        joined = None
        if probs is not None:
            forced_ids = torch.tensor(forced, dtype=torch.long, device=probs.device)
            one_hot = torch.nn.functional.one_hot(forced_ids, probs.shape[-1])  # [len(forced), V]
            joined = torch.cat([one_hot.to(probs.dtype), probs[:keep]])  # [len(forced) + keep, V]
        return ConstrainedDraft([*forced, *tokens[:keep]], joined, len(forced), rejected, rejected_probs)

    def masks(self, tokens: list[int], vocab_size: int, budget: int | None = None) -> torch.Tensor:
        """Allowed tokens for each scored row -> [len(tokens), vocab_size] bool. tokens[0] is
        the pending token (already consumed); row i is the mask after tokens[1..i]. Rows
        after an EOS (or a token the grammar rejects) are never verified: they allow EOS.
        `budget`: the tokens the reply may still emit from row 0; a row where the closing
        completion is due allows only its next token (see the module doc)."""
        rows = len(tokens)
        words = (self.vocab_size + 31) // 32
        bitmask = torch.zeros(rows, words, dtype=torch.int32)  # [rows, words]
        accepting = torch.zeros(rows, dtype=torch.bool)
        stopped = torch.ones(rows, dtype=torch.bool)
        due: dict[int, int] = {}  # row -> the completion's next token, where it is due
        consumed = 0
        for i in range(rows):
            if i > 0:
                token = tokens[i]
                if token in self.eos_token_ids or not self.matcher.try_consume_tokens([token]):
                    break
                consumed += 1
            if budget is not None and (completion := self._due(tuple(tokens[1 : i + 1]), budget - i)):
                due[i] = completion[0]
            row = bitmask[i]  # what llguidance.torch.fill_next_token_bitmask does, without importing dynamo
            self.matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())
            accepting[i], stopped[i] = self.matcher.is_accepting(), self.matcher.is_stopped()
        if consumed:
            self.matcher.rollback(consumed)
        bits = ((bitmask.unsqueeze(-1) >> _BITS) & 1).bool().view(rows, -1)  # [rows, words * 32]
        allowed = torch.zeros(rows, vocab_size, dtype=torch.bool)  # padding rows of the logits stay off
        width = min(vocab_size, self.vocab_size)
        allowed[:, :width] = bits[:, :width]
        eos = self._eos[self._eos < vocab_size]
        allowed[stopped] = False
        allowed[:, eos] = (accepting | stopped).unsqueeze(-1)
        for i, token in due.items():
            allowed[i] = False
            allowed[i, token] = True
        return allowed

    def mask_logits(self, logits: torch.Tensor, tokens: list[int], budget: int | None = None,
                    allowed: torch.Tensor | None = None) -> torch.Tensor:
        """logits: [len(tokens), V] for the scored tokens -> the same with disallowed at -inf.
        `allowed`: these tokens' masks() when the caller made them before the forward."""
        if allowed is None:
            allowed = self.masks(tokens, logits.shape[-1], budget)
        return logits.masked_fill(~allowed.to(logits.device), float("-inf"))

    def advance(self, tokens: list[int]) -> int | None:
        """Consume what a step emitted, up to an EOS. When the grammar stops, the reply is
        complete: return how many of `tokens` it keeps (what follows can only be EOS)."""
        start = len(self.history)
        try:
            for i, token in enumerate(tokens):
                if self.matcher.is_stopped():
                    return i
                if token in self.eos_token_ids:
                    return None
                if not self.matcher.consume_token(token):
                    raise RuntimeError(f"the grammar rejected emitted token {token}: "
                                       f"{self.matcher.get_error()}")
                self.history.append(token)
            return len(tokens) if self.matcher.is_stopped() else None
        finally:  # the cached completions of the states ahead of the new one, re-keyed from it
            moved = tuple(self.history[start:])
            n = len(moved)
            self._closings = {key[n:]: c for key, c in self._closings.items() if key[:n] == moved}
