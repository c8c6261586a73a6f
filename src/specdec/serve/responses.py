"""The Responses API (POST /v1/responses), translated into the chat request it means.

A Responses body is turned into the `ChatCompletionRequest` a chat client would send for the
same turn, once (`to_chat`): `instructions` becomes a system message, `input` items become
chat messages (`function_call` items an assistant message's `tool_calls`,
`function_call_output` items tool messages), flat function tools and `tool_choice` take
chat's nesting, `text.format` becomes `response_format` and `max_output_tokens`
`max_completion_tokens`. From there the request runs the chat path: the same request value
(serve/bodies.py), admission, scheduler, speculation, metrics and tenants. Only the reply is
written differently (serve/responses_out.py).

Nothing is stored: `store: true`, `previous_response_id` and `conversation` are refused by
name, as is every field we do not honour (docs/responses.md lists them).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from specdec.errors import SpecdecError
from specdec.logprobs import MAX_TOP_LOGPROBS
from specdec.serve.protocol import ChatCompletionRequest, _Strict

# Fields of OpenAI's Responses schema that this server does not implement: sent with a value,
# they are refused by name (an empty `include` or `tools` list is accepted).
_REFUSED_WHEN_SET = {
    "previous_response_id": "previous_response_id is not supported: this server stores no responses; "
                            "send the whole conversation in input",
    "conversation": "conversation is not supported: this server stores no conversations; send the whole "
                    "conversation in input",
    "background": "background responses are not supported",
    "include": "include is not supported",
    "reasoning": "reasoning is not supported",
    "max_tool_calls": "max_tool_calls is not supported",
    "prompt": "prompt templates are not supported",
    "top_logprobs": "top_logprobs is not supported on /v1/responses; use /v1/chat/completions",
    "context_management": "context_management is not supported",
    "stream_options": "stream_options is not supported on /v1/responses",
}


class ResponsesRequest(_Strict):
    model: str | None = Field(default=None, max_length=512)
    input: str | list[dict[str, Any]] = Field(max_length=4096)
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = Field(default=None, max_length=128)
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stream: bool | None = False
    store: bool | None = None  # only false (or omitted): nothing is stored
    truncation: Literal["disabled", "auto"] | None = None  # only disabled: a prompt too long is a 400
    # Metadata and routing hints, accepted without effect on the output (as on chat).
    user: str | None = Field(default=None, max_length=512)
    safety_identifier: str | None = Field(default=None, max_length=512)
    prompt_cache_key: str | None = Field(default=None, max_length=512)
    metadata: dict[str, str] | None = Field(default=None, max_length=16)
    # Known and refused when set (_REFUSED_WHEN_SET).
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    background: bool | None = None
    include: list[str] | None = None
    reasoning: dict[str, Any] | None = None
    max_tool_calls: int | None = None
    prompt: dict[str, Any] | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    context_management: list[Any] | None = None
    stream_options: dict[str, Any] | None = None
    # Extensions, as on chat: sampling seed, the speculative settings, statistics, tenant salt.
    seed: int | None = Field(default=None, ge=-(2**63), le=2**64 - 1)
    cache_salt: str | None = Field(default=None, min_length=1, max_length=512)
    return_spec_decode: bool | None = None
    drafter: str | None = Field(default=None, max_length=512)
    k: int | Literal["auto"] | None = None


def refused(body: ResponsesRequest) -> tuple[str, str] | None:
    """(param, message) for a field we would have to ignore, else None."""
    if body.store:
        return "store", "store=true is not supported: this server stores no responses"
    if body.truncation == "auto":
        return "truncation", ("truncation 'auto' is not supported; "
                              "a prompt too long for the context is an error")
    for name, message in _REFUSED_WHEN_SET.items():
        value = getattr(body, name)
        if value is not None and value != [] and value is not False:
            return name, message
    return None


# ---- the translation ------------------------------------------------------------------------


def to_chat(body: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request this Responses request means (SpecdecError naming the Responses field)."""
    messages = [{"role": "system", "content": body.instructions}] if body.instructions else []
    if isinstance(body.input, str):
        messages.append({"role": "user", "content": body.input})
    else:
        messages += input_messages(body.input)
    if not messages:
        raise SpecdecError("input must hold at least one item", "input")
    tools = [chat_tool(t, i) for i, t in enumerate(body.tools or [])]
    fields = dict(
        model=body.model, messages=messages, tools=tools or None,
        tool_choice=chat_tool_choice(body.tool_choice),
        parallel_tool_calls=body.parallel_tool_calls, response_format=response_format(body.text),
        max_completion_tokens=body.max_output_tokens, temperature=body.temperature, top_p=body.top_p,
        stream=bool(body.stream), seed=body.seed, cache_salt=body.cache_salt,
        return_spec_decode=body.return_spec_decode, drafter=body.drafter, k=body.k, user=body.user,
        safety_identifier=body.safety_identifier, prompt_cache_key=body.prompt_cache_key,
        metadata=body.metadata,
    )
    return ChatCompletionRequest(**{name: value for name, value in fields.items() if value is not None})


def input_messages(items: list[dict]) -> list[dict]:
    """Responses input items -> chat messages; consecutive calls join one assistant message."""
    messages: list[dict] = []
    names: dict[str, str] = {}  # call_id -> the function's name, for the tool messages
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        where = f"input[{i}]"
        if kind == "message":
            messages.append(_message(item, where))
        elif kind == "function_call":
            call = _call(item, where)
            names[call["id"]] = call["function"]["name"]
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and not last.get("_closed"):
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append(_call_output(item, where, names))
        else:
            raise SpecdecError(f"{where}.type: input items of type {str(kind)[:40]!r} are not supported; use "
                               "message, function_call or function_call_output", f"{where}.type")
    for m in messages:
        m.pop("_closed", None)
    return messages


_MESSAGE_KEYS = {"type", "role", "content", "id", "status", "phase"}  # id, status, phase: echoed output
_PART_TEXT = {"input_text", "output_text"}


def _message(item: dict, where: str) -> dict:
    _only(item, _MESSAGE_KEYS, where)
    role = item.get("role")
    if role not in ("user", "system", "developer", "assistant"):
        raise SpecdecError(f"{where}.role must be user, system, developer or assistant", f"{where}.role")
    content = item.get("content")
    if isinstance(content, str):
        text = content
    elif isinstance(content, list):
        text = "".join(_part_text(part, f"{where}.content[{j}]") for j, part in enumerate(content))
    else:
        raise SpecdecError(f"{where}.content must be text or a list of content parts", f"{where}.content")
    # a message after calls starts a new turn: later calls do not join the earlier message
    return {"role": role, "content": text, "_closed": role != "assistant"}


def _part_text(part, where: str) -> str:
    if (not isinstance(part, dict) or part.get("type") not in _PART_TEXT
            or not isinstance(part.get("text"), str)):
        kind = part.get("type") if isinstance(part, dict) else None
        raise SpecdecError(f"{where}: content parts of type {str(kind)[:40]!r} are not supported; only "
                           "input_text and output_text", f"{where}.type")
    if part.get("annotations") or part.get("logprobs"):  # echoed output parts carry them empty
        raise SpecdecError(f"{where}: annotations and logprobs are not supported in input", where)
    _only(part, {"type", "text", "annotations", "logprobs"}, where)
    return part["text"]


def _call(item: dict, where: str) -> dict:
    _only(item, {"type", "call_id", "name", "arguments", "id", "status"}, where)
    for key in ("call_id", "name", "arguments"):
        if not isinstance(item.get(key), str):
            raise SpecdecError(f"{where}.{key} must be a string", f"{where}.{key}")
    return {"id": item["call_id"], "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]}}


def _call_output(item: dict, where: str, names: dict[str, str]) -> dict:
    _only(item, {"type", "call_id", "output", "id", "status"}, where)
    call_id, output = item.get("call_id"), item.get("output")
    if not isinstance(call_id, str):
        raise SpecdecError(f"{where}.call_id must be a string", f"{where}.call_id")
    if isinstance(output, list):
        output = "".join(_part_text(part, f"{where}.output[{j}]") for j, part in enumerate(output))
    if not isinstance(output, str):
        raise SpecdecError(f"{where}.output must be text or a list of text parts", f"{where}.output")
    message = {"role": "tool", "tool_call_id": call_id, "content": output, "_closed": True}
    if call_id in names:
        message["name"] = names[call_id]
    return message


def _only(item: dict, allowed: set[str], where: str) -> None:
    extra = sorted(set(item) - allowed)
    if extra:
        raise SpecdecError(f"{where}.{extra[0][:64]} is not supported", f"{where}.{extra[0][:64]}")


def chat_tool(tool: dict, i: int) -> dict:
    """A Responses function tool (flat) as chat's {type, function: {...}}."""
    where = f"tools[{i}]"
    if tool.get("type") != "function":
        raise SpecdecError(f"{where}.type: only function tools are supported, "
                           f"got {str(tool.get('type'))[:40]!r}", f"{where}.type")
    _only(tool, {"type", "name", "description", "parameters", "strict"}, where)
    return {"type": "function", "function": {k: v for k, v in tool.items() if k != "type" and v is not None}}


def chat_tool_choice(choice: str | dict | None) -> str | dict | None:
    if choice is None or isinstance(choice, str):
        return choice
    if (choice.get("type") != "function" or not isinstance(choice.get("name"), str)
            or set(choice) - {"type", "name"}):
        raise SpecdecError("tool_choice must be none, auto, required or {'type': 'function', 'name': ...}",
                           "tool_choice")
    return {"type": "function", "function": {"name": choice["name"]}}


def response_format(text: dict | None) -> dict | None:
    """`text` ({format: {type: text | json_object | json_schema, ...}}) as chat's response_format."""
    if text is None:
        return None
    _only(text, {"format", "verbosity"}, "text")
    if text.get("verbosity") not in (None, "medium"):
        raise SpecdecError("text.verbosity is not supported", "text.verbosity")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise SpecdecError("text.format.type must be text, json_object or json_schema", "text.format.type")
    if fmt["type"] != "json_schema":
        _only(fmt, {"type"}, "text.format")
        return {"type": fmt["type"]}
    _only(fmt, {"type", "name", "schema", "strict", "description"}, "text.format")
    if not isinstance(fmt.get("schema"), dict):
        raise SpecdecError("text.format.schema must be a JSON schema object", "text.format.schema")
    spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
    return {"type": "json_schema", "json_schema": spec}


def rename(param: str | None) -> str | None:
    """A chat field named in an error, as the Responses field the client sent."""
    if param is None:
        return None
    if param == "max_completion_tokens":
        return "max_output_tokens"
    if param == "response_format" or param.startswith("response_format."):
        return "text.format"
    if param.startswith("messages"):
        return "input"
    if param.startswith(("tools[", "tool_choice.")) and ".function." in param:
        return param.replace(".function.", ".", 1)  # chat nests a function's fields; Responses does not
    return param
