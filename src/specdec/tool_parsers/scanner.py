"""Scans a tool-call object `{"name": ..., "arguments": ...}` as its text streams in."""

from __future__ import annotations

import json
from typing import NamedTuple

_SCALAR = set("0123456789+-.eEtruefalsn")
_CLOSERS = {"{": "}", "[": "]"}


class Event(NamedTuple):
    """What a parser settles: "content" (text), "call" (text is the name) or "arguments"
    (text is a piece of the call's arguments)."""

    kind: str
    text: str
    index: int = -1  # the call's index in the reply


class CallObject:
    """Scans one call object `{"name": ..., "arguments": ...}` a character at a time.

    `push(ch)` returns False (and sets `error`) when ch cannot continue the object; the char
    is then not consumed. The call is committed (`Event("call")` in `out`) once its name is
    known and its arguments have started; from then on the arguments' characters stream out.
    Keys may come in either order; other keys are skipped; "parameters" stands for "arguments".
    """

    def __init__(self, index: int):
        self.index = index
        self.out: list[Event] = []
        self.state = "open"
        self.key: str | None = None
        self.keys = 0
        self.chars: list[str] = []  # the current key or value
        self.stack: list[str] = []  # brackets open in the current value
        self.in_string = self.escape = False
        self.name: str | None = None
        self.args: str | None = None  # the arguments text, once complete
        self.value_is_args = False  # the current value is the arguments
        self.streaming = False  # ... streamed as scanned (the name is known)
        self.committed = self.done = self.error = False

    def push(self, ch: str) -> bool:
        state = self.state
        if state in ("open", "key_or_end", "colon", "value_start", "after_value") and ch in " \t\r\n":
            return True
        if state == "open":
            return self._expect(ch == "{", "key_or_end")
        if state == "key_or_end":
            if ch == "}" and self.keys == 0:
                return self._close()
            self.chars = []
            return self._expect(ch == '"', "key")
        if state == "key":
            if self._string_char(ch):
                try:
                    self.key = json.loads('"' + "".join(self.chars) + '"')
                except ValueError:
                    return self._expect(False, "key")
                self.state = "colon"
            return True
        if state == "colon":
            return self._expect(ch == ":", "value_start")
        if state == "value_start":
            return self._start_value(ch)
        if state == "value":
            return self._value_char(ch)
        if state == "scalar":
            if ch in _SCALAR:
                self._take(ch)
                return True
            self._end_value()
            return not self.error and self.push(ch)
        if state == "after_value":
            if ch == ",":
                self.state = "key_or_end"
                return True
            return self._expect(ch == "}", "done") and self._close()
        return self._expect(False, state)

    def _expect(self, ok: bool, state: str) -> bool:
        if ok:
            self.state = state
        else:
            self.error = True
        return ok

    def _string_char(self, ch: str) -> bool:
        """Append a char inside a JSON string; True when it is the closing quote."""
        if self.escape:
            self.escape = False
        elif ch == "\\":
            self.escape = True
        elif ch == '"':
            self.in_string = False
            return True
        self.chars.append(ch)
        return False

    def _start_value(self, ch: str) -> bool:
        if ch not in '{["' and ch not in _SCALAR:
            return self._expect(False, "value_start")
        self.keys += 1
        self.chars, self.stack = [], []
        self.value_is_args = self.key in ("arguments", "parameters") and self.args is None
        self.streaming = self.value_is_args and ch != '"' and self.name is not None
        if self.streaming and not self.committed:
            self._commit()
        self._take(ch)
        if ch in "{[":
            self.stack.append(ch)
        self.in_string = ch == '"'
        self.state = "value" if ch in '{["' else "scalar"
        return True

    def _value_char(self, ch: str) -> bool:
        if self.in_string:
            if self.escape:
                self.escape = False
            elif ch == "\\":
                self.escape = True
            elif ch == '"':
                self.in_string = False
        elif ch == '"':
            self.in_string = True
        elif ch in "{[":
            self.stack.append(ch)
        elif ch in "}]" and (not self.stack or _CLOSERS[self.stack.pop()] != ch):
            return self._expect(False, "value")  # it closes nothing open
        self._take(ch)
        if not self.in_string and not self.stack:
            self._end_value()
        return not self.error

    def _take(self, ch: str) -> None:
        self.chars.append(ch)
        if self.streaming:
            self._emit("arguments", ch)

    def _end_value(self) -> None:
        text = "".join(self.chars)
        self.state = "after_value"
        try:
            value = json.loads(text)
        except ValueError:
            self.error = True  # a committed call keeps the arguments it streamed
            return
        if self.key == "name" and self.name is None:
            if not isinstance(value, str):
                self.error = True
                return
            self.name = value
            if self.args is not None:  # the arguments came first
                self._commit()
                self._emit("arguments", self.args)
        elif self.value_is_args:
            self.args = value if isinstance(value, str) else text  # a JSON-encoded string stays as sent
            if not self.streaming and self.name is not None:
                self._commit()
                self._emit("arguments", self.args)
        self.streaming = False

    def _commit(self) -> None:
        self.committed = True
        self.out.append(Event("call", self.name, self.index))

    def _emit(self, kind: str, text: str) -> None:
        last = self.out[-1] if self.out else None
        if last is not None and last.kind == kind == "arguments":
            self.out[-1] = Event(kind, last.text + text, self.index)
        elif text:
            self.out.append(Event(kind, text, self.index))

    def _close(self) -> bool:
        self.state, self.done = "done", True
        return True

    def drain(self) -> list[Event]:
        out, self.out = self.out, []
        return out
