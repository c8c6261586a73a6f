"""The OpenAI-compatible HTTP gateway: FastAPI routes over the continuous-batching scheduler.

Routes (one module each in serve/routes/): POST /v1/chat/completions, POST /v1/completions,
POST /v1/responses (the Responses API, translated to chat: responses.py),
GET /v1/models, GET /health (503 while the model loads or the server drains), GET /metrics
(Prometheus), GET /version.

Modules: gateway.py (loading, admission, request building), handlers.py (a request from
admission to its reply or stream), tokenize.py (tokenization in a thread pool), tenants.py
(API keys to tenants), guards.py (body limit, bearer keys), ops.py (request ids, access log,
draining on SIGTERM), protocol.py (schemas, errors, response objects), metrics.py.

Hardening: 127.0.0.1 by default, bearer keys compared in constant time (guarding /v1 only,
like vLLM), OpenAI-shaped errors for every malformed input (never FastAPI's 422, never a
500), a body size limit, bounded admission (429 + Retry-After, before any tokenization), a
per-request timeout, client disconnects that cancel generation and free the request's cache
slot, optional CORS, and a drain on SIGTERM.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from starlette.exceptions import HTTPException as StarletteHTTPException

from specdec import __version__
from specdec.serve.gateway import Gateway, error_response
from specdec.serve.guards import ApiKeyAuth, BodyLimit
from specdec.serve.ops import AccessLog, DrainingServer, RequestContext
from specdec.serve.protocol import validation_error
from specdec.serve.routes import routers
from specdec.serve.settings import ServeConfig

log = logging.getLogger("specdec.server")
__all__ = ["DrainingServer", "ServeConfig", "create_app"]  # DrainingServer: for serve/cli.py


def create_app(config: ServeConfig) -> FastAPI:
    gateway = Gateway(config)
    access_log = AccessLog() if config.access_log == "json" else None

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        if access_log is not None:
            access_log.start()
        threading.Thread(target=gateway.load, name="specdec-load", daemon=True).start()
        yield
        await gateway.stop_scheduler()
        await asyncio.to_thread(gateway.close)
        if access_log is not None:
            access_log.stop()

    app = FastAPI(title="specdec", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None)
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
    # The last added runs first: CORS (so refusals carry its headers too), request context, keys, size.
    app.add_middleware(BodyLimit, max_bytes=config.max_body_bytes)
    if keys := config.keys():
        app.add_middleware(ApiKeyAuth, api_keys=keys)
    app.add_middleware(RequestContext, gateway=gateway, access_log=access_log)
    if config.allowed_origins:
        app.add_middleware(
            CORSMiddleware, allow_origins=config.allowed_origins, allow_methods=["GET", "POST", "OPTIONS"],
            allow_headers=["authorization", "content-type", "x-request-id"], expose_headers=["x-request-id"],
            allow_credentials="*" not in config.allowed_origins,
        )
    return app
