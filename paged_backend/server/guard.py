"""Raw ASGI guard in front of the app: API key, body size and concurrency limits, answered before parsing.

Pure ASGI (not BaseHTTPMiddleware) so streaming responses and client disconnects pass through untouched.
The key is accepted as OpenAI's `Authorization: Bearer` or Anthropic's `x-api-key`; rejections of Anthropic's
routes (/v1/messages) come in Anthropic's error shape, the rest in OpenAI's.
"""

from __future__ import annotations

import hmac
import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from paged_backend.server.openai_errors import anthropic_error_body, error_bytes, is_anthropic_path

GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages")
# vLLM's sleep routes and our debug routes (the pool map names every request): outside /v1, yet the key's alone
OPERATOR_PATHS = ("/sleep", "/wake_up", "/is_sleeping", "/debug/kv")
UPLOAD_PATHS = ("/v1/files",)  # bodies up to max_file_bytes instead of max_request_body_bytes


class RequestGuard:
    def __init__(
        self,
        app: ASGIApp,
        *,
        api_keys: list[str],
        max_request_body_bytes: int,
        max_concurrent_requests: int | None,
        max_file_bytes: int | None = None,
    ) -> None:
        self.app = app
        self.api_keys = api_keys  # empty: no key needed
        self.max_request_body_bytes = max_request_body_bytes
        self.max_file_bytes = max_file_bytes if max_file_bytes is not None else max_request_body_bytes
        self.max_concurrent_requests = max_concurrent_requests
        self.in_flight = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        keyed = path.startswith("/v1/") or path in OPERATOR_PATHS
        if self.api_keys and keyed and not self._authorized(scope):
            message = "missing or wrong API key; send 'Authorization: Bearer <key>' or 'x-api-key: <key>'"
            return await _reject(send, path, 401, message, "invalid_request_error", "invalid_api_key")
        limit = self.max_file_bytes if path in UPLOAD_PATHS else self.max_request_body_bytes
        # A declared size past the limit is answered at once: waiting for a body that will be refused anyway would
        # hold the request until the client sent it all (or the idle timeout, when it never does)
        body = None if _declared_length(scope) > limit else await self._read_body(receive, limit)
        if body is None:
            message = f"request body is larger than {limit} bytes; send a smaller request"
            return await _reject(send, path, 413, message, "invalid_request_error", "request_too_large")
        replay = _replaying(body, receive)
        if path not in GENERATION_PATHS or self.max_concurrent_requests is None:
            return await self.app(scope, replay, send)
        if self.in_flight >= self.max_concurrent_requests:
            message = f"the server is at its limit of {self.max_concurrent_requests} concurrent requests; retry later"
            return await _reject(send, path, 429, message, "rate_limit_error", "rate_limit_exceeded", retry_after=1)
        self.in_flight += 1
        try:
            await self.app(scope, replay, send)
        finally:
            self.in_flight -= 1

    def _authorized(self, scope: Scope) -> bool:
        headers = dict(scope["headers"])
        bearer, key = headers.get(b"authorization", b""), headers.get(b"x-api-key", b"")
        # every key compared, in constant time each, so the answer's timing does not say which one nearly matched
        matches = [hmac.compare_digest(bearer, f"Bearer {k}".encode()) | hmac.compare_digest(key, k.encode())
                   for k in self.api_keys]  # fmt: skip
        return any(matches)

    async def _read_body(self, receive: Receive, limit: int) -> bytes | None:
        """The whole body, or None as soon as it passes the limit (a chunked body has no declared size)."""
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return b"".join(chunks)  # the client left; the app sees an empty body and the disconnect
            size += len(message.get("body", b""))
            if size > limit:
                return None
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                return b"".join(chunks)


def _declared_length(scope: Scope) -> int:
    """The body's size as its Content-Length header states it (0 when absent; the HTTP server refuses a malformed one)."""
    for name, value in scope["headers"]:
        if name == b"content-length" and value.strip().isdigit():
            return int(value)
    return 0


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


async def _reject(
    send: Send, path: str, status: int, message: str, type_: str, code: str, retry_after: int | None = None
) -> None:
    anthropic = is_anthropic_path(path)
    body = (
        json.dumps(anthropic_error_body(message, status)).encode() if anthropic else error_bytes(message, type_, code)
    )
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if retry_after is not None:  # a busy server: the OpenAI SDK waits this long before its retry
        headers.append((b"retry-after", str(retry_after).encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
