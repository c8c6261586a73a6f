"""The agent frameworks' own clients against a real `specdec serve` process (issue 27): the
OpenAI Agents SDK (through its Chat Completions and its Responses model classes), pydantic-ai,
instructor, LangChain's ChatOpenAI and LiteLLM, each driving the real SmolLM2-135M.

Every test asserts that the framework's own loop completes with a parsed result. Where the
small model's content decides (which city, whether it calls a tool under `auto`), the prompts
show it one worked example, and the assertions check the protocol, not the model's wisdom.

Offline: the Agents SDK's trace export and LiteLLM's remote model-cost map are turned off, and
a guard refuses (and records) every connection or name lookup beyond loopback while the module
runs; the module fails if any was tried. The client libraries come from the `frameworks` extra;
a missing one skips its tests. The matrix of results is in docs/frameworks.md.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Iterable

import httpx
import pytest
from pydantic import BaseModel

from served_helpers import ServerProcess

pytestmark = pytest.mark.slow

MODEL = "smollm2"
KEY = "unused"
STRUCTURED_TOKENS = 300  # room for a structured reply to close (a cut one is invalid JSON; branch `closing`)
TEXT_TOKENS = 96  # "Say hello." stops on its own well before: a cut reply fails a streamed Responses run
OFFLINE_ENV = {
    "OPENAI_AGENTS_DISABLE_TRACING": "1",
    "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # read at import: set before litellm is imported
    "LANGSMITH_TRACING": "false",
    "LANGCHAIN_TRACING_V2": "false",
}
LOOPBACK = {"127.0.0.1", "::1", "localhost"}


class Weather(BaseModel):
    """A weather report of one city."""

    city: str
    temperature_c: int


def weather_tool(seen: list[str]):
    """The function tool every loop calls; `seen` records the cities it was called with."""

    def get_weather(city: str) -> str:
        """The current weather of a city."""
        seen.append(city)
        return f"Sunny, 21 C in {city}"

    return get_weather


def _call(i: int, city: str, temperature: int) -> dict:
    arguments = json.dumps({"city": city, "temperature_c": temperature})
    return {"id": f"call_{i}", "type": "function", "function": {"name": "Weather", "arguments": arguments}}


SYSTEM = {"role": "system", "content": "You record weather reports."}
# One worked example each: SmolLM2-135M calls a tool under `auto` (instructor's PARALLEL_TOOLS
# sends it) only after it has seen a call, and writes the asked-for JSON after one example.
CALLS_SHOT = [SYSTEM, {"role": "user", "content": "Berlin is 18 C and Oslo is 9 C."},
              {"role": "assistant", "content": None,
               "tool_calls": [_call(1, "Berlin", 18), _call(2, "Oslo", 9)]},
              {"role": "user", "content": "Paris is 21 C and Rome is 25 C."}]
JSON_SHOT = [SYSTEM, {"role": "user", "content": "Berlin is 18 C."},
             {"role": "assistant", "content": '{"city": "Berlin", "temperature_c": 18}'},
             {"role": "user", "content": "Paris is 21 C."}]


class NetworkGuard:
    """Refuses and records every connection and name lookup beyond loopback (all threads)."""

    def __init__(self):
        self.attempts: list[str] = []
        self._connect, self._getaddrinfo = socket.socket.connect, socket.getaddrinfo

    def __enter__(self):
        guard = self

        def connect(sock, address):
            host = address[0] if isinstance(address, tuple) else address
            if sock.family in (socket.AF_INET, socket.AF_INET6) and host not in LOOPBACK:
                guard.attempts.append(f"connect {address}")
                raise OSError(f"test_frameworks: the network is off ({address})")
            return guard._connect(sock, address)

        def getaddrinfo(host, *args, **kw):
            if host is not None and host not in LOOPBACK:
                guard.attempts.append(f"lookup {host}")
                raise socket.gaierror(f"test_frameworks: the network is off ({host})")
            return guard._getaddrinfo(host, *args, **kw)

        socket.socket.connect, socket.getaddrinfo = connect, getaddrinfo
        return self

    def __exit__(self, *exc):
        socket.socket.connect, socket.getaddrinfo = self._connect, self._getaddrinfo


@pytest.fixture(scope="module")
def offline():
    with pytest.MonkeyPatch.context() as mp, NetworkGuard() as guard:
        for name, value in OFFLINE_ENV.items():
            mp.setenv(name, value)
        yield guard
    assert not guard.attempts, f"a framework tried to reach the network: {guard.attempts}"


@pytest.fixture(scope="module")
def server(offline):
    srv = ServerProcess("smollm2-135m", "--served-model-name", MODEL, "--max-batch", "4", backend="auto",
                        ready_timeout=600)
    yield srv
    srv.close()


@pytest.fixture
def base_url(server):
    return server.url + "/v1"


def test_the_guard_refuses_the_network(offline):
    before = list(offline.attempts)
    with pytest.raises(OSError):
        socket.create_connection(("example.com", 443), timeout=1)
    assert offline.attempts[len(before):] == ["lookup example.com"]
    del offline.attempts[len(before):]  # the module's final check is about the frameworks


# ---- the OpenAI Agents SDK, through both model classes ----------------------------------------


@pytest.fixture(params=["chat", "responses"])
def agents_model(request, base_url):
    """A factory of the SDK's model (called inside the test's event loop, where its client lives)."""
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    if request.param == "responses":
        probe = httpx.post(base_url + "/responses",
                           json={"model": MODEL, "input": "Hi", "max_output_tokens": 1}, timeout=120)
        if probe.status_code == 404:
            pytest.skip("POST /v1/responses answers 404: this server does not serve the Responses API yet")
    model_class = {"chat": agents.OpenAIChatCompletionsModel,
                   "responses": agents.OpenAIResponsesModel}[request.param]

    def make():
        from openai import AsyncOpenAI

        client = AsyncOpenAI(base_url=base_url, api_key=KEY, max_retries=0, timeout=300)
        return model_class(model=MODEL, openai_client=client)

    return make


def test_agents_tool_loop_calls_the_tool_and_answers(agents_model):
    from agents import Agent, ModelSettings, Runner, ToolCallItem, ToolCallOutputItem, function_tool

    seen: list[str] = []
    settings = ModelSettings(tool_choice="required", parallel_tool_calls=False, max_tokens=200, temperature=0)

    async def run():
        agent = Agent(name="weather", instructions="Use the tool, then answer in one sentence.",
                      model=agents_model(), tools=[function_tool(weather_tool(seen))],
                      model_settings=settings)
        return await Runner.run(agent, "What is the weather in Paris?", max_turns=6)

    result = asyncio.run(run())
    kinds = [type(item) for item in result.new_items]
    assert ToolCallItem in kinds and ToolCallOutputItem in kinds and seen
    first_output = next(i for i in result.new_items if isinstance(i, ToolCallOutputItem))
    assert first_output.output == f"Sunny, 21 C in {seen[0]}"
    # The tool's result went back to the model, which then answered (tool_choice resets to auto).
    assert len(result.raw_responses) >= 2
    assert isinstance(result.final_output, str) and result.final_output


def test_agents_streamed_run_yields_the_final_text_in_deltas(agents_model):
    from agents import Agent, ModelSettings, Runner
    from openai.types.responses import ResponseTextDeltaEvent

    async def run():
        agent = Agent(name="greeter", model=agents_model(),
                      model_settings=ModelSettings(max_tokens=TEXT_TOKENS, temperature=0))
        result = Runner.run_streamed(agent, "Say hello.")
        deltas = [event.data.delta async for event in result.stream_events()
                  if event.type == "raw_response_event" and isinstance(event.data, ResponseTextDeltaEvent)]
        return result, deltas

    result, deltas = asyncio.run(run())
    assert len(deltas) > 1 and result.is_complete
    assert "".join(deltas) == result.final_output and result.final_output


def test_agents_structured_output_type_is_parsed(agents_model):
    from agents import Agent, ModelSettings, Runner

    async def run():
        agent = Agent(name="extract", instructions="Extract the weather report.", model=agents_model(),
                      output_type=Weather,
                      model_settings=ModelSettings(max_tokens=STRUCTURED_TOKENS, temperature=0))
        return await Runner.run(agent, "Paris is 21 C.")

    assert isinstance(asyncio.run(run()).final_output, Weather)


# ---- pydantic-ai ---------------------------------------------------------------------------


@pytest.fixture
def pai_model(base_url):
    pytest.importorskip("pydantic_ai")
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    return OpenAIChatModel(MODEL, provider=OpenAIProvider(base_url=base_url, api_key=KEY))


@pytest.mark.parametrize("kind", ["tool", "native"])
def test_pydantic_ai_structured_output(pai_model, kind):
    from pydantic_ai import Agent, NativeOutput, ToolOutput
    from pydantic_ai.messages import ToolCallPart

    output = ToolOutput(Weather) if kind == "tool" else NativeOutput(Weather)
    agent = Agent(pai_model, output_type=output, instructions="Extract the weather report.",
                  model_settings={"max_tokens": STRUCTURED_TOKENS, "temperature": 0})
    result = agent.run_sync("Paris is 21 C.")
    assert isinstance(result.output, Weather)
    calls = [p for m in result.all_messages() for p in m.parts if isinstance(p, ToolCallPart)]
    assert bool(calls) == (kind == "tool")  # the output tool, or a json_schema reply without calls


def test_pydantic_ai_tools_then_text(pai_model):
    from pydantic_ai import Agent
    from pydantic_ai.messages import ToolReturnPart

    seen: list[str] = []

    def settings(ctx):  # force the call on the first step, then text (pydantic-ai's per-step settings)
        return {"max_tokens": 200, "temperature": 0, "parallel_tool_calls": False,
                "tool_choice": "required" if ctx.run_step <= 1 else "none"}

    agent = Agent(pai_model, model_settings=settings, tools=[weather_tool(seen)],
                  instructions="Use the tool, then answer in one sentence.")
    result = agent.run_sync("What is the weather in Paris?")
    returns = [p for m in result.all_messages() for p in m.parts if isinstance(p, ToolReturnPart)]
    assert seen and returns and returns[0].content == f"Sunny, 21 C in {seen[0]}"
    assert isinstance(result.output, str) and result.output


def test_pydantic_ai_streamed_text(pai_model):
    from pydantic_ai import Agent

    agent = Agent(pai_model, model_settings={"max_tokens": TEXT_TOKENS, "temperature": 0})

    async def run():
        async with agent.run_stream("Say hello.") as result:
            deltas = [d async for d in result.stream_text(delta=True, debounce_by=None)]
            return deltas, await result.get_output()

    deltas, output = asyncio.run(run())
    assert len(deltas) > 1 and "".join(deltas) == output and output


# ---- instructor ------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["TOOLS", "PARALLEL_TOOLS", "JSON_SCHEMA", "JSON"])
def test_instructor_modes_parse_the_reply(base_url, mode):
    instructor = pytest.importorskip("instructor")
    import openai

    client = instructor.from_openai(openai.OpenAI(base_url=base_url, api_key=KEY, max_retries=0, timeout=300),
                                    mode=instructor.Mode[mode])
    completions = []  # the raw replies, through instructor's hook
    client.on("completion:response", completions.append)
    parallel = mode == "PARALLEL_TOOLS"
    parsed = client.chat.completions.create(
        model=MODEL, messages=CALLS_SHOT if parallel else JSON_SHOT, max_retries=0, temperature=0,
        response_model=Iterable[Weather] if parallel else Weather, max_tokens=STRUCTURED_TOKENS)
    reports = list(parsed) if parallel else [parsed]
    assert reports and all(isinstance(r, Weather) for r in reports)
    (completion,) = completions
    finish = completion.choices[0].finish_reason
    assert finish == ("tool_calls" if mode.endswith("TOOLS") else "stop")


# ---- LangChain ---------------------------------------------------------------------------------


@pytest.fixture
def chat_openai(base_url):
    pytest.importorskip("langchain_openai")
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(model=MODEL, base_url=base_url, api_key=KEY, temperature=0, max_tokens=200,
                      max_retries=0, timeout=300)


def test_langchain_bind_tools_round_trip(chat_openai):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool

    seen: list[str] = []
    get_weather = tool(weather_tool(seen))
    question = HumanMessage("What is the weather in Paris?")
    call_reply = chat_openai.bind_tools([get_weather], tool_choice="get_weather").invoke([question])
    assert call_reply.tool_calls and all(c["name"] == "get_weather" for c in call_reply.tool_calls)
    results = [ToolMessage(get_weather.invoke(c["args"]), tool_call_id=c["id"])
               for c in call_reply.tool_calls]
    answer = chat_openai.bind_tools([get_weather], tool_choice="none").invoke([question, call_reply,
                                                                               *results])
    assert seen and not answer.tool_calls and isinstance(answer.content, str) and answer.content


@pytest.mark.parametrize("method", ["json_schema", "function_calling", "json_mode"])
def test_langchain_with_structured_output(chat_openai, method):
    structured = chat_openai.with_structured_output(Weather, method=method, include_raw=True)
    reply = structured.invoke("Paris is 21 C. Give the weather as JSON with the keys city and temperature_c.")
    assert reply["parsing_error"] is None and isinstance(reply["parsed"], Weather)


# ---- LiteLLM -----------------------------------------------------------------------------------


@pytest.fixture
def litellm_call(base_url):
    litellm = pytest.importorskip("litellm")

    def call(**kw):
        return litellm.completion(model=f"openai/{MODEL}", api_base=base_url, api_key=KEY, temperature=0,
                                  **kw)

    return call


def test_litellm_tool_call_and_json_schema(litellm_call):
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "The current weather of a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    reply = litellm_call(messages=[{"role": "user", "content": "What is the weather in Paris?"}], tools=tools,
                         tool_choice="required", parallel_tool_calls=False, max_tokens=200)
    assert reply.choices[0].finish_reason == "tool_calls"
    (call,) = reply.choices[0].message.tool_calls
    assert (call.function.name == "get_weather"
            and isinstance(json.loads(call.function.arguments)["city"], str))
    reply = litellm_call(messages=JSON_SHOT, response_format=Weather, max_tokens=STRUCTURED_TOKENS)
    assert Weather.model_validate_json(reply.choices[0].message.content)


def test_litellm_streamed_text(litellm_call):
    chunks = list(litellm_call(messages=[{"role": "user", "content": "Say hello."}], max_tokens=TEXT_TOKENS,
                               stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(chunks) > 2 and text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] in (
        ["length"], ["stop"])
