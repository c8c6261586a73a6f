"""The request value (specdec/request.py): built once from Python arguments, CLI flags or an
HTTP body (serve/bodies.py, serve/responses.py), checked when built, bound to a model by
`prepare`, and taken by Engine, Sequence and the scheduler."""

from __future__ import annotations

import dataclasses

import pytest

from conftest import tiny_llama
from specdec import Engine, SpecdecError
from specdec.request import Prepared, Request
from specdec.sampling import SamplingParams
from specdec.serve.bodies import chat_request, completion_request
from specdec.serve.protocol import ChatCompletionRequest, CompletionRequest
from specdec.serve.responses import ResponsesRequest, rename, to_chat
from test_tools import TOOLS

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
ASK = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def engine():
    return Engine(tiny_llama(seed=0), "ngram:min=1", k=4)


def test_a_request_and_its_keywords_give_the_same_reply(engine):
    kwargs = dict(max_new_tokens=24, temperature=0.0, stop=None, chat=True)
    by_keywords = engine.generate("The quick brown fox", **kwargs)
    by_value = engine.generate(Request.build("The quick brown fox", **kwargs))
    assert by_value.token_ids == by_keywords.token_ids and by_value.text == by_keywords.text
    assert by_value.stats.num_accepted_tokens > 0  # speculation ran
    streamed = engine.stream(Request.build("The quick brown fox", **kwargs))
    assert "".join(streamed) == by_keywords.text


def test_a_request_takes_no_other_settings(engine):
    with pytest.raises(SpecdecError) as err:
        engine.generate(Request.build("hi"), max_new_tokens=5)
    assert err.value.param == "max_new_tokens"


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"logprobs": 99}, "logprobs"),
        ({"json_schema": SCHEMA, "response_format": {"type": "json_object"}}, "response_format"),
        ({"tools": TOOLS, "tool_choice": "required", "json_schema": SCHEMA}, "response_format"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [{"type": "web"}]}, "tools[0].type"),
    ],
)
def test_bad_arguments_are_refused_when_built(kwargs, param):
    with pytest.raises(SpecdecError) as err:
        Request.build("hi", **kwargs)
    assert err.value.param == param


@pytest.mark.parametrize(
    ("max_tokens", "limit_field", "n_prompt", "context", "want"),
    [
        (None, None, 10, 100, 90),  # no limit: what the context leaves
        (16, None, 10, 100, 16),  # a default cap (legacy completions' 16)
        (16, None, 90, 100, 10),  # ... that the context cuts
        (50, "max_output_tokens", 10, 100, 50),
        (128, "max_new_tokens", 10, None, 128),  # the engine: the sequence ends where the cache does
    ],
)
def test_budget(max_tokens, limit_field, n_prompt, context, want):
    request = Request("hi", max_tokens=max_tokens, limit_field=limit_field)
    assert request.budget(n_prompt, context) == want


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens", "max_output_tokens"])
def test_a_limit_that_does_not_fit_names_the_field_the_client_sent(field):
    request = Request(ASK, max_tokens=95, limit_field=field)
    with pytest.raises(SpecdecError) as err:
        request.budget(10, 100)
    assert err.value.param == field and "105 tokens" in err.value.message
    with pytest.raises(SpecdecError) as err:
        request.budget(100, 100)
    assert err.value.param == "messages"


def test_prepare_binds_the_prompt_budget_and_a_fresh_grammar(engine):
    request = Request.build(ASK, json_schema=SCHEMA)
    first = request.prepare(engine.tokenizer, engine.eos_token_ids, 256)
    second = request.prepare(engine.tokenizer, engine.eos_token_ids, 256)
    assert first.prompt_ids == engine.encode_prompt(ASK) and first.max_new_tokens == 128
    assert first.grammar is not None and first.grammar is not second.grammar
    plain = Prepared.tokens([1, 2, 3], SamplingParams(0.5), 7, seed=3, stop=["x"])
    assert plain.request.stop == ("x",) and plain.request.seed == 3 and plain.max_new_tokens == 7


def test_chat_and_completion_bodies():
    chat = chat_request(ChatCompletionRequest(messages=ASK, max_completion_tokens=9, stop="\n", seed=4,
                                              tools=TOOLS, tool_choice="auto", logprobs=True,
                                              top_logprobs=2),
                        "hermes")
    assert ((chat.max_tokens, chat.limit_field, chat.stop, chat.seed, chat.logprobs)
            == (9, "max_completion_tokens", ("\n",), 4, 2))
    assert chat.sampling == SamplingParams(1.0, 0, 1.0) and chat.tools.choice == "auto"
    assert chat_request(ChatCompletionRequest(messages=ASK), "hermes").limit_field is None
    legacy = completion_request(CompletionRequest(prompt=["hello"], temperature=0), vocab_size=100)
    assert (legacy.prompt, legacy.chat, legacy.max_tokens, legacy.limit_field) == ("hello", False, 16, None)
    with pytest.raises(SpecdecError) as err:
        completion_request(CompletionRequest(prompt=[5, 500]), vocab_size=100)
    assert err.value.param == "prompt"


def test_a_responses_body_becomes_the_chat_request_it_means():
    flat = [{"type": "function", **t["function"]} for t in TOOLS]
    body = ResponsesRequest(
        instructions="Be brief.", tools=flat, tool_choice={"type": "function", "name": "add"},
        max_output_tokens=30, text={"format": {"type": "text"}},
        input=[{"role": "user", "content": [{"type": "input_text", "text": "Add 1 and 2, ping."}]},
               {"type": "function_call", "call_id": "c1", "name": "add", "arguments": '{"a": 1, "b": 2}',
                "id": "fc_1", "status": "completed"},
               {"type": "function_call", "call_id": "c2", "name": "ping", "arguments": "{}"},
               {"type": "function_call_output", "call_id": "c1", "output": "3"},
               {"type": "function_call_output", "call_id": "c2",
                "output": [{"type": "input_text", "text": "ok"}]}],
    )
    chat = to_chat(body)
    messages = [m.model_dump(exclude_none=True) for m in chat.messages]
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "tool"]
    assert [c["id"] for c in messages[2]["tool_calls"]] == ["c1", "c2"]  # both calls in one assistant turn
    assert messages[3] == {"role": "tool", "content": "3", "tool_call_id": "c1", "name": "add"}
    assert messages[4]["content"] == "ok" and messages[4]["name"] == "ping"
    assert chat.tools == TOOLS and chat.tool_choice == {"type": "function", "function": {"name": "add"}}
    assert chat.max_completion_tokens == 30 and chat.response_format == {"type": "text"}
    request = dataclasses.replace(chat_request(chat, "hermes"), limit_field="max_output_tokens")
    assert request.tools.choice == "add" and request.max_tokens == 30


@pytest.mark.parametrize(
    ("chat_param", "responses_param"),
    [
        ("max_completion_tokens", "max_output_tokens"),
        ("response_format", "text.format"),
        ("messages", "input"),
        ("tools[1].function.parameters", "tools[1].parameters"),
        ("tool_choice.function.name", "tool_choice.name"),
        ("temperature", "temperature"),
        (None, None),
    ],
)
def test_errors_name_the_responses_field(chat_param, responses_param):
    assert rename(chat_param) == responses_param
