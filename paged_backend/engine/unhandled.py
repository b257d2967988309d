"""A bug's 500 without a dropped connection. Shared by the OpenAI server and the TGI face.

Starlette answers an exception no handler took with a 500 and then re-raises it to the server, which closes the
keep-alive connection: the client's next pooled request, a valid one, fails with a reset. This pure ASGI
middleware, the outermost of an app's own, answers such an exception itself (with the face's body) and keeps
the connection. An exception after the response started cannot be answered and still closes it."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

logger = logging.getLogger("paged_backend.server")


class AnswerUnhandled:
    """`answer(request, exc)` writes the face's 500 (and logs); it runs for any exception before the response
    started."""

    def __init__(self, app: ASGIApp, answer: Callable[[Request, Exception], Awaitable[Response]]) -> None:
        self.app, self.answer = app, answer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def send_tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_tracked)
        except Exception as exc:
            if started:
                raise
            from starlette.requests import Request

            response = await self.answer(Request(scope, receive), exc)
            await response(scope, receive, send)


async def log_and_answer_500(request: Request, exc: Exception, body: dict) -> Response:
    """The plain form of `answer`: the traceback in the log, `body` as JSON."""
    from starlette.responses import JSONResponse

    logger.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return JSONResponse(body, status_code=500)
