"""Runs the online batches in the background, one batch at a time, a bounded number of lines at once.

Each line goes through the app's own route in process in the "batch" class of service, which the scheduler runs
only on capacity live traffic leaves over. Results are stored as lines finish; on start-up the runner resumes
the batches a stop interrupted, running only their unfinished lines. A line the server does not take now
(asleep, draining: 503) is retried, never recorded, so a restart midway redoes nothing and loses nothing.
"""

from __future__ import annotations

import asyncio
import json
import logging

from fastapi import FastAPI

from paged_backend.server.batch_lines import BatchLine, InProcessClient, parse_lines, succeeded
from paged_backend.server.batch_store import BatchRecord, BatchStore
from paged_backend.server.file_store import FileNotFound, FileStore, files_dir

logger = logging.getLogger(__name__)
BATCH_CONCURRENCY = 32  # lines of a batch in the engine at once: enough to batch, few enough to leave room


def file_store_of(app: FastAPI) -> FileStore:
    return FileStore(files_dir(app.state.server.settings.files_dir))


def batch_store_of(app: FastAPI) -> BatchStore:
    """The app's one batch store, made on first use (the routes and the runner share it)."""
    store = getattr(app.state, "batch_store", None)
    if store is None:
        store = app.state.batch_store = BatchStore(files_dir(app.state.server.settings.files_dir))
    return store


class BatchRunner:
    def __init__(self, app: FastAPI) -> None:
        self.store, self.files = batch_store_of(app), file_store_of(app)
        self.client = InProcessClient(app, app.state.server.settings.api_key, request_class="batch")
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run_forever())

    async def stop(self) -> None:
        """Stop at once; lines still running are dropped, not recorded, and run again after the next start."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self.client.aclose()

    async def _run_forever(self) -> None:
        while True:
            self.store.changed.clear()
            for record in self.store.active():
                try:
                    await self.run(record)
                except Exception as error:  # a bug must not stop the other batches
                    logger.exception("batch %s failed", record.id)
                    self._fail(record, "internal_error", f"the batch stopped on an internal error: {error}")
            if not self.store.active():
                await self.store.changed.wait()

    async def run(self, record: BatchRecord) -> None:
        """Run `record`'s unfinished lines (unless it is being cancelled), then write its output files."""
        try:
            text = self.files.content(record.input_file_id).decode("utf-8", errors="replace")
        except FileNotFound:
            return self._fail(record, "file_not_found", f"the input file {record.input_file_id} was deleted")
        lines = parse_lines(text, record.endpoint)
        finished = self.store.results(record)
        if record.status == "validating":
            record.set_status("in_progress")
            self.store.save(record)
        if record.status == "in_progress":
            await self._run_lines(record, [line for line in lines if line.number not in finished])
        self._finalize(record, lines)

    async def _run_lines(self, record: BatchRecord, lines: list[BatchLine]) -> None:
        slots = asyncio.Semaphore(BATCH_CONCURRENCY)

        async def run_line(line: BatchLine) -> None:
            try:
                self.store.add_result(record, line.number, await self.client.run_until_taken(line))
            finally:
                slots.release()

        async with asyncio.TaskGroup() as lines_running:
            for line in lines:
                await slots.acquire()
                if record.status != "in_progress":  # cancelled: the lines already running finish
                    break
                lines_running.create_task(run_line(line))

    def _finalize(self, record: BatchRecord, lines: list[BatchLine]) -> None:
        """Outputs in input order: 2xx answers to the output file, the rest to the error file."""
        cancelled = record.status == "cancelling"
        if not cancelled:
            record.set_status("finalizing")
            self.store.save(record)
        finished = self.store.results(record)
        outputs = [finished[line.number] for line in lines if line.number in finished]
        hex_id = record.id.removeprefix("batch_")
        for kind, chosen in (
            ("output", [o for o in outputs if succeeded(o)]),
            ("error", [o for o in outputs if not succeeded(o)]),
        ):
            if chosen:
                content = "".join(json.dumps(output) + "\n" for output in chosen).encode()
                # one id per batch and kind: finalizing again after a crash replaces the file, never adds one
                stored = self.files.create(
                    f"{record.id}_{kind}.jsonl", "batch_output", content, f"file-{hex_id}-{kind}"
                )
                setattr(record, f"{kind}_file_id", stored.id)
        record.set_status("cancelled" if cancelled else "completed")
        self.store.save(record)

    def _fail(self, record: BatchRecord, code: str, message: str) -> None:
        record.errors = [{"code": code, "message": message, "param": None, "line": None}]
        record.set_status("failed")
        self.store.save(record)
