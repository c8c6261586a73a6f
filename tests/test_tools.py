"""Function calling (tools.py, tool_parsers/): checks, prompt rendering, the parsers streamed
and not, the call grammars, and the engine's tool calls exact under speculation."""

from __future__ import annotations

import copy
import json
import random

import pytest

from conftest import tiny_llama, tiny_tokenizer
from specdec.engine import Engine
from specdec.errors import SpecdecError
from specdec.grammar import GrammarMatcher, grammar
from specdec.prompts import encode
from specdec.tool_parsers import available_parsers, get_parser
from specdec.tools import ToolStream, chat_messages, new_call_id, tool_plan

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                           "b": {"type": "integer", "minimum": 0, "maximum": 99}},
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
PING = {"type": "function", "function": {"name": "ping"}}  # no parameters: arguments {}
TOOLS = [WEATHER, ADD, PING]
# SmolLM2-135M-Instruct's template: ChatML, any role string, no tool support.
CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, "
    "trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def valid_args(arguments: str, tool: dict) -> bool:
    """Just enough JSON Schema for the tools above."""
    args = json.loads(arguments)
    schema = tool["function"].get("parameters") or {"properties": {}}
    props = schema["properties"]
    if set(args) - set(props) or not set(schema.get("required", [])) <= set(args):
        return False
    for key, value in args.items():
        rule = props[key]
        if "enum" in rule and value not in rule["enum"]:
            return False
        if rule.get("type") == "string" and not (isinstance(value, str) and len(value) <= rule["maxLength"]):
            return False
        if rule.get("type") == "integer" and not (isinstance(value, int)
                                                  and rule["minimum"] <= value <= rule["maximum"]):
            return False
    return True


def tok_with(template: str):
    tok = copy.copy(tiny_tokenizer())
    tok.chat_template = template
    return tok


# ---- checks ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "param", "message"),
    [
        ({"tools": "x"}, "tools", "expected a list"),
        ({"tools": [1]}, "tools[0]", "expected an object"),
        ({"tools": [{"type": "code_interpreter"}]}, "tools[0].type", "only 'function' tools"),
        ({"tools": [{"type": "function"}]}, "tools[0].function", "expected an object"),
        ({"tools": [WEATHER, {"type": "function", "function": {"name": "bad name"}}]},
         "tools[1].function.name", "letters, digits"),
        ({"tools": [{"type": "function", "function": {"name": "x" * 65}}]}, "tools[0].function.name", "1-64"),
        ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name", "duplicate"),
        ({"tools": [{"type": "function", "function": {"name": "f", "description": 3}}]},
         "tools[0].function.description", "string"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
         "tools[0].function.parameters", "type 'object'"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"a": {"type": "strin"}}}}}]},
         "tools[0].function.parameters", "invalid JSON schema"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}}]},
         "tools[0].function.parameters", "invalid JSON schema"),
        ({"tools": [{"type": "function", "function": {"name": "f", "strict": "yes"}}]},
         "tools[0].function.strict", "boolean"),
        ({"tools": [PING] * 129}, "tools", "at most 128"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "must be none, auto, required"),
        ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice", "expected"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice.function.name", "no tool is named 'nope'"),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice",
         "only allowed when tools"),
        ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls", "boolean"),
        ({"tools": TOOLS, "parser": "xml"}, "tool_parser", "unknown tool-call parser"),
    ],
)
def test_bad_tool_fields_are_one_line_errors_naming_the_field(kwargs, param, message):
    with pytest.raises(SpecdecError) as err:
        tool_plan(**kwargs)
    assert err.value.param == param
    assert message in err.value.message and "\n" not in err.value.message


def test_plans():
    assert tool_plan() is None and tool_plan([], "auto") is None and tool_plan(None, "none") is None
    plan = tool_plan(TOOLS)
    assert (plan.choice, plan.parallel, plan.parser.name) == ("auto", True, "hermes")
    named = tool_plan(TOOLS, {"type": "function", "function": {"name": "add"}}, False, "json")
    assert (named.choice, named.parallel, named.parser.name, named.forced) == ("add", False, "json", True)
    assert tool_plan(TOOLS, "none").stream() is None
    assert set(available_parsers()) >= {"hermes", "tool_call", "json"}
    assert get_parser("tool_call") is get_parser("hermes")
    assert new_call_id().startswith("call_") and new_call_id() != new_call_id()


# ---- parsers --------------------------------------------------------------------------------

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'
HERMES = [  # (text, content, [(name, arguments)])
    ("Hello there.", "Hello there.", []),
    ("a < b and <tool nope <", "a < b and <tool nope <", []),
    ("  padded  ", "  padded  ", []),
    (CALL, "", [("get_weather", '{"city": "Paris", "unit": "c"}')]),
    ("Let me look.\n" + CALL + "\n" + CALL.replace("Paris", "Rome") + "\n",
     "Let me look.",
     [("get_weather", '{"city": "Paris", "unit": "c"}'), ("get_weather", '{"city": "Rome", "unit": "c"}')]),
    (CALL + " Done.", "Done.", [("get_weather", '{"city": "Paris", "unit": "c"}')]),
    ('<tool_call>{"arguments": {"x": [1, {"y": "}"}]}, "name": "f"}</tool_call>', "",
     [("f", '{"x": [1, {"y": "}"}]}')]),
    ('<tool_call>{"name": "f", "parameters": {}}</tool_call>', "", [("f", "{}")]),
    ('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>', "", [("f", '{"a": 1}')]),
    ('<tool_call>{"name": "f", "arguments": {"a": "\\"<tool_call>\\""}}</tool_call>', "",
     [("f", '{"a": "\\"<tool_call>\\""}')]),
    ("<tool_call>not json</tool_call> ok", "<tool_call>not json</tool_call> ok", []),
    ('<tool_call>{"name": 3}</tool_call>', '<tool_call>{"name": 3}</tool_call>', []),
    ('x <tool_call>{"name": "f"}</tool_call>', 'x <tool_call>{"name": "f"}</tool_call>', []),  # no arguments
    ('<tool_call>{"name": "f", "arguments": {"a": 1]}}</tool_call>after', "after", [("f", '{"a": 1')]),
    ('<tool_call>\n{"name": "f", "arguments": {"a": "cut sho', "", [("f", '{"a": "cut sho')]),
    ('<tool_call>\n{"name": "f", "argu', '<tool_call>\n{"name": "f", "argu', []),
    ('<tool_call><tool_call>{"name": "f", "arguments": {}}</tool_call>', "<tool_call>", [("f", "{}")]),
    ('<tool_call>{"name": "f", "arguments": {}} trailing text', "trailing text", [("f", "{}")]),
    ("text <tool_ca", "text <tool_ca", []),
]
JSON = [
    ('{"name": "f", "arguments": {"x": 1}}', "", [("f", '{"x": 1}')]),
    ('  [{"name": "f", "arguments": {}}, {"name": "g", "arguments": {"y": "]"}}] ok', "ok",
     [("f", "{}"), ("g", '{"y": "]"}')]),
    ("Plain text {not json}", "Plain text {not json}", []),
    ('{"answer": 42}', '{"answer": 42}', []),
    ("[1, 2]", "[1, 2]", []),
    ("   ", "   ", []),
    ('[{"name": "f", "arguments": {}}, 7]', "", [("f", "{}")]),
    ('{"name": "f", "arguments": {"x": tru', "", [("f", '{"x": tru')]),
]
CASES = [("hermes", *c) for c in HERMES] + [("json", *c) for c in JSON]


def splits(text: str, seed: int) -> list[list[str]]:
    """Char by char, every two-piece split, and random chunkings."""
    out = [list(text)] + [[text[:i], text[i:]] for i in range(len(text) + 1)]
    rng = random.Random(seed)
    for _ in range(20):
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(1, 8))))
        out.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)])
    return out


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES)
def test_parse_tables(parser, text, content, calls):
    got_content, got_calls = get_parser(parser).parse(text)
    assert got_content == content
    assert [(c["name"], c["arguments"]) for c in got_calls] == calls


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES)
def test_streaming_in_any_split_agrees_with_parse(parser, text, content, calls):
    for chunks in splits(text, seed=len(text)):
        stream = ToolStream(get_parser(parser))
        deltas = [d for chunk in chunks for d in stream.feed(chunk)] + stream.finish()
        assert (stream.content if calls else stream.content or "") == (content or None if calls else content)
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in stream.calls] == calls
        # The OpenAI deltas alone rebuild the same reply: a call opens with index, id, type,
        # name and empty arguments; then only index and argument pieces.
        rebuilt, opened = {}, set()
        for d in deltas:
            assert len(d) == 1
            for piece in d.get("tool_calls", []):
                if piece["index"] not in opened:
                    assert (set(piece) == {"index", "id", "type", "function"}
                            and piece["function"]["arguments"] == "")
                    opened.add(piece["index"])
                    rebuilt[piece["index"]] = [piece["function"]["name"], ""]
                else:
                    assert set(piece) == {"index", "function"} and set(piece["function"]) == {"arguments"}
                    rebuilt[piece["index"]][1] += piece["function"]["arguments"]
        assert [tuple(rebuilt[i]) for i in sorted(rebuilt)] == calls
        assert "".join(d.get("content", "") for d in deltas) == content


def test_a_partial_tag_is_held_back_then_released():
    stream = ToolStream(get_parser("hermes"))
    assert stream.feed("Sure <tool") == [{"content": "Sure"}]  # the space may be layout before a call
    assert stream.feed("box>") == [{"content": " <toolbox>"}]
    opened = stream.feed(' <tool_call>\n{"name": "ping", "arguments": {')
    assert opened[0]["tool_calls"][0]["function"] == {"name": "ping", "arguments": ""}
    assert opened[1] == {"tool_calls": [{"index": 0, "function": {"arguments": "{"}}]}


# ---- prompts --------------------------------------------------------------------------------


def test_tools_render_in_a_system_block_for_a_template_without_tool_support():
    tok = tok_with(CHATML)
    plan = tool_plan(TOOLS)
    text = tok.decode(encode(tok, "Weather in Paris?", tools=plan))
    # it replaces the default
    assert text.startswith("<|im_start|>system\n# Tools\n") and "SmolLM" not in text
    assert text.count('{"type": "function", "function": {"name": ') == 3 and "<tool_call>" in text
    assert text.endswith("<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n")
    merged = tok.decode(encode(tok, [{"role": "system", "content": "Be brief."},
                                     {"role": "user", "content": "Hi"}], tools=plan))
    assert (merged.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
            and merged.count("<|im_start|>system") == 1)
    json_plan = tool_plan(TOOLS, parser="json")
    assert "JSON list of such objects" in tok.decode(encode(tok, "Hi", tools=json_plan))
    # no tools: unchanged
    assert tok.decode(encode(tok, "Hi")).startswith("<|im_start|>system\nYou are a helpful")


HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "Paris", "unit": "c"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
    {"role": "user", "content": "And now?"},
]


def test_history_with_calls_and_results():
    tok = tok_with(CHATML)
    text = tok.decode(encode(tok, HISTORY, tools=tool_plan(TOOLS)))
    assert f"<|im_start|>assistant\n{CALL}<|im_end|>" in text  # the call in the model's own format
    assert ('<|im_start|>tool\n<tool_response>\n{"name": "get_weather", "content": {"temp": 21}}\n'
            "</tool_response><|im_end|>") in text
    assert HISTORY[1]["content"] is None and "tool_calls" in HISTORY[1]  # the caller's messages are untouched
    no_tools = tok.decode(encode(tok, HISTORY))  # a history alone renders too
    assert CALL in no_tools and "# Tools" not in no_tools
    # A template that refuses the tool role gets the result as a user message.
    strict = tok_with("{% for m in messages %}{% if m['role'] not in ['system', 'user', 'assistant'] %}"
                      "{{ raise_exception('bad role') }}{% endif %}"
                      "[{{ m['role'] }}]{{ m['content'] }}{% endfor %}")
    assert "[user]<tool_response>" in strict.decode(encode(strict, HISTORY))
    with pytest.raises(SpecdecError) as err:
        encode(tok, [{"role": "assistant", "content": None, "tool_calls": [{"function": "x"}]}])
    assert err.value.param == "messages[0].tool_calls[0]"
    with pytest.raises(SpecdecError) as err:
        encode(tok, [5, 6], tools=tool_plan(TOOLS))
    assert err.value.param == "tools"


def test_a_template_with_tool_support_renders_them_itself():
    tok = tok_with(
        "{% if tools %}[tools:{% for t in tools %}{{ t.function.name }};{% endfor %}]{% endif %}"
        "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% if m.tool_calls %}"
        "{% for c in m.tool_calls %}<{{ c.function.name }} {{ c.function.arguments.city }}>{% endfor %}"
        "{% endif %}"
        "{% if m.name %}({{ m.name }}){% endif %}{% endfor %}"
    )
    messages, extra = chat_messages(tok, HISTORY, tool_plan(TOOLS))
    assert extra == {"tools": TOOLS} and messages[0] == HISTORY[0]
    text = tok.decode(encode(tok, HISTORY, tools=tool_plan(TOOLS)))
    assert text.startswith("[tools:get_weather;add;ping;]") and "# Tools" not in text
    assert "[assistant]<get_weather Paris>" in text and '[tool]{"temp": 21}(get_weather)' in text


# ---- grammars -------------------------------------------------------------------------------


def accepts(lark: str, text: str) -> bool:
    tok = tiny_tokenizer()
    matcher = GrammarMatcher(grammar(lark), tok, {tok.eos_token_id})
    ids = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
    return matcher.valid_prefix(ids) == len(ids)


ARGS = '{"city": "Paris", "unit": "c"}'


@pytest.mark.parametrize(
    ("parser", "required", "parallel", "text", "ok"),
    [
        ("hermes", True, False, CALL, True),
        ("hermes", True, False, CALL + "\n" + CALL, False),
        ("hermes", True, True, CALL + "\n" + CALL, True),
        ("hermes", True, False, "Sure. " + CALL, False),
        ("hermes", True, False, CALL.replace('"c"', '"k"'), False),  # not in the enum
        ("hermes", True, False, CALL.replace("get_weather", "get_wether"), False),
        ("hermes", True, False, '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>', True),
        ("hermes", False, True, "Any text at all, even <tool", True),
        ("hermes", False, True, "Let me see. " + CALL + " and " + CALL, True),
        ("hermes", False, True, "Let me see. <tool_call>\n{oops}", False),  # an opened call is forced
        ("hermes", False, False, "Let me see. " + CALL, True),
        ("hermes", False, False, CALL + " more", False),  # one call ends the reply
        ("json", True, False, '{"name": "get_weather", "arguments": ' + ARGS + "}", True),
        ("json", True, True,
         '[{"name": "ping", "arguments": {}}, {"name": "add", "arguments": {"a": 1, "b": 2}}]', True),
        ("json", True, False, '{"name": "add", "arguments": {"a": 100, "b": 2}}', False),  # above the maximum
        ("json", False, True, "No call needed.", True),
        ("json", False, True, '{"answer": 1}', False),  # a reply that starts like JSON is a call
    ],
)
def test_call_grammars(parser, required, parallel, text, ok):
    assert accepts(get_parser(parser).grammar(TOOLS, required, parallel), text) is ok


# ---- the engine -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def target():
    return tiny_llama(0, max_positions=2048)


@pytest.mark.parametrize("parser", ["hermes", "json"])
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_choices_produce_valid_calls_exactly_under_speculation(target, parser, choice):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    kwargs = dict(max_new_tokens=120, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False,
                  tool_parser=parser)
    plain = Engine(target, drafter="none", k=0).generate(messages, **kwargs)
    assert plain.finish_reason == "tool_calls" and len(plain.tool_calls) == 1 and plain.content is None
    call = plain.tool_calls[0]
    assert call["id"].startswith("call_") and call["type"] == "function"
    tool = next(t for t in TOOLS if t["function"]["name"] == call["function"]["name"])
    assert valid_args(call["function"]["arguments"], tool)
    if isinstance(choice, dict):
        assert call["function"]["name"] == "get_weather"
    for drafter in ("ngram:min=1", "suffix"):
        spec = Engine(target, drafter=drafter, k=4).generate(messages, **kwargs)
        assert spec.token_ids == plain.token_ids and spec.text == plain.text
        assert [c["function"] for c in spec.tool_calls] == [c["function"] for c in plain.tool_calls]
        assert spec.stats.num_accepted_tokens + spec.stats.num_forced_tokens > 0
    assert plain.to_dict()["tool_calls"] == plain.tool_calls


def test_auto_and_none(target):
    engine = Engine(target, drafter="ngram", k=4)
    auto = engine.generate("Hi", max_new_tokens=40, tools=TOOLS, tool_choice="auto")
    plain = Engine(target, drafter="none", k=0).generate("Hi", max_new_tokens=40, tools=TOOLS,
                                                         tool_choice="auto")
    assert auto.token_ids == plain.token_ids
    assert auto.content == auto.text and auto.tool_calls == [] and auto.finish_reason in ("stop", "length")
    none = engine.generate("Hi", max_new_tokens=20, tools=TOOLS, tool_choice="none")
    assert none.tool_calls == [] and none.content == none.text
    with pytest.raises(SpecdecError) as err:
        engine.generate("Hi", tools=TOOLS, tool_choice="required", response_format={"type": "json_object"})
    assert err.value.param == "response_format"
    formatted = engine.generate("Hi", max_new_tokens=30, tools=TOOLS, response_format={"type": "json_object"})
    assert (formatted.text.startswith("{") and formatted.tool_calls == []
            and formatted.content == formatted.text)
    if formatted.finish_reason == "stop":  # the random model's keys may run past max_new_tokens
        json.loads(formatted.text)
