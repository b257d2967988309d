"""/v1/batches on disk: each batch's record `<dir>/batches/<id>.json`, and its results so far `<id>.results.jsonl`.

A result is appended (and fsync'd) as each line finishes, as `{"line": n, "output": <output line>}`; the record's
request counts and token usage follow. After a restart the results say which lines are done, so a resumed batch
runs only the others and no line is answered twice; the counts and usage are summed again from the results then
(and once more when the batch finishes), so a crash between a result and its record cannot make them drift.
A batch must finish by its `expires` (created + the server's completion window, fixed when it is created).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from paged_backend.server.batch_lines import add_usage, succeeded, usage_object
from paged_backend.server.file_store import write_atomically

ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")  # what the runner still has to finish
COMPLETION_WINDOW = 24 * 3600.0  # seconds of "24h", the one window OpenAI offers (ServerSettings may shorten it)


class BatchNotFound(LookupError):
    """No batch has this id."""


@dataclass
class BatchRecord:
    id: str
    endpoint: str
    input_file_id: str
    completion_window: str
    metadata: dict[str, str] | None
    created: float  # time.time(), exact enough to order the batches of one second
    total: int
    status: str = "validating"
    completed: int = 0
    failed: int = 0
    output_file_id: str | None = None
    error_file_id: str | None = None
    errors: list[dict[str, Any]] | None = None
    times: dict[str, int] = field(default_factory=dict)  # "in_progress" -> in_progress_at, ...
    expires: float | None = None  # time.time() it must finish by; None: a record from before windows were set
    usage: dict[str, int] = field(default_factory=dict)  # batch_lines.USAGE_KEYS summed over the finished lines

    def __post_init__(self) -> None:
        if self.expires is None:
            self.expires = self.created + COMPLETION_WINDOW

    def expired(self) -> bool:
        return time.time() >= self.expires

    def set_status(self, status: str) -> None:
        self.status = status
        self.times[status] = int(time.time())

    def to_object(self) -> dict[str, Any]:
        """OpenAI's batch object."""
        stamps = ("in_progress", "finalizing", "completed", "failed", "expired", "cancelling", "cancelled")
        return {
            "id": self.id, "object": "batch", "endpoint": self.endpoint, "model": None,
            "errors": None if self.errors is None else {"object": "list", "data": self.errors},
            "input_file_id": self.input_file_id, "completion_window": self.completion_window, "status": self.status,
            "output_file_id": self.output_file_id, "error_file_id": self.error_file_id,
            "created_at": int(self.created), "expires_at": int(self.expires),
            **{f"{stamp}_at": self.times.get(stamp) for stamp in stamps},
            "request_counts": {"total": self.total, "completed": self.completed, "failed": self.failed},
            "usage": usage_object(self.usage),
            "metadata": self.metadata,
        }  # fmt: skip


class BatchStore:
    """Every batch of one directory, in memory and on disk; one per app (the routes and the runner share it)."""

    def __init__(self, root: Path) -> None:
        self.directory = root / "batches"
        self.directory.mkdir(parents=True, exist_ok=True)
        self.changed = asyncio.Event()  # set when there is new work (a batch created or cancelled)
        self._batches: dict[str, BatchRecord] = {}
        for path in self.directory.glob("batch_*.json"):
            try:
                record = BatchRecord(**json.loads(path.read_text()))
            except (ValueError, TypeError):
                continue  # not one of ours
            self._batches[record.id] = record

    def create(
        self, endpoint: str, input_file_id: str, metadata: dict[str, str] | None, total: int, window: float
    ) -> BatchRecord:
        """A new batch that must finish within `window` seconds (what its completion_window "24h" means here)."""
        created = time.time()
        record = BatchRecord(f"batch_{uuid.uuid4().hex}", endpoint, input_file_id, "24h", metadata, created, total,
                             expires=created + window)  # fmt: skip
        self.save(record)
        self.changed.set()
        return record

    def get(self, batch_id: str) -> BatchRecord:
        record = self._batches.get(batch_id) if re.fullmatch(r"batch_[0-9a-f]{32}", batch_id) else None
        if record is None:
            raise BatchNotFound(f"no batch with id {batch_id!r}; GET /v1/batches lists the batches")
        return record

    def newest_first(self) -> list[BatchRecord]:
        return sorted(self._batches.values(), key=lambda record: (record.created, record.id), reverse=True)

    def active(self) -> list[BatchRecord]:
        """The batches still to finish, oldest first (the order they run in)."""
        return [record for record in reversed(self.newest_first()) if record.status in ACTIVE]

    def save(self, record: BatchRecord) -> None:
        self._batches[record.id] = record
        write_atomically(self.directory / f"{record.id}.json", json.dumps(asdict(record)).encode())

    def cancel(self, record: BatchRecord) -> None:
        if record.status in ("validating", "in_progress"):
            record.set_status("cancelling")
            self.save(record)
            self.changed.set()

    def add_result(self, record: BatchRecord, line: int, output: dict[str, Any]) -> None:
        """Append one finished line's output (on disk before the counts and usage say so)."""
        self.add_results(record, {line: output})

    def add_results(self, record: BatchRecord, outputs: dict[int, dict[str, Any]]) -> None:
        """Append finished lines' outputs by line number, with one fsync (expiry writes every unfinished line)."""
        with open(self._results(record.id), "a") as out:
            out.write("".join(json.dumps({"line": line, "output": output}) + "\n" for line, output in outputs.items()))
            out.flush()
            os.fsync(out.fileno())
        for output in outputs.values():
            _tally(record, output)
        self.save(record)

    def results(self, record: BatchRecord) -> dict[int, dict[str, Any]]:
        """The finished lines' outputs by line number. A last line cut short by a crash is dropped from the file,
        so the next append starts on a line of its own."""
        path = self._results(record.id)
        if not path.exists():
            return {}
        text = path.read_text()
        if text and not text.endswith("\n"):
            text = text[: text.rfind("\n") + 1]
            write_atomically(path, text.encode())
        finished = {}
        for raw in text.splitlines():
            result = json.loads(raw)
            finished.setdefault(result["line"], result["output"])  # the first answer of a line is its answer
        record.completed, record.failed, record.usage = 0, 0, {}
        for output in finished.values():
            _tally(record, output)
        return finished

    def _results(self, batch_id: str) -> Path:
        return self.directory / f"{batch_id}.results.jsonl"


def _tally(record: BatchRecord, output: dict[str, Any]) -> None:
    """Count one finished line into the record's request counts and token usage."""
    if succeeded(output):
        record.completed += 1
    else:
        record.failed += 1
    record.usage = add_usage(record.usage, output)
