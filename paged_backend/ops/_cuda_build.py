"""Build csrc/ into libpaged_attention.so with nvcc: the one place that knows the compiler command.

Cached in the build cache (:mod:`paged_backend.core.build_cache`) under a hash of the sources, flags and nvcc
version, so a rebuild happens only when one of them changes. ``PAGED_BACKEND_CSRC`` points
at a csrc/ directory when the package is installed without the repository around it.

    python -m paged_backend.ops._cuda_build --arch 80 --arch 90 -o libpaged_attention.so
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
from pathlib import Path

from paged_backend.core.build_cache import build_once, cache_root, csrc_dir, fingerprint

LIBRARY_NAME = "libpaged_attention.so"
# --threads 0: compile the per-architecture targets in parallel
NVCC_FLAGS = ("-O3", "-std=c++17", "-shared", "-Xcompiler", "-fPIC", "-lineinfo", "--threads", "0")


class CudaBuildError(RuntimeError):
    """nvcc is missing or rejected the sources; the message carries the compiler's own words."""


def find_nvcc() -> str | None:
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if cuda_home and (Path(cuda_home) / "bin" / "nvcc").exists():
        return str(Path(cuda_home) / "bin" / "nvcc")
    return shutil.which("nvcc")


def gencode_flags(archs: list[int]) -> list[str]:
    return [flag for arch in archs for flag in ("-gencode", f"arch=compute_{arch},code=sm_{arch}")]


def _sources() -> list[Path]:
    sources = sorted(csrc_dir().glob("*.cu"))
    if not sources:
        raise CudaBuildError(f"no .cu sources in {csrc_dir()}; set PAGED_BACKEND_CSRC to the csrc/ directory")
    return sources


def build_library(output: Path, archs: list[int]) -> Path:
    """Compile every csrc/*.cu into the shared library `output` for the given SM architectures."""
    nvcc = find_nvcc()
    if nvcc is None:
        raise CudaBuildError("nvcc was not found on PATH or in $CUDA_HOME/bin; install the CUDA toolkit")
    output.parent.mkdir(parents=True, exist_ok=True)
    command = [nvcc, *NVCC_FLAGS, *gencode_flags(archs), *map(str, _sources()), "-o", str(output)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise CudaBuildError(f"nvcc failed ({' '.join(command)}):\n{done.stderr[-4000:]}")
    return output


def cached_library(archs: list[int]) -> Path:
    """The library for `archs`, built on first use."""
    nvcc = find_nvcc() or ""
    version = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout if nvcc else ""
    sources = [p for p in sorted(csrc_dir().glob("*")) if p.suffix in (".cu", ".cuh", ".h")]
    key = fingerprint([str(NVCC_FLAGS), str(archs), version, *(p.name.encode() + p.read_bytes() for p in sources)])
    return build_once(cache_root() / "cuda" / key / LIBRARY_NAME, lambda path: build_library(path, archs))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, action="append", default=None, help="SM version, e.g. 80, 90")
    parser.add_argument("-o", "--output", type=Path, default=Path(LIBRARY_NAME))
    args = parser.parse_args()
    print(build_library(args.output, args.arch or [80, 90]))


if __name__ == "__main__":
    main()
