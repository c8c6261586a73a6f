"""`specdec bench` on tool sessions: the conversation each runner is fed, the call metrics, and
exact replies under speculation with and without the tools' grammars."""

from __future__ import annotations

import json

import pytest

from conftest import tiny_llama
from specdec.bench import run as bench
from specdec.bench.report import markdown
from specdec.bench.run import Question, TurnRecord, load_questions, run_benchmark
from specdec.bench.tool_sessions import call_metrics, exchange, reply_is_valid
from test_bench import _cli_error, _Recorder

SEARCH = {"type": "function", "function": {"name": "search", "parameters": {
    "type": "object", "properties": {"query": {"type": "string", "maxLength": 6}}, "required": ["query"],
    "additionalProperties": False}}}
UNIT = {"type": "function", "function": {"name": "unit", "parameters": {
    "type": "object",
    "properties": {"to": {"enum": ["c", "f"]}, "n": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["to"], "additionalProperties": False}}}
SESSION_TOOLS = [SEARCH, UNIT]
NAMED_UNIT = {"type": "function", "function": {"name": "unit"}}
SESSION = {"question_id": "s1", "category": "tool_sessions", "system": "You act through tools.",
           "tools": SESSION_TOOLS,
           "turns": [{"user": "Search the weather.", "tool_choice": "required", "result": {"temp": 21}},
                     {"tool_choice": NAMED_UNIT, "result": "21 C is 70 F"},
                     {"user": "Thanks.", "tool_choice": "auto"}]}
CALL_TEXT = '<tool_call>\n{"name": "search", "arguments": {"query": "sun"}}\n</tool_call>'


@pytest.fixture(scope="module")
def long_target():
    # a tool list takes hundreds of the tiny vocabulary's tokens
    return tiny_llama(seed=0, max_positions=2048)


def _sessions(tmp_path, *records) -> list[Question]:
    data = tmp_path / "sessions.jsonl"
    data.write_text("".join(json.dumps({**SESSION, **r}) + "\n" for r in records))
    return load_questions(data)


class _SessionRecorder(_Recorder):
    def __init__(self, name, answer):
        super().__init__(name, answer)
        self.constraints = []

    def run(self, prompt_ids, max_new_tokens, temperature, seed, constraint=None):
        self.constraints.append(constraint)
        return super().run(prompt_ids, max_new_tokens, temperature, seed)


@pytest.mark.parametrize("grammar", [True, False])
def test_tool_session_feeds_results_back_as_tool_messages(long_target, tmp_path, grammar):
    tok = long_target.tokenizer
    runner = _SessionRecorder("base", tok.encode(CALL_TEXT, add_special_tokens=False))
    run = run_benchmark(long_target, _sessions(tmp_path, {}), [runner], warmup=0, progress=False,
                        grammar=grammar)
    turn2, turn3 = (tok.decode(ids) for ids in runner.prompts[1:])
    assert turn2.count('<tool_call>\n{"name": "search", "arguments": {"query": "sun"}}\n</tool_call>') == 1
    assert '<|tool|><tool_response>\n{"name": "search", "content": {"temp": 21}}\n</tool_response>' in turn2
    assert '"content": "21 C is 70 F"' in turn3 and turn3.endswith("<|user|>Thanks.</s><|assistant|>")
    assert runner.prompts[1][: len(runner.prompts[0])] == runner.prompts[0]  # the conversation accumulates
    # auto too: a call, once opened, is forced
    assert [c is not None for c in runner.constraints] == [grammar] * 3
    turns = run.records["base"][0]
    assert [t.valid_call for t in turns] == [True, False, None]  # turn 2 had to call `unit`
    assert turns[0].calls == [{"name": "search", "arguments": '{"query": "sun"}'}]
    assert call_metrics(turns, is_method=False) == {"valid_calls": "1/2", "valid_call_rate": 0.5,
                                                    "forced_share": None}


@pytest.mark.parametrize(
    "calls, result, expected",
    [
        ([{"name": "search", "arguments": "{}"}], {"a": 1},
         [{"role": "assistant", "content": None, "tool_calls": [
             {"id": "call_2_1", "type": "function", "function": {"name": "search", "arguments": "{}"}}]},
          {"role": "tool", "tool_call_id": "call_2_1", "content": '{"a": 1}'}]),
        ([], "done", [{"role": "assistant", "content": "hello"},
                      {"role": "tool", "tool_call_id": "call_2_0", "content": "done"}]),
        ([{"name": "a", "arguments": "{}"}, {"name": "b", "arguments": "{}"}], "ok",
         [{"role": "assistant", "content": "hello", "tool_calls": [
             {"id": "call_2_1", "type": "function", "function": {"name": "a", "arguments": "{}"}},
             {"id": "call_2_2", "type": "function", "function": {"name": "b", "arguments": "{}"}}]},
          {"role": "tool", "tool_call_id": "call_2_1", "content": "ok"},
          {"role": "tool", "tool_call_id": "call_2_2", "content": "ok"}]),
        ([{"name": "a", "arguments": "{}"}], None,
         [{"role": "assistant", "content": None, "tool_calls": [
             {"id": "call_2_1", "type": "function", "function": {"name": "a", "arguments": "{}"}}]}]),
    ],
)
def test_exchange_answers_each_call(calls, result, expected):
    content = "" if calls and expected[0]["content"] is None else "hello"
    assert exchange(content, calls, result, 1) == expected


def _call(name, **args):
    return {"name": name, "arguments": json.dumps(args)}


@pytest.mark.parametrize(
    "calls, choice, valid",
    [
        ([_call("search", query="sun")], "required", True),
        ([_call("unit", to="f", n=3)], NAMED_UNIT, True),
        ([_call("search", query="sun"), _call("unit", to="c")], "required", True),
        ([], "required", False),  # no call at all
        ([_call("search", query="sun")], NAMED_UNIT, False),  # not the named tool
        ([_call("lookup", query="sun")], "required", False),  # not a declared tool
        ([{"name": "search", "arguments": '{"query": "sun"'}], "required", False),  # cut short: not JSON
        ([{"name": "search", "arguments": '["sun"]'}], "required", False),  # not an object
        ([_call("search", query="sunshine")], "required", False),  # maxLength
        ([_call("search")], "required", False),  # a required argument is missing
        ([_call("search", query="sun", page=2)], "required", False),  # additionalProperties
        ([_call("unit", to="k")], "required", False),  # enum
        ([_call("unit", to="c", n="3")], "required", False),  # type
        ([_call("search", query="sun"), _call("unit", to="x")], "required", False),  # one bad call of two
    ],
)
def test_valid_calls_parse_and_follow_their_schema(calls, choice, valid):
    assert reply_is_valid(calls, SESSION_TOOLS, choice) is valid


def test_call_metrics_pool_turns():
    turns = [TurnRecord([1] * 10, forced=4, valid_call=True),
             TurnRecord([1] * 10, forced=1, valid_call=False),
             TurnRecord([1] * 20, forced=0, valid_call=None),
             TurnRecord([1] * 10, forced=5, valid_call=True)]
    assert call_metrics(turns) == {"valid_calls": "2/3", "valid_call_rate": 0.6667, "forced_share": 0.2}
    assert call_metrics(turns[2:3]) == {"valid_calls": None, "valid_call_rate": None, "forced_share": 0.0}


def test_tool_sessions_are_exact_under_speculation_with_and_without_grammar(long_target, tmp_path):
    questions = _sessions(tmp_path, {}, {"question_id": "s2", "system": None, "turns": [
        {"user": "Convert it.", "tool_choice": NAMED_UNIT, "result": {"f": 70}},
        {"user": "Again.", "tool_choice": NAMED_UNIT, "result": {"f": 70}},
        {"user": "Search it.", "tool_choice": "required"}]})
    methods = ["none", "ngram:min=1", f"model:{long_target.name}:k=3:backend=hf"]  # on the target's backend
    for grammar in (True, False):
        runners = bench.make_engine_runners(long_target, methods)
        run = run_benchmark(long_target, questions, runners, max_new_tokens=48, progress=False,
                            log=lambda m: None, grammar=grammar)
        assert run.mismatches == []
        results = bench.summarize(run)
        entries = results["methods"]
        assert (len({e["valid_calls"] for e in entries.values()}) == 1
                and entries["none"]["valid_calls"].endswith("/5"))
        plain, self_draft = entries["none"], entries[methods[2]]
        # plain: one token a forward
        assert plain["forced_share"] == 0.0 and plain["mean_accepted_length"] == 1.0
        assert self_draft["acceptance_rate"] > 0.5 and self_draft["mean_accepted_length"] > 2.0
        if grammar:  # the unconstrained self-draft loses the tokens the grammar cuts; forced ones are free
            assert entries["none"]["valid_calls"] == "5/5"  # the grammar forces valid calls
            assert self_draft["forced_share"] > 0.2 and entries["ngram:min=1"]["forced_share"] > 0.2
            assert self_draft["per_category"]["tool_sessions"]["valid_calls"] == "5/5"
        else:
            assert (all(e["forced_share"] == 0.0 for e in entries.values())
                    and self_draft["acceptance_rate"] == 1.0)
    table = markdown({**results, "settings": {"grammar": False}})
    assert "without their grammars" in table and "| Valid calls | Forced |" in table


@pytest.mark.parametrize(
    "change, expect",
    [
        ({"tools": {"name": "search"}}, "tools: expected a list of tools"),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
        ({"turns": ["hi"]}, "turns must be a non-empty list of objects"),
        ({"turns": [{"user": "hi", "tool_choice": "required", "reply": "x"}]}, "unknown key 'reply'"),
        ({"turns": [{"tool_choice": "required"}]}, "turns[0]: user must be a non-empty string"),
        ({"turns": [{"user": "hi", "tool_choice": "sometimes"}]},
         "turns[0]: tool_choice: must be none, auto"),
        ({"turns": [{"user": "hi", "tool_choice": {"type": "function", "function": {"name": "x"}}}]},
         "no tool is named 'x'"),
    ],
)
def test_cli_bad_tool_sessions(tmp_path, capsys, change, expect):
    data = tmp_path / "q.jsonl"
    data.write_text(json.dumps({**SESSION, **change}) + "\n")
    err = _cli_error(["bench", "--data", str(data), "--methods", "none"], capsys)
    assert f"{data}:1: " in err and expect in err
