"""Function calling, as the OpenAI API and vLLM's server do it, for the engine, the CLI and the server.

A request's `tools`, `tool_choice` and `parallel_tool_calls` become a `ToolPlan`
(`tool_plan(...)`, which raises a one-line SpecdecError naming the bad field). The plan says:

- how the prompt shows the tools (`chat_messages`, called by prompts.encode): through the chat
  template's own tool support when the template mentions `tools`
  (`apply_chat_template(messages, tools=...)`); otherwise the parser's default system block
  (the tool list and the call format), merged into the first system message or prepended.
  Past calls (assistant `tool_calls`, content possibly null) are written in the call format
  and tool results (`role: tool`) keep their role with the tool's name in the content, or
  become user messages when the template refuses the role;
- what constrains the reply (`constraint`), llguidance grammars from the parser:
  - `required`: at least one call (one only unless parallel) of one of the tools, its name
    one of theirs and its arguments following that tool's `parameters` schema;
  - a named choice: the same with that tool only;
  - `auto`: free text, but once the model opens a call the call is forced (a lazily
    triggered grammar), so every call the reply holds is well-formed;
  - `none`: nothing; the tools are still shown (the prompt, and its cache, stay the same
    whatever the choice, as in OpenAI and vLLM) but the reply is never parsed for calls.
  A `response_format` replaces the auto grammar (and calls are then not parsed); it cannot be
  combined with a required or named choice;
- how the reply is read (`stream()` -> ToolStream, `finish(result)`): calls come out as
  OpenAI `tool_calls` with fresh `call_...` ids, and a reply that ended with calls finishes
  with "tool_calls".

The default parser is `hermes` (`<tool_call>` tags): the embedded SmolLM2 was not trained on
any call format, so the one to prefer is the one that parses unambiguously while streaming.
A tag marks exactly where a call starts, text may surround calls, only a partial tag is
ever held back, and it is the format of the Hermes/Qwen templates that vLLM's `hermes`
parser reads. The `json` format must hold back any reply that starts like JSON.
"""

from __future__ import annotations

import functools
import json
import re
import uuid
from dataclasses import dataclass, replace

import llguidance

from specdec.errors import SpecdecError
from specdec.grammar import Constraint, grammar
from specdec.tool_parsers import ToolParser, get_parser

DEFAULT_PARSER = "hermes"
MAX_TOOLS = 128  # OpenAI's limit
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
CHOICES = ("none", "auto", "required")


# ---- validation -------------------------------------------------------------------------------


def _fail(message: str, param: str):
    raise SpecdecError(f"{param}: {message}" if not message.startswith(param) else message, param)


def _schema_error(schema: dict) -> str | None:
    """llguidance's one-line complaint about a parameters schema, or None."""
    try:
        text = json.dumps({**schema, "x-guidance": {"lenient": True}})
    except (TypeError, ValueError) as e:
        return str(e)
    return _schema_error_text(text)


@functools.lru_cache(maxsize=1024)  # agents send the same tools with every turn
def _schema_error_text(text: str) -> str | None:
    try:
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            llguidance.LLMatcher.grammar_from_lark(f"start: %json {text}"))
    except (TypeError, ValueError) as e:
        return str(e)
    if not is_error:
        return None
    first = " ".join(messages[0].split("\n")[0].split()) if messages else "invalid"
    return first.split("failed to compile JSON schema: ")[-1]


def check_tool(tool, i: int) -> dict:
    """One OpenAI tool definition, checked; returned as given (its function's keys kept)."""
    where = f"tools[{i}]"
    if not isinstance(tool, dict):
        _fail("expected an object {'type': 'function', 'function': {...}}", where)
    if tool.get("type", "function") != "function":
        _fail(f"only 'function' tools are supported, got {str(tool.get('type'))[:32]!r}", f"{where}.type")
    fn = tool.get("function")
    if not isinstance(fn, dict):
        _fail("expected an object with 'name', 'description' and 'parameters'", f"{where}.function")
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        _fail("must be 1-64 letters, digits, underscores or dashes", f"{where}.function.name")
    if fn.get("description") is not None and not isinstance(fn["description"], str):
        _fail("must be a string", f"{where}.function.description")
    if fn.get("strict") is not None and not isinstance(fn["strict"], bool):
        _fail("must be a boolean", f"{where}.function.strict")
    params = fn.get("parameters")
    if params is not None:
        if not isinstance(params, dict) or params.get("type", "object") != "object":
            _fail("must be a JSON schema of type 'object'", f"{where}.function.parameters")
        if (problem := _schema_error(params)) is not None:
            _fail(f"invalid JSON schema: {problem[:300]}", f"{where}.function.parameters")
    return {"type": "function", "function": fn}


def check_tools(tools) -> list[dict]:
    if not isinstance(tools, list):
        _fail("expected a list of tools", "tools")
    if len(tools) > MAX_TOOLS:
        _fail(f"at most {MAX_TOOLS} tools, got {len(tools)}", "tools")
    checked = [check_tool(tool, i) for i, tool in enumerate(tools)]
    seen: set[str] = set()
    for i, tool in enumerate(checked):
        name = tool["function"]["name"]
        if name in seen:
            _fail(f"duplicate tool name {name!r}", f"tools[{i}].function.name")
        seen.add(name)
    return checked


def check_choice(choice, names: list[str]) -> str:
    """'none' | 'auto' | 'required' | the name of the one tool the reply must call."""
    if isinstance(choice, str):
        if choice not in CHOICES:
            _fail(f"must be none, auto, required or {{'type': 'function', 'function': {{'name': ...}}}}, "
                  f"got {choice[:32]!r}", "tool_choice")
        if choice == "required" and not names:
            _fail("'required' needs tools", "tool_choice")
        return choice
    fn = choice.get("function") if isinstance(choice, dict) else None
    if (not isinstance(fn, dict) or choice.get("type", "function") != "function"
            or not isinstance(fn.get("name"), str)):
        _fail("expected {'type': 'function', 'function': {'name': ...}}", "tool_choice")
    if fn["name"] not in names:
        _fail(f"no tool is named {fn['name'][:64]!r}", "tool_choice.function.name")
    return fn["name"]


# ---- the plan ---------------------------------------------------------------------------------


@dataclass
class ToolPlan:
    """What one request's tools mean for its prompt, its grammar and its reply."""

    tools: list[dict]  # checked OpenAI tool definitions
    choice: str  # "none", "auto", "required", or the name of the tool to call
    parallel: bool
    parser: type[ToolParser]
    formatted: bool = False  # a response_format shapes the reply instead (set by `constraint`)

    @property
    def parses(self) -> bool:
        return self.choice != "none" and not self.formatted

    @property
    def forced(self) -> bool:
        return self.choice not in ("none", "auto")

    def constraint(self, response_format: Constraint | None = None) -> Constraint | None:
        """The reply's grammar, given the request's response_format constraint (or None);
        a response_format turns call parsing off."""
        if self.forced and response_format is not None:
            raise SpecdecError(f"tool_choice {self.choice!r} cannot be combined with response_format",
                               "response_format")
        self.formatted = response_format is not None
        if response_format is not None or self.choice == "none":
            return response_format
        named = self.choice not in CHOICES
        tools = [t for t in self.tools if t["function"]["name"] == self.choice] if named else self.tools
        constraint = grammar(self.parser.grammar(tools, required=self.forced, parallel=self.parallel))
        return replace(constraint, closes=self.forced)  # `auto` allows free text: no closing there

    def stream(self) -> ToolStream | None:
        """A streaming reader for the reply, or None when calls are not parsed."""
        return ToolStream(self.parser) if self.parses else None

    def finish(self, result):
        """Set `result.content`, `.tool_calls` and `.finish_reason` from `result.text`."""
        if not self.parses:
            result.content, result.tool_calls = result.text, []
            return result
        stream = ToolStream(self.parser)
        stream.feed(result.text)
        stream.finish()
        result.content, result.tool_calls = stream.content, stream.calls
        result.finish_reason = finish_reason(stream.calls, result.finish_reason)
        return result


def tool_plan(tools=None, tool_choice=None, parallel_tool_calls=None,
              parser=DEFAULT_PARSER) -> ToolPlan | None:
    """Check a request's tool fields; None when it has no tools (and no choice needing them)."""
    parser_cls = get_parser(parser or DEFAULT_PARSER)
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        _fail("must be a boolean", "parallel_tool_calls")
    if not tools:
        if tools is not None and not isinstance(tools, list):
            _fail("expected a list of tools", "tools")
        if tool_choice not in (None, "none", "auto"):
            if isinstance(tool_choice, str):
                check_choice(tool_choice, [])  # an unknown value, or 'required', gets its own message
            _fail("tool_choice is only allowed when tools are specified", "tool_choice")
        return None
    checked = check_tools(tools)
    choice = check_choice("auto" if tool_choice is None else tool_choice,
                          [t["function"]["name"] for t in checked])
    return ToolPlan(checked, choice, True if parallel_tool_calls is None else parallel_tool_calls, parser_cls)


def finish_reason(calls: list[dict], reason: str) -> str:
    """A reply that ended on its own after calling tools finishes with "tool_calls"; one cut
    by max_tokens stays "length"."""
    return "tool_calls" if calls and reason == "stop" else reason


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolStream:
    """A reply's calls, read as its text streams: `feed(delta)` and `finish()` return OpenAI
    chat-completion deltas ({"content": ...} or {"tool_calls": [...]}); `calls` and `content`
    hold the whole reply's calls and text so far."""

    def __init__(self, parser: type[ToolParser]):
        self.parser = parser()
        self.calls: list[dict] = []
        self._content: list[str] = []

    @property
    def content(self) -> str | None:
        text = "".join(self._content)
        return None if self.calls and not text else text

    def feed(self, text: str) -> list[dict]:
        return self._deltas(self.parser.feed(text))

    def finish(self) -> list[dict]:
        return self._deltas(self.parser.finish())

    def _deltas(self, events) -> list[dict]:
        deltas = []
        for event in events:
            if event.kind == "content":
                self._content.append(event.text)
                deltas.append({"content": event.text})
            elif event.kind == "call":
                call = {"id": new_call_id(), "type": "function",
                        "function": {"name": event.text, "arguments": ""}}
                self.calls.append(call)
                opened = {"index": event.index, "id": call["id"], "type": "function",
                          "function": {"name": event.text, "arguments": ""}}
                deltas.append({"tool_calls": [opened]})
            else:
                self.calls[event.index]["function"]["arguments"] += event.text
                deltas.append({"tool_calls": [{"index": event.index, "function": {"arguments": event.text}}]})
        return deltas


def parse_calls(text: str, parser=DEFAULT_PARSER) -> tuple[str, list[dict]]:
    """(content, [{"name", "arguments"}]) of a whole reply in a parser's format."""
    return get_parser(parser).parse(text)


# ---- the prompt -------------------------------------------------------------------------------


def template_has_tools(tokenizer) -> bool:
    """Whether the chat template renders tools itself (it then also renders calls and results)."""
    return "tools" in str(getattr(tokenizer, "chat_template", None) or "")


def render_chat(tokenizer, messages: list[dict], plan: ToolPlan | None = None) -> str:
    """The chat template's text for `messages` (with the generation prompt), the plan's tools
    shown to the model. A template that refuses the `tool` role gets tool results as user
    messages."""
    rendered, extra = chat_messages(tokenizer, messages, plan)
    try:
        return tokenizer.apply_chat_template(rendered, add_generation_prompt=True, tokenize=False, **extra)
    except Exception:
        if extra or not any(m.get("role") == "tool" for m in messages if isinstance(m, dict)):
            raise
    rendered, extra = chat_messages(tokenizer, messages, plan, tool_role="user")
    return tokenizer.apply_chat_template(rendered, add_generation_prompt=True, tokenize=False, **extra)


def chat_messages(tokenizer, messages: list, plan: ToolPlan | None = None, tool_role: str = "tool"):
    """(messages, apply_chat_template's extra arguments) that show the plan's tools and the
    conversation's calls and results to the model. Messages without calls are kept as they
    are (a null content becomes "")."""
    parser = plan.parser if plan else get_parser(DEFAULT_PARSER)
    native = template_has_tools(tokenizer)
    names: dict[str, str] = {}  # tool_call_id -> the called tool's name
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            out.append(m)  # the template's complaint names it
            continue
        m = {**m, "content": "" if m.get("content") is None else m["content"]}
        if m.get("tool_calls"):
            calls = _check_calls(m["tool_calls"], i)
            names.update((c["id"], c["function"]["name"]) for c in calls if c.get("id"))
            m = _native_calls(m, calls) if native else _written_calls(m, calls, parser)
        elif m.get("tool_calls") is not None:
            m.pop("tool_calls")  # an empty list: no calls
        if m.get("role") == "tool":
            name = m.get("name") or names.get(m.get("tool_call_id"))
            if native:
                m = {**m, "name": name} if name else m
            else:
                m = {"role": tool_role, "content": parser.render_result(name, str(m["content"]))}
        out.append(m)
    if plan is None or native:
        return out, ({"tools": plan.tools} if plan else {})
    block = parser.instructions(plan.tools)
    if (out and isinstance(out[0], dict) and out[0].get("role") == "system"
            and isinstance(out[0]["content"], str)):
        out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{block}" if out[0]["content"] else block}
    else:
        out.insert(0, {"role": "system", "content": block})
    return out, {}


def _check_calls(calls, i: int) -> list[dict]:
    """An assistant message's tool_calls, checked; arguments as JSON text."""
    where = f"messages[{i}].tool_calls"
    if not isinstance(calls, list):
        _fail("expected a list of calls", where)
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            _fail("expected {'id', 'type': 'function', 'function': {'name', 'arguments'}}", f"{where}[{j}]")
        args = fn.get("arguments")
        if args is None:
            args = "{}"
        elif not isinstance(args, str):
            try:
                args = json.dumps(args, ensure_ascii=False)
            except (TypeError, ValueError):
                _fail("must be a JSON string", f"{where}[{j}].function.arguments")
        out.append({"id": call.get("id") or "", "type": "function",
                    "function": {"name": fn["name"], "arguments": args}})
    return out


def _native_calls(m: dict, calls: list[dict]) -> dict:
    """For a template with tool support: arguments as objects, which templates expect."""
    native = []
    for call in calls:
        fn = call["function"]
        try:
            args = json.loads(fn["arguments"])
        except ValueError:
            args = fn["arguments"]
        native.append({**call, "function": {"name": fn["name"], "arguments": args}})
    return {**m, "tool_calls": native}


def _written_calls(m: dict, calls: list[dict], parser: type[ToolParser]) -> dict:
    """For a template without: the calls written in the parser's format after the content."""
    written = parser.render_calls([c["function"] for c in calls])
    content = m["content"] if isinstance(m["content"], str) else ""
    m = {k: v for k, v in m.items() if k != "tool_calls"}
    return {**m, "content": f"{content}\n{written}" if content else written}
