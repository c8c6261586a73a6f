"""How a finished or streaming generation is written back: one writer per API dialect.

Every endpoint runs the same request path (serve/handlers.py); only the reply's shape differs.
A `Reply` turns the generation into the dialect's objects: `whole` for a JSON reply, and for a
stream `open`, `delta` (a chat delta as tools.ToolStream makes them: {"content": text} or
{"tool_calls": [...]}), `close` and `error`, each returning the SSE frames to send.
`ChatReply` writes chat completions and legacy completions; `responses_out.ResponsesReply`
the Responses API's objects and typed events.
"""

from __future__ import annotations

from typing import Protocol

from specdec.sequence import GenerationResult
from specdec.serve.protocol import ResponseBuilder, mark_closed_by_budget, sse, usage


class Reply(Protocol):
    def rename(self, param: str | None) -> str | None:
        """The field an error names, in this dialect's words."""

    def whole(self, result: GenerationResult, spec: dict | None, logprobs: dict | None) -> dict:
        """The JSON reply; `result` has been through ToolPlan.finish (content, tool_calls)."""

    def open(self) -> list[bytes]: ...

    def delta(self, delta: dict, logprobs: dict | None) -> list[bytes]: ...

    def close(self, result: GenerationResult, finish_reason: str, spec: dict | None,
              logprobs: dict | None) -> list[bytes]: ...

    def error(self, body: dict) -> list[bytes]:
        """Frames for an error after the stream's headers were sent (the body: error_body's)."""


def result_usage(result: GenerationResult) -> dict:
    return usage(len(result.prompt_ids), len(result.token_ids), result.stats.cached_prompt_tokens)


class ChatReply:
    """/v1/chat/completions (chat=True) and /v1/completions: chunks, then `data: [DONE]`."""

    def __init__(self, chat: bool, model: str, include_usage: bool = False):
        self.builder = ResponseBuilder(chat, model)
        self.chat, self.include_usage = chat, include_usage

    def rename(self, param: str | None) -> str | None:
        return param

    def whole(self, result: GenerationResult, spec: dict | None, logprobs: dict | None) -> dict:
        text = result.content if result.tool_calls or result.content is not None else result.text
        reply = self.builder.full(text, result.finish_reason, result_usage(result), spec, result.tool_calls,
                                  logprobs)
        # the `specdec` extension (docs/structured-budget.md)
        mark_closed_by_budget(reply["choices"][0], result)
        return reply

    def open(self) -> list[bytes]:
        # the first delta carries the role
        return [sse(self.builder.chunk("", role=True))] if self.chat else []

    def delta(self, delta: dict, logprobs: dict | None) -> list[bytes]:
        if self.chat:
            return [sse(self.builder.chunk(delta=delta, logprobs=logprobs))]
        return [sse(self.builder.chunk(delta.get("content", ""), logprobs=logprobs))]

    def close(self, result: GenerationResult, finish_reason: str, spec: dict | None,
              logprobs: dict | None) -> list[bytes]:
        final = self.builder.chunk(None, finish_reason, logprobs=logprobs)
        mark_closed_by_budget(final["choices"][0], result)
        if spec is not None:
            final["spec_decode"] = spec
        frames = [sse(final)]
        if self.include_usage:
            frames.append(sse(self.builder.usage_chunk(result_usage(result))))
        return [*frames, sse("[DONE]")]

    def error(self, body: dict) -> list[bytes]:
        return [sse(body), sse("[DONE]")]  # an error event the OpenAI SDKs raise on
