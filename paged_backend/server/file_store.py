"""/v1/files on disk: each file is `<dir>/files/<id>.data` beside its record `<id>.json`, so they survive a restart.

Writes go to a temporary name first and are renamed into place: a crash leaves the old state or the new one,
never half a file.

>>> store = FileStore(Path(tempfile.mkdtemp()))                       # doctest: +SKIP
>>> record = store.create("requests.jsonl", "batch", b"...")           # doctest: +SKIP
>>> store.content(record.id)                                          # doctest: +SKIP
b'...'
"""

from __future__ import annotations

import json
import os
import re
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

DEFAULT_FILES_DIR = "~/.cache/paged_backend/files"


class FileNotFound(LookupError):
    """No file has this id (never uploaded, or deleted)."""


@dataclass
class FileRecord:
    id: str
    bytes: int
    created: float  # time.time(), exact enough to order the files of one second
    filename: str
    purpose: str

    def to_object(self) -> dict[str, Any]:
        """OpenAI's file object."""
        return {"id": self.id, "object": "file", "bytes": self.bytes, "created_at": int(self.created),
                "filename": self.filename, "purpose": self.purpose, "status": "processed", "expires_at": None,
                "status_details": None}  # fmt: skip


def files_dir(configured: str | None) -> Path:
    """The directory of /v1/files and /v1/batches: ServerSettings.files_dir, or the default under ~/.cache."""
    return Path(os.path.expanduser(configured or DEFAULT_FILES_DIR))


def write_atomically(path: Path, data: bytes) -> None:
    """`data` at `path`, on disk (fsync) before it replaces what was there."""
    temporary = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    with open(temporary, "wb") as out:
        out.write(data)
        out.flush()
        os.fsync(out.fileno())
    os.replace(temporary, path)


class FileStore:
    def __init__(self, root: Path) -> None:
        self.directory = root / "files"

    def create(self, filename: str, purpose: str, content: bytes, file_id: str | None = None) -> FileRecord:
        """Store `content`; `file_id` names it (a batch's output file keeps one id however often it is written)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        record = FileRecord(file_id or f"file-{uuid.uuid4().hex}", len(content), time.time(), filename, purpose)
        write_atomically(self._data(record.id), content)
        write_atomically(self._record(record.id), json.dumps(asdict(record)).encode())
        return record

    def get(self, file_id: str) -> FileRecord:
        try:
            return FileRecord(**json.loads(self._record(file_id).read_text()))
        except (FileNotFoundError, ValueError, TypeError):
            raise FileNotFound(f"no file with id {file_id!r}; GET /v1/files lists the files") from None

    def content(self, file_id: str) -> bytes:
        self.get(file_id)
        return self._data(file_id).read_bytes()

    def list(self, purpose: str | None = None) -> list[FileRecord]:
        """Every file (with `purpose`, only those), oldest first."""
        records = []
        for path in self.directory.glob("file-*.json"):
            try:
                record = self.get(path.stem)
            except FileNotFound:
                continue  # deleted while listing
            if purpose is None or record.purpose == purpose:
                records.append(record)
        return sorted(records, key=lambda record: (record.created, record.id))

    def delete(self, file_id: str) -> None:
        self.get(file_id)
        self._record(file_id).unlink(missing_ok=True)  # the record first: a half-deleted file is gone
        self._data(file_id).unlink(missing_ok=True)

    def _record(self, file_id: str) -> Path:
        return self.directory / f"{_safe(file_id)}.json"

    def _data(self, file_id: str) -> Path:
        return self.directory / f"{_safe(file_id)}.data"


def _safe(file_id: str) -> str:
    """An id as a file name; an id that is not one of ours (a path, a dot) can name no file."""
    if not re.fullmatch(r"file-[A-Za-z0-9-]{1,100}", file_id):
        raise FileNotFound(f"no file with id {file_id!r}; GET /v1/files lists the files")
    return file_id
