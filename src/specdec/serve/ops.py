"""Operations: request ids, JSON access logs, in-flight counting and graceful shutdown.

- `RequestContext` (pure ASGI, so client disconnects still reach the handlers): takes the
  client's `X-Request-Id` (printable ASCII, at most 128 characters) or makes one, returns it
  on the response, counts the /v1 requests in flight, answers 503 to new /v1 requests once
  the server drains, and writes one JSON access-log line per request.
- `AccessLog`: the lines go through a bounded queue to a writer thread (stderr), never
  written on the event loop; a full queue drops lines.
- `DrainingServer`: uvicorn, where SIGTERM drains instead of closing at once: new requests
  get 503 (and /health 503, so a load balancer stops routing here), running ones finish
  within `shutdown_timeout` seconds, then the server exits with status 0. Requests still
  running at the deadline end with a "shutting down" error. A second SIGTERM exits at once.
"""

from __future__ import annotations

import contextlib
import json
import logging
import logging.handlers
import queue
import re
import signal
import sys
import time
import uuid

import uvicorn

from specdec.serve.guards import TENANT
from specdec.serve.protocol import error_body

log = logging.getLogger("specdec.server")
CONTEXT = "specdec.context"  # the scope key of a request's context dict (request id, tenant, tokens)
_REQUEST_ID = re.compile(rb"^[\x21-\x7e]{1,128}$")


class AccessLog:
    """JSON lines on stderr, written by a QueueListener thread."""

    def __init__(self, stream=None, max_pending: int = 10000):
        self.logger = logging.getLogger("specdec.access")
        self.logger.propagate = False
        self.logger.setLevel(logging.INFO)
        handler = logging.StreamHandler(stream or sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        self._queue: queue.Queue = queue.Queue(max_pending)
        self._handler = _DroppingQueueHandler(self._queue)
        self._listener = logging.handlers.QueueListener(self._queue, handler)

    def start(self) -> None:
        self.logger.addHandler(self._handler)
        self._listener.start()

    def stop(self) -> None:
        self.logger.removeHandler(self._handler)
        self._listener.stop()  # writes what is queued

    def write(self, entry: dict) -> None:
        self.logger.info(json.dumps(entry, separators=(",", ":")))


class _DroppingQueueHandler(logging.handlers.QueueHandler):
    def enqueue(self, record) -> None:
        with contextlib.suppress(queue.Full):  # the log is behind: drop the line rather than block a request
            self.queue.put_nowait(record)


class RequestContext:
    """X-Request-Id in and out, /v1 requests in flight, 503 while draining, the access log."""

    def __init__(self, app, gateway, access_log: AccessLog | None = None):
        self.app, self.gateway, self.access_log = app, gateway, access_log

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"x-request-id", b"")
        request_id = given.decode() if _REQUEST_ID.match(given) else uuid.uuid4().hex
        ctx = scope[CONTEXT] = {"request_id": request_id}
        status, started = 500, time.perf_counter()
        counted = scope["path"].startswith("/v1")

        async def send_with_id(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = [*message.get("headers", []), (b"x-request-id", request_id.encode())]
                message = {**message, "headers": headers}
            await send(message)

        if counted and self.gateway.draining and scope["method"] != "OPTIONS":
            body = error_body(503, "the server is shutting down")
            await _send_json(send_with_id, 503, body, {"retry-after": "1", "connection": "close"})
            return self._log(scope, ctx, 503, started)
        self.gateway.in_flight += counted
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            self.gateway.in_flight -= counted
            if ctx.pop("admitted", False):  # the generation slot the handler took (gateway.admit)
                self.gateway.release()
            self._log(scope, ctx, status, started)

    def _log(self, scope, ctx: dict, status: int, started: float) -> None:
        if self.access_log is None:
            return
        entry = {
            "time": round(time.time(), 3), "request_id": ctx["request_id"],
            "tenant": ctx.get("tenant", scope.get(TENANT, "")), "method": scope["method"],
            "route": scope["path"], "status": status, "latency_s": round(time.perf_counter() - started, 4),
            "prompt_tokens": ctx.get("prompt_tokens"), "completion_tokens": ctx.get("completion_tokens"),
        }
        self.access_log.write(entry)


async def _send_json(send, status: int, body: dict, headers: dict) -> None:
    data = json.dumps(body).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    raw += [(k.encode(), v.encode()) for k, v in headers.items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": data})


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose SIGTERM drains the gateway first (see the module docstring)."""

    def __init__(self, config: uvicorn.Config, gateway, shutdown_timeout: float):
        super().__init__(config)
        self.gateway, self.shutdown_timeout = gateway, shutdown_timeout
        self._deadline: float | None = None

    def handle_exit(self, sig: int, frame) -> None:
        if sig != signal.SIGTERM:
            return super().handle_exit(sig, frame)
        # Not recorded in _captured_signals: uvicorn would raise it again after a clean exit.
        if self._deadline is None and not self.should_exit:
            self._deadline = time.monotonic() + self.shutdown_timeout
            self.gateway.draining = True
            log.warning("SIGTERM: draining (%d requests in flight, %gs deadline)", self.gateway.in_flight,
                        self.shutdown_timeout)
        else:
            self.should_exit = True

    async def on_tick(self, counter: int) -> bool:
        if self._deadline is not None and not self.should_exit:
            if self.gateway.in_flight == 0:
                self.should_exit = True
            elif time.monotonic() >= self._deadline:
                log.warning("shutdown deadline: ending %d requests", self.gateway.in_flight)
                await self.gateway.stop_scheduler()
                self.should_exit = True
        return await super().on_tick(counter)
