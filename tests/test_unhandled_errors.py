"""A bug's 500 through `AnswerUnhandled`: answered with the face's body, and the exception stops there, so the
server keeps the client's keep-alive connection (Starlette's own last resort re-raises, and the server then drops
it, failing the client's next, valid, request)."""

from __future__ import annotations

import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.testclient import TestClient

from paged_backend.engine.unhandled import AnswerUnhandled


def app_with_bugs() -> FastAPI:
    app = FastAPI()

    @app.get("/broken")
    async def broken():
        raise RuntimeError("a bug")

    @app.get("/broken-mid-stream")
    async def broken_mid_stream():
        async def chunks():
            yield b"first"
            raise RuntimeError("a bug after the answer started")

        return StreamingResponse(chunks())

    async def answer(request, exc):
        return JSONResponse({"error": f"internal: {type(exc).__name__} on {request.url.path}"}, status_code=500)

    app.add_middleware(AnswerUnhandled, answer=answer)
    return app


def test_an_unhandled_error_is_the_faces_500_and_goes_no_further():
    with TestClient(app_with_bugs()) as client:  # raise_server_exceptions: whatever reaches the server fails here
        response = client.get("/broken")
    assert response.status_code == 500
    assert response.json() == {"error": "internal: RuntimeError on /broken"}


def test_an_error_after_the_answer_started_still_reaches_the_server():
    with TestClient(app_with_bugs()) as client, pytest.raises(RuntimeError, match="after the answer started"):
        client.get("/broken-mid-stream")
