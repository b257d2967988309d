"""Runs the online batches in the background, one batch at a time, a bounded number of lines at once.

Each line goes through the app's own route in process in the "batch" class of service, which the scheduler runs
only on capacity live traffic leaves over. Results are stored as lines finish; on start-up the runner resumes
the batches a stop interrupted, running only their unfinished lines. A line the server does not take now
(asleep: 503) is retried, never recorded; when a shutdown starts draining the engine, the running lines are aborted
rather than waited for. So a restart midway redoes nothing and loses nothing.

A batch still running at its `expires` stops as a cancelled one does, but its unfinished lines are recorded as
`batch_expired` error lines and it ends "expired" (whether it expired is read back from those results, so a
crash while finalizing cannot turn it into "completed"). Lines go to `app.state.batch_front` when set (a
multi-model server's router, see `send_lines_through`), else to the app itself: wherever an online request enters.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import logging
from collections.abc import Iterable
from pathlib import Path
from typing import IO

from fastapi import FastAPI
from starlette.types import ASGIApp

from paged_backend.server.batch_lines import (
    BatchLine,
    InProcessClient,
    expired_line,
    is_expired,
    parse_lines,
    succeeded,
)
from paged_backend.server.batch_store import BatchRecord, BatchStore
from paged_backend.server.file_store import FileNotFound, FileStore, files_dir

logger = logging.getLogger(__name__)
BATCH_CONCURRENCY = 32  # lines of a batch in the engine at once: enough to batch, few enough to leave room
POLL = 0.1  # seconds between looks at a running batch's status and at the engine's


def file_store_of(app: FastAPI) -> FileStore:
    return FileStore(files_dir(app.state.server.settings.files_dir))


def batch_store_of(app: FastAPI) -> BatchStore:
    """The app's one batch store, made on first use (the routes and the runner share it)."""
    store = getattr(app.state, "batch_store", None)
    if store is None:
        store = app.state.batch_store = BatchStore(files_dir(app.state.server.settings.files_dir))
    return store


def send_lines_through(front: ASGIApp, apps: Iterable[FastAPI]) -> None:
    """Send the batch lines of `apps` to `front`, the ASGI app online requests enter (a multi-model server's
    router), so that each line runs on the model its body names, or gets the 404 an online request would. The
    first app alone runs them: the others' runners lost the directory's lock and warned of "another server"."""
    for index, app in enumerate(apps):
        app.state.batch_front, app.state.runs_batches = front, index == 0


class BatchRunner:
    def __init__(self, app: FastAPI) -> None:
        self.store, self.files = batch_store_of(app), file_store_of(app)
        self.async_engine = app.state.server.async_engine
        keys = app.state.server.settings.api_keys
        front = getattr(app.state, "batch_front", app)
        self.client = InProcessClient(front, keys[0] if keys else None, request_class="batch")

    def start(self) -> None:
        self._lock = _lock_directory(self.store.directory)
        if self._lock is None:
            logger.warning(
                "another server runs the batches of %s; this one only answers /v1/batches", self.store.directory
            )
            return
        self._task = asyncio.create_task(self._run_forever())
        self._watcher = asyncio.create_task(self._stop_when_draining())

    async def stop(self) -> None:
        """Stop at once; lines still running are aborted, not recorded, and run again after the next start."""
        if self._lock is not None:
            for task in (self._watcher, self._task):
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
            self._lock.close()  # releases the lock
        await self.client.aclose()

    async def _stop_when_draining(self) -> None:
        """A shutdown drains the engine before the app stops: abort the batch lines then, so they do not hold up
        the drain (they resume on the next start)."""
        while self.async_engine.accepting:
            await asyncio.sleep(POLL)
        self._task.cancel()

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
        """Run `record`'s unfinished lines (unless it is being cancelled or has expired), then write its output
        files."""
        try:
            text = self.files.content(record.input_file_id).decode("utf-8-sig", errors="replace")  # as batches.py reads it
        except FileNotFound:
            return self._fail(record, "file_not_found", f"the input file {record.input_file_id} was deleted")
        lines = parse_lines(text, record.endpoint)
        finished = self.store.results(record)  # counts and usage summed again from what is on disk
        if record.status == "validating":
            record.set_status("in_progress")
        self.store.save(record)
        if record.status == "in_progress":
            await self._run_lines(record, [line for line in lines if line.number not in finished])
        if record.status == "in_progress" and record.expired():
            self._expire_unfinished(record, lines)
        self._finalize(record, lines)

    def _expire_unfinished(self, record: BatchRecord, lines: list[BatchLine]) -> None:
        """Record every line without a result as a batch_expired error line (on disk, so a restart sees them)."""
        finished = self.store.results(record)
        unfinished = {line.number: expired_line(line) for line in lines if line.number not in finished}
        if unfinished:
            self.store.add_results(record, unfinished)

    async def _run_lines(self, record: BatchRecord, lines: list[BatchLine]) -> None:
        slots = asyncio.Semaphore(BATCH_CONCURRENCY)
        running: set[asyncio.Task] = set()

        async def run_line(line: BatchLine) -> None:
            try:
                self.store.add_result(record, line.number, await self.client.run_until_taken(line))
            finally:
                slots.release()

        watcher = asyncio.create_task(_abort_when_stopped(record, running))
        try:
            async with asyncio.TaskGroup() as lines_running:
                for line in lines:
                    await slots.acquire()
                    if _stopped(record):
                        break
                    task = lines_running.create_task(run_line(line))
                    running.add(task)
                    task.add_done_callback(running.discard)
        finally:
            watcher.cancel()

    def _finalize(self, record: BatchRecord, lines: list[BatchLine]) -> None:
        """Outputs in input order: 2xx answers to the output file, the rest (expired lines too) to the error file."""
        cancelled = record.status == "cancelling"
        finished = self.store.results(record)
        outputs = [finished[line.number] for line in lines if line.number in finished]
        expired = not cancelled and any(is_expired(output) for output in outputs)
        if not cancelled and not expired:
            record.set_status("finalizing")
            self.store.save(record)
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
        record.set_status("cancelled" if cancelled else "expired" if expired else "completed")
        self.store.save(record)

    def _fail(self, record: BatchRecord, code: str, message: str) -> None:
        record.errors = [{"code": code, "message": message, "param": None, "line": None}]
        record.set_status("failed")
        self.store.save(record)


def _lock_directory(directory: Path) -> IO | None:
    """An exclusive lock on the batches of `directory` (None: another runner holds it), so that two servers on one
    --files-dir (or the per-model apps of one) never run a line twice."""
    lock = open(directory / ".runner.lock", "w")  # noqa: SIM115 (held open for the runner's life)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        return None
    return lock


def _stopped(record: BatchRecord) -> bool:
    """Whether no more lines of the batch may run: it is being cancelled, or its completion window has ended."""
    return record.status != "in_progress" or record.expired()


async def _abort_when_stopped(record: BatchRecord, running: set[asyncio.Task]) -> None:
    """Once the batch is being cancelled or has expired, abort its running lines (they are not recorded; an
    expired batch records them as expired afterwards)."""
    while not _stopped(record):
        await asyncio.sleep(POLL)
    for task in list(running):
        task.cancel()
