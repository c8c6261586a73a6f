"""POST /v1/responses: OpenAI's Responses API, served through the chat path (serve/responses.py)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from pydantic import ValidationError

from specdec.errors import SpecdecError
from specdec.serve.gateway import error_response
from specdec.serve.handlers import complete
from specdec.serve.protocol import not_unicode, unencodable_field, validation_error
from specdec.serve.responses import ResponsesRequest, refused, rename, to_chat
from specdec.serve.responses_out import ResponsesReply
from specdec.serve.routes import gateway

router = APIRouter()


@router.post("/v1/responses")
async def responses(body: ResponsesRequest, request: Request):
    if (param := unencodable_field(body)) is not None:
        return error_response(400, not_unicode(param), param)
    if (problem := refused(body)) is not None:
        return error_response(400, problem[1], problem[0])
    try:
        chat = to_chat(body)
    except SpecdecError as e:
        return error_response(400, e.message, e.param)
    except ValidationError as e:  # a translated message or tool that chat's schema refuses
        message, param = validation_error(e.errors())
        return error_response(400, message, rename(param))
    gw = gateway(request)
    return await complete(gw, chat, request, chat=True, reply=ResponsesReply(body, gw.config.model_name),
                          kind="responses")
