"""POST /v1/chat/completions and /v1/completions: OpenAI's text generation endpoints."""

from __future__ import annotations

from fastapi import APIRouter, Request

from specdec.serve.handlers import complete
from specdec.serve.protocol import ChatCompletionRequest, CompletionRequest
from specdec.serve.routes import gateway

router = APIRouter()


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    return await complete(gateway(request), body, request, chat=True)


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    return await complete(gateway(request), body, request, chat=False)
