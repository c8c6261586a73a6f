"""Fuzzing the closing guarantee (issue 27): structured replies are valid under any budget.

A case is a random JSON schema (nested objects and arrays, enums, required and optional keys,
integers and numbers with and without bounds, strings with and without length bounds), a way
to ask for it (a `json_schema` reply, a required tool call, parallel or not, or JSON mode), a
token budget around the schema's closing length, and a temperature. The model is a stub that
wants to keep going: a fixed preference for letters, digits, commas and openers over quotes,
brackets and EOS, plus noise keyed to the position (`PushyBackend`), so strings never close
and numbers never end by themselves. The drafter proposes the same model's unconstrained
choice (`PushyDrafter`): blind to the grammar and to the budget, it drafts the tokens that
must be cut or replaced near the end, and they are accepted often.

`run_case` checks what the guarantee says:
- a budget below the closing length from the start is refused (`require_budget`, the 400);
- any other reply fits the budget, finishes "stop" ("tool_calls" for calls), parses, and
  validates against the schema (jsonschema);
- speculative decoding (the drafter, k=4, forced tokens drafted) emits exactly the tokens of
  plain decoding (one token per step, nothing drafted).

hypothesis draws the cases (`cases()`); tests/test_closing_fuzz.py runs a sample, and
scripts/bench/measure/fuzz_closing.py the full run. Needs the dev and bench extras (hypothesis, jsonschema).
"""

from __future__ import annotations

import dataclasses
import json
import zlib
from dataclasses import dataclass, field

import torch

from specdec.backends.prefix_cache import PrefixCache
from specdec.config import EngineConfig
from specdec.drafters import Draft, Drafter
from specdec.errors import SpecdecError
from specdec.grammar import GrammarMatcher, json_object, json_schema
from specdec.request import Prepared
from specdec.sampling import SamplingParams
from specdec.sequence import Runtime, Sequence
from specdec.tools import tool_plan

KEYS = ("id", "name", "query", "items", "value", "tags", "note", "count")
WORDS = ("a", "fox", "search", "weather in Paris", "")
K = 4  # the speculative run's draft length


# ---- the model: a stub that never wants to stop ---------------------------------------------


_BASE: dict[tuple[int, tuple[int, ...]], torch.Tensor] = {}  # (id of a tokenizer, EOS ids) -> [V]


def preference(tokenizer, eos_token_ids: set[int], seed: int) -> torch.Tensor:
    """[V] logits: content (letters, digits) and continuations (`,` `[` `{` `:`) over closers."""
    key = (id(tokenizer), tuple(sorted(eos_token_ids)))
    if key not in _BASE:
        scores = []
        for token in range(len(tokenizer)):
            text = tokenizer.decode([token])
            content = sum(ch.isalnum() for ch in text) / max(1, len(text))
            score = (3.0 * content + 2.0 * sum(ch in ",[{:" for ch in text)
                     - 3.0 * sum(ch in '"}]' for ch in text))
            scores.append(-6.0 if token in eos_token_ids else score)
        _BASE[key] = torch.tensor(scores)
    noise = torch.randn(len(_BASE[key]), generator=torch.Generator().manual_seed(seed))
    return _BASE[key] + 0.5 * noise  # [V]


class PushyBackend:
    """A Backend whose next-token logits after a prefix depend on its last token and length
    only: the preference plus noise keyed to both. No tree support, no slot pool."""

    supports_tree = False
    pool = None
    hidden = None
    compile_seconds = 0.0

    def __init__(self, preference: torch.Tensor, seed: int, max_length: int = 1 << 14):
        self.preference, self.seed = preference, seed
        self.vocab_size, self.max_length = len(preference), max_length
        self.prefix_cache = PrefixCache("off")
        self.tokens: list[int] = []

    @property
    def length(self) -> int:
        return len(self.tokens)

    def row(self, last: int, length: int) -> torch.Tensor:
        """[V] the logits after a prefix of `length` tokens ending with `last`."""
        key = zlib.crc32(f"{self.seed}:{last}:{length}".encode())
        return self.preference + torch.randn(self.vocab_size, generator=torch.Generator().manual_seed(key))

    def forward(self, token_ids: list[int], unscored=()) -> torch.Tensor:
        rows = []
        for token in token_ids:
            self.tokens.append(token)
            rows.append(self.row(token, len(self.tokens)))
        return torch.stack(rows)  # [len(token_ids), V]

    def prefill(self, token_ids: list[int], all_logits: bool = True, keep: int = 0) -> torch.Tensor:
        self.tokens = list(self.tokens[:keep])
        logits = self.forward(list(token_ids[keep:]))
        return logits if all_logits else logits[-1:]

    def rollback(self, length: int) -> None:
        del self.tokens[length:]

    def reset(self) -> None:
        self.tokens = []

    def forward_tree(self, token_ids, parents):
        raise ValueError("PushyBackend scores chains only")

    def keep(self, indices) -> None:
        raise ValueError("PushyBackend scores chains only")

    def enable_hidden_states(self) -> None:
        raise ValueError("PushyBackend keeps no hidden states")


class PushyDrafter(Drafter):
    """Drafts the stub model's own greedy choices: blind to the grammar, or (`matcher`) under
    the grammar but blind to the budget, so its drafts are accepted up to the one the budget
    must cut. `silent`: drafts nothing (plain decoding)."""

    name = "pushy"

    def __init__(self, backend: PushyBackend, matcher: GrammarMatcher | None = None, silent: bool = False):
        self.backend, self.matcher, self.silent = backend, matcher, silent

    def propose(self, context_ids: list[int], k: int) -> Draft:
        tokens: list[int] = []
        for _ in range(0 if self.silent else k):
            prefix = [context_ids[-1], *tokens]
            row = self.backend.row(prefix[-1], len(context_ids) + len(tokens))  # [V]
            if self.matcher is not None:
                row = self.matcher.mask_logits(row.unsqueeze(0), prefix,
                                               allowed=self.matcher.masks(prefix, len(row))[-1:])[0]
            tokens.append(int(row.argmax()))
        return Draft(tokens)


# ---- cases ------------------------------------------------------------------------------------


@dataclass
class Case:
    schema: dict
    mode: str  # "json_schema", "tool", "parallel_tools" or "json_object"
    offset: int  # the budget is the closing length from the start plus this (may be negative)
    temperature: float
    seed: int
    drafter: str = "grammar"  # "grammar": PushyDrafter under the grammar; "blind": without it


@dataclass
class Outcome:
    refused: bool
    budget: int
    need: int  # the closing length from the start
    tokens: int = 0
    closed_by_budget: bool = False
    replaced_drafts: int = 0  # accepted drafts the budget cut or replaced in the speculative run
    accepted: int = 0  # drafts accepted in the speculative run
    text: str = ""
    problems: list[str] = field(default_factory=list)


def cases():
    """The hypothesis strategy of a Case."""
    from hypothesis import strategies as st

    def bounded(kind: str):
        lo = st.integers(-20, 20)
        return st.builds(lambda a, b, use: {"type": kind,
                                            **({"minimum": min(a, b), "maximum": max(a, b)} if use else {})},
                         lo, lo, st.booleans())

    strings = st.one_of(
        st.just({"type": "string"}),
        st.builds(lambda lo, extra: {"type": "string", "minLength": lo, "maxLength": lo + extra},
                  st.integers(0, 4), st.integers(0, 8)),
        st.builds(lambda words: {"type": "string", "enum": sorted(set(words))},
                  st.lists(st.sampled_from(WORDS), min_size=1, max_size=3)),
    )
    leaves = st.one_of(strings, bounded("integer"), bounded("number"), st.just({"type": "boolean"}),
                       st.just({"type": "null"}),
                       st.builds(lambda v: {"enum": sorted(set(v))},
                                 st.lists(st.integers(-5, 99), min_size=1, max_size=3)))

    @st.composite
    def objects(draw, children):
        props = draw(st.dictionaries(st.sampled_from(KEYS), children, min_size=1, max_size=4))
        required = [key for key in sorted(props) if draw(st.integers(0, 3))]  # each required 3 times in 4
        schema = {"type": "object", "properties": props, "required": required}
        return {**schema, "additionalProperties": False} if draw(st.booleans()) else schema

    def arrays(children):
        return st.builds(lambda item, lo, extra, bound: {"type": "array", "items": item, "minItems": lo,
                                                         **({"maxItems": lo + extra} if bound else {})},
                         children, st.integers(0, 2), st.integers(0, 3), st.booleans())

    values = st.recursive(leaves, lambda children: st.one_of(objects(children), arrays(children)),
                          max_leaves=8)
    return st.builds(Case, objects(values),
                     st.sampled_from(["json_schema", "tool", "parallel_tools", "json_object"]),
                     st.integers(-4, 40), st.sampled_from([0.0, 0.0, 0.8]), st.integers(0, 2**31 - 1),
                     st.sampled_from(["grammar", "blind"]))


# ---- one case ---------------------------------------------------------------------------------


def constraint_of(case: Case):
    """The case's constraint and tool plan (None unless tools)."""
    if case.mode == "json_object":
        return json_object(), None
    if case.mode == "json_schema":
        return json_schema(case.schema, strict=True), None
    tool = {"type": "function", "function": {"name": "record", "parameters": case.schema, "strict": True}}
    plan = tool_plan([tool], "required", case.mode == "parallel_tools")
    return plan.constraint(), plan


def run_case(case: Case, tokenizer, eos_token_ids: set[int], prompt_ids: list[int]) -> Outcome:
    """Refusal, or plain and speculative runs of one case, checked (Outcome.problems)."""
    constraint, plan = constraint_of(case)
    probe = GrammarMatcher(constraint, tokenizer, eos_token_ids)
    closing = probe.closing()
    need = max(1, len(closing)) if closing is not None else 0
    budget = max(1, need + case.offset)
    try:
        probe.require_budget(budget, "max_tokens")
    except SpecdecError as e:
        outcome = Outcome(True, budget, need)
        if budget >= need or e.param != "max_tokens" or str(need) not in e.message:
            outcome.problems.append(f"refused a budget of {budget} (needs {need}): {e.message}")
        return outcome
    outcome = Outcome(False, budget, need)
    if budget < need:
        outcome.problems.append(f"a budget of {budget} was not refused (needs {need})")
    pref = preference(tokenizer, eos_token_ids, case.seed)
    plain = _generate(case, constraint, tokenizer, eos_token_ids, prompt_ids, pref, budget, speculative=False)
    spec = _generate(case, constraint, tokenizer, eos_token_ids, prompt_ids, pref, budget, speculative=True)
    outcome.tokens, outcome.text = len(plain[0].token_ids), plain[0].text
    outcome.closed_by_budget = plain[0].closed_by_budget
    outcome.replaced_drafts, outcome.accepted = spec[1], spec[0].stats.num_accepted_tokens
    if spec[0].token_ids != plain[0].token_ids:
        outcome.problems.append("speculative output differs from plain")
    outcome.problems += _check(plain[0], case, plan, budget)
    return outcome


def _generate(case, constraint, tokenizer, eos_token_ids, prompt_ids, pref, budget, speculative: bool):
    """(result, accepted drafts the budget replaced) of one run through the engine's Sequence."""
    backend = PushyBackend(pref, case.seed)
    matcher = GrammarMatcher(constraint, tokenizer, eos_token_ids)
    replaced = [0]
    fit = matcher.fit

    def counting_fit(tokens, left):
        fitted, how = fit(tokens, left)
        dropped = len(tokens) - len(fitted) - (how == "ended")  # accepted drafts after the cut
        if how is not None and dropped > 0:
            replaced[0] += dropped
        return fitted, how

    matcher.fit = counting_fit
    drafter = PushyDrafter(backend, matcher if case.drafter == "grammar" else None, silent=not speculative)
    prepared = Prepared.tokens(prompt_ids, SamplingParams(case.temperature), budget, seed=case.seed)
    job = dataclasses.replace(prepared, grammar=matcher)
    runtime = Runtime(tokenizer, eos_token_ids, EngineConfig(draft_forced=speculative))
    seq = Sequence(backend, drafter, job, K if speculative else 0, runtime, track_text=True)
    seq.start()
    while (tokens := seq.plan()) is not None:
        seq.advance(backend.forward(tokens))
    seq.finish()
    return seq.result, replaced[0]


def _check(result, case: Case, plan, budget: int) -> list[str]:
    import jsonschema

    problems = []
    if len(result.token_ids) > budget:
        problems.append(f"{len(result.token_ids)} tokens past a budget of {budget}")
    if plan is not None:
        plan.finish(result)
        if result.finish_reason != "tool_calls" or not result.tool_calls:
            return [*problems, f"finish_reason {result.finish_reason!r} with {len(result.tool_calls)} calls"]
        values = [call["function"]["arguments"] for call in result.tool_calls]
    else:
        if result.finish_reason != "stop":
            return [*problems, f"finish_reason {result.finish_reason!r}"]
        values = [result.text]
    schema = {"type": "object"} if case.mode == "json_object" else case.schema
    for text in values:
        try:
            jsonschema.validate(json.loads(text), schema)
        except (ValueError, jsonschema.ValidationError) as e:
            problems.append(f"invalid: {str(e).splitlines()[0][:200]}")
    return problems
