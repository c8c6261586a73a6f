"""Structured replies are valid by construction under any token budget (issue 27): closing
completions from any grammar state (closing.py), the rows where they are due, the steps they
cut, the refusal of a budget too small, and plain == speculative throughout."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from conftest import tiny_llama
from specdec import Engine, SpecdecError
from specdec.closing import find_closing
from specdec.grammar import GrammarMatcher, json_object, json_schema
from specdec.tools import tool_plan
from test_grammar import PROMPTS, ROWS, TOOL, ScriptedDrafter, plain_constrained

NESTED = {  # required keys several levels down, numbers, an array with a minimum
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 10, "maximum": 99},
        "point": {"type": "object", "properties": {"x": {"type": "number"}, "tags": {
            "type": "array", "items": {"type": "string", "minLength": 2}, "minItems": 2}},
            "required": ["x", "tags"], "additionalProperties": False},
    },
    "required": ["id", "point"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "function": {"name": "search", "parameters": TOOL["properties"]["arguments"]}}]


@pytest.fixture(scope="module")
def target():
    return tiny_llama(seed=0, max_positions=1024)  # room for the tools' system prompt


def matcher_after(target, constraint, text: str) -> GrammarMatcher:
    matcher = GrammarMatcher(constraint, target.tokenizer, target.eos_token_ids)
    assert matcher.advance(target.tokenizer.encode(text, add_special_tokens=False)) is None
    return matcher


@pytest.mark.parametrize(
    ("schema", "prefix"),
    [
        (TOOL, ""),
        (TOOL, '{"name": "sea'),  # inside an enum value
        (TOOL, '{"name": "search", "arguments": {"query": "fox'),  # inside a free string
        (TOOL, '{"name": "search", "arguments": {"que'),  # inside a key
        (NESTED, '{"id": 1'),  # a number below its minimum
        (NESTED, '{"id": 12, "point": {"x": -'),  # a number that needs a digit
        (NESTED, '{"id": 12, "point": {"x": 1.5e'),  # an exponent
        (NESTED, '{"id": 12, "point": {"x": 3, "tags": ["a'),  # a string below its minLength, minItems
        (ROWS, '{"items": [{"name": "fox", "value": 12'),  # required keys still missing, then the array
    ],
)
def test_a_closing_completion_from_any_state_is_valid(target, schema, prefix):
    """From the state after `prefix`, the completion ends in an accepting state and the whole
    text validates; asking again gives the same completion, and the matcher is untouched."""
    matcher = matcher_after(target, json_schema(schema, strict=True), prefix)
    completion = matcher.closing()
    assert completion and matcher.closing() == completion and matcher.history == target.tokenizer.encode(
        prefix, add_special_tokens=False)
    jsonschema.validate(json.loads(prefix + target.tokenizer.decode(completion)), schema)
    assert find_closing(matcher.matcher, matcher._vocab) == completion  # the cache holds the search's result
    matcher.advance(completion[:1])  # one token on, the completion is the rest of it
    assert matcher.closing() == completion[1:]


def test_grammars_that_allow_free_text_have_no_closing(target):
    auto = GrammarMatcher(tool_plan(TOOLS, "auto").constraint(), target.tokenizer, target.eos_token_ids)
    assert auto.closing() is None and auto.fit([1, 2, 3], 2) == ([1, 2, 3], None)
    vocab = len(target.tokenizer)
    assert torch.equal(auto.masks([0], vocab), auto.masks([0], vocab, budget=1))


def test_the_row_where_the_completion_is_due_allows_only_its_next_token(target):
    matcher = matcher_after(target, json_schema(NESTED, strict=True),
                            '{"id": 12, "point": {"x": 3, "tags": ["a')
    completion, vocab, pending = matcher.closing(), len(target.tokenizer), [0]
    assert len(completion) > 3
    free = matcher.masks(pending, vocab, budget=len(completion) + 1)[0]
    due = matcher.masks(pending, vocab, budget=len(completion))[0]
    assert free.sum() > 100 and due.nonzero().flatten().tolist() == [completion[0]]
    # rows further on: row i has budget - i left; the completion's own path stays due
    rows = matcher.masks([0, *completion[:2]], vocab, budget=len(completion))
    assert [r.nonzero().flatten().tolist() for r in rows] == [[t] for t in completion[:3]]
    assert (matcher.closing_due(len(completion)) == completion
            and matcher.closing_due(len(completion) + 1) is None)


@pytest.mark.parametrize(
    ("left", "how"),
    [(+1, None), (0, "closed")],  # budget: the completion's length plus `left`
)
def test_fit_replaces_the_token_that_would_leave_no_room_to_close(target, left, how):
    """Inside the free string, a letter keeps the completion's length; with one token to spare
    it fits, with none it is replaced by the completion's next token (the closing quote)."""
    matcher = matcher_after(target, json_schema(TOOL, strict=True),
                            '{"name": "search", "arguments": {"query": "fox')
    completion = matcher.closing()
    letters = target.tokenizer.encode(" dog", add_special_tokens=False)
    fitted, fitted_how = matcher.fit([*letters, *completion], len(completion) + left)
    assert (fitted_how == how
            and matcher.history[-1] == target.tokenizer.encode("fox", add_special_tokens=False)[-1])
    if how is None:
        assert fitted == [*letters, *completion]
    else:
        assert fitted == [completion[0]]


def test_fit_ends_a_reply_that_accepts_before_the_next_call(target):
    """Parallel calls: after a complete call the grammar accepts; a second call that could
    not close within the budget ends the reply where it is."""
    plan = tool_plan(TOOLS, "required", True)
    one = '<tool_call>\n{"name": "search", "arguments": {"query": "fox"}}\n</tool_call>'
    matcher = matcher_after(target, plan.constraint(), one)
    assert matcher.is_accepting and matcher.closing() == []
    more = target.tokenizer.encode("\n<tool_call>", add_special_tokens=False)
    assert matcher.fit(more, 3) == ([], "ended")
    assert matcher.fit(more, 200) == (more, None)


ARGS = TOOL["properties"]["arguments"]
ASKS = {  # Engine.generate's arguments, the constraint they make, the schema a reply follows
    "schema": ({"json_schema": ROWS}, lambda: json_schema(ROWS, strict=True), ROWS),
    "json_object": ({"response_format": {"type": "json_object"}}, json_object, {"type": "object"}),
    "tool": ({"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False},
             lambda: tool_plan(TOOLS, "required", False).constraint(), ARGS),
    "parallel": ({"tools": TOOLS, "tool_choice": "required"},
                 lambda: tool_plan(TOOLS, "required").constraint(), ARGS),
}


@pytest.mark.parametrize("ask", list(ASKS))
def test_every_budget_from_the_minimum_gives_a_valid_reply_the_same_under_speculation(target, ask,
                                                                                      monkeypatch):
    """Below the closing length from the start the request is refused naming max_new_tokens
    and the minimum; from it on, every budget gives a complete, valid reply within it,
    finish_reason stop (tool_calls), token for token the same under speculation. The drafter
    proposes the reply of the largest budget: accepted up to where a smaller budget closes,
    where the step is cut (the drafts the target accepted, replaced)."""
    cuts = []
    fit = GrammarMatcher.fit

    def spy(self, tokens, budget):
        fitted, how = fit(self, tokens, budget)
        cuts.append(how is not None and len(fitted) < len(tokens) - (how == "ended"))
        return fitted, how

    monkeypatch.setattr(GrammarMatcher, "fit", spy)
    kwargs, constraint, schema = ASKS[ask]
    calls = "tools" in kwargs
    need = len(GrammarMatcher(constraint(), target.tokenizer, target.eos_token_ids).closing())
    prompt = [{"role": "user", "content": PROMPTS[1]}]
    plain, spec = (Engine(target, "none", k=0),
                   Engine(target, ScriptedDrafter(target.tokenizer.convert_tokens_to_ids("<|user|>")), k=4))
    with pytest.raises(SpecdecError, match=f"at least {need} tokens") as refused:
        plain.generate(prompt, max_new_tokens=need - 1, **kwargs)
    assert refused.value.param == "max_new_tokens"
    budgets = (need + 40, need + 12, need + 6, need + 3, need + 1, need)
    spec.drafter.answer = plain.generate(prompt, max_new_tokens=budgets[0], **kwargs).token_ids
    accepted = closed = 0
    for n in budgets:
        a, b = (plain.generate(prompt, max_new_tokens=n, **kwargs),
                spec.generate(prompt, max_new_tokens=n, **kwargs))
        assert a.token_ids == b.token_ids and len(a.token_ids) <= n
        assert a.finish_reason == ("tool_calls" if calls else "stop") == b.finish_reason
        assert a.closed_by_budget == b.closed_by_budget
        for text in [c["function"]["arguments"] for c in a.tool_calls] if calls else [a.text]:
            jsonschema.validate(json.loads(text), schema)
        accepted, closed = accepted + b.stats.num_accepted_tokens, closed + a.closed_by_budget
    assert accepted > 0 and closed > 0  # not vacuous
    # a cut needs the budget's own token to fall on an accepted draft; ROWS' replies close
    # where the forced tokens end instead (the fuzz cuts hundreds: test_closing_fuzz.py)
    assert any(cuts) or ask == "schema"


def test_the_closing_completion_is_forced_tokens(target):
    """At the minimum budget the whole reply is the completion from the start: every token
    but the last step's own is a forced token, drafted for free."""
    ids = target.tokenizer.encode(PROMPTS[1])
    need = len(GrammarMatcher(json_schema(TOOL, strict=True), target.tokenizer,
                              target.eos_token_ids).closing())
    result = Engine(target, "none", k=0).generate(ids, max_new_tokens=need, json_schema=TOOL)
    assert len(result.token_ids) == need and result.closed_by_budget and result.finish_reason == "stop"
    assert result.stats.num_forced_tokens >= need - result.stats.num_steps > 0


@pytest.mark.parametrize("drafter", ["none", "ngram:min=1"])
def test_without_closing_the_same_reply_is_cut(target, drafter, monkeypatch):
    """The tiny model never closes TOOL's free string by itself: with closing it ends valid
    within the budget (as the plain reference does), without it (no row is ever within
    MAX_CLOSING of the end) it is cut: the test can fail."""
    ids, n = target.tokenizer.encode(PROMPTS[1]), 32
    result = Engine(target, drafter, k=4).generate(ids, max_new_tokens=n, json_schema=TOOL)
    assert result.finish_reason == "stop" and result.closed_by_budget and len(result.token_ids) <= n
    jsonschema.validate(json.loads(result.text), TOOL)
    assert result.token_ids == plain_constrained(target, ids, TOOL, max_new_tokens=n)
    monkeypatch.setattr("specdec.grammar.MAX_CLOSING", -1)
    cut = Engine(target, drafter, k=4).generate(ids, max_new_tokens=n, json_schema=TOOL)
    assert cut.finish_reason == "length" and not cut.closed_by_budget
    with pytest.raises(ValueError):
        json.loads(cut.text)


def test_a_context_too_short_for_the_completion_is_refused_naming_the_prompt(target):
    engine = Engine(target, "none", k=0)
    need = len(GrammarMatcher(json_schema(TOOL, strict=True), target.tokenizer,
                              target.eos_token_ids).closing())
    long_prompt = list(range(10, 10 + engine.backend.max_length - need + 2))  # leaves need - 1 tokens
    with pytest.raises(SpecdecError, match=f"leaves {need - 1} tokens") as refused:
        engine.generate(long_prompt, max_new_tokens=500, json_schema=TOOL)
    assert refused.value.param == "prompt"
