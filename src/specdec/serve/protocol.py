"""OpenAI request schemas, error bodies and response objects for the server.

Bounds that pydantic can check live on the fields (so they also appear in the OpenAPI
schema); checks that need the tokenizer or the context length live in app.py.

Allowlist, not denylist: the request models forbid unknown fields (vLLM accepts and ignores
them), so nothing a client sends is silently dropped. An unknown field is a 400 naming it;
OpenAI's and vLLM's fields we know but do not implement (NOT_SUPPORTED) say so; declared
fields whose value we cannot honour (n > 1, penalties, logit_bias, ...) are refused by
`unsupported()`. Accepted without effect on the output: `user`, `safety_identifier`,
`metadata`, `prompt_cache_key` (metadata and routing hints) and `store: false`.
`cache_salt` (vLLM's) splits the caller's tenant (serve/tenants.py); `return_spec_decode`
asks for the per-request `spec_decode` statistics, which are off by default.

Every string of a request must be valid Unicode: JSON's `\ud800` escape parses to a lone
UTF-16 surrogate, which no tokenizer can encode; `unencodable_field` names the first one.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from specdec.config import MAX_K, parse_k
from specdec.errors import SpecdecError
from specdec.logprobs import MAX_TOP_LOGPROBS

MAX_ERROR_MESSAGE = 1024  # characters; error bodies never echo unbounded input
MAX_STOP = 16
MAX_STOP_CHARS = 256

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_error",
    503: "unavailable_error",
    504: "timeout_error",
}


def error_body(status: int, message: str, param: str | None = None, type_: str | None = None) -> dict:
    """The OpenAI error shape, with vLLM's integer `code`; message and param are bounded."""
    if len(message) > MAX_ERROR_MESSAGE:
        message = message[: MAX_ERROR_MESSAGE - 3] + "..."
    return {
        "error": {
            "message": _printable(message),
            "type": type_ or _ERROR_TYPES.get(status, "invalid_request_error"),
            "param": _printable(param[:128]) if param else None,
            "code": status,
        }
    }


def _printable(text: str) -> str:
    """Text that encodes as UTF-8: a lone surrogate from the request becomes its escape."""
    return text if text.isascii() else text.encode("utf-8", "backslashreplace").decode("utf-8")


# Fields of OpenAI's and vLLM's request schemas that this server does not implement; sent,
# they get "not supported" rather than "unrecognized" (any other unknown field is refused too).
NOT_SUPPORTED = frozenset({
    "audio", "modalities", "prediction", "reasoning_effort", "verbosity", "service_tier",
    "web_search_options", "prompt_cache_retention", "prompt_cache_options", "moderation", "functions",
    "function_call", "image_url", "input_audio", "file",
    "continuous_usage_stats", "include_obfuscation", "echo",
    "repetition_penalty", "min_p", "min_tokens", "stop_token_ids", "bad_words",
    "allowed_token_ids", "use_beam_search", "length_penalty", "include_stop_str_in_output",
    "skip_special_tokens", "spaces_between_special_tokens", "prompt_logprobs", "truncate_prompt_tokens",
    "logits_processors", "return_tokens_as_token_ids", "guided_json", "guided_regex", "guided_choice",
    "guided_grammar", "guided_decoding_backend", "structured_outputs", "chat_template",
    "chat_template_kwargs", "add_generation_prompt", "continue_final_message", "documents",
    "add_special_tokens", "priority", "request_id", "vllm_xargs", "kv_transfer_params",
})
_HINTS = {
    "functions": "use tools", "function_call": "use tool_choice", "image_url": "only text content parts are",
    "input_audio": "only text content parts are", "file": "only text content parts are",
    **dict.fromkeys(("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs"),
                    "use response_format"),
}


def validation_error(errors: list[dict]) -> tuple[str, str | None]:
    """pydantic errors -> (message, param) for one 400 naming the first bad field (an unknown
    field first); the input is never echoed (a body with many bad fields must not produce a
    huge error)."""
    first = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": ""}
    first = next((e for e in errors if e.get("type") == "extra_forbidden"), first)
    first = next((e for e in errors if e.get("type") == "string_unicode"), first)  # a lone surrogate
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return f"the request body is not valid JSON: {str(detail)[:200]}", None
    # Drop "body" and pydantic's union-branch names ("str", "list[int]") from the location.
    parts = [p for p in first.get("loc", ()) if p != "body" and not (isinstance(p, str) and _is_branch(p))]
    param = ""
    for p in parts:
        param += f"[{p}]" if isinstance(p, int) else (f".{p}" if param else str(p))
    if first.get("type") == "string_unicode":  # loc () when a field's name is the bad text
        return not_unicode(param or "a field name in the request body"), param or None
    if not param:
        return f"the request body must be a JSON object: {first.get('msg', '')}", None
    if first.get("type") == "extra_forbidden":
        return _unknown_field(param, str(parts[-1])), param
    more = f" (and {len(errors) - 1} more errors)" if len(errors) > 1 else ""
    return f"{param}: {first.get('msg', 'invalid value')}{more}", param


def _unknown_field(param: str, name: str) -> str:
    if name not in NOT_SUPPORTED:
        return f"Unrecognized request argument supplied: {param}"
    hint = _HINTS.get(name)
    return f"{param} is not supported by this server" + (f"; {hint}" if hint else "")


def _is_branch(part: str) -> bool:
    return part[:1].islower() and ("[" in part
                                   or part in {"str", "int", "float", "bool", "list", "dict", "none"})


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # unknown fields: a 400 naming them


class ContentPart(_Strict):
    type: str = Field(max_length=64)
    text: str | None = None


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = Field(default=None, max_length=256)
    # An assistant's past calls and a tool's result; checked by tools.py, which names the field.
    tool_calls: list[Any] | None = Field(default=None, max_length=128)
    tool_call_id: str | None = Field(default=None, max_length=256)
    # In an assistant message a client echoes back from a response; accepted when empty only.
    refusal: str | None = None
    audio: dict[str, Any] | None = None
    function_call: dict[str, Any] | None = None
    annotations: list[Any] | None = Field(default=None, max_length=128)


class StreamOptions(_Strict):
    include_usage: bool = False


StopStrings = str | Annotated[list[Annotated[str, Field(max_length=MAX_STOP_CHARS)]],
                              Field(max_length=MAX_STOP)]


class _Sampling(_Strict):
    model: str | None = Field(default=None, max_length=512)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1, description="0 or -1 disables top-k (vLLM extension)")
    n: int | None = Field(default=None, description="only 1 is supported")
    stop: StopStrings | None = None
    seed: int | None = Field(default=None, ge=-(2**63), le=2**64 - 1)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    # Metadata and routing hints, accepted without effect on the output.
    user: str | None = Field(default=None, max_length=512)
    safety_identifier: str | None = Field(default=None, max_length=512)
    prompt_cache_key: str | None = Field(default=None, max_length=512)
    metadata: Annotated[dict[str, Annotated[str, Field(max_length=512)]], Field(max_length=16)] | None = None
    store: bool | None = None  # only false: nothing is stored
    # Scopes the prefix cache and the suffix drafter's state within the caller's tenant (vLLM's field).
    cache_salt: str | None = Field(default=None, min_length=1, max_length=512)
    # Extensions: the speculative settings of this request, and its statistics in the response.
    return_spec_decode: bool | None = Field(default=None, description="add the spec_decode statistics")
    drafter: str | None = Field(default=None, max_length=512, description="drafter spec, e.g. ngram or none")
    k: int | Literal["auto"] | None = Field(default=None, description=f"draft length, 0..{MAX_K} or auto")
    ignore_eos: bool | None = Field(default=None, description="run to the token limit past end-of-sequence "
                                                              "tokens (vLLM extension)")


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1, max_length=4096)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    # Function calling and structured output, checked by tools.py and grammar.py.
    tools: list[Any] | None = Field(default=None, max_length=128)
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None


def unsupported(req: _Sampling) -> tuple[str, str] | None:
    """(param, message) for a declared field whose value we would have to ignore, else None."""
    checks = [  # (param, refused, message)
        ("n", req.n not in (None, 1), f"only n=1 is supported, got n={req.n}"),
        ("stream_options", req.stream_options is not None and not req.stream,
         "stream_options is only allowed when stream is true"),
        ("presence_penalty", bool(req.presence_penalty), "presence_penalty is not supported; leave it at 0"),
        ("frequency_penalty", bool(req.frequency_penalty),
         "frequency_penalty is not supported; leave it at 0"),
        ("logit_bias", bool(req.logit_bias), "logit_bias is not supported"),
        ("store", bool(req.store), "store=true is not supported: this server does not store completions"),
    ]
    if isinstance(req, ChatCompletionRequest):
        checks.append(("top_logprobs", bool(req.top_logprobs) and not req.logprobs,
                       "top_logprobs needs logprobs set to true"))
        checks += [(f"messages[{i}].{name}", bool(getattr(m, name)), f"messages[{i}].{name} is not supported")
                   for i, m in enumerate(req.messages)
                   for name in ("refusal", "audio", "function_call", "annotations")]
    if isinstance(req, CompletionRequest):
        checks += [
            ("echo", bool(req.echo), "echo is not supported"),
            ("best_of", req.best_of not in (None, 1), "only best_of=1 is supported"),
            ("suffix", bool(req.suffix), "suffix is not supported"),
        ]
    for param, refused, message in checks:
        if refused:
            return param, message
    if req.k is not None:
        try:
            parse_k(req.k)
        except SpecdecError as e:
            return "k", e.message
    return None


def unencodable_field(value, path: str = "") -> str | None:
    """The param (`messages[0].content`) of the first string, or dict key, in a request that
    is not valid Unicode (a lone surrogate), else None."""
    if isinstance(value, str):
        return None if value.isascii() or _encodes(value) else (path or "body")
    if isinstance(value, BaseModel):
        items = ((name, getattr(value, name)) for name in type(value).model_fields)
    elif isinstance(value, dict):
        items = value.items()
    elif isinstance(value, list | tuple):
        return next((p for i, v in enumerate(value) if (p := unencodable_field(v, f"{path}[{i}]"))), None)
    else:
        return None
    for key, v in items:
        if isinstance(key, str) and not (key.isascii() or _encodes(key)):
            return path or "body"
        if p := unencodable_field(v, f"{path}.{key}" if path else str(key)):
            return p
    return None


def not_unicode(param: str) -> str:
    return (f"{param} is not valid text: it holds a lone UTF-16 surrogate (such as the JSON escape \\ud800 "
            "without its pair), which cannot be encoded")


def _encodes(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def stop_list(stop: str | list[str] | None) -> list[str] | None:
    if stop is None:
        return None
    stops = [stop] if isinstance(stop, str) else list(stop)
    if any(len(s) > MAX_STOP_CHARS for s in stops):
        raise ValueError(f"stop strings are limited to {MAX_STOP_CHARS} characters")
    return [s for s in stops if s] or None


def message_text(content: str | list[ContentPart] | None) -> str:
    """Flatten OpenAI content parts; only text parts are supported."""
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for part in content:
        if part.type != "text" or part.text is None:
            raise ValueError(f"content parts of type {part.type[:32]!r} are not supported; only text")
        texts.append(part.text)
    return "".join(texts)


# ---- responses ---------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


# A structured reply that its token budget closed (grammar.py): complete and valid, but ended
# by the closing completion rather than by the model. Marked by the choice's `specdec` object,
# this header on a non-streamed response, and specdec:num_requests_closed_by_budget.
CLOSED_BY_BUDGET_HEADER = "X-Specdec-Closed-By-Budget"


def mark_closed_by_budget(choice: dict, result) -> bool:
    """Add the choice's `specdec` extension when the budget closed `result`; say whether it did."""
    if result.closed_by_budget:
        choice["specdec"] = {"closed_by_budget": True}
    return result.closed_by_budget


def spec_decode(stats, drafter: str) -> dict:
    """Per-request speculative statistics: tau (mean_accepted_length) counts the bonus token
    and grammar-forced tokens; drafted / accepted / acceptance_rate are the drafter's alone."""
    return {
        "drafter": drafter,
        "steps": stats.num_steps,
        "drafts": stats.num_drafts,
        "drafted": stats.num_draft_tokens,
        "accepted": stats.num_accepted_tokens,
        "forced_tokens": stats.num_forced_tokens,
        "acceptance_rate": round(stats.acceptance_rate, 4),
        "mean_accepted_length": round(stats.mean_accepted_length, 4),
    }


class ResponseBuilder:
    """Builds the completion object or the stream chunks of one request."""

    def __init__(self, chat: bool, model: str):
        self.chat, self.model = chat, model
        self.id = new_id("chatcmpl" if chat else "cmpl")
        self.created = int(time.time())

    def _envelope(self, obj: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices}

    def full(self, text: str | None, finish_reason: str, usage_: dict, spec: dict | None,
             tool_calls: list[dict] | None = None, logprobs: dict | None = None) -> dict:
        if self.chat:
            message = {"role": "assistant", "content": text}
            if tool_calls:
                message["tool_calls"] = tool_calls
            choice = {"index": 0, "message": message, "logprobs": logprobs}
        else:
            choice = {"index": 0, "text": text, "logprobs": logprobs}
        choice["finish_reason"] = finish_reason
        body = self._envelope("chat.completion" if self.chat else "text_completion", [choice])
        body["usage"] = usage_
        if spec is not None:  # asked for with return_spec_decode
            body["spec_decode"] = spec
        return body

    def chunk(self, text: str | None = None, finish_reason: str | None = None, role: bool = False,
              delta: dict | None = None, logprobs: dict | None = None) -> dict:
        """A stream chunk: a text delta, or a chat `delta` as tools.ToolStream makes them;
        `logprobs`: those of the tokens generated since the previous chunk (serve/logprobs.py)."""
        if self.chat:
            delta = dict(delta or {})
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
        return self._envelope("chat.completion.chunk" if self.chat else "text_completion", [choice])

    def usage_chunk(self, usage_: dict) -> dict:
        body = self._envelope("chat.completion.chunk" if self.chat else "text_completion", [])
        return {**body, "usage": usage_}


def sse(obj: dict | str) -> bytes:
    data = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"), ensure_ascii=False)
    return f"data: {data}\n\n".encode()
