"""Every block the README and docs/ mark as runnable still runs, as written, on a fresh checkout.

A fenced ```bash or ```python block whose previous non-blank line is ``<!-- runnable -->`` is run for real:
bash with ``bash -euo pipefail``, python with the venv's interpreter, each in its own working copy of the
repository root (a folder of links to the top-level entries, so files a block writes land in a temporary
folder) with ``.venv/bin`` first on ``PATH``, a temporary ``HOME`` and the Hugging Face hub offline. A block that
starts a server stops it itself (one left running fails the block at the time limit), and the block's process
group is killed either way. Only quick blocks (embedded tiny model, few tokens) are marked; the others stay
plain examples.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
from pathlib import Path

import pytest

from paged_backend.core.build_cache import cache_root

REPO = Path(__file__).resolve().parents[1]
DOC_FILES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
MARKER = "<!-- runnable -->"
FENCE = re.compile(r"^```(\w*)\s*$")
BLOCK_TIMEOUT_S = 120


def runnable_blocks(path: Path) -> list[tuple[int, str, str]]:
    """(line of the opening fence, language, body) of each block marked runnable in one Markdown file."""
    lines = path.read_text().splitlines()
    blocks, index = [], 0
    while index < len(lines):
        if lines[index].strip() != MARKER:
            index += 1
            continue
        index += 1
        while index < len(lines) and not lines[index].strip():
            index += 1
        opening = FENCE.match(lines[index]) if index < len(lines) else None
        if not opening or opening.group(1) not in ("bash", "python"):
            raise ValueError(f"{path.name}:{index + 1}: {MARKER} must precede a ```bash or ```python block")
        start, body = index, []
        index += 1
        while index < len(lines) and lines[index].strip() != "```":
            body.append(lines[index])
            index += 1
        if index == len(lines):
            raise ValueError(f"{path.name}:{start + 1}: the runnable block is never closed")
        blocks.append((start + 1, opening.group(1), "\n".join(body) + "\n"))
        index += 1
    return blocks


CASES = [
    pytest.param(path, language, body, id=f"{path.relative_to(REPO)}:{line}")
    for path in DOC_FILES
    for line, language, body in runnable_blocks(path)
]


def working_copy(root: Path) -> Path:
    """A folder that looks like the repository root: links to its entries, so relative paths resolve."""
    root.mkdir()
    for entry in REPO.iterdir():
        if entry.name != ".git":
            (root / entry.name).symlink_to(entry)
    return root


def block_environment(home: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        PATH=f"{REPO / '.venv' / 'bin'}{os.pathsep}{env.get('PATH', '')}",
        HOME=str(home),
        PAGED_BACKEND_CACHE=str(cache_root()),  # the kernels this machine already built, not a rebuild
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        PYTHONUNBUFFERED="1",
    )
    env.pop("XDG_CACHE_HOME", None)
    return env


def run_block(command: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    process = subprocess.Popen(
        command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        output, _ = process.communicate(timeout=BLOCK_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(
            f"the block, or a process it left running, ran past {BLOCK_TIMEOUT_S} s (a block that starts a "
            f"server must stop it):\n{output[-4000:]}"
        )
    finally:
        try:  # a server the block forgot to stop
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return subprocess.CompletedProcess(command, process.returncode, output)


@pytest.mark.parametrize(("path", "language", "body"), CASES)
def test_runnable_block(path, language, body, tmp_path):
    cwd = working_copy(tmp_path / "repo")
    (tmp_path / "home").mkdir()
    script = tmp_path / ("block.sh" if language == "bash" else "block.py")
    script.write_text(body)
    interpreter = ["bash", "-euo", "pipefail"] if language == "bash" else [str(REPO / ".venv" / "bin" / "python")]
    result = run_block([*interpreter, str(script)], cwd, block_environment(tmp_path / "home"))
    assert result.returncode == 0, f"{path.name} block exited {result.returncode}:\n{result.stdout[-4000:]}"
