"""GET /v1/models: the one model this server serves."""

from __future__ import annotations

from fastapi import APIRouter, Request

from specdec.serve.routes import gateway

router = APIRouter()


@router.get("/v1/models")
async def models(request: Request):
    gw = gateway(request)
    card = {"id": gw.config.model_name, "object": "model", "created": gw.created, "owned_by": "specdec",
            "max_model_len": gw.max_length}
    return {"object": "list", "data": [card]}
