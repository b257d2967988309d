"""csrc/ compiles with nvcc for sm_80 and sm_90, and the library's C ABI matches the ctypes mirror."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest

from paged_backend.ops import _cuda_abi
from paged_backend.ops._cuda_build import build_library, find_nvcc

NVCC = find_nvcc()
pytestmark = pytest.mark.skipif(NVCC is None, reason="nvcc is not on PATH")


@pytest.fixture(scope="module")
def library(tmp_path_factory) -> Path:
    return build_library(tmp_path_factory.mktemp("csrc") / "libpaged_attention.so", archs=[80, 90])


def test_library_holds_sm80_and_sm90_code(library: Path):
    cuobjdump = shutil.which("cuobjdump") or shutil.which("cuobjdump", path=str(Path(NVCC).resolve().parent))
    if cuobjdump:
        listing = subprocess.run([cuobjdump, "--list-elf", str(library)], capture_output=True, text=True,
                                 check=True).stdout
    else:  # toolkits without cuobjdump: the fatbinary still names each cubin's architecture
        listing = library.read_bytes().decode("latin-1")
    assert "sm_80" in listing and "sm_90" in listing


def test_library_loads_without_a_gpu_and_its_structs_match_ctypes(library: Path):
    lib = _cuda_abi.load_library(library)  # raises when sizeof differs between C and ctypes
    assert b"head_dim" in lib.pb_error_string(-2)
    assert lib.pb_paged_decode.restype is ctypes.c_int


def test_invalid_shapes_are_rejected_before_any_launch(library: Path):
    lib = _cuda_abi.load_library(library)
    args = _cuda_abi.DecodeArgs(num_seqs=1, num_q_heads=8, num_kv_heads=3, head_dim=128, block_size=16,
                                num_partitions=1)
    assert lib.pb_paged_decode(ctypes.byref(args), 2, 2, None) == -3  # 8 q heads over 3 kv heads
    args.num_kv_heads, args.head_dim = 8, 100
    assert lib.pb_paged_decode(ctypes.byref(args), 2, 2, None) == -2
