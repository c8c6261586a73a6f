"""HTTP bodies to request values: one function per endpoint, one line per field.

`chat_request` and `completion_request` turn a validated pydantic body (protocol.py) into a
`request.Request`; the Responses API translates its body into chat messages and then uses
`chat_request`'s pieces too (serve/responses.py). The server's own extensions (drafter, k,
return_spec_decode, cache_salt) are not part of the request value: the handler reads them.
"""

from __future__ import annotations

from specdec.errors import SpecdecError
from specdec.grammar import constraint_from_response_format
from specdec.request import Request
from specdec.sampling import SamplingParams
from specdec.serve.protocol import ChatCompletionRequest, CompletionRequest, message_text, stop_list
from specdec.tools import tool_plan


def chat_message(i: int, m) -> dict:
    """A request message as prompts.encode takes it: text content, calls and results kept."""
    try:
        content = None if m.content is None else message_text(m.content)
    except ValueError as e:
        raise SpecdecError(str(e), f"messages[{i}].content") from None
    msg = {"role": m.role, "content": content}
    if m.tool_calls is not None:
        msg["tool_calls"] = m.tool_calls
    if m.tool_call_id is not None:
        msg["tool_call_id"] = m.tool_call_id
    if m.name is not None:
        if m.role != "tool":  # the chat template has no place for a speaker's name
            raise SpecdecError(f"messages[{i}].name is supported on tool messages only",
                               f"messages[{i}].name")
        msg["name"] = m.name
    return msg


def sampling(temperature: float | None, top_p: float | None, top_k: int | None = None) -> SamplingParams:
    """The HTTP APIs' sampling: temperature and top_p default to 1 (OpenAI's defaults)."""
    return SamplingParams(1.0 if temperature is None else float(temperature),
                          top_k if top_k and top_k > 0 else 0, 1.0 if top_p is None else float(top_p))


def stops(stop) -> tuple[str, ...] | None:
    try:
        found = stop_list(stop)
    except ValueError as e:
        raise SpecdecError(str(e), "stop") from None
    return tuple(found) if found else None


def chat_request(body: ChatCompletionRequest, tool_parser: str,
                 messages: list[dict] | None = None) -> Request:
    """/v1/chat/completions. `messages`: already translated ones (the Responses API's)."""
    limit_field = "max_completion_tokens" if body.max_completion_tokens is not None else (
        "max_tokens" if body.max_tokens is not None else None)
    return Request(
        prompt=(messages if messages is not None
                else [chat_message(i, m) for i, m in enumerate(body.messages)]),
        chat=True,
        sampling=sampling(body.temperature, body.top_p, body.top_k),
        max_tokens=body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens,
        limit_field=limit_field,
        stop=stops(body.stop),
        seed=body.seed,
        tools=tool_plan(body.tools, body.tool_choice, body.parallel_tool_calls, tool_parser),
        response_format=constraint_from_response_format(body.response_format),
        logprobs=(body.top_logprobs or 0) if body.logprobs else None,
        ignore_eos=bool(body.ignore_eos),
    )


def completion_request(body: CompletionRequest, vocab_size: int) -> Request:
    """/v1/completions: text or token ids, no chat template; 16 tokens unless max_tokens says."""
    return Request(
        prompt=completion_prompt(body.prompt, vocab_size),
        chat=False,
        sampling=sampling(body.temperature, body.top_p, body.top_k),
        max_tokens=body.max_tokens if body.max_tokens is not None else 16,
        limit_field="max_tokens" if body.max_tokens is not None else None,
        stop=stops(body.stop),
        seed=body.seed,
        logprobs=body.logprobs,
        ignore_eos=bool(body.ignore_eos),
    )


def completion_prompt(prompt, vocab_size: int) -> str | list[int]:
    """One prompt: text or token ids (a batch of one is unwrapped)."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, list):
        if not all(isinstance(t, int) for t in prompt):
            raise SpecdecError("only one prompt per request is supported", "prompt")
        if not all(0 <= t < vocab_size for t in prompt):  # ids from the client
            raise SpecdecError(f"prompt token ids must be in [0, {vocab_size})", "prompt")
    return prompt
