"""Raw ASGI guard in front of the app: API key, body size and concurrency limits, answered before parsing.

Pure ASGI (not BaseHTTPMiddleware) so streaming responses and client disconnects pass through untouched.
"""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from paged_backend.server.openai_errors import error_bytes

GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")


class RequestGuard:
    def __init__(
        self, app: ASGIApp, *, api_key: str | None, max_request_body_bytes: int, max_concurrent_requests: int | None
    ) -> None:
        self.app = app
        self.api_key = api_key
        self.max_request_body_bytes = max_request_body_bytes
        self.max_concurrent_requests = max_concurrent_requests
        self.in_flight = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        if self.api_key is not None and path.startswith("/v1/") and not self._authorized(scope):
            message = "missing or wrong API key; send 'Authorization: Bearer <key>'"
            return await _reject(send, 401, error_bytes(message, "invalid_request_error", "invalid_api_key"))
        body = await self._read_body(receive)
        if body is None:
            message = f"request body is larger than {self.max_request_body_bytes} bytes; send a smaller request"
            return await _reject(send, 413, error_bytes(message, "invalid_request_error", "request_too_large"))
        replay = _replaying(body, receive)
        if path not in GENERATION_PATHS or self.max_concurrent_requests is None:
            return await self.app(scope, replay, send)
        if self.in_flight >= self.max_concurrent_requests:
            message = f"the server is at its limit of {self.max_concurrent_requests} concurrent requests; retry later"
            return await _reject(send, 429, error_bytes(message, "rate_limit_error", "rate_limit_exceeded"))
        self.in_flight += 1
        try:
            await self.app(scope, replay, send)
        finally:
            self.in_flight -= 1

    def _authorized(self, scope: Scope) -> bool:
        headers = dict(scope["headers"])
        expected = f"Bearer {self.api_key}".encode()
        return hmac.compare_digest(headers.get(b"authorization", b""), expected)

    async def _read_body(self, receive: Receive) -> bytes | None:
        """The whole body, or None as soon as it passes the limit (declared or actual size)."""
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return b"".join(chunks)  # the client left; the app sees an empty body and the disconnect
            size += len(message.get("body", b""))
            if size > self.max_request_body_bytes:
                return None
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                return b"".join(chunks)


def _replaying(body: bytes, receive: Receive) -> Receive:
    """A receive that first hands out the buffered body, then the real channel (for the disconnect)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay


async def _reject(send: Send, status: int, body: bytes) -> None:
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
