"""Tool-call formats: how a model writes its calls, parsed from its text, streamed or not.

One parser per output format, one module each, registered by name like the drafters
(`@register_parser`; `get_parser(name)` is the only lookup):

- `hermes` (alias `tool_call`, hermes.py): calls in tags, any text around them (Hermes,
  Qwen2.5): `<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`, possibly several;
- `json` (json_calls.py): the whole reply is one call object `{"name": ..., "arguments": ...}`
  or a list of them; a reply that does not start with `{` or `[` is plain text.

A parser instance reads one reply: `feed(text)` takes a text delta and returns the events it
settles, `finish()` the rest. Events are `Event("content", text)`, `Event("call", name,
index)` when a call's name is known, then `Event("arguments", piece, index)`. Whatever is not
settled yet is held back (a partial `<tool_call` tag, whitespace before a tag, a call object
whose name has not arrived), so a multi-token step that crosses the boundary between text and
a call splits exactly where a whole-text parse would. `parse(text)` is feed + finish on the
whole text, so streamed and non-streamed replies agree by construction; the arguments are the
model's own JSON text, not a re-serialisation.

A parser also renders its format: the system block that tells a model without template
support how to call (`instructions`), past calls in a conversation (`render_calls`), tool
results (`render_result`), and the llguidance Lark grammar that forces calls (`grammar`).
"""

from __future__ import annotations

import json

from specdec.grammar import JSON_OPTIONS
from specdec.registry import Registry
from specdec.tool_parsers.scanner import CallObject, Event

__all__ = ["CallObject", "Event", "ToolParser", "assemble", "available_parsers", "get_parser",
           "register_parser"]

SEPARATORS = (", ", ": ")  # compact JSON with a space after ',' and ':', as grammar.JSON_OPTIONS writes it


def dumps(value) -> str:
    return json.dumps(value, ensure_ascii=False, separators=SEPARATORS)


def json_text(text: str) -> str:
    """A JSON text as it is when it parses (the model's own tokens), else as a JSON string."""
    try:
        json.loads(text)
        return text.strip()
    except (TypeError, ValueError):
        return dumps(text)


class ToolParser:
    """One reply's parse; subclasses implement a format (see the module docstring)."""

    name = "base"

    def __init__(self):
        self.events: list[Event] = []
        self.calls = 0  # calls committed so far

    # ---- parsing -------------------------------------------------------------------------

    def feed(self, text: str) -> list[Event]:
        for ch in text:
            self._push(ch)
        return self._take()

    def finish(self) -> list[Event]:
        self._end()
        return self._take()

    @classmethod
    def parse(cls, text: str) -> tuple[str, list[dict]]:
        """(content, [{"name", "arguments"}]) of a whole reply."""
        parser = cls()
        return assemble([*parser.feed(text), *parser.finish()])

    def _push(self, ch: str) -> None:
        raise NotImplementedError

    def _end(self) -> None:
        raise NotImplementedError

    def _content(self, text: str) -> None:
        if not text:
            return
        last = self.events[-1] if self.events else None
        if last is not None and last.kind == "content":
            self.events[-1] = Event("content", last.text + text)
        else:
            self.events.append(Event("content", text))

    def _relay(self, obj: CallObject) -> None:
        """Pass on a call object's events; a call counts once it is committed."""
        for event in obj.drain():
            self.calls += event.kind == "call"
            last = self.events[-1] if self.events else None
            if last is not None and last.kind == event.kind == "arguments" and last.index == event.index:
                self.events[-1] = Event("arguments", last.text + event.text, event.index)
            else:
                self.events.append(event)

    def _take(self) -> list[Event]:
        out, self.events = self.events, []
        return out

    # ---- rendering -----------------------------------------------------------------------

    format_help = ""  # how to call, after the tool list in the system block

    @classmethod
    def instructions(cls, tools: list[dict]) -> str:
        listed = "\n".join(dumps(tool) for tool in tools)
        return (
            "# Tools\n\nYou may call functions to help with the user's request. "
            f"Their signatures are within <tools></tools>:\n<tools>\n{listed}\n</tools>\n\n{cls.format_help}"
        )

    @classmethod
    def render_calls(cls, calls: list[dict]) -> str:
        raise NotImplementedError

    @classmethod
    def render_result(cls, name: str | None, content: str) -> str:
        """A tool message's content, for templates without a tool role of their own."""
        body = json_text(content) if content.strip() else '""'
        head = f'{{"name": {dumps(name)}, ' if name else "{"
        return f"<tool_response>\n{head}\"content\": {body}}}\n</tool_response>"

    @classmethod
    def grammar(cls, tools: list[dict], required: bool, parallel: bool) -> str:
        """The Lark grammar (llguidance's dialect) of a reply: `required` forces at least one
        call (of one of `tools`), otherwise text with optional calls; `parallel` allows more
        than one."""
        raise NotImplementedError


def lark_literal(text: str) -> str:
    return json.dumps(text)  # a Lark string literal takes JSON's escapes


def _call_rule(tool: dict) -> str:
    """`{"name": "f", "arguments": <f's parameters>}` as a Lark expression."""
    fn = tool["function"]
    schema = dict(fn.get("parameters") or {"type": "object", "properties": {}, "additionalProperties": False})
    own = schema.get("x-guidance")
    options = {**JSON_OPTIONS, "lenient": not fn.get("strict", False),
               **(own if isinstance(own, dict) else {})}
    schema["x-guidance"] = options
    head = lark_literal(f'{{"name": {dumps(fn["name"])}, "arguments": ')
    return f'{head} %json {json.dumps(schema)} "}}"'


def call_rules(tools: list[dict]) -> str:
    return "call_obj: " + "\n    | ".join(_call_rule(t) for t in tools) + "\n"


def assemble(events: list[Event]) -> tuple[str, list[dict]]:
    content, calls = [], []
    for event in events:
        if event.kind == "content":
            content.append(event.text)
        elif event.kind == "call":
            calls.append({"name": event.text, "arguments": ""})
        else:
            calls[event.index]["arguments"] += event.text
    return "".join(content), calls


# ---- registry ----------------------------------------------------------------------------

PARSERS: Registry[type[ToolParser]] = Registry(
    "tool-call parser", __name__, ("hermes", "json_calls"), "tool_parser"
)
register_parser, available_parsers = PARSERS.register, PARSERS.available


def get_parser(name: str | type[ToolParser]) -> type[ToolParser]:
    if isinstance(name, type) and issubclass(name, ToolParser):
        return name
    return PARSERS.lookup(name)


