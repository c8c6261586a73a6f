"""Tool-calling agent sessions in the API's form, for `specdec bench` (category `tool_sessions`).

A session declares its tools once, as an OpenAI `tools` list, and runs several turns. A turn
may add a user message, asks for one reply under its `tool_choice` (`required` or a named
tool where the reply must call, `auto` where it may answer in words), and scripts the
`result` that is fed back after the reply as a `role: tool` message answering the model's own
call (its `tool_call_id`). Each turn's context is everything before it: the earlier user
messages, the model's actual calls and the scripted results, so every runner continues its
own session, as an agent loop would.

With the grammar on (the default), each reply is decoded under its choice's constraint
(tools.ToolPlan: `required` and named choices force a call, `auto` forces a call once the
model opens one); `--no-grammar` decodes every turn as `auto` without any constraint and
parses what the model wrote. A call is valid when it parses, names a declared tool (the
named one, for a named choice) and its arguments validate against that tool's `parameters`
schema (jsonschema). The valid-call rate is the share of the turns that must call whose
reply holds at least one call, every one of them valid.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

from specdec.errors import SpecdecError
from specdec.prompts import encode
from specdec.tools import CHOICES, check_choice, check_tools, tool_plan

CATEGORY = "tool_sessions"
_TURN_KEYS = ("user", "tool_choice", "result")


@dataclass
class ToolTurn:
    user: str | None  # a new user message before the reply, if any
    tool_choice: str | dict  # as the API takes it
    result: object = None  # fed back after the reply as a role:tool message (None: nothing)

    @property
    def must_call(self) -> bool:
        return self.tool_choice not in ("auto", "none")


@dataclass
class ToolSession:
    tools: list[dict]
    turns: list[ToolTurn]
    system: str | None = None


def parse_session(obj: dict, where: str) -> ToolSession:
    """A session record's `tools`, `system` and `turns`, checked (one-line SpecdecErrors)."""
    try:
        tools = check_tools(obj["tools"])
    except SpecdecError as e:
        raise SpecdecError(f"{where}: {e.message}", "data") from None
    system = obj.get("system")
    if system is not None and (not isinstance(system, str) or not system.strip()):
        raise SpecdecError(f"{where}: system must be a non-empty string", "data")
    raw = obj["turns"]
    if not isinstance(raw, list) or not raw or not all(isinstance(t, dict) for t in raw):
        raise SpecdecError(f"{where}: a tool session's turns must be a non-empty list of objects", "data")
    names = [t["function"]["name"] for t in tools]
    turns = []
    for i, turn in enumerate(raw):
        at = f"{where}: turns[{i}]"
        unknown = sorted(set(turn) - set(_TURN_KEYS))
        if unknown:
            raise SpecdecError(f"{at}: unknown key {unknown[0]!r}; a turn has {', '.join(_TURN_KEYS)}",
                               "data")
        user = turn.get("user")
        if (user is not None or i == 0) and (not isinstance(user, str) or not user.strip()):
            raise SpecdecError(f"{at}: user must be a non-empty string (the first turn needs one)", "data")
        try:
            check_choice(turn.get("tool_choice", "auto"), names)
        except SpecdecError as e:
            raise SpecdecError(f"{at}: {e.message}", "data") from None
        turns.append(ToolTurn(user, turn.get("tool_choice", "auto"), turn.get("result")))
    return ToolSession(tools, turns, system)


# ---- running a session --------------------------------------------------------------------


def run_session(target, runner, session: ToolSession, max_new_tokens: int, temperature: float,
                seeds: list[int], grammar: bool = True) -> list:
    """One runner through one session: returns its TurnRecords, each with the reply's parsed
    `calls` and, on turns that must call, `valid_call`."""
    messages: list[dict] = [{"role": "system", "content": session.system}] if session.system else []
    records = []
    for ti, (turn, seed) in enumerate(zip(session.turns, seeds, strict=True)):
        if turn.user is not None:
            messages.append({"role": "user", "content": turn.user})
        plan = tool_plan(session.tools, turn.tool_choice if grammar else "auto", parallel_tool_calls=False)
        constraint = plan.constraint() if grammar else None
        try:
            prompt_ids = encode(target.tokenizer, messages, max_length=target.max_length, tools=plan)
        except SpecdecError as e:
            raise SpecdecError(f"turn {ti + 1}: {e.message}", "data") from e
        t0 = time.perf_counter()
        record = runner.run(prompt_ids, max_new_tokens, temperature, seed, constraint=constraint)
        record.wall_s = time.perf_counter() - t0
        record.text = target.tokenizer.decode(record.token_ids, skip_special_tokens=True)
        content, calls = plan.parser.parse(record.text)
        record.calls = calls
        if turn.must_call:
            record.valid_call = reply_is_valid(calls, session.tools, turn.tool_choice)
        messages += exchange(content, calls, turn.result, ti)
        records.append(record)
    return records


def exchange(content: str, calls: list[dict], result, ti: int) -> list[dict]:
    """The assistant's reply as the API shows it (content, tool_calls with ids), then the
    scripted result as a role:tool message for each call (one with a fresh id when the reply
    made none, as an agent harness would still report the tool's output)."""
    # fixed ids: every runner sees the same prompt
    ids = [f"call_{ti + 1}_{j + 1}" for j in range(len(calls))]
    reply: dict = {"role": "assistant", "content": (content.strip() or None) if calls else content}
    if calls:
        reply["tool_calls"] = [{"id": i, "type": "function", "function": dict(c)}
                               for i, c in zip(ids, calls, strict=True)]
    out = [reply]
    if result is not None:
        text = result if isinstance(result, str) else json.dumps(result, ensure_ascii=False)
        out += [{"role": "tool", "tool_call_id": i, "content": text} for i in ids or [f"call_{ti + 1}_0"]]
    return out


# ---- valid calls --------------------------------------------------------------------------


def call_is_valid(call: dict, tools: list[dict], choice: str | dict = "required") -> bool:
    """The call names a declared tool (the chosen one, for a named choice) and its arguments
    are a JSON object that validates against the tool's `parameters` schema."""
    validators = _jsonschema()
    picked = check_choice(choice, [t["function"]["name"] for t in tools])
    tool = next((t for t in tools if t["function"]["name"] == call.get("name")), None)
    if tool is None or (picked not in CHOICES and call["name"] != picked):
        return False
    try:
        args = json.loads(call.get("arguments") or "")
    except ValueError:
        return False
    if not isinstance(args, dict):
        return False
    schema = tool["function"].get("parameters") or {"type": "object"}
    return validators.validator_for(schema)(schema).is_valid(args)


def _jsonschema():
    try:
        import jsonschema.validators  # the bench extra; only tool sessions need it
    except ImportError:
        raise SpecdecError("tool sessions need jsonschema: pip install 'specdec[bench]'", "data") from None
    return jsonschema.validators


def reply_is_valid(calls: list[dict], tools: list[dict], choice: str | dict = "required") -> bool:
    """A reply that must call: at least one call, every one valid."""
    return bool(calls) and all(call_is_valid(c, tools, choice) for c in calls)


def call_metrics(turns, is_method: bool = True) -> dict:
    """Over TurnRecords: `valid_calls` ("m/n": of the n turns that had to call, m made only
    valid calls) and `valid_call_rate`, both None without such turns; `forced_share`, the
    share of the emitted tokens that a grammar forced (None for peers and without grammars)."""
    judged = [t.valid_call for t in turns if getattr(t, "valid_call", None) is not None]
    valid = sum(judged)
    forced, emitted = sum(getattr(t, "forced", 0) for t in turns), sum(t.new_tokens for t in turns)
    return {
        "valid_calls": f"{valid}/{len(judged)}" if judged else None,
        "valid_call_rate": round(valid / len(judged), 4) if judged else None,
        "forced_share": (round(forced / emitted, 4) if emitted else 0.0) if is_method else None,
    }


def warm_up_request(target, session: ToolSession, prompt: str) -> tuple[list[int], object]:
    """(prompt ids, constraint) of a warm-up reply that must call one of the session's tools."""
    plan = tool_plan(session.tools, "required", parallel_tool_calls=False)
    return encode(target.tokenizer, prompt, max_length=target.max_length, tools=plan), plan.constraint()
