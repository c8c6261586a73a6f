"""GET /health: 200 once the model is loaded, 503 while it loads or the server drains."""

from __future__ import annotations

from fastapi import APIRouter, Request

from specdec.serve.routes import gateway

router = APIRouter()


@router.get("/health")
async def health(request: Request):
    gw = gateway(request)
    return {"status": "ok"} if gw.ready and not gw.draining else gw.not_ready()
