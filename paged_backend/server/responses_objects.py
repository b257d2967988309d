"""The Response object: its id, status, output items and usage, with the request fields OpenAI echoes back.

Statuses: in_progress while it runs (and `queued` never: a background response starts at once), completed,
incomplete (with `incomplete_details.reason` "max_output_tokens" when the budget ran out), failed (with `error`)
and cancelled.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from paged_backend.server.generation import Usage
from paged_backend.server.responses_schemas import ResponsesRequest

FINISHED = ("completed", "incomplete", "failed", "cancelled")


def new_id(prefix: str) -> str:
    """OpenAI's id shape: `resp_...`, `msg_...`, `fc_...`, `call_...`."""
    return f"{prefix}_{uuid.uuid4().hex}"


def responses_usage(usage: Usage) -> dict[str, Any]:
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


def _echoed_tool_choice(body: ResponsesRequest) -> str | dict[str, Any]:
    if body.tool_choice is None:
        return "auto" if body.tools else "none"
    return body.tool_choice if isinstance(body.tool_choice, str) else body.tool_choice.model_dump()


@dataclass
class ResponseRecord:
    """One response as it runs and after; `as_dict` is the object the API returns."""

    body: ResponsesRequest
    model: str
    id: str = field(default_factory=lambda: new_id("resp"))
    created_at: int = field(default_factory=lambda: int(time.time()))
    status: str = "in_progress"
    output: list[dict[str, Any]] = field(default_factory=list)
    usage: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    incomplete_reason: str | None = None
    completed_at: int | None = None

    @property
    def finished(self) -> bool:
        return self.status in FINISHED

    def finish(self, status: str, usage: Usage | None = None, incomplete_reason: str | None = None) -> None:
        self.status, self.incomplete_reason = status, incomplete_reason
        if usage is not None:
            self.usage = responses_usage(usage)
        if status == "completed":
            self.completed_at = int(time.time())

    def fail(self, code: str, message: str) -> None:
        self.status, self.error = "failed", {"code": code, "message": message}

    def as_dict(self) -> dict[str, Any]:
        body = self.body
        text_format = body.text.format if body.text is not None and body.text.format is not None else None
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": self.status,
            "completed_at": self.completed_at,
            "error": self.error,
            "incomplete_details": None if self.incomplete_reason is None else {"reason": self.incomplete_reason},
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "model": self.model,
            "output": self.output,
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id,
            "reasoning": {"effort": None, "summary": None},
            "store": body.store,
            "background": bool(body.background),
            "temperature": 1.0 if body.temperature is None else body.temperature,
            "top_p": 1.0 if body.top_p is None else body.top_p,
            "text": {
                "format": text_format.model_dump(by_alias=True, exclude_none=True) if text_format else {"type": "text"}
            },
            "tool_choice": _echoed_tool_choice(body),
            "tools": [tool.model_dump(exclude_none=True) for tool in body.tools or []],
            "truncation": body.truncation or "disabled",
            "usage": self.usage,
            "user": body.user,
            "metadata": body.metadata or {},
        }
