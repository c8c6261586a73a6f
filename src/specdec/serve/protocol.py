"""OpenAI request schemas, error bodies and response objects for the server.

Bounds that pydantic can check live on the fields (so they also appear in the OpenAPI
schema); checks that need the tokenizer or the context length live in server.py. Unknown
fields are accepted and ignored, as vLLM does; fields whose effect we cannot honour
(logprobs, penalties, n > 1, ...) are refused with a 400 rather than silently ignored.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from specdec.config import MAX_K, parse_k
from specdec.errors import SpecdecError

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
            "message": message,
            "type": type_ or _ERROR_TYPES.get(status, "invalid_request_error"),
            "param": param[:128] if param else None,
            "code": status,
        }
    }


def validation_error(errors: list[dict]) -> tuple[str, str | None]:
    """pydantic errors -> (message, param) for one 400 naming the first bad field; the input
    is never echoed (a body with many bad fields must not produce a huge error)."""
    first = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": ""}
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return f"the request body is not valid JSON: {str(detail)[:200]}", None
    # Drop "body" and pydantic's union-branch names ("str", "list[int]") from the location.
    parts = [p for p in first.get("loc", ()) if p != "body" and not (isinstance(p, str) and _is_branch(p))]
    param = ""
    for p in parts:
        param += f"[{p}]" if isinstance(p, int) else (f".{p}" if param else str(p))
    if not param:
        return f"the request body must be a JSON object: {first.get('msg', '')}", None
    more = f" (and {len(errors) - 1} more errors)" if len(errors) > 1 else ""
    return f"{param}: {first.get('msg', 'invalid value')}{more}", param


def _is_branch(part: str) -> bool:
    return part[:1].islower() and ("[" in part or part in {"str", "int", "float", "bool", "list", "dict", "none"})


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)


class ContentPart(_Open):
    type: str = Field(max_length=64)
    text: str | None = None


class ChatMessage(_Open):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = Field(default=None, max_length=256)
    # An assistant's past calls and a tool's result; checked by tools.py, which names the field.
    tool_calls: list[Any] | None = Field(default=None, max_length=128)
    tool_call_id: str | None = Field(default=None, max_length=256)


class StreamOptions(_Open):
    include_usage: bool = False


StopStrings = str | Annotated[list[Annotated[str, Field(max_length=MAX_STOP_CHARS)]], Field(max_length=MAX_STOP)]


class _Sampling(_Open):
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
    user: str | None = Field(default=None, max_length=512)
    # Extensions: the speculative settings of this request.
    drafter: str | None = Field(default=None, max_length=512, description="drafter spec, e.g. ngram or none")
    k: int | Literal["auto"] | None = Field(default=None, description=f"draft length, 0..{MAX_K} or auto")


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1, max_length=4096)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    # Function calling and structured output, checked by tools.py and grammar.py.
    tools: list[Any] | None = Field(default=None, max_length=128)
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=5)
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None


def unsupported(req: _Sampling) -> tuple[str, str] | None:
    """(param, message) for a field we would have to ignore silently, else None."""
    if req.n not in (None, 1):
        return "n", f"only n=1 is supported, got n={req.n}"
    if req.stream_options is not None and not req.stream:
        return "stream_options", "stream_options is only allowed when stream is true"
    if req.presence_penalty or req.frequency_penalty:
        param = "presence_penalty" if req.presence_penalty else "frequency_penalty"
        return param, f"{param} is not supported; leave it at 0"
    if req.logit_bias:
        return "logit_bias", "logit_bias is not supported"
    if isinstance(req, ChatCompletionRequest) and (req.logprobs or req.top_logprobs):
        return "logprobs", "logprobs are not supported"
    if isinstance(req, CompletionRequest):
        if req.logprobs is not None:
            return "logprobs", "logprobs are not supported"
        if req.echo:
            return "echo", "echo is not supported"
        if req.best_of not in (None, 1):
            return "best_of", "only best_of=1 is supported"
        if req.suffix:
            return "suffix", "suffix is not supported"
    if req.k is not None:
        try:
            parse_k(req.k)
        except SpecdecError as e:
            return "k", e.message
    return None


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


def spec_decode(stats, drafter: str) -> dict:
    """Per-request speculative statistics: tau (mean_accepted_length) counts the bonus token."""
    return {
        "drafter": drafter,
        "steps": stats.num_steps,
        "drafts": stats.num_drafts,
        "drafted": stats.num_draft_tokens,
        "accepted": stats.num_accepted_tokens,
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
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def full(self, text: str | None, finish_reason: str, usage_: dict, spec: dict,
             tool_calls: list[dict] | None = None) -> dict:
        if self.chat:
            message = {"role": "assistant", "content": text}
            if tool_calls:
                message["tool_calls"] = tool_calls
            choice = {"index": 0, "message": message, "logprobs": None}
        else:
            choice = {"index": 0, "text": text, "logprobs": None}
        choice["finish_reason"] = finish_reason
        body = self._envelope("chat.completion" if self.chat else "text_completion", [choice])
        return {**body, "usage": usage_, "spec_decode": spec}

    def chunk(self, text: str | None = None, finish_reason: str | None = None, role: bool = False,
              delta: dict | None = None) -> dict:
        """A stream chunk: a text delta, or a chat `delta` as tools.ToolStream makes them."""
        if self.chat:
            delta = dict(delta or {})
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        return self._envelope("chat.completion.chunk" if self.chat else "text_completion", [choice])

    def usage_chunk(self, usage_: dict) -> dict:
        body = self._envelope("chat.completion.chunk" if self.chat else "text_completion", [])
        return {**body, "usage": usage_}


def sse(obj: dict | str) -> bytes:
    data = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"), ensure_ascii=False)
    return f"data: {data}\n\n".encode()
