"""One on-disk cache for everything paged-backend compiles on first use (kernels, gRPC stubs), and where
the kernel sources are found (``PAGED_BACKEND_CSRC`` overrides).

Entries live under ``$PAGED_BACKEND_CACHE`` (default ``$XDG_CACHE_HOME/paged_backend``, else
``~/.cache/paged_backend``), keyed by a hash of whatever went into them, so a rebuild happens only when
an input changes. Builds go to a scratch path beside the entry and are renamed into place, so processes
that build at the same time (test workers, server shards) never see a half-written file.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path


def csrc_dir() -> Path:
    if os.environ.get("PAGED_BACKEND_CSRC"):
        return Path(os.environ["PAGED_BACKEND_CSRC"])
    repo = Path(__file__).resolve().parents[2] / "csrc"  # editable install / source checkout
    return repo if repo.is_dir() else Path(__file__).resolve().parents[1] / "_csrc"  # wheel


def cache_root() -> Path:
    base = os.environ.get("PAGED_BACKEND_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "paged_backend"
    )
    return Path(base)


def fingerprint(parts: Iterable[str | bytes]) -> str:
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part.encode() if isinstance(part, str) else part)
        digest.update(b"\0")
    return digest.hexdigest()[:16]


def build_once(target: Path, build: Callable[[Path], object]) -> Path:
    """`target` (a file or a directory), made by `build(scratch_path)` the first time it is asked for."""
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch_dir = Path(tempfile.mkdtemp(dir=target.parent, prefix=".build-"))
    try:
        scratch = scratch_dir / target.name
        build(scratch)
        try:
            os.rename(scratch, target)
        except OSError:  # a directory another process renamed into place first
            if not target.exists():
                raise
    finally:
        shutil.rmtree(scratch_dir, ignore_errors=True)
    return target
