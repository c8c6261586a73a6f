"""The text generation handlers: a request from admission to its JSON reply or its stream.

Order of work, cheapest refusal first: unencodable text (400 naming the field), fields we do
not honour (400), the model name, readiness and draining (503), then admission (429 with
Retry-After) before the prompt is tokenized; tokenizing and building the request run in the
TokenizerPool. The model runs in the scheduler's worker thread; each request gets an asyncio
queue that the worker fills through `loop.call_soon_threadsafe`. A client that disconnects
cancels its generation and frees its cache slot.
"""

from __future__ import annotations

import asyncio
import json
import time

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from specdec.errors import SpecdecError
from specdec.serve.gateway import Gateway, chat_message, error_response
from specdec.serve.guards import TENANT
from specdec.serve.ops import CONTEXT
from specdec.serve.protocol import (
    CLOSED_BY_BUDGET_HEADER,
    ResponseBuilder,
    mark_closed_by_budget,
    not_unicode,
    spec_decode,
    sse,
    unencodable_field,
    unsupported,
    usage,
)
from specdec.serve.scheduler import QueueFull, RequestTimeout, ServerShutdown
from specdec.serve.tenants import request_tenant
from specdec.tools import ToolPlan, finish_reason


class _Events:
    """The worker's events for one request, raced against the client going away."""

    def __init__(self, request: Request):
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.started_at: float | None = None
        self._request = request
        self._disconnect: asyncio.Task | None = asyncio.ensure_future(self._wait_disconnect())

    async def _wait_disconnect(self) -> None:
        while (await self._request.receive())["type"] != "http.disconnect":
            pass

    def emit(self, kind: str, payload) -> None:  # called from the worker thread
        if kind == "started" and self.started_at is None:
            self.started_at = time.perf_counter()
        self.loop.call_soon_threadsafe(self.queue.put_nowait, (kind, payload))

    async def next(self):
        """The next event, or None if the client disconnected first."""
        if not self.queue.empty() or self._disconnect is None:
            return await self.queue.get()
        get = asyncio.ensure_future(self.queue.get())
        done, _ = await asyncio.wait({get, self._disconnect}, return_when=asyncio.FIRST_COMPLETED)
        if get in done:
            return get.result()
        get.cancel()
        return None

    def stop_watching(self) -> None:
        """Hand disconnect detection over to StreamingResponse, which cancels the stream."""
        if self._disconnect is not None:
            self._disconnect.cancel()
            self._disconnect = None


def error_for(exc: Exception) -> JSONResponse:
    if isinstance(exc, SpecdecError):
        return error_response(400, exc.message, exc.param)
    if isinstance(exc, QueueFull):
        return error_response(429, str(exc), headers={"Retry-After": str(exc.retry_after)})
    if isinstance(exc, RequestTimeout):
        return error_response(504, str(exc))
    if isinstance(exc, ServerShutdown):
        return error_response(503, str(exc))
    return error_response(500, f"internal error ({type(exc).__name__})")


def _abort_reason(exc: Exception) -> str:
    return "timeout" if isinstance(exc, RequestTimeout) else "shutdown" if isinstance(exc, ServerShutdown) else "error"


def refusal(gw: Gateway, body) -> JSONResponse | None:
    """The cheap checks, before any work: a 400, 503 or 429, else None."""
    if (param := unencodable_field(body)) is not None:
        return error_response(400, not_unicode(param), param)
    if problem := unsupported(body):
        return error_response(400, problem[1], problem[0])
    if body.model is not None and body.model != gw.config.model_name:
        return error_response(400, f"The model `{body.model[:200]}` does not exist.", "model")
    if not gw.ready or gw.draining:
        return gw.not_ready()
    if not gw.admit():
        gw.metrics.rejected("QueueFull")
        retry = gw.retry_after()
        return error_response(429, f"the server is at capacity; retry after {retry}s", headers={"Retry-After": str(retry)})
    return None


async def complete(gw: Gateway, body, request: Request, chat: bool) -> Response:
    if (refused := refusal(gw, body)) is not None:
        return refused
    ctx = request.scope.setdefault(CONTEXT, {})
    ctx["admitted"] = True  # ops.RequestContext gives the place back when the response ends
    ctx["tenant"] = tenant = request_tenant(request.scope.get(TENANT, ""), body.cache_salt)
    events = _Events(request)
    try:
        req, tools = await gw.tokenizers.run(gw.build_request, body, chat, events.emit, tenant)
        gw.scheduler.submit(req)
    except Exception as e:
        events.stop_watching()
        if not isinstance(e, SpecdecError):
            gw.metrics.rejected(type(e).__name__)
        return error_for(e)
    builder = ResponseBuilder(chat, gw.config.model_name)
    streaming = False
    try:
        first = await events.next()
        if first is not None and events.started_at is not None:
            gw.metrics.observe_queue_time(events.started_at - req.submitted_at)
        if first is None:  # the client left while queued
            req.cancel()
            _count_abort(gw, req, "client_disconnect")
            return Response(status_code=499)
        if first[0] == "error":
            _count_abort(gw, req, _abort_reason(first[1]))
            return error_for(first[1])
        if body.stream:
            events.stop_watching()
            streaming = True
            return StreamingResponse(
                _stream(gw, req, events, builder, body, chat, tools, ctx),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        return await _whole(gw, req, events, builder, body, chat, tools, ctx)
    finally:
        events.stop_watching()
        if not streaming:
            req.cancel()  # the client left or the handler failed; a no-op once finished


async def _whole(gw: Gateway, req, events: _Events, builder: ResponseBuilder, body, chat: bool,
                 tools: ToolPlan | None, ctx: dict) -> Response:
    while (event := await events.next()) is not None:
        kind, payload = event
        if kind == "error":
            _count_abort(gw, req, _abort_reason(payload))
            return error_for(payload)
        if kind == "done":
            record(gw, body, chat, payload, ctx)
            use = usage(len(payload.prompt_ids), len(payload.token_ids), payload.stats.cached_prompt_tokens)
            spec = spec_decode(payload.stats, req.drafter or gw.scheduler.default_drafter) if body.return_spec_decode else None
            text = tools.finish(payload).content if tools is not None else payload.text
            lps = gw.logprob_format.request(chat, req.logprobs or 0).whole(payload.logprobs)
            reply = builder.full(text, payload.finish_reason, use, spec, payload.tool_calls, lps)
            closed = mark_closed_by_budget(reply["choices"][0], payload)
            return JSONResponse(reply, headers={CLOSED_BY_BUDGET_HEADER: "true"} if closed else None)
    req.cancel()  # the client disconnected: stop generating, free the cache slot
    _count_abort(gw, req, "client_disconnect")
    return Response(status_code=499)


async def _stream(gw: Gateway, req, events: _Events, builder: ResponseBuilder, body, chat: bool,
                  tools: ToolPlan | None, ctx: dict):
    calls = tools.stream() if tools is not None else None  # text deltas -> content and tool_calls deltas
    lps = gw.logprob_format.request(chat, req.logprobs or 0)  # chunks carry their tokens' logprobs
    ended = False
    try:
        if chat:  # the first delta carries the role
            yield sse(builder.chunk("", role=True))
        while True:
            kind, payload = await events.queue.get()
            if kind == "logprobs":
                lps.add(payload)
            elif kind == "delta" and calls is not None:
                for delta in calls.feed(payload):
                    yield sse(builder.chunk(delta=delta, logprobs=lps.take()))
            elif kind == "delta":
                yield sse(builder.chunk(payload, logprobs=lps.take()))
            elif kind == "done":
                ended = True
                record(gw, body, chat, payload, ctx)
                reason = payload.finish_reason
                if calls is not None:
                    for delta in calls.finish():
                        yield sse(builder.chunk(delta=delta, logprobs=lps.take()))
                    reason = finish_reason(calls.calls, reason)
                final = builder.chunk(None, reason, logprobs=lps.take())
                mark_closed_by_budget(final["choices"][0], payload)
                if body.return_spec_decode:
                    final["spec_decode"] = spec_decode(payload.stats, req.drafter or gw.scheduler.default_drafter)
                yield sse(final)
                if body.stream_options and body.stream_options.include_usage:
                    yield sse(builder.usage_chunk(usage(len(payload.prompt_ids), len(payload.token_ids),
                                                        payload.stats.cached_prompt_tokens)))
                break
            elif kind == "error":  # headers are sent: an error event the OpenAI SDKs raise on
                ended = True
                _count_abort(gw, req, _abort_reason(payload))
                yield sse(json.loads(error_for(payload).body))
                break
        yield sse("[DONE]")
    finally:
        if not ended:
            _count_abort(gw, req, "client_disconnect")
        req.cancel()  # a disconnect cancels this generator; the worker frees the slot


def _count_abort(gw: Gateway, req, reason: str) -> None:
    if req.claim_end():  # not when the worker has counted it finished
        gw.metrics.aborted(reason)


def record(gw: Gateway, body, chat: bool, result, ctx: dict) -> None:
    """Tokens for the access log, and the traffic log's record, queued for its writer thread
    (which also renders the prompt)."""
    ctx["prompt_tokens"], ctx["completion_tokens"] = len(result.prompt_ids), len(result.token_ids)
    if gw.traffic is None:
        return
    if chat:
        def prompt():
            return [chat_message(i, m) for i, m in enumerate(body.messages)]
    elif isinstance(body.prompt, str):
        prompt = body.prompt
    else:
        def prompt():
            return gw.tokenizer.decode(result.prompt_ids)
    drafter = body.drafter or gw.scheduler.default_drafter
    meta = {
        "target": gw.config.engine.target, "chat": chat, "finish_reason": result.finish_reason,
        "temperature": 1.0 if body.temperature is None else body.temperature, "drafter": drafter,
        "prompt_tokens": len(result.prompt_ids), "completion_tokens": len(result.token_ids),
        "spec_decode": spec_decode(result.stats, drafter),
    }
    if chat and body.tools:  # what the prompt showed, for whoever re-renders it
        meta["tools"] = body.tools
    gw.traffic.record(prompt, result.text, meta)
