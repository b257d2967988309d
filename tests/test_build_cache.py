"""First-use builds: built once, renamed into place whole, and a failed build leaves nothing behind."""

from __future__ import annotations

import pytest

from paged_backend.core.build_cache import build_once, cache_root, fingerprint


def test_builds_once_and_reuses(tmp_path):
    calls = []

    def build(path):
        calls.append(path)
        path.mkdir()
        (path / "out.txt").write_text("built")

    target = tmp_path / "entry" / "stubs"
    assert build_once(target, build) == target
    assert build_once(target, build) == target
    assert len(calls) == 1 and (target / "out.txt").read_text() == "built"
    assert calls[0] != target  # built aside, then renamed into place


def test_a_failed_build_leaves_no_entry_and_no_scratch(tmp_path):
    def broken(path):
        path.write_text("half")
        raise RuntimeError("compiler said no")

    target = tmp_path / "lib.so"
    with pytest.raises(RuntimeError, match="compiler said no"):
        build_once(target, broken)
    assert list(tmp_path.iterdir()) == []


def test_cache_root_and_fingerprint(monkeypatch, tmp_path):
    monkeypatch.setenv("PAGED_BACKEND_CACHE", str(tmp_path))
    assert cache_root() == tmp_path
    assert fingerprint(["a", b"b"]) == fingerprint(["a", b"b"]) != fingerprint(["ab"])
