"""The HTTP endpoints: one module each, holding a FastAPI `router`.

Adding an endpoint is one module here with `router = APIRouter()` and its routes, plus its
name in `ROUTE_MODULES`. A route reaches the model through `gateway(request)`, the app's one
`Gateway` (serve/gateway.py); errors it raises as `SpecdecError` become OpenAI-shaped 400s.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator

from fastapi import APIRouter, Request

ROUTE_MODULES = ("completions", "responses", "models", "health", "metrics", "version")


def routers() -> Iterator[APIRouter]:
    for module in ROUTE_MODULES:
        yield importlib.import_module(f"{__name__}.{module}").router


def gateway(request: Request):
    """The app's Gateway (set by create_app)."""
    return request.app.state.gateway
