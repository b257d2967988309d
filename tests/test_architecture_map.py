"""docs/architecture.md names files; each one it names exists (a moved module must take its map along)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# a path with a folder, or a source file by name: `engine/engine.py`, `kv_groups.py`, `csrc/cpu/...cpp`
PATH = re.compile(r"(?<![\w/.:-])((?:[\w.-]+/)*[\w.-]+\.(?:py|cu|cuh|cpp|h|md|toml|yaml|json|sh))\b")


def repository_files() -> list[str]:
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True
    )
    return listed.stdout.split()


def named_paths(text: str) -> set[str]:
    """Paths with a folder, and bare source-file names; a checkpoint's or a user's file (config.json,
    models.yaml) is named bare and is not the repository's."""
    names = set()
    for name in PATH.findall(text):
        if "/" in name or name.endswith((".py", ".cu", ".cuh", ".cpp", ".h")):
            names.add(name.removeprefix("./"))
    return names


def test_every_file_the_architecture_map_names_exists():
    files = repository_files()
    text = (ROOT / "docs/architecture.md").read_text()
    missing = sorted(
        name for name in named_paths(text) if not any(f == name or f.endswith("/" + name) for f in files)
    )
    assert not missing, f"docs/architecture.md names files that do not exist: {missing}"


def test_the_check_sees_a_missing_file():
    assert named_paths("see `engine/nowhere.py` and config.json") == {"engine/nowhere.py"}
