"""OpenAI's Responses API: POST /v1/responses, and GET, DELETE, cancel and input_items on a stored response.

A request is read as the chat conversation it means (responses_conversation.py) and runs through chat's own
pieces (template rendering, tool-call plan, sampling), so its greedy text equals /v1/chat/completions' token for
token. `previous_response_id` prepends the stored conversation (its input items, then its output items), so the
earlier prompt is a prefix of the new one and the prefix cache serves it. `background: true` answers at once with
an in_progress response that GET polls and cancel stops; its run keeps its stream events, which
`GET ?stream=true&starting_after=N` replays and then follows live (as OpenAI and vLLM serve it), and which
`background` with `stream: true` streams from the start.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Path, Query, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import TypeAdapter

from paged_backend.engine.disconnect import cancel_on_disconnect
from paged_backend.server import sse
from paged_backend.server.chat import chat_sampling_params, render_chat_prompt, tool_call_plan
from paged_backend.server.generation import Generation, output_budget
from paged_backend.server.openai_errors import AsciiJSONResponse, engine_error, error_body
from paged_backend.server.openapi_document import EVENT_STREAM, ErrorResponse
from paged_backend.server.responses_conversation import Item, chat_messages, chat_request
from paged_backend.server.responses_events import OutputAssembler
from paged_backend.server.responses_objects import ResponseRecord
from paged_backend.server.responses_schemas import InputItem, MessageItem, ResponsesRequest
from paged_backend.server.responses_store import EventLog, ResponseStore, credential_owner
from paged_backend.server.state import ServerState, server_state
from paged_backend.server.tool_parsers.base import StreamDelta, ToolCallDelta
from paged_backend.server.tool_parsers.choice import ToolCallPlan

router = APIRouter()
_ITEM = TypeAdapter(InputItem)
ResponseId = Annotated[str, Path(min_length=1, max_length=128)]
NOT_FOUND = {
    400: {"model": ErrorResponse, "description": "The id or a query parameter is not valid"},
    404: {"model": ErrorResponse, "description": "No stored response with this id for this API key"},
}


@dataclass
class StoredResponse:
    record: ResponseRecord
    conversation: list[Item]  # the input items it answered, those of previous responses first
    task: asyncio.Task | None = None  # a background response's run
    log: EventLog | None = None  # a background response's stream events


@router.post("/v1/responses")
async def create_response(
    body: ResponsesRequest, request: Request, server: ServerState = Depends(server_state)
) -> Response:
    lora_request = server.check_model(body.model)
    if body.background and not body.store:
        return _bad_request("a background response needs store=true, so it can be fetched", "background")
    store, owner = response_store(request), _owner(request, server)
    history: list[Item] = []
    if body.previous_response_id is not None:
        previous = store.get(owner, body.previous_response_id)
        if previous is None or not previous.record.finished:
            state = "does not exist (or has expired)" if previous is None else "is still in progress"
            return _bad_request(f"previous response {body.previous_response_id!r} {state}", "previous_response_id")
        history = previous.conversation + [_ITEM.validate_python(item) for item in previous.record.output]
    conversation = history + body.items()
    chat_body = chat_request(body, chat_messages(conversation, body.instructions, first_new=len(history)))
    plan = tool_call_plan(server, chat_body)
    prompt = await render_chat_prompt(server, chat_body)
    max_tokens = output_budget(body.max_output_tokens, [len(prompt)], server.max_model_len,
                               server.sampling_defaults.get("max_tokens"))  # fmt: skip
    params = chat_sampling_params(chat_body, plan, max_tokens, server.sampling_defaults)
    generation = Generation(server.async_engine, server.metrics, "resp")
    await cancel_on_disconnect(request, generation.start([prompt], params, body.priority, lora_request))
    stored = StoredResponse(ResponseRecord(body, server.answered_as(body.model)), conversation)
    if body.store:
        store.put(owner, stored.record.id, stored)
    assembler = OutputAssembler(stored.record)
    if body.background:
        stored.log = EventLog()
        stored.task = asyncio.create_task(_run_in_background(_events(generation, assembler, plan), stored.log))
        if body.stream:  # the client may leave; the run goes on, and GET ?stream=true picks it up again
            return StreamingResponse(stored.log.follow(), media_type=sse.MEDIA_TYPE, headers=sse.HEADERS)
        return json_response(stored.record.as_dict())
    if body.stream:
        events = _events(generation, assembler, plan)
        return StreamingResponse(events, media_type=sse.MEDIA_TYPE, headers=sse.HEADERS)
    await cancel_on_disconnect(request, _run_to_end(generation, assembler, plan))
    return json_response(stored.record.as_dict())


@router.get(
    "/v1/responses/{response_id}",
    responses={
        **NOT_FOUND,
        200: {"description": "The response, or with `stream=true` its events", "content": EVENT_STREAM},
    },
)
async def retrieve_response(
    response_id: ResponseId,
    request: Request,
    server: ServerState = Depends(server_state),
    stream: bool = False,
    starting_after: Annotated[int | None, Query(ge=0)] = None,
) -> Response:
    """The stored response; with stream=true a background one's events after `starting_after` (a sequence
    number), then the rest as they come."""
    stored = _find(request, server, response_id)
    if not isinstance(stored, StoredResponse):
        return stored
    if not stream:
        if starting_after is not None:
            return _bad_request("starting_after picks where a stream resumes; add stream=true", "starting_after")
        return json_response(stored.record.as_dict())
    if stored.log is None:
        return _bad_request(f"only a background response can be streamed again; {response_id!r} was not created with "
                            "background=true (GET it without stream)", "stream")  # fmt: skip
    return StreamingResponse(stored.log.follow(starting_after), media_type=sse.MEDIA_TYPE, headers=sse.HEADERS)


@router.delete("/v1/responses/{response_id}", responses=NOT_FOUND)
async def delete_response(
    response_id: ResponseId, request: Request, server: ServerState = Depends(server_state)
) -> Response:
    stored = _find(request, server, response_id)
    if not isinstance(stored, StoredResponse):
        return stored
    if stored.task is not None:
        stored.task.cancel()
    response_store(request).delete(_owner(request, server), response_id)
    return json_response({"id": response_id, "object": "response", "deleted": True})


@router.post(
    "/v1/responses/{response_id}/cancel",
    responses={
        **NOT_FOUND,
        400: {"model": ErrorResponse, "description": "The response is not a running background one"},
    },
)
async def cancel_response(
    response_id: ResponseId, request: Request, server: ServerState = Depends(server_state)
) -> Response:
    stored = _find(request, server, response_id)
    if not isinstance(stored, StoredResponse):
        return stored
    record = stored.record
    if stored.task is None:
        return _bad_request(f"only a background response can be cancelled; {response_id!r} was not created with "
                            "background=true", "response_id")  # fmt: skip
    if record.finished:
        return _bad_request(f"response {response_id!r} is already {record.status}; only one in progress can be "
                            "cancelled", "response_id")  # fmt: skip
    stored.task.cancel()
    await asyncio.gather(stored.task, return_exceptions=True)  # its engine request is aborted before we answer
    return json_response(record.as_dict())


@router.get("/v1/responses/{response_id}/input_items", responses=NOT_FOUND)
async def list_input_items(
    response_id: ResponseId,
    request: Request,
    server: ServerState = Depends(server_state),
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    order: Literal["asc", "desc"] = "desc",
) -> Response:
    stored = _find(request, server, response_id)
    if not isinstance(stored, StoredResponse):
        return stored
    items = [_listed(stored.record.id, position, item) for position, item in enumerate(stored.conversation)]
    items = items if order == "asc" else items[::-1]
    page = items[:limit]
    return json_response({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                         "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit})  # fmt: skip


def response_store(request: Request) -> ResponseStore[StoredResponse]:
    """The app's store, made on first use with the server's bounds."""
    state = request.app.state
    if not hasattr(state, "responses"):
        settings = state.server.settings
        state.responses = ResponseStore(settings.max_stored_responses, settings.stored_response_ttl)
    return state.responses


def _owner(request: Request, server: ServerState) -> str:
    return credential_owner(request.headers, bool(server.settings.api_keys))


def _find(request: Request, server: ServerState, response_id: str) -> StoredResponse | Response:
    stored = response_store(request).get(_owner(request, server), response_id)
    if stored is None:
        message = (
            f"no stored response with id {response_id!r} (it may have expired, been deleted, or belong to another key)"
        )
        return json_response(error_body(message, "invalid_request_error", "response_id", "not_found"), 404)
    return stored


def _bad_request(message: str, param: str) -> Response:
    return json_response(error_body(message, "invalid_request_error", param), 400)


def json_response(content: dict[str, Any], status_code: int = 200) -> Response:
    """JSON in ASCII: request text echoed back (metadata, ids) may hold lone surrogates, which UTF-8 cannot carry."""
    return AsciiJSONResponse(content, status_code)


def _listed(response_id: str, position: int, item: Item) -> dict[str, Any]:
    """An input item as OpenAI lists it: with an id, and a message's content as parts."""
    listed = item.model_dump(exclude_none=True)
    if isinstance(item, MessageItem) and isinstance(item.content, str):
        kind = "output_text" if item.role == "assistant" else "input_text"
        listed["content"] = [{"type": kind, "text": item.content}]
    listed.setdefault("id", f"item_{response_id.removeprefix('resp_')}_{position}")
    listed.setdefault("status", "completed")
    return listed


async def _pieces(generation: Generation, plan: ToolCallPlan) -> AsyncIterator[tuple[StreamDelta, str | None]]:
    """The output as parsed pieces while it grows, with the engine's finish reason on the last."""
    reader = plan.reader()
    async for deltas in generation.deltas():
        for delta in deltas:  # one choice: Responses has no n
            piece = StreamDelta(content=delta.text) if reader is None else reader.feed(delta.text)
            if delta.finish_reason is not None and reader is not None:
                piece += reader.finish()
            yield piece, delta.finish_reason


async def _whole_piece(generation: Generation, plan: ToolCallPlan) -> tuple[StreamDelta, str | None]:
    """The finished output in one piece, its calls read as chat reads a finished output."""
    [choice] = await generation.collect()
    reader = plan.reader()
    if reader is None:
        return StreamDelta(content=choice.text), choice.finish_reason
    extracted = reader.extract(choice.text)
    calls = [
        ToolCallDelta(index, call.arguments, call.id, call.name) for index, call in enumerate(extracted.tool_calls)
    ]
    return StreamDelta(extracted.content or "", calls), choice.finish_reason


def _finish(assembler: OutputAssembler, generation: Generation, finish_reason: str | None) -> list[dict]:
    if finish_reason == "length":
        return assembler.finish("incomplete", generation.usage(), "max_output_tokens")
    if finish_reason == "abort":
        return assembler.fail("server_error", "the request was aborted before it finished")
    return assembler.finish("completed", generation.usage())


async def _run_to_end(generation: Generation, assembler: OutputAssembler, plan: ToolCallPlan) -> None:
    """Run a response that is not streamed; a cancelled one (the client left) is marked so, and an error is the
    request's to answer, as chat would (a 4xx or 5xx)."""
    try:
        piece, finish_reason = await _whole_piece(generation, plan)
    except asyncio.CancelledError:
        assembler.record.status = "cancelled"
        raise
    assembler.feed(piece)
    _finish(assembler, generation, finish_reason)


async def _run_in_background(events: AsyncIterator[bytes], log: EventLog) -> None:
    """A background response's run: streamed into its log, whoever reads it (a cancel marks it cancelled, an
    error fails it, and either way the log ends)."""
    try:
        async for event in events:
            log.append(event)
    finally:
        log.close()


async def _events(generation: Generation, assembler: OutputAssembler, plan: ToolCallPlan) -> AsyncIterator[bytes]:
    for event in assembler.start():
        yield sse.named_event(event)
    finish_reason = None
    try:
        async for piece, reason in _pieces(generation, plan):
            finish_reason = reason or finish_reason
            for event in assembler.feed(piece):
                yield sse.named_event(event)
    except (asyncio.CancelledError, GeneratorExit):  # the client left
        assembler.record.status = "cancelled"
        raise
    except Exception as error:  # after the headers went out, an error ends the stream as a failed response
        _, body = engine_error(error)
        for event in assembler.fail(body["error"]["code"] or "server_error", body["error"]["message"]):
            yield sse.named_event(event)
        return
    for event in _finish(assembler, generation, finish_reason):
        yield sse.named_event(event)
