"""/v1/responses through a real `specdec serve` process, driven by the official OpenAI client's
`responses` methods (the tiny random model: the grammar alone makes its calls and JSON valid)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from conftest import save_loaded, tiny_llama
from served_helpers import ServerProcess, assert_error_shape
from specdec.serve.ray_routing import conversation_key
from test_tools import TOOLS, valid_args

MODEL = "tiny"
WEATHER = TOOLS[0]["function"]
FLAT = [{"type": "function", **t["function"]} for t in TOOLS]  # the Responses API's tool shape
NAMED = {"type": "function", "name": WEATHER["name"]}
SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]},
                                           "why": {"type": "string", "maxLength": 20}},
          "required": ["answer", "why"], "additionalProperties": False}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = save_loaded(tiny_llama(0, max_positions=2048), tmp_path_factory.mktemp("tiny-responses"))
    srv = ServerProcess(model_dir, "--served-model-name", MODEL, "--drafter", "ngram:min=1",
                        "--max-batch", "4")
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def create(client, **kw):
    base = dict(model=MODEL, input="What is the weather in Paris?", temperature=0, max_output_tokens=120)
    return client.responses.create(**{**base, **kw})


def test_text_in_text_out(client):
    r = create(client, instructions="Answer briefly.", max_output_tokens=12)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL
    assert r.status in ("completed", "incomplete") and r.output_text
    assert r.output[0].type == "message" and r.output[0].content[0].type == "output_text"
    assert (r.usage.output_tokens <= 12
            and r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens)
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens"


def test_function_call_round_trip(client):
    """call -> our function_call_output item -> the final text, as an agent loop does it."""
    first = create(client, tools=FLAT, tool_choice=NAMED, parallel_tool_calls=False)
    calls = [item for item in first.output if item.type == "function_call"]
    assert first.status == "completed" and len(calls) == 1
    call = calls[0]
    assert call.name == WEATHER["name"] and call.call_id.startswith("call_")
    assert valid_args(call.arguments, TOOLS[0])
    history = [{"role": "user", "content": "What is the weather in Paris?"},
               *[item.model_dump(exclude_none=True) for item in first.output],
               {"type": "function_call_output", "call_id": call.call_id,
                "output": '{"temp": 21, "sky": "clear"}'}]
    final = create(client, input=history, tools=FLAT, tool_choice="none", max_output_tokens=16)
    assert final.output_text and not [i for i in final.output if i.type == "function_call"]
    assert final.usage.input_tokens > first.usage.input_tokens  # the call and its result were in the prompt


def test_json_schema_reply(client):
    r = create(client, input="Is the sky blue?", max_output_tokens=200,
               text={"format": {"type": "json_schema", "name": "verdict", "schema": SCHEMA, "strict": True}})
    assert r.status == "completed"
    reply = json.loads(r.output_text)
    assert reply["answer"] in ("yes", "no") and len(reply["why"]) <= 20


def test_the_stream_parses_and_matches_the_whole_reply(client):
    whole = create(client, tools=FLAT, tool_choice="required", parallel_tool_calls=False)
    events = list(create(client, tools=FLAT, tool_choice="required", parallel_tool_calls=False, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    for kind in ("response.output_item.added", "response.function_call_arguments.delta",
                 "response.function_call_arguments.done", "response.output_item.done"):
        assert kind in kinds
    streamed = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    want = next(i for i in whole.output if i.type == "function_call")
    assert streamed == done.arguments == want.arguments and done.name == want.name
    final = events[-1].response
    assert [i.type for i in final.output] == [i.type for i in whole.output]


def test_streamed_text_events(client):
    whole = create(client, max_output_tokens=16)
    events = list(create(client, max_output_tokens=16, stream=True))
    kinds = [e.type for e in events]
    for kind in ("response.output_item.added", "response.content_part.added", "response.output_text.delta",
                 "response.output_text.done", "response.content_part.done", "response.output_item.done"):
        assert kind in kinds
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == next(e for e in events if e.type == "response.output_text.done").text == whole.output_text
    assert kinds[-1] == ("response.completed" if whole.status == "completed" else "response.incomplete")


def test_speculation_changes_nothing(client):
    base = dict(tools=FLAT, tool_choice=NAMED, parallel_tool_calls=False)
    plain = create(client, **base, extra_body={"drafter": "none", "return_spec_decode": True})
    spec = create(client, **base, extra_body={"drafter": "ngram", "k": 4, "return_spec_decode": True})
    args = [(i.name, i.arguments) for i in plain.output if i.type == "function_call"]
    assert [(i.name, i.arguments) for i in spec.output if i.type == "function_call"] == args
    assert plain.model_extra["spec_decode"]["drafted"] == 0
    assert spec.model_extra["spec_decode"]["forced_tokens"] > 0  # the grammar's tokens were drafted for free


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"store": True}, "store"),
        ({"previous_response_id": "resp_123"}, "previous_response_id"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"background": True}, "background"),
        ({"include": ["message.output_text.logprobs"]}, "include"),
        ({"reasoning": {"effort": "low"}}, "reasoning"),
        ({"truncation": "auto"}, "truncation"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"service_tier": "auto"}, "service_tier"),
        ({"frobnicate": 1}, "frobnicate"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
         "input[0].content[0].type"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
        ({"tools": FLAT, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice.name"),
        ({"max_output_tokens": 100000}, "max_output_tokens"),
    ],
)
def test_refusals_name_the_field(server, body, param):
    r = httpx.post(server.url + "/v1/responses", json={"model": MODEL, "input": "hi", **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert assert_error_shape(r.json(), 400)["param"] == param


def test_defaults_the_clients_send_are_accepted(server):
    """What the Agents SDK sends with default settings: an empty include and tools list, store
    omitted or false, and echoed output items with their ids and statuses."""
    echoed = {"id": "msg_1", "type": "message", "role": "assistant", "status": "completed",
              "content": [{"type": "output_text", "text": "Hi.", "annotations": [], "logprobs": []}]}
    body = {"model": MODEL,
            "input": [{"role": "user", "content": "hi"}, echoed, {"role": "user", "content": "again"}],
            "include": [], "tools": [], "store": False, "max_output_tokens": 4, "truncation": "disabled"}
    r = httpx.post(server.url + "/v1/responses", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["store"] is False


def test_the_openai_client_raises_on_a_refusal(client):
    with pytest.raises(openai.BadRequestError) as err:
        create(client, store=True)
    assert err.value.body["param"] == "store"


def test_a_responses_conversation_keeps_its_replica():
    """`--replicas` routes a Responses conversation by its instructions and first input, as chat's."""
    turn1 = {"instructions": "Be brief.", "input": "Plan my trip."}
    turn2 = {"instructions": "Be brief.",
             "input": [{"role": "user", "content": "Plan my trip."},
                       {"type": "function_call_output", "call_id": "c", "output": "ok"}]}
    chat = {"messages": [{"role": "system", "content": "Be brief."},
                         {"role": "user", "content": "Plan my trip."}]}
    assert conversation_key(turn1) == conversation_key(turn2) == conversation_key(chat)
    assert conversation_key({**turn1, "input": "Something else."}) != conversation_key(turn1)


@pytest.mark.slow
def test_real_model_round_trip_through_responses():
    """SmolLM2-135M: a named call through /v1/responses follows the schema, drafting changes
    nothing, the streamed arguments equal the whole ones, and the call's result comes back as
    a function_call_output item for the final text."""
    srv = ServerProcess("smollm2-135m", "--served-model-name", "smol", backend="auto")
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=300)
        base = dict(model="smol", input="What's the weather in Paris, in celsius?", tools=FLAT,
                    tool_choice=NAMED, parallel_tool_calls=False, temperature=0, max_output_tokens=60)
        plain = client.responses.create(**base, extra_body={"drafter": "none"})
        call = next(i for i in plain.output if i.type == "function_call")
        assert plain.status == "completed" and valid_args(call.arguments, TOOLS[0])
        for drafter in ("ngram", "suffix"):
            spec = client.responses.create(**base,
                                           extra_body={"drafter": drafter, "return_spec_decode": True})
            assert next(i for i in spec.output if i.type == "function_call").arguments == call.arguments
        events = list(client.responses.create(**base, stream=True))
        assert ("".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
                == call.arguments)
        history = [{"role": "user", "content": base["input"]}, call.model_dump(exclude_none=True),
                   {"type": "function_call_output", "call_id": call.call_id, "output": '{"temp": 21}'}]
        final = client.responses.create(**{**base, "input": history, "tool_choice": "none"})
        assert final.output_text and final.usage.input_tokens > plain.usage.input_tokens
    finally:
        srv.close()


def test_the_agents_sdk_runs_on_the_responses_model(server):
    """The OpenAI Agents SDK's default model class (OpenAIResponsesModel): a tool loop, a
    streamed run and a structured output_type complete. The random model's words are
    nonsense; the protocol is what is checked."""
    agents = pytest.importorskip("agents")
    import asyncio

    from pydantic import BaseModel

    agents.set_tracing_disabled(True)  # offline: no trace export

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return "sunny"

    class Verdict(BaseModel):
        answer: str

    async def run() -> None:
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        model = agents.OpenAIResponsesModel(MODEL, client)
        settings = agents.ModelSettings(tool_choice="required", max_tokens=400, temperature=0)
        agent = agents.Agent(name="a", instructions="Be brief.", tools=[get_weather], model=model,
                             model_settings=settings)
        result = await agents.Runner.run(agent, "Weather in Paris?", max_turns=4)
        kinds = [type(item).__name__ for item in result.new_items]
        assert kinds[:2] == ["ToolCallItem", "ToolCallOutputItem"] and isinstance(result.final_output, str)
        streamed = agents.Runner.run_streamed(agent, "Weather in Rome?", max_turns=4)
        async for _ in streamed.stream_events():
            pass
        assert isinstance(streamed.final_output, str)
        judge = agents.Agent(name="b", model=model, output_type=Verdict,
                             model_settings=agents.ModelSettings(max_tokens=400, temperature=0))
        assert isinstance((await agents.Runner.run(judge, "Is the sky blue?")).final_output, Verdict)

    asyncio.run(run())
