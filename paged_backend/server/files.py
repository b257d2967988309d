"""/v1/files: upload a batch input file (multipart, purpose "batch"), list, retrieve, read its content, delete.

Files are kept on disk under --files-dir (file_store), so they survive a restart; the request guard limits an
upload to --max-file-bytes (413).
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Literal

from fastapi import APIRouter, File, Form, Query, Request, UploadFile
from fastapi.responses import JSONResponse, Response

from paged_backend.server.batch_runner import file_store_of
from paged_backend.server.file_store import FileNotFound
from paged_backend.server.openai_errors import error_response
from paged_backend.server.openapi_document import ErrorResponse

router = APIRouter()
QUERY_ERROR = {400: {"model": ErrorResponse, "description": "A query parameter is out of range"}}
NOT_FOUND = {404: {"model": ErrorResponse, "description": "No file (or batch) has this id"}}


def not_found(error: LookupError, param: str) -> JSONResponse:
    return error_response(404, str(error), "invalid_request_error", param, "not_found")


def page(objects: list[dict], limit: int, after: str | None) -> dict:
    """OpenAI's list object: up to `limit` objects following the one with id `after` (none found: an empty page)."""
    if after is not None:
        ids = [each["id"] for each in objects]
        objects = objects[ids.index(after) + 1 :] if after in ids else []
    data = objects[:limit]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": len(objects) > limit}  # fmt: skip


@router.post("/v1/files")
async def upload_file(
    request: Request,
    file: Annotated[UploadFile, File(description="the JSONL batch input file")],
    purpose: Annotated[Literal["batch"], Form(description='"batch": the input of POST /v1/batches')],
) -> JSONResponse:
    """Upload a file (OpenAI's file object back)."""
    content = await file.read()
    record = await asyncio.to_thread(
        file_store_of(request.app).create, file.filename or "upload.jsonl", purpose, content
    )
    return JSONResponse(record.to_object())


@router.get("/v1/files", responses=QUERY_ERROR)
async def list_files(
    request: Request,
    purpose: str | None = None,
    limit: Annotated[int, Query(ge=1, le=10000)] = 10000,
    after: str | None = None,
    order: Literal["asc", "desc"] = "desc",
) -> JSONResponse:
    """The files, newest first (order=asc: oldest first), `limit` at a time after the file `after`."""
    records = file_store_of(request.app).list(purpose)
    objects = [record.to_object() for record in (reversed(records) if order == "desc" else records)]
    return JSONResponse(page(objects, limit, after))


@router.get("/v1/files/{file_id}", responses=NOT_FOUND)
async def retrieve_file(file_id: str, request: Request) -> JSONResponse:
    try:
        return JSONResponse(file_store_of(request.app).get(file_id).to_object())
    except FileNotFound as error:
        return not_found(error, "file_id")


@router.get(
    "/v1/files/{file_id}/content",
    response_class=Response,
    responses={200: {"content": {"application/octet-stream": {}}, "description": "The file's bytes"}, **NOT_FOUND},
)
async def file_content(file_id: str, request: Request) -> Response:
    try:
        content = await asyncio.to_thread(file_store_of(request.app).content, file_id)
    except FileNotFound as error:
        return not_found(error, "file_id")
    return Response(content, media_type="application/octet-stream")


@router.delete("/v1/files/{file_id}", responses=NOT_FOUND)
async def delete_file(file_id: str, request: Request) -> JSONResponse:
    try:
        file_store_of(request.app).delete(file_id)
    except FileNotFound as error:
        return not_found(error, "file_id")
    return JSONResponse({"id": file_id, "object": "file", "deleted": True})
