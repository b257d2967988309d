"""llama.cpp's `llama-server` and `llama-quantize`, built once from the llama-cpp-python sdist, and GGUF files
requantized with them; both cached under `$PAGED_BACKEND_CACHE/llama.cpp/` (see benchmarks/llama_cpp.py).

The sdist on the package index vendors a pinned llama.cpp under vendor/llama.cpp, so `pip download` is the one
source needed (no git, no second registry). Only the two targets are built, statically linked, so the cached
`<version>/bin/` holds two self-contained binaries and nothing else.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from paged_backend.core.build_cache import build_once, cache_root

TARGETS = ("llama-server", "llama-quantize")
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",  # this machine's vector units (AVX2/AVX-512/AMX), as a local llama.cpp build gets
    "-DLLAMA_CURL=OFF",  # no model downloads (a no-op in versions that dropped the option)
    "-DLLAMA_OPENSSL=OFF",  # no HTTPS: no libssl-dev needed
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_TOOLS=ON",  # the server and quantize live under tools/
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",  # otherwise the web UI is downloaded from Hugging Face at build time
    "-DBUILD_SHARED_LIBS=OFF",  # binaries that run after the build tree is gone
)


def llama_cpp_root() -> Path:
    return cache_root() / "llama.cpp"


def binaries(version: str | None = None, jobs: int = 2) -> tuple[Path, str]:
    """The cached bin/ directory holding TARGETS and its llama-cpp-python version; built first when missing.

    No version: reuse the newest cached build, else build the newest sdist on the index."""
    cached = sorted(
        (p for p in llama_cpp_root().glob(f"{version or '*'}/bin") if all((p / t).is_file() for t in TARGETS)),
        key=lambda p: [int(n) if n.isdigit() else 0 for n in p.parent.name.split(".")],
    )
    if cached:
        return cached[-1], cached[-1].parent.name
    with tempfile.TemporaryDirectory(prefix="llama-cpp-sdist-") as scratch:
        sdist = download_sdist(version, Path(scratch))
        version = re.match(r"llama_cpp_python-(.+)\.tar\.gz$", sdist.name).group(1)
        entry = build_once(llama_cpp_root() / version, lambda out: build(sdist, out, jobs))
    return entry / "bin", version


def download_sdist(version: str | None, dest: Path) -> Path:
    spec = f"llama-cpp-python=={version}" if version else "llama-cpp-python"
    print(f"llama.cpp: downloading the {spec} sdist", flush=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-binary", ":all:", "--no-deps",
                    spec, "-d", str(dest)], check=True)  # fmt: skip
    (sdist,) = dest.glob("llama_cpp_python-*.tar.gz")
    return sdist


def cmake() -> str:
    """A cmake on PATH or in this venv; else `pip install cmake` (on PyPI) into this venv."""
    venv_cmake = Path(sys.executable).parent / "cmake"
    found = shutil.which("cmake") or (str(venv_cmake) if venv_cmake.is_file() else None)
    if found:
        return found
    print("llama.cpp: no cmake found; pip install cmake", flush=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "cmake"], check=True)
    return str(venv_cmake)


def build(sdist: Path, out: Path, jobs: int) -> None:
    """Configure and build TARGETS from the sdist's vendor/llama.cpp; copy them into out/bin (log: out/build.log)."""
    out.mkdir(parents=True)
    log_path = out / "build.log"
    with tempfile.TemporaryDirectory(prefix="llama-cpp-build-") as work, open(log_path, "w") as log:
        with tarfile.open(sdist) as archive:
            archive.extractall(work, filter="data")
        (source,) = Path(work).glob("llama_cpp_python-*/vendor/llama.cpp")
        build_dir = Path(work) / "build"
        started = time.monotonic()
        print(f"llama.cpp: building {', '.join(TARGETS)} with -j{jobs} (~8 min on 2 cores)", flush=True)
        steps = ([cmake(), "-S", str(source), "-B", str(build_dir), *CMAKE_FLAGS],
                 [cmake(), "--build", str(build_dir), "--config", "Release", "-j", str(jobs), "--target", *TARGETS])  # fmt: skip
        for step in steps:
            log.write(f"$ {' '.join(step)}\n")
            log.flush()
            if subprocess.run(step, stdout=log, stderr=subprocess.STDOUT).returncode:
                log.close()
                tail = "".join(log_path.read_text().splitlines(keepends=True)[-30:])
                raise SystemExit(
                    f"llama.cpp build failed ({' '.join(step[:3])} ...); last lines of {log_path}:\n{tail}"
                )
        (out / "bin").mkdir()
        for target in TARGETS:
            shutil.copy2(build_dir / "bin" / target, out / "bin" / target)
        print(f"llama.cpp: built in {time.monotonic() - started:.0f} s", flush=True)


def requantize(bin_dir: Path, source: Path, qtype: str) -> Path:
    """`source` as GGUF type `qtype` (F32, BF16, Q8_0, ...), made once by llama-quantize and cached."""
    target = llama_cpp_root() / "models" / f"{source.stem.split('.')[0]}.{qtype.upper()}.gguf"

    def make(scratch: Path) -> None:
        print(f"llama.cpp: requantizing {source.name} to {qtype.upper()}", flush=True)
        command = [str(bin_dir / "llama-quantize"), "--allow-requantize", str(source), str(scratch), qtype.upper()]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(f"{' '.join(command)} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")

    return build_once(target, make)
