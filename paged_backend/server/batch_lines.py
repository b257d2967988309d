"""OpenAI's batch line format, and each line run through the server's own routes in process.

An input line is `{"custom_id", "method": "POST", "url", "body"}`; its output line is `{"id", "custom_id",
"response": {"status_code", "request_id", "body"}, "error"}`. The body goes to the route of `url` on the app itself
(httpx's ASGI transport), so a batch answer is the online answer: the same validation, errors and output. A line
that cannot be sent at all (not JSON, no custom_id, an unknown url) gets `response: null` and an `error` instead,
as does a line its batch's completion window ran out on (`batch_expired`). `line_usage` reads the tokens a line's
answer reports, whichever endpoint's names it uses; `usage_object` sums them into OpenAI's batch `usage`.

>>> first, second = parse_lines('{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {}}\\nnope')
>>> first.problem, second.problem
(None, 'line 2 is not valid JSON: Expecting value: line 1 column 1 (char 0)')
"""

from __future__ import annotations

import asyncio
import json
import sys
import uuid
from dataclasses import dataclass
from typing import Any

import httpx
from starlette.types import ASGIApp

from paged_backend.server.request_class import REQUEST_CLASS, RequestClass

BATCH_ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
RETRY_DELAY = 1.0  # seconds before a line the server could not take (503 asleep or draining, 429 busy) is retried


@dataclass
class BatchLine:
    """One request line: `number` counts the file's lines from 1; `problem` says why it cannot be sent."""

    number: int
    custom_id: str | None
    url: str | None
    body: dict[str, Any] | None
    problem: str | None = None


def parse_lines(text: str, endpoint: str | None = None) -> list[BatchLine]:
    """The request lines of a batch file (blank lines skipped). With `endpoint`, every line's url must be it.

    A custom_id may appear once; a later line reusing it gets a problem (results are matched by custom_id).
    """
    lines, seen = [], set()
    for number, raw in enumerate(text.splitlines(), 1):
        if raw.strip():
            line = parse_line(raw, number, endpoint)
            if line.problem is None and line.custom_id in seen:
                line.problem = f"line {number} reuses custom_id {line.custom_id!r}; every line needs its own custom_id"
            seen.add(line.custom_id)
            lines.append(line)
    return lines


def parse_line(raw: str, number: int, endpoint: str | None = None) -> BatchLine:
    try:
        record = json.loads(raw)
    except json.JSONDecodeError as error:
        return BatchLine(number, None, None, None, f"line {number} is not valid JSON: {error}")
    except RecursionError:  # the parser's depth limit: the line's answer, not the whole batch's failure
        return BatchLine(number, None, None, None, f"line {number} is nested too deeply to parse; send a flatter body")
    except ValueError:  # Python's cap on an integer's digits
        problem = f"line {number} holds a number of more than {sys.get_int_max_str_digits()} digits; send a smaller one"
        return BatchLine(number, None, None, None, problem)
    if not isinstance(record, dict):
        return BatchLine(
            number, None, None, None, f"line {number} must be a JSON object with custom_id, method, url, body"
        )
    custom_id, url, body = record.get("custom_id"), record.get("url"), record.get("body")
    line = BatchLine(number, custom_id if isinstance(custom_id, str) else None, url, body)
    line.problem = _problem(record, number, endpoint)
    return line


def _problem(record: dict, number: int, endpoint: str | None) -> str | None:
    custom_id, url, body = record.get("custom_id"), record.get("url"), record.get("body")
    if not isinstance(custom_id, str) or not custom_id:
        return f"line {number} needs a 'custom_id' string (your id for matching the result)"
    if record.get("method") != "POST":
        return f"line {number}: 'method' must be \"POST\""
    if url not in BATCH_ENDPOINTS:
        return f"line {number}: unknown url {url!r}; use one of {', '.join(BATCH_ENDPOINTS)}"
    if endpoint is not None and url != endpoint:
        return f"line {number}: url {url!r} differs from the batch's endpoint {endpoint!r}; one batch, one endpoint"
    if not isinstance(body, dict):
        return f"line {number} needs a 'body' object (the request to {url})"
    if body.get("stream"):
        return f"line {number}: a batch request cannot stream; remove 'stream' from the body"
    if body.get("background"):  # its answer would be an in_progress stub whose result no one can fetch
        return f"line {number}: a batch request runs to its end; remove 'background' from the body"
    return None


def response_line(custom_id: str | None, status_code: int, body: Any) -> dict[str, Any]:
    """The output line of a request the route answered (any status: a 400 is the route's own answer)."""
    response = {"status_code": status_code, "request_id": f"req_{uuid.uuid4().hex}", "body": body}
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": response, "error": None}


def error_line(line: BatchLine) -> dict[str, Any]:
    """The output line of a line that could not be sent."""
    error = {"code": "invalid_request", "message": line.problem, "line": line.number}
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": line.custom_id, "response": None, "error": error}


def expired_line(line: BatchLine) -> dict[str, Any]:
    """The output line of a line that had not finished when its batch's completion window ended."""
    message = "the batch's completion window ended before this request finished; submit it again in a new batch"
    error = {"code": "batch_expired", "message": message, "line": line.number}
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": line.custom_id, "response": None, "error": error}


def is_expired(output: dict[str, Any]) -> bool:
    return output["error"] is not None and output["error"].get("code") == "batch_expired"


USAGE_KEYS = ("input_tokens", "cached_tokens", "output_tokens", "reasoning_tokens")


def line_usage(output: dict[str, Any]) -> dict[str, int]:
    """The tokens one output line's answer reports in its own `usage` (none: zeros). Chat and completions name them
    prompt_tokens / completion_tokens, responses input_tokens / output_tokens."""
    body = (output.get("response") or {}).get("body")
    usage = body.get("usage") if isinstance(body, dict) else None
    if not isinstance(usage, dict):
        return dict.fromkeys(USAGE_KEYS, 0)
    inputs = usage.get("input_tokens", usage.get("prompt_tokens"))
    outputs = usage.get("output_tokens", usage.get("completion_tokens"))
    input_details = usage.get("input_tokens_details") or usage.get("prompt_tokens_details")
    output_details = usage.get("output_tokens_details") or usage.get("completion_tokens_details")
    return {
        "input_tokens": _count(inputs),
        "cached_tokens": _count(_detail(input_details, "cached_tokens")),
        "output_tokens": _count(outputs),
        "reasoning_tokens": _count(_detail(output_details, "reasoning_tokens")),
    }


def add_usage(total: dict[str, int], output: dict[str, Any]) -> dict[str, int]:
    """`total` (USAGE_KEYS, as `line_usage` gives) plus one output line's tokens."""
    line = line_usage(output)
    return {key: total.get(key, 0) + line[key] for key in USAGE_KEYS}


def usage_object(total: dict[str, int]) -> dict[str, Any]:
    """OpenAI's batch `usage` from summed `line_usage` counts."""
    inputs, outputs = total.get("input_tokens", 0), total.get("output_tokens", 0)
    return {"input_tokens": inputs, "input_tokens_details": {"cached_tokens": total.get("cached_tokens", 0)},
            "output_tokens": outputs, "output_tokens_details": {"reasoning_tokens": total.get("reasoning_tokens", 0)},
            "total_tokens": inputs + outputs}  # fmt: skip


def _detail(details: Any, key: str) -> Any:
    return details.get(key) if isinstance(details, dict) else None


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def succeeded(output: dict[str, Any]) -> bool:
    """Whether an output line belongs in the output file (2xx) rather than the error file."""
    return output["response"] is not None and 200 <= output["response"]["status_code"] < 300


class InProcessClient:
    """Sends batch lines to an app's routes in process, with its API key, in a class of service."""

    def __init__(self, app: ASGIApp, api_key: str | None, request_class: RequestClass = "interactive") -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key is not None else {}
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)  # a route's crash is its 500 line
        self._client = httpx.AsyncClient(transport=transport, base_url="http://in-process", headers=headers,
                                         timeout=None)  # fmt: skip
        self.request_class = request_class

    async def run(self, line: BatchLine) -> dict[str, Any]:
        """The output line of `line`, whatever the route answered (see `not_taken`)."""
        if line.problem is not None:
            return error_line(line)
        token = REQUEST_CLASS.set(self.request_class)  # copied into the route's tasks, read by Generation
        try:
            # ASCII JSON, as a client's body arrives: httpx's UTF-8 cannot carry a lone surrogate ("\ud800"), and
            # the route answers that line's 400 itself
            content = json.dumps(line.body).encode()
            response = await self._client.post(line.url, content=content, headers={"Content-Type": "application/json"})
        finally:
            REQUEST_CLASS.reset(token)
        try:
            body = response.json()
        except json.JSONDecodeError:
            body = response.text
        return response_line(line.custom_id, response.status_code, body)

    async def run_until_taken(self, line: BatchLine) -> dict[str, Any]:
        """`run`, again after a pause while the server does not take the line now."""
        while not_taken(output := await self.run(line)):
            await asyncio.sleep(RETRY_DELAY)
        return output

    async def aclose(self) -> None:
        await self._client.aclose()


def not_taken(output: dict[str, Any]) -> bool:
    """Whether the server turned the line away for now (asleep or draining: 503; at --max-concurrent-requests:
    429 rate_limit_exceeded), so that it is no answer to record. A full KV cache's 429 is the request's own answer.
    """
    response = output["response"]
    if response is None or response["status_code"] not in (429, 503):
        return False
    if response["status_code"] == 503:
        return True
    try:
        return response["body"]["error"]["code"] == "rate_limit_exceeded"
    except (KeyError, TypeError):
        return False
