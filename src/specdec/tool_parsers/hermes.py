"""`hermes` (alias `tool_call`): calls in `<tool_call>` tags with text around them, the format
of Hermes and Qwen2.5 models and of vLLM's `hermes` parser."""

from __future__ import annotations

from specdec.tool_parsers import ToolParser, call_rules, dumps, json_text, lark_literal, register_parser
from specdec.tool_parsers.scanner import CallObject

OPEN_TAG, CLOSE_TAG = "<tool_call>", "</tool_call>"


@register_parser("hermes", "tool_call")
class HermesParser(ToolParser):
    """Calls in `<tool_call>` tags, text around them. Whitespace next to a call is layout,
    not content: it is dropped, so "Let me look.\\n<tool_call>..." has content "Let me look."
    A call that breaks off (invalid JSON after its name) keeps what it streamed and the rest
    up to `</tool_call>` is dropped; a tag whose body never names a call is content."""

    name = "hermes"
    format_help = (
        "To call a function, write a JSON object with its name and arguments within <tool_call></tool_call> "
        'tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )

    def __init__(self):
        super().__init__()
        self.mode = "text"  # text | call | tail (after a call's object) | skip (a broken call)
        self.tag = ""  # the part of a tag matched so far
        self.ws = ""  # whitespace held in text mode
        self.drop_ws = False  # just after a call: leading whitespace is layout
        self.held = ""  # a call's text while it may still turn out to be content
        self.obj: CallObject | None = None

    def _push(self, ch: str) -> None:
        if self.mode == "text":
            self._text(ch)
        elif self.mode == "call":
            self._call(ch)
        elif self.mode == "tail":
            self._tail(ch)
        else:  # skip: drop up to the closing tag
            self.tag = (self.tag + ch)[-len(CLOSE_TAG):]
            if self.tag == CLOSE_TAG:
                self._after_call()

    def _text(self, ch: str) -> None:
        if self.tag:
            if OPEN_TAG.startswith(self.tag + ch):
                self.tag += ch
                if self.tag == OPEN_TAG:  # a call opens: the whitespace before it is layout
                    self.held, self.ws, self.tag = ("" if self.drop_ws else self.ws) + OPEN_TAG, "", ""
                    self.mode, self.obj = "call", CallObject(self.calls)
                return
            self._flush(self.tag)
            self.tag = ""
        if ch == "<":
            self.tag = ch
        elif ch.isspace():
            self.ws += ch
        else:
            self._flush(ch)

    def _flush(self, text: str) -> None:
        self._content(("" if self.drop_ws else self.ws) + text)
        self.ws, self.drop_ws = "", False

    def _call(self, ch: str) -> None:
        obj = self.obj
        ok = obj.push(ch)
        self._relay(obj)
        if ok:
            self.held += ch
        if obj.error and obj.committed:
            self.mode, self.tag = "skip", ""
            if not ok:
                self._push(ch)
        elif obj.error or (obj.done and not obj.committed):
            self._fallback()
            if not ok:
                self._push(ch)
        elif obj.done:
            self.mode, self.held = "tail", ""

    def _fallback(self) -> None:
        """The tag's body is not a call: it was text all along."""
        self.mode, self.obj, held = "text", None, self.held
        self.held = ""
        self._flush(held)

    def _tail(self, ch: str) -> None:
        if (self.held + ch).strip() and not CLOSE_TAG.startswith((self.held + ch).lstrip()):
            held, self.mode, self.held = self.held, "text", ""  # no closing tag: text resumes
            self.drop_ws = True
            for c in held + ch:
                self._push(c)
            return
        self.held += ch
        if self.held.lstrip() == CLOSE_TAG:
            self._after_call()

    def _after_call(self) -> None:
        self.mode, self.held, self.tag, self.obj, self.drop_ws = "text", "", "", None, True

    def _end(self) -> None:
        if self.mode == "call" and not self.obj.committed:  # a committed call cut short keeps what it has
            self._fallback()
        if self.mode == "text":
            if self.tag:
                self._flush(self.tag)
            elif self.ws and not self.calls:
                self._content(self.ws)
        self.mode, self.ws, self.tag = "done", "", ""

    @classmethod
    def render_calls(cls, calls: list[dict]) -> str:
        return "\n".join(
            f"{OPEN_TAG}\n{{\"name\": {dumps(c['name'])}, "
            f"\"arguments\": {json_text(c['arguments'])}}}\n{CLOSE_TAG}"
            for c in calls
        )

    @classmethod
    def grammar(cls, tools: list[dict], required: bool, parallel: bool) -> str:
        body = f'{lark_literal(chr(10))} call_obj {lark_literal(chr(10) + CLOSE_TAG)}'
        if required:
            start = 'start: call ("\\n" call)*' if parallel else "start: call"
            return f"{start}\ncall: {lark_literal(OPEN_TAG)} {body}\n{call_rules(tools)}"
        # Free text until the model writes the opening tag; from there the call is forced.
        start = "start: (call_hd call_rest)* TEXT" if parallel else "start: call_hd call_rest | TEXT"
        return (f"{start}\ncall_hd[lazy]: TEXT {lark_literal(OPEN_TAG)}\ncall_rest: {body}\n"
                f"TEXT: /(?s:.*)/\n{call_rules(tools)}")
