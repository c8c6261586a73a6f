"""GET /metrics: Prometheus text, metric names after vLLM's (serve/metrics.py)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from specdec.serve.routes import gateway

router = APIRouter()


@router.get("/metrics")
async def metrics(request: Request):
    data, content_type = gateway(request).metrics.render()
    return Response(data, media_type=content_type)
