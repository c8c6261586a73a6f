"""GET /version: the server's version, as vLLM's /version answers."""

from __future__ import annotations

from fastapi import APIRouter

from specdec import __version__

router = APIRouter()


@router.get("/version")
async def version():
    return {"version": __version__}
