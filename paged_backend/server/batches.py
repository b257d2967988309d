"""/v1/batches: create a batch over an uploaded file, retrieve, list and cancel it, with OpenAI's batch objects.

Creating checks the request and the file; the lines themselves are checked as they run, so a malformed line
becomes an error line in the batch's error file while every other line still runs (batch_runner). The one
completion_window OpenAI offers, "24h", gives the batch --batch-completion-window seconds (24 h unless set) to
finish before it expires.
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse
from pydantic import Field, StringConstraints

from paged_backend.server.batch_lines import BATCH_ENDPOINTS, parse_lines
from paged_backend.server.batch_runner import batch_store_of, file_store_of
from paged_backend.server.batch_store import BatchNotFound
from paged_backend.server.file_store import FileNotFound
from paged_backend.server.files import NOT_FOUND, QUERY_ERROR, not_found, page
from paged_backend.server.openai_errors import error_response
from paged_backend.server.openapi_document import ErrorResponse
from paged_backend.server.schemas import _Request

router = APIRouter()
FINISHED = {400: {"model": ErrorResponse, "description": "The batch has finished already"}}

MetadataKey = Annotated[str, StringConstraints(max_length=64)]
MetadataValue = Annotated[str, StringConstraints(max_length=512)]


class BatchCreateRequest(_Request):
    input_file_id: str
    endpoint: Literal[BATCH_ENDPOINTS]
    completion_window: Literal["24h"]
    metadata: Annotated[dict[MetadataKey, MetadataValue] | None, Field(max_length=16)] = None
    output_expires_after: dict | None = None  # accepted; outputs are kept until deleted


@router.post("/v1/batches")
async def create_batch(body: BatchCreateRequest, request: Request) -> JSONResponse:
    """Queue a batch of the file's lines (OpenAI's batch object back, status "validating")."""
    files = file_store_of(request.app)
    try:
        input_file = files.get(body.input_file_id)
        text = (await asyncio.to_thread(files.content, body.input_file_id)).decode("utf-8-sig", errors="replace")  # a BOM: saved on Windows
    except FileNotFound as error:
        return not_found(error, "input_file_id")
    if input_file.purpose != "batch":
        message = f"file {body.input_file_id} has purpose {input_file.purpose!r}; upload the input with purpose 'batch'"
        return error_response(400, message, "invalid_request_error", "input_file_id")
    total = len(parse_lines(text, body.endpoint))
    if total == 0:
        message = f"file {body.input_file_id} has no request lines; upload a JSONL file with one request per line"
        return error_response(400, message, "invalid_request_error", "input_file_id")
    window = request.app.state.server.settings.batch_completion_window
    record = batch_store_of(request.app).create(body.endpoint, body.input_file_id, body.metadata, total, window)
    return JSONResponse(record.to_object())


@router.get("/v1/batches", responses=QUERY_ERROR)
async def list_batches(
    request: Request, limit: Annotated[int, Query(ge=1, le=100)] = 20, after: str | None = None
) -> JSONResponse:
    """The batches, newest first, `limit` at a time after the batch `after`."""
    objects = [record.to_object() for record in batch_store_of(request.app).newest_first()]
    return JSONResponse(page(objects, limit, after))


@router.get("/v1/batches/{batch_id}", responses=NOT_FOUND)
async def retrieve_batch(batch_id: str, request: Request) -> JSONResponse:
    try:
        return JSONResponse(batch_store_of(request.app).get(batch_id).to_object())
    except BatchNotFound as error:
        return not_found(error, "batch_id")


@router.post("/v1/batches/{batch_id}/cancel", responses={**FINISHED, **NOT_FOUND})
async def cancel_batch(batch_id: str, request: Request) -> JSONResponse:
    """Stop the batch: lines still running are aborted, and it ends "cancelled" with the outputs it has."""
    store = batch_store_of(request.app)
    try:
        record = store.get(batch_id)
    except BatchNotFound as error:
        return not_found(error, "batch_id")
    if record.status not in ("validating", "in_progress", "cancelling"):
        message = (
            f"batch {batch_id} is already {record.status}; only a validating or in_progress batch can be cancelled"
        )
        return error_response(400, message, "invalid_request_error", "batch_id")
    store.cancel(record)
    return JSONResponse(record.to_object())
