"""HTTP hardening as pure ASGI middleware (BaseHTTPMiddleware would break the disconnect
detection that cancels generation): a request body size limit and optional bearer keys."""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json

from specdec.serve.protocol import error_body


class _TooLarge(Exception):
    pass


class BodyLimit:
    """413 for bodies over `max_bytes`, by Content-Length or by counting a chunked body."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            return await _send_json(send, 413,
                                    error_body(413, f"the request body exceeds {self.max_bytes} bytes"))
        received, exceeded, started = 0, False, False

        async def limited_receive():
            nonlocal received, exceeded
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    exceeded = True
                    raise _TooLarge
            return message

        async def guarded_send(message):
            nonlocal started
            if exceeded:  # drop whatever the app makes of the interrupted body
                return
            started = started or message["type"] == "http.response.start"
            await send(message)

        with contextlib.suppress(_TooLarge):
            await self.app(scope, limited_receive, guarded_send)
        if exceeded and not started:
            await _send_json(send, 413, error_body(413, f"the request body exceeds {self.max_bytes} bytes"))


TENANT = "specdec.tenant"  # the scope key where ApiKeyAuth leaves the caller's tenant


class ApiKeyAuth:
    """Bearer keys on /v1 (key -> tenant). The sha256 digest of the given key is compared
    with every known digest by hmac.compare_digest, so the time taken does not depend on
    which key matched or how much of one did. The matching key's tenant goes into the scope."""

    def __init__(self, app, api_keys: dict[str, str]):
        self.app = app
        self._digests = [(hashlib.sha256(key.encode()).digest(), tenant) for key, tenant in api_keys.items()]

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith("/v1") or scope["method"] == "OPTIONS":
            return await self.app(scope, receive, send)
        auth = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = auth.partition(b" ")
        given = hashlib.sha256(token.strip()).digest()
        tenant = None
        for digest, name in self._digests:
            if hmac.compare_digest(given, digest):
                tenant = name
        if scheme.lower() != b"bearer" or tenant is None:
            body = error_body(401, "Incorrect or missing API key (send Authorization: Bearer <key>).")
            return await _send_json(send, 401, body, {"www-authenticate": "Bearer"})
        scope[TENANT] = tenant
        return await self.app(scope, receive, send)


async def _send_json(send, status: int, body: dict, headers: dict | None = None) -> None:
    data = json.dumps(body).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    raw += [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": data})
