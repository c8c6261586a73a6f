"""`json`: the whole reply is a call object `{"name": ..., "arguments": ...}` or a list of them
(like vLLM's `llama3_json`); any other reply is text."""

from __future__ import annotations

from specdec.tool_parsers import ToolParser, call_rules, dumps, json_text, register_parser
from specdec.tool_parsers.scanner import CallObject


@register_parser("json")
class JsonParser(ToolParser):
    """The whole reply is a call object or a list of them; any other reply is text. Text after
    the calls is content; a list that breaks off after a committed call drops its rest."""

    name = "json"
    format_help = (
        'To call a function, reply with only a JSON object with its name and arguments: {"name": '
        '<function-name>, "arguments": <args-json-object>}; for several calls, a JSON list of such objects.'
    )

    def __init__(self):
        super().__init__()
        self.mode = "start"  # start | list | object | after | end | text | skip
        self.in_list = False
        self.held = ""  # the reply so far, while it may still be text
        self.drop_ws = True  # leading whitespace after the calls
        self.obj: CallObject | None = None

    def _push(self, ch: str) -> None:
        mode = self.mode
        if mode == "text":
            self._content(ch)
        elif mode in ("start", "list") and ch.isspace():
            self.held += ch
        elif mode == "start" and ch == "[":
            self.held, self.mode, self.in_list = self.held + ch, "list", True
        elif mode in ("start", "list") and ch == "{":
            self.mode, self.obj = "object", CallObject(self.calls)
            self._object(ch)
        elif mode in ("start", "list"):
            self._broken(ch)
        elif mode == "object":
            self._object(ch)
        elif mode == "after":
            if ch in ",]":
                self.mode = "list" if ch == "," else "end"
            elif not ch.isspace():
                self._broken(ch)
        elif mode == "end" and not (self.drop_ws and ch.isspace()):
            self.drop_ws = False
            self._content(ch)

    def _object(self, ch: str) -> None:
        obj = self.obj
        ok = obj.push(ch)
        self._relay(obj)
        if ok:
            self.held += ch
        if obj.error or (obj.done and not obj.committed):
            self._broken("" if ok else ch)
        elif obj.done:
            self.mode = "after" if self.in_list else "end"

    def _broken(self, ch: str) -> None:
        """Not a call after all: text when nothing was committed, else the rest is dropped."""
        if self.calls:
            self.mode = "skip"
            return
        self.mode = "text"
        self._content(self.held + ch)
        self.held = ""

    def _end(self) -> None:
        if self.mode in ("start", "list", "object") and not self.calls:  # never a call: text
            self._content(self.held)
        self.mode = "done"

    @classmethod
    def render_calls(cls, calls: list[dict]) -> str:
        objects = [f"{{\"name\": {dumps(c['name'])}, \"arguments\": {json_text(c['arguments'])}}}"
                   for c in calls]
        return objects[0] if len(objects) == 1 else "[" + ", ".join(objects) + "]"

    @classmethod
    def grammar(cls, tools: list[dict], required: bool, parallel: bool) -> str:
        calls = 'call_obj | "[" call_obj (", " call_obj)* "]"' if parallel else "call_obj"
        if required:
            return f"start: {calls}\n{call_rules(tools)}"
        # Text that does not start like JSON, or calls.
        return f"start: {calls} | TEXT\nTEXT: /(?s:[^\\[{{].*)?/\n{call_rules(tools)}"
