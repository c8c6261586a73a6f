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
from specdec.serve.gateway import Gateway, error_response
from specdec.serve.guards import TENANT
from specdec.serve.ops import CONTEXT
from specdec.serve.protocol import (
    CLOSED_BY_BUDGET_HEADER,
    not_unicode,
    spec_decode,
    unencodable_field,
    unsupported,
)
from specdec.serve.replies import ChatReply, Reply
from specdec.serve.scheduler import QueueFull, RequestTimeout, ServerShutdown
from specdec.serve.tenants import request_tenant
from specdec.tools import finish_reason


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


def error_for(exc: Exception, rename=None) -> JSONResponse:
    """The error's response; `rename` (Reply.rename) names a field as the client's dialect does."""
    if isinstance(exc, SpecdecError):
        return error_response(400, exc.message, rename(exc.param) if rename else exc.param)
    if isinstance(exc, QueueFull):
        return error_response(429, str(exc), headers={"Retry-After": str(exc.retry_after)})
    if isinstance(exc, RequestTimeout):
        return error_response(504, str(exc))
    if isinstance(exc, ServerShutdown):
        return error_response(503, str(exc))
    return error_response(500, f"internal error ({type(exc).__name__})")


def _abort_reason(exc: Exception) -> str:
    return ("timeout" if isinstance(exc, RequestTimeout)
            else "shutdown" if isinstance(exc, ServerShutdown) else "error")


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
        return error_response(429, f"the server is at capacity; retry after {retry}s",
                              headers={"Retry-After": str(retry)})
    return None


async def complete(gw: Gateway, body, request: Request, chat: bool, reply: Reply | None = None,
                   kind: str | None = None) -> Response:
    """One generation request, from its cheap checks to its reply. `reply` writes the answer
    (default: chat or legacy completions); `kind` picks the body's request builder
    (Gateway.request; default: chat or completion)."""
    if (refused := refusal(gw, body)) is not None:
        return refused
    kind = kind or ("chat" if chat else "completion")
    if reply is None:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        reply = ChatReply(chat, gw.config.model_name, include_usage)
    ctx = request.scope.setdefault(CONTEXT, {})
    ctx["admitted"] = True  # ops.RequestContext gives the place back when the response ends
    ctx["tenant"] = tenant = request_tenant(request.scope.get(TENANT, ""), body.cache_salt)
    events = _Events(request)
    try:
        req = await gw.tokenizers.run(gw.build_request, body, kind, events.emit, tenant)
        gw.scheduler.submit(req)
    except Exception as e:
        events.stop_watching()
        if not isinstance(e, SpecdecError):
            gw.metrics.rejected(type(e).__name__)
        return error_for(e, reply.rename)
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
            return error_for(first[1], reply.rename)
        if body.stream:
            events.stop_watching()
            streaming = True
            return StreamingResponse(
                _stream(gw, req, events, reply, body, ctx),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        return await _whole(gw, req, events, reply, body, ctx)
    finally:
        events.stop_watching()
        if not streaming:
            req.cancel()  # the client left or the handler failed; a no-op once finished


def _spec(gw: Gateway, req, body, result) -> dict | None:
    """The spec_decode statistics, when the request asked for them."""
    return (spec_decode(result.stats, req.drafter or gw.scheduler.default_drafter)
            if body.return_spec_decode else None)


async def _whole(gw: Gateway, req, events: _Events, reply: Reply, body, ctx: dict) -> Response:
    request = req.job.request
    while (event := await events.next()) is not None:
        kind, payload = event
        if kind == "error":
            _count_abort(gw, req, _abort_reason(payload))
            return error_for(payload, reply.rename)
        if kind == "done":
            record(gw, req, body, payload, ctx)
            if request.tools is not None:
                request.tools.finish(payload)  # content, tool_calls, finish_reason
            lps = gw.logprob_format.request(request.chat, request.logprobs or 0).whole(payload.logprobs)
            headers = {CLOSED_BY_BUDGET_HEADER: "true"} if payload.closed_by_budget else None
            return JSONResponse(reply.whole(payload, _spec(gw, req, body, payload), lps), headers=headers)
    req.cancel()  # the client disconnected: stop generating, free the cache slot
    _count_abort(gw, req, "client_disconnect")
    return Response(status_code=499)


async def _stream(gw: Gateway, req, events: _Events, reply: Reply, body, ctx: dict):
    request = req.job.request
    # text -> content and tool_calls deltas
    calls = request.tools.stream() if request.tools is not None else None
    # chunks carry their tokens' logprobs
    lps = gw.logprob_format.request(request.chat, request.logprobs or 0)
    ended = False
    try:
        for frame in reply.open():
            yield frame
        while True:
            kind, payload = await events.queue.get()
            if kind == "logprobs":
                lps.add(payload)
            elif kind == "delta":
                for delta in calls.feed(payload) if calls is not None else [{"content": payload}]:
                    for frame in reply.delta(delta, lps.take()):
                        yield frame
            elif kind == "done":
                ended = True
                record(gw, req, body, payload, ctx)
                reason = payload.finish_reason
                if calls is not None:
                    for delta in calls.finish():
                        for frame in reply.delta(delta, lps.take()):
                            yield frame
                    reason = finish_reason(calls.calls, reason)
                for frame in reply.close(payload, reason, _spec(gw, req, body, payload), lps.take()):
                    yield frame
                break
            elif kind == "error":  # headers are sent: an error event the OpenAI SDKs raise on
                ended = True
                _count_abort(gw, req, _abort_reason(payload))
                for frame in reply.error(json.loads(error_for(payload, reply.rename).body)):
                    yield frame
                break
    finally:
        if not ended:
            _count_abort(gw, req, "client_disconnect")
        req.cancel()  # a disconnect cancels this generator; the worker frees the slot


def _count_abort(gw: Gateway, req, reason: str) -> None:
    if req.claim_end():  # not when the worker has counted it finished
        gw.metrics.aborted(reason)


def record(gw: Gateway, req, body, result, ctx: dict) -> None:
    """Tokens for the access log, and the traffic log's record, queued for its writer thread
    (which also renders token ids to text)."""
    ctx["prompt_tokens"], ctx["completion_tokens"] = len(result.prompt_ids), len(result.token_ids)
    if gw.traffic is None:
        return
    request = req.job.request
    if isinstance(request.prompt, str | list) and not (request.prompt and isinstance(request.prompt[0], int)):
        prompt = request.prompt  # text, or the chat messages (a Responses input as chat messages)
    else:
        def prompt():
            return gw.tokenizer.decode(result.prompt_ids)
    drafter = body.drafter or gw.scheduler.default_drafter
    meta = {
        "target": gw.config.engine.target, "chat": request.chat and not isinstance(request.prompt, str),
        "finish_reason": result.finish_reason, "temperature": request.sampling.temperature,
        "drafter": drafter,
        "prompt_tokens": len(result.prompt_ids), "completion_tokens": len(result.token_ids),
        "spec_decode": spec_decode(result.stats, drafter),
    }
    if request.tools is not None:  # what the prompt showed, for whoever re-renders it
        meta["tools"] = request.tools.tools
    gw.traffic.record(prompt, result.text, meta)
