"""The OpenAI-compatible HTTP gateway: FastAPI routes over the continuous-batching scheduler.

Routes (one module each in serve/routes/): POST /v1/chat/completions, POST /v1/completions,
GET /v1/models, GET /health (503 while the model loads), GET /metrics (Prometheus).

The model runs in the scheduler's worker thread; each request gets an asyncio queue that the
worker fills through `loop.call_soon_threadsafe`. Hardening: 127.0.0.1 by default, an
optional bearer key compared in constant time (guards /v1 only, like vLLM), OpenAI-shaped
errors for every malformed input (never FastAPI's 422, never a 500), a body size limit, a
bounded queue (429 + Retry-After), a per-request timeout, and client disconnects that cancel
generation and free the request's cache slot.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import threading
import time
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from specdec.config import EngineConfig, split_k
from specdec.drafters import DrafterSpec, available
from specdec.errors import SpecdecError
from specdec.grammar import GrammarMatcher, constraint_from_response_format
from specdec.models import load_model
from specdec.prompts import encode
from specdec.sampling import SamplingParams
from specdec.serve.guards import ApiKeyAuth, BodyLimit
from specdec.serve.logprobs import LogprobFormatter, requested
from specdec.serve.metrics import ServerMetrics
from specdec.serve.protocol import (
    ResponseBuilder,
    error_body,
    message_text,
    spec_decode,
    sse,
    stop_list,
    unsupported,
    usage,
    validation_error,
)
from specdec.serve.routes import routers
from specdec.serve.scheduler import (
    GenRequest,
    LoadPolicy,
    QueueFull,
    RequestTimeout,
    Scheduler,
    ServerShutdown,
)
from specdec.serve.traffic_log import TrafficLog
from specdec.tools import DEFAULT_PARSER, ToolPlan, finish_reason, tool_plan

log = logging.getLogger("specdec.server")


@dataclass
class ServeConfig:
    engine: EngineConfig = field(default_factory=EngineConfig)  # target, default drafter and k, backend, ...
    served_model_name: str | None = None
    api_key: str | None = None  # the key itself (read from the environment by the CLI)
    max_batch: int = 16
    max_queue: int = 64
    max_batch_tokens: int = 128
    spec_off_above: int = 0
    request_timeout: float = 600.0
    max_body_bytes: int = 8 * 1024 * 1024
    allow_drafters: list[str] = field(default_factory=list)  # extra specs clients may ask for
    tool_parser: str = DEFAULT_PARSER  # the model's tool-call format (tool_parsers/)
    log_dir: str | None = None
    log_max_bytes: int = 256 * 1024 * 1024
    on_load_error: object = None  # callable(message) run when loading fails
    on_ready: object = None  # callable() run once the model serves

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.engine.target


def error_response(status: int, message: str, param: str | None = None, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status, headers=headers)


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
            raise SpecdecError(f"messages[{i}].name is supported on tool messages only", f"messages[{i}].name")
        msg["name"] = m.name
    return msg


# ---- request plumbing -------------------------------------------------------------------------


class _Events:
    """The worker's events for one request, raced against the client going away."""

    def __init__(self, request: Request):
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self._request = request
        self._disconnect: asyncio.Task | None = asyncio.ensure_future(self._wait_disconnect())

    async def _wait_disconnect(self) -> None:
        while (await self._request.receive())["type"] != "http.disconnect":
            pass

    def emit(self, kind: str, payload) -> None:  # called from the worker thread
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


def _error_for(exc: Exception) -> JSONResponse:
    if isinstance(exc, SpecdecError):
        return error_response(400, exc.message, exc.param)
    if isinstance(exc, QueueFull):
        return error_response(429, str(exc), headers={"Retry-After": str(exc.retry_after)})
    if isinstance(exc, RequestTimeout):
        return error_response(504, str(exc))
    if isinstance(exc, ServerShutdown):
        return error_response(503, str(exc))
    return error_response(500, f"internal error ({type(exc).__name__})")


class Gateway:
    """Server state: loading, the scheduler, and the request handlers."""

    def __init__(self, config: ServeConfig):
        self.config = config
        self.metrics = ServerMetrics()
        self.traffic = None
        if config.log_dir:  # served prompts and completions, for `specdec distill --from-logs`
            self.traffic = TrafficLog(config.log_dir, config.log_max_bytes)
        self.scheduler = None
        self.tokenizer = None
        self.max_length: int | None = None
        self.load_error: str | None = None
        self.created = int(time.time())
        self._encode_lock = threading.Lock()
        self.logprob_format: LogprobFormatter | None = None
        self._allowed: set[str] = set()

    # ---- loading -------------------------------------------------------------------------

    def load(self) -> None:
        """Runs in a background thread so the server answers /health (503) meanwhile."""
        try:
            delay = float(os.environ.get("SPECDEC_SERVE_LOAD_DELAY", "0") or 0)  # for tests
            if delay > 0:
                time.sleep(delay)
            cfg = self.config
            target = load_model(cfg.engine.target)
            policy = LoadPolicy(cfg.max_batch_tokens, cfg.spec_off_above)
            scheduler = Scheduler(target, cfg.engine, cfg.max_batch, cfg.max_queue, policy, self.metrics)
            self._allowed = {split_k(s)[0] for s in [cfg.engine.drafter, "none", *cfg.allow_drafters]}
            self.metrics.bind_scheduler(scheduler)
            self.tokenizer, self.max_length = target.tokenizer, scheduler.max_length
            self.eos_token_ids = target.eos_token_ids
            self.logprob_format = LogprobFormatter(target.tokenizer, target.eos_token_ids, self._encode_lock)
            self.vocab_size = int(target.model.get_input_embeddings().num_embeddings)
            scheduler.start()
            self.scheduler = scheduler  # last: from here on the server is ready
            if callable(cfg.on_ready):
                cfg.on_ready()
        except Exception as e:
            self.load_error = e.message if isinstance(e, SpecdecError) else f"{type(e).__name__}: {e}"
            if callable(self.config.on_load_error):
                self.config.on_load_error(self.load_error)  # the CLI prints it and exits
            else:
                log.error("loading failed: %s", self.load_error)

    @property
    def ready(self) -> bool:
        s = self.scheduler
        return s is not None and s.alive

    def not_ready(self) -> JSONResponse:
        message = f"model failed to load: {self.load_error}" if self.load_error else "Loading model"
        return error_response(503, message, headers={"Retry-After": "1"})

    # ---- validation ----------------------------------------------------------------------

    def check_drafter(self, text: str) -> str | None:
        """Clients may pick `none`, a bare registered drafter name, or a spec the server
        configured; specs with paths or options only come from the server's own flags."""
        try:
            spec_text, _ = split_k(text)  # also checks the k
            name = DrafterSpec.parse(spec_text).name
        except SpecdecError as e:
            return e.message
        if spec_text in self._allowed or (spec_text == name and name in available()):
            return None
        if name not in available():
            return f"unknown drafter {name!r}; choose one of: {', '.join(available())}"
        return f"drafter {spec_text!r} is not enabled on this server (see specdec serve --allow-drafter)"

    def encode(self, body, chat: bool, tools: ToolPlan | None = None) -> list[int]:
        """The request's prompt as token ids (`prompts.encode`), its tools shown to the model.
        The context-length check is build_request's, in OpenAI's words."""
        if chat:
            prompt = [chat_message(i, m) for i, m in enumerate(body.messages)]
        else:
            prompt = body.prompt
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
                prompt = prompt[0]  # a batch of one
            if isinstance(prompt, list):
                if not all(isinstance(t, int) for t in prompt):
                    raise SpecdecError("only one prompt per request is supported", "prompt")
                if not all(0 <= t < self.vocab_size for t in prompt):  # ids from the client
                    raise SpecdecError(f"prompt token ids must be in [0, {self.vocab_size})", "prompt")
        with self._encode_lock:
            return encode(self.tokenizer, prompt, chat=chat, tools=tools)

    def grammar(self, body, tools: ToolPlan | None) -> GrammarMatcher | None:
        """The reply's constraint: the response_format, or the tool calls (tools.py)."""
        constraint = constraint_from_response_format(body.response_format)
        if tools is not None:
            constraint = tools.constraint(constraint)
        if constraint is None:
            return None
        with self._encode_lock:  # the first one per tokenizer reads its vocabulary
            return GrammarMatcher(constraint, self.tokenizer, self.eos_token_ids)

    def build_request(self, body, chat: bool, emit) -> tuple[GenRequest, ToolPlan | None]:
        """Validate everything that needs the tokenizer; return a GenRequest and the request's
        tools, or raise SpecdecError."""
        prompt_param = "messages" if chat else "prompt"
        tools = tool_plan(body.tools, body.tool_choice, body.parallel_tool_calls, self.config.tool_parser) if chat else None
        prompt_ids = self.encode(body, chat, tools)
        n_prompt, context = len(prompt_ids), self.max_length
        if n_prompt >= context:
            raise SpecdecError(
                f"This model's maximum context length is {context} tokens. However, your "
                f"{prompt_param} resulted in {n_prompt} tokens, leaving no room for a completion.",
                prompt_param,
            )
        max_param = "max_completion_tokens" if chat and body.max_completion_tokens is not None else "max_tokens"
        max_tokens = body.max_completion_tokens if max_param == "max_completion_tokens" else body.max_tokens
        if max_tokens is None:
            max_tokens = context - n_prompt if chat else min(16, context - n_prompt)
        elif n_prompt + max_tokens > context:
            raise SpecdecError(
                f"This model's maximum context length is {context} tokens. However, you requested "
                f"{n_prompt + max_tokens} tokens ({n_prompt} in the {prompt_param}, {max_tokens} in the "
                f"completion). Please reduce the length of the {prompt_param} or completion.",
                max_param,
            )
        try:
            stop = stop_list(body.stop)
        except ValueError as e:
            raise SpecdecError(str(e), "stop") from None
        top_k = body.top_k if body.top_k and body.top_k > 0 else 0
        params = SamplingParams(
            1.0 if body.temperature is None else float(body.temperature), top_k,
            1.0 if body.top_p is None else float(body.top_p),
        )
        params.validate()
        if body.drafter is not None and (problem := self.check_drafter(body.drafter)):
            raise SpecdecError(problem, "drafter")
        if (logprobs := requested(body, chat)) is not None:
            self.logprob_format.prepare()  # here, off the event loop
        req = GenRequest(
            prompt_ids, params, max_tokens, emit, stop=stop, seed=body.seed, drafter=body.drafter,
            k=body.k, stream=bool(body.stream), timeout_s=self.config.request_timeout,
            grammar=self.grammar(body, tools) if chat else None, logprobs=logprobs,
        )
        return req, tools

    # ---- handlers ------------------------------------------------------------------------

    async def complete(self, body, request: Request, chat: bool) -> Response:
        problem = unsupported(body)
        if problem:
            return error_response(400, problem[1], problem[0])
        if body.model is not None and body.model != self.config.model_name:
            return error_response(400, f"The model `{body.model[:200]}` does not exist.", "model")
        if not self.ready:
            return self.not_ready()
        events = _Events(request)
        try:  # tokenizing a long prompt must not stall the event loop
            req, tools = await asyncio.to_thread(self.build_request, body, chat, events.emit)
            self.scheduler.submit(req)
        except Exception as e:
            events.stop_watching()
            if not isinstance(e, SpecdecError):
                self.metrics.rejected.labels(reason=type(e).__name__).inc()
            return _error_for(e)
        builder = ResponseBuilder(chat, self.config.model_name)
        streaming = False
        try:
            first = await events.next()
            if first is None:  # the client left while queued
                req.cancel()
                return Response(status_code=499)
            if first[0] == "error":
                return _error_for(first[1])
            if body.stream:
                events.stop_watching()
                streaming = True
                include_usage = bool(body.stream_options and body.stream_options.include_usage)
                return StreamingResponse(
                    self._stream(req, events, builder, body, chat, include_usage, tools),
                    media_type="text/event-stream",
                    headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                )
            while (event := await events.next()) is not None:
                kind, payload = event
                if kind == "error":
                    return _error_for(payload)
                if kind == "done":
                    self._record(body, chat, payload)
                    use = usage(len(payload.prompt_ids), len(payload.token_ids), payload.stats.cached_prompt_tokens)
                    spec = spec_decode(payload.stats, req.drafter or self.scheduler.default_drafter)
                    text = tools.finish(payload).content if tools is not None else payload.text
                    lps = self.logprob_format.request(chat, req.logprobs or 0).whole(payload.logprobs)
                    return JSONResponse(builder.full(text, payload.finish_reason, use, spec, payload.tool_calls, lps))
            req.cancel()  # the client disconnected: stop generating, free the cache slot
            return Response(status_code=499)
        finally:
            events.stop_watching()
            if not streaming:
                req.cancel()  # the client left or the handler failed; a no-op once finished

    async def _stream(self, req, events: _Events, builder: ResponseBuilder, body, chat: bool, include_usage: bool,
                      tools: ToolPlan | None = None):
        calls = tools.stream() if tools is not None else None  # text deltas -> content and tool_calls deltas
        lps = self.logprob_format.request(chat, req.logprobs or 0)  # chunks carry their tokens' logprobs
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
                    self._record(body, chat, payload)
                    reason = payload.finish_reason
                    if calls is not None:
                        for delta in calls.finish():
                            yield sse(builder.chunk(delta=delta, logprobs=lps.take()))
                        reason = finish_reason(calls.calls, reason)
                    final = builder.chunk(None, reason, logprobs=lps.take())
                    final["spec_decode"] = spec_decode(payload.stats, req.drafter or self.scheduler.default_drafter)
                    yield sse(final)
                    if include_usage:
                        yield sse(builder.usage_chunk(usage(len(payload.prompt_ids), len(payload.token_ids), payload.stats.cached_prompt_tokens)))
                    break
                elif kind == "error":  # headers are sent: an error event the OpenAI SDKs raise on
                    yield sse(json.loads(_error_for(payload).body))
                    break
            yield sse("[DONE]")
        finally:
            req.cancel()  # a disconnect cancels this generator; the worker frees the slot

    def _record(self, body, chat: bool, result) -> None:
        if self.traffic is None:
            return
        if chat:
            prompt = [chat_message(i, m) for i, m in enumerate(body.messages)]
        else:
            prompt = body.prompt if isinstance(body.prompt, str) else self.tokenizer.decode(result.prompt_ids)
        drafter = body.drafter or self.scheduler.default_drafter
        meta = {
            "target": self.config.engine.target, "chat": chat, "finish_reason": result.finish_reason,
            "temperature": 1.0 if body.temperature is None else body.temperature, "drafter": drafter,
            "prompt_tokens": len(result.prompt_ids), "completion_tokens": len(result.token_ids),
            "spec_decode": spec_decode(result.stats, drafter),
        }
        if chat and body.tools:  # what the prompt showed, for whoever re-renders it
            meta["tools"] = body.tools
        try:
            self.traffic.record(prompt, result.text, meta)
        except OSError as e:  # a full disk must not fail the request
            log.warning("traffic log write failed: %s", e)


def create_app(config: ServeConfig) -> FastAPI:
    gateway = Gateway(config)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        threading.Thread(target=gateway.load, name="specdec-load", daemon=True).start()
        yield
        if gateway.scheduler is not None:
            await asyncio.to_thread(gateway.scheduler.stop)

    app = FastAPI(title="specdec", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.gateway = gateway

    @app.exception_handler(RequestValidationError)
    async def _on_validation(request: Request, exc: RequestValidationError):
        message, param = validation_error(exc.errors())
        return error_response(400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def _on_http(request: Request, exc: StarletteHTTPException):
        return error_response(exc.status_code, str(exc.detail)[:200], headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _on_error(request: Request, exc: Exception):
        log.exception("unhandled error")
        return error_response(500, f"internal error ({type(exc).__name__})")

    for router in routers():
        app.include_router(router)
    app.add_middleware(BodyLimit, max_bytes=config.max_body_bytes)
    if config.api_key:
        app.add_middleware(ApiKeyAuth, api_key=config.api_key)
    return app
