"""Function calling and structured output through a real `specdec serve` process, driven by
the official OpenAI client (the tiny random model: the grammar alone makes its calls valid)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import save_loaded, tiny_llama
from served_helpers import JSON, ServerProcess, assert_error_shape
from test_tools import TOOLS, valid_args

MODEL = "tiny"
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NOTE = {  # a free string to write: room for the drafters to guess
    "type": "function",
    "function": {"name": "take_note", "parameters": {
        "type": "object", "properties": {"text": {"type": "string", "maxLength": 80}}, "required": ["text"]}},
}
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = save_loaded(tiny_llama(0, max_positions=2048), tmp_path_factory.mktemp("tiny-tools"))
    srv = ServerProcess(model_dir, "--served-model-name", MODEL, "--drafter", "ngram:min=1",
                        "--max-batch", "4")
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def create(client, **kw):
    base = dict(model=MODEL, messages=ASK, tools=TOOLS, temperature=0, max_tokens=200)
    return client.chat.completions.create(**{**base, **kw})


def check_calls(calls, names=None):
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        tool = next(t for t in TOOLS + [NOTE] if t["function"]["name"] == call.function.name)
        assert (valid_args(call.function.arguments, tool) if tool is not NOTE
                else json.loads(call.function.arguments))
        assert names is None or call.function.name in names


@pytest.mark.parametrize(("choice", "names"), [
    ("required", None),
    ({"type": "function", "function": {"name": "add"}}, {"add"}),
])
def test_forced_choices_return_calls_that_follow_the_schema(client, choice, names):
    reply = create(client, tool_choice=choice, parallel_tool_calls=False)
    choice0 = reply.choices[0]
    assert choice0.finish_reason == "tool_calls"
    assert choice0.message.content is None and len(choice0.message.tool_calls) == 1
    check_calls(choice0.message.tool_calls, names)
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens


def test_parallel_calls_each_follow_the_schema(client):
    reply = create(client, tool_choice="required", max_tokens=400)
    assert reply.choices[0].finish_reason == "tool_calls"  # never cut: the budget closes the last call
    check_calls(reply.choices[0].message.tool_calls)


def _minimum(server, field: str, **body) -> int:
    """The budget a request needs, from the 400 that a budget of 1 gets (naming the field)."""
    payload = {"model": MODEL, "messages": ASK, "tools": TOOLS, field: 1, **body}
    r = httpx.post(server.url + "/v1/chat/completions", json=payload, timeout=60)
    assert r.status_code == 400, r.text
    err = assert_error_shape(r.json(), 400)
    assert err["param"] == field and "\n" not in err["message"], err
    return int(re.search(r"at least (\d+) tokens", err["message"]).group(1))


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
@pytest.mark.parametrize("ask", [
    {"tool_choice": NAMED, "parallel_tool_calls": False},
    {"tool_choice": "required"},
    {"tools": None, "response_format": {"type": "json_object"}},
])
def test_a_budget_below_the_closing_completion_is_a_400_naming_the_field(server, field, ask):
    need = _minimum(server, field, **ask)
    payload = {"model": MODEL, "messages": ASK, "tools": TOOLS, field: need, "temperature": 0, **ask}
    r = httpx.post(server.url + "/v1/chat/completions", json=payload, timeout=120)
    assert r.status_code == 200 and len(r.json()["choices"]) == 1, r.text
    assert r.json()["usage"]["completion_tokens"] <= need


def test_a_reply_closed_by_the_budget_is_complete_and_marked(server, client):
    """The tiny model never ends a note by itself: a budget a little above the minimum closes
    the call, valid, with finish_reason tool_calls, the choice's specdec field, the header,
    the final chunk's field when streamed, and the metric; the same with and without drafts."""
    base = dict(messages=[{"role": "user", "content": "Note: the quick brown fox."}], tools=[NOTE],
                tool_choice={"type": "function", "function": {"name": "take_note"}},
                parallel_tool_calls=False)
    need = _minimum(server, "max_tokens", **base)
    before = server.metrics().get("specdec:num_requests_closed_by_budget_total", 0.0)
    replies = []
    for drafter in ("none", "ngram"):
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, temperature=0, max_tokens=need + 6, extra_body={"drafter": drafter}, **base)
        reply = raw.parse()
        assert raw.headers["x-specdec-closed-by-budget"] == "true"
        assert reply.choices[0].finish_reason == "tool_calls" and reply.usage.completion_tokens <= need + 6
        assert reply.choices[0].model_extra["specdec"] == {"closed_by_budget": True}
        replies.append([c.function.model_dump() for c in reply.choices[0].message.tool_calls])
        check_calls(reply.choices[0].message.tool_calls)
    assert replies[0] == replies[1]
    chunks = list(client.chat.completions.create(model=MODEL, temperature=0, max_tokens=need + 6, stream=True,
                                                 **base))
    final = [c.choices[0] for c in chunks if c.choices and c.choices[0].finish_reason]
    assert ([f.finish_reason for f in final] == ["tool_calls"]
            and final[0].model_extra["specdec"]["closed_by_budget"])
    assert server.metrics()["specdec:num_requests_closed_by_budget_total"] == before + 3


def test_streamed_tool_calls_reassemble_to_the_non_streamed_ones(client):
    for kw in ({"tool_choice": NAMED, "parallel_tool_calls": False}, {"tool_choice": "required"}):
        full = create(client, **kw).choices[0]
        chunks = list(create(client, stream=True, stream_options={"include_usage": True}, **kw))
        assert chunks[0].choices[0].delta.role == "assistant"
        calls: dict[int, dict] = {}
        for chunk in chunks:
            for piece in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
                if piece.index not in calls:  # a call opens with its id, type, name and no arguments yet
                    assert piece.id.startswith("call_") and piece.type == "function"
                    assert piece.function.name and piece.function.arguments == ""
                    calls[piece.index] = {"name": piece.function.name, "arguments": ""}
                else:
                    assert piece.id is None and piece.function.name is None
                    calls[piece.index]["arguments"] += piece.function.arguments
        want = [{"name": c.function.name, "arguments": c.function.arguments} for c in full.message.tool_calls]
        assert [calls[i] for i in sorted(calls)] == want
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert finish == [full.finish_reason]
        assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert chunks[-1].usage.completion_tokens > 0


def test_speculation_changes_no_tool_call(client):
    base = dict(messages=[{"role": "user", "content": "Note: the quick brown fox."}], tools=[NOTE],
                tool_choice={"type": "function", "function": {"name": "take_note"}},
                parallel_tool_calls=False)
    plain = create(client, **base, extra_body={"drafter": "none", "return_spec_decode": True})
    want = [c.function.model_dump() for c in plain.choices[0].message.tool_calls]
    accepted = 0
    for drafter in ("ngram", "suffix"):
        spec = create(client, **base, extra_body={"drafter": drafter, "k": 4, "return_spec_decode": True})
        assert [c.function.model_dump() for c in spec.choices[0].message.tool_calls] == want
        assert spec.usage.completion_tokens == plain.usage.completion_tokens
        assert spec.choices[0].finish_reason == plain.choices[0].finish_reason
        accepted += spec.model_extra["spec_decode"]["accepted"]
    assert plain.model_extra["spec_decode"]["drafted"] == 0
    assert accepted > 0  # not vacuous: drafts were accepted


def test_auto_and_none(client):
    auto = create(client, tool_choice="auto", max_tokens=30)
    message = auto.choices[0].message
    assert message.content or message.tool_calls
    none = create(client, tool_choice="none", max_tokens=30)
    assert none.choices[0].message.tool_calls is None and none.choices[0].finish_reason in ("stop", "length")
    streamed = "".join(c.choices[0].delta.content or ""
                       for c in create(client, tool_choice="none", max_tokens=30, stream=True) if c.choices)
    assert streamed == none.choices[0].message.content


def test_a_conversation_with_calls_and_results(client):
    first = create(client, tool_choice=NAMED, parallel_tool_calls=False).choices[0].message
    calls = [c.model_dump(exclude_none=True) for c in first.tool_calls]
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": calls},
                {"role": "tool", "tool_call_id": calls[0]["id"], "content": '{"temp": 21, "sky": "clear"}'},
                {"role": "user", "content": "Thanks. And in Rome?"}]
    second = create(client, messages=messages, tool_choice="required", parallel_tool_calls=False)
    check_calls(second.choices[0].message.tool_calls)
    assert second.usage.prompt_tokens > create(client, tool_choice="required", parallel_tool_calls=False,
                                               max_tokens=64).usage.prompt_tokens  # room for a whole call
    plain = create(client, messages=[*messages, {"role": "assistant", "content": "Sunny."}], tools=None,
                   max_tokens=5)
    assert plain.choices[0].finish_reason in ("stop", "length")


def test_response_format(client):
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "why": {"type": "string",
                                                                                         "maxLength": 20}},
              "required": ["answer", "why"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": schema, "strict": True}}
    reply = create(client, tools=None, response_format=fmt)
    data = json.loads(reply.choices[0].message.content)
    assert data["answer"] in ("yes", "no") and len(data["why"]) <= 20 and set(data) == {"answer", "why"}
    assert reply.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].delta.content or ""
                       for c in create(client, tools=None, response_format=fmt, stream=True) if c.choices)
    assert streamed == reply.choices[0].message.content
    obj = create(client, tools=None, response_format={"type": "json_object"}, max_tokens=20).choices[0]
    assert obj.finish_reason == "stop"  # JSON mode: the random model's keys run long, the budget closes them
    assert isinstance(json.loads(obj.message.content), dict)


BAD = [
    ({"tools": [TOOLS[0], {"type": "function", "function": {"name": "no spaces"}}]},
     "tools[1].function.name"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "strin"}}}}}]}, "tools[0].function.parameters"),
    ({"tools": "all of them"}, "tools"),
    ({"tool_choice": "always"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
    ({"tools": None, "tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
     "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"messages": [{"role": "assistant", "content": None,
                    "tool_calls": [{"type": "function", "function": 7}]}]},
     "messages[0].tool_calls[0]"),
    ({"parallel_tool_calls": "sometimes"}, "parallel_tool_calls"),
]


@pytest.mark.parametrize(("body", "param"), BAD)
def test_bad_tool_requests_get_openai_shaped_400s(server, body, param):
    payload = {"model": MODEL, "messages": ASK, "tools": TOOLS, "max_tokens": 5, **body}
    r = httpx.post(server.url + "/v1/chat/completions", json=payload, timeout=60)
    assert r.status_code == 400, r.text
    err = assert_error_shape(r.json(), 400)
    assert err["param"] == param and "\n" not in err["message"]


def test_the_openai_client_sees_a_bad_request(client):
    with pytest.raises(openai.BadRequestError) as info:
        create(client, tools=[{"type": "function", "function": {"name": "a b"}}])
    assert info.value.body["param"] == "tools[0].function.name"


def test_the_json_tool_call_parser(tmp_path):
    """--tool-call-parser json: the model is told to reply with a bare JSON call, and that is
    what the grammar forces and the server parses; an unknown parser is refused at startup."""
    model_dir = save_loaded(tiny_llama(0, max_positions=2048), tmp_path / "m")
    bad = subprocess.run([sys.executable, "-m", "specdec.cli", "serve", "--target", model_dir,
                          "--tool-call-parser", "xml"], capture_output=True, text=True, timeout=120)
    assert (bad.returncode != 0 and "unknown tool-call parser 'xml'" in bad.stderr
            and "Traceback" not in bad.stderr)
    srv = ServerProcess(model_dir, "--served-model-name", MODEL, "--tool-call-parser", "json")
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        reply = create(client, tool_choice=NAMED, parallel_tool_calls=False).choices[0]
        assert reply.finish_reason == "tool_calls" and reply.message.content is None
        check_calls(reply.message.tool_calls, {"get_weather"})
        streamed = list(create(client, tool_choice=NAMED, parallel_tool_calls=False, stream=True))
        args = "".join(p.function.arguments or "" for c in streamed if c.choices
                       for p in c.choices[0].delta.tool_calls or [])
        assert args == reply.message.tool_calls[0].function.arguments
    finally:
        srv.close()


NAMES = st.sampled_from(["get_weather", "add", "f", "bad name", "", "x" * 70])
SCHEMA = st.fixed_dictionaries({}, optional={
    "type": st.sampled_from(["object", "array", "strin"]) | JSON,
    "properties": st.dictionaries(st.sampled_from(["a", "b"]), st.fixed_dictionaries({}, optional={
        "type": st.sampled_from(["string", "integer", "boolean", "nope"]) | JSON,
        "maxLength": st.integers(-1, 5) | JSON, "enum": st.lists(JSON, max_size=3),
        "$ref": st.text(max_size=8)}),
        max_size=2) | JSON,
    "required": st.lists(st.sampled_from(["a", "b", "c"]), max_size=2) | JSON,
    "additionalProperties": st.booleans() | JSON,
})
TOOL = st.fixed_dictionaries({"type": st.just("function") | JSON}, optional={
    "function": st.fixed_dictionaries({"name": NAMES | JSON}, optional={
        "description": st.text(max_size=10) | JSON, "parameters": SCHEMA | JSON,
        "strict": st.booleans() | JSON}) | JSON,
}) | JSON
CALL_SHAPED = st.fixed_dictionaries({"id": st.text(max_size=6) | JSON, "type": st.just("function") | JSON},
                                    optional={"function": st.fixed_dictionaries(
                                        {"name": NAMES | JSON},
                                        optional={"arguments": st.text(max_size=10) | JSON}) | JSON})
TOOL_MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "tool"])},
    optional={"content": st.none() | st.text(max_size=10),
              "tool_calls": st.lists(CALL_SHAPED, max_size=2) | JSON,
              "tool_call_id": st.text(max_size=6) | JSON, "name": st.text(max_size=6) | JSON},
)
TOOL_BODY = st.fixed_dictionaries(
    {"messages": st.lists(TOOL_MESSAGE, min_size=1, max_size=3), "max_tokens": st.integers(1, 6)},
    optional={
        "tools": st.lists(TOOL, max_size=3) | JSON,
        "tool_choice": st.sampled_from(["none", "auto", "required", "x"]) | st.fixed_dictionaries(
            {"type": st.just("function"), "function": st.fixed_dictionaries({"name": NAMES})}) | JSON,
        "parallel_tool_calls": st.booleans() | JSON,
        "response_format": st.sampled_from([{"type": "json_object"}, {"type": "text"},
                                            {"type": "json_schema"}]) | JSON,
        "stream": st.booleans(),
    },
)


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=TOOL_BODY)
def test_fuzzed_tool_requests_never_get_a_5xx(server, body):
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": MODEL, **body}, timeout=60)
    assert r.status_code in (200, 400), (body, r.status_code, r.text)
    if r.status_code == 400:
        assert_error_shape(r.json(), 400)
    elif r.headers["content-type"].startswith("text/event-stream"):
        assert r.text.rstrip().endswith("data: [DONE]") and '"error"' not in r.text
    else:
        assert r.json()["choices"][0]["finish_reason"] in ("stop", "length", "tool_calls")


@pytest.mark.slow
def test_real_model_calls_tools_losslessly():
    """SmolLM2-135M (no tool support in its template: the system block shows the tools):
    a named call parses and follows the schema, ngram and suffix drafting change nothing, and
    the streamed call equals the non-streamed one."""
    srv = ServerProcess("smollm2-135m", "--served-model-name", "smol", backend="auto")
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=300)
        base = dict(model="smol",
                    messages=[{"role": "user", "content": "What's the weather in Paris, in celsius?"}],
                    tools=TOOLS, tool_choice=NAMED, parallel_tool_calls=False, temperature=0, max_tokens=60)
        plain = client.chat.completions.create(**base, extra_body={"drafter": "none"})
        call = plain.choices[0].message.tool_calls[0].function
        assert plain.choices[0].finish_reason == "tool_calls" and valid_args(call.arguments, TOOLS[0])
        for drafter in ("ngram", "suffix"):
            spec = client.chat.completions.create(**base, extra_body={"drafter": drafter})
            assert spec.choices[0].message.tool_calls[0].function == call
        streamed = list(client.chat.completions.create(**base, stream=True))
        args = "".join(p.function.arguments or "" for c in streamed if c.choices
                       for p in c.choices[0].delta.tool_calls or [])
        assert args == call.arguments
    finally:
        srv.close()
