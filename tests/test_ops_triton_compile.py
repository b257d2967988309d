"""The Triton kernels compile to real GPU code (sm_80 and sm_90) on a machine without a GPU.

The interpreter checks the math; this checks what only the compiler sees: types a GPU generation rejects
(Triton has no e4m3 on sm_80), loop-carried type mismatches, shared memory over the per-CTA limit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
from tests._ops_triton_compile import ARCHS, ATTENTION_CONFIGS, config_id  # noqa: E402

MAX_SHARED_BYTES = 99 * 1024  # what one CTA may use on every GPU from sm_80 up (A10 / L4 are the smallest)
REPO_ROOT = Path(__file__).resolve().parents[1]
KERNELS = [config_id("attention", arch, c) for arch in ARCHS for c in ATTENTION_CONFIGS]
KERNELS += [config_id(kind, arch) for kind in ("reduce", "cache") for arch in ARCHS]


@pytest.fixture(scope="module")
def compiled() -> dict:
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-m", "tests._ops_triton_compile"], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("kernel", KERNELS)
def test_kernel_compiles_for_gpu(compiled: dict, kernel: str):
    result = compiled[kernel]
    assert "error" not in result, result.get("error")
    assert result["shared_bytes"] <= MAX_SHARED_BYTES
