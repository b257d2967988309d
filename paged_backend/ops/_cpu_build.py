"""Build csrc/cpu/ (paged attention and the fused decoder-layer ops) into libpaged_attention_cpu.so with the host
C++ compiler (g++/clang++, OpenMP).

A plain C ABI and no torch headers keep the build to the kernels themselves (about 20 s on 2 cores, most of it the
panel linear's templates; the sources compile in parallel), so it happens on first use and is cached in the build
cache under a hash of the source, the flags, the compiler and this CPU: the library is compiled with
``-march=native`` for the machine that runs it.

    python -m paged_backend.ops._cpu_build -o libpaged_attention_cpu.so
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from paged_backend.core.build_cache import build_once, cache_root, csrc_dir, fingerprint

LIBRARY_NAME = "libpaged_attention_cpu.so"
# Full-width vectors where the CPU has AVX-512: GCC's Xeon tuning prefers 256-bit ones and then runs a loop's first
# or last elements through other code than its body, so a kernel's bits followed its buffers' addresses (a prompt's
# logprobs moved in the last bit between two engines whose KV blocks sat elsewhere). At 512 bits the remainders are
# masked vectors of the same code, as on the AMD cores the kernels were first measured on. (Ignored without AVX-512.)
CXX_FLAGS = ("-O3", "-march=native", "-mprefer-vector-width=512", "-std=c++17", "-fopenmp", "-fno-math-errno",
             "-shared", "-fPIC")


class CpuBuildError(RuntimeError):
    """No C++ compiler, or it rejected the source; the message carries the compiler's own words."""


def find_compiler() -> str | None:
    for candidate in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if candidate and shutil.which(candidate):
            return shutil.which(candidate)
    return None


SOURCES = ("paged_attention_cpu.cpp", "fused_ops_cpu.cpp", "panel_linear_cpu.cpp", "decoder_layers_cpu.cpp",
           "argmax_cpu.cpp", "amx_cpu.cpp", "block_reads_cpu.cpp")
HEADERS = ("kernels.h", "vector_exp.h", "bf16.h", "fp8.h", "amx.h", "attention_cpu.h", "attention_decode.h",
           "attention_tiles.h")


def sources(headers: bool = False) -> list[Path]:
    """The .cpp files to compile (and, with `headers`, the headers they include: the build key hashes both)."""
    paths = [csrc_dir() / "cpu" / name for name in SOURCES + (HEADERS if headers else ())]
    for path in paths:
        if not path.exists():
            raise CpuBuildError(f"{path} is missing; set PAGED_BACKEND_CSRC to the csrc/ directory")
    return paths


def build_library(output: Path) -> Path:
    """Each source compiled on its own core, then linked into `output`."""
    compiler = find_compiler()
    if compiler is None:
        raise CpuBuildError("no C++ compiler found (tried $CXX, g++, c++, clang++); install g++ or set CXX")
    with tempfile.TemporaryDirectory(dir=output.parent, prefix=".objects-") as folder:

        def compile_one(source: Path) -> str:
            obj = str(Path(folder) / f"{source.stem}.o")
            _run([compiler, *CXX_FLAGS, "-c", str(source), "-o", obj])
            return obj

        with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            objects = list(pool.map(compile_one, sources()))
        _run([compiler, *CXX_FLAGS, *objects, "-o", str(output)])
    return output


def _run(command: list[str]) -> None:
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise CpuBuildError(f"{' '.join(command)} failed:\n{done.stderr[-4000:]}")


def cpu_signature() -> str:
    try:  # -march=native code is only valid on CPUs with the same features
        return next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def cached_library() -> Path:
    """The library for this machine, built on first use."""
    compiler = find_compiler() or ""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout if compiler else ""
    key = fingerprint([str(CXX_FLAGS), version, cpu_signature(), *(path.read_bytes() for path in sources(headers=True))])
    return build_once(cache_root() / "cpu" / key / LIBRARY_NAME, build_library)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-o", "--output", type=Path, default=Path(LIBRARY_NAME))
    print(build_library(parser.parse_args().output))


if __name__ == "__main__":
    main()
