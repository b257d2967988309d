"""Compile the generate.v3 proto into Python stubs (generate_pb2, generate_pb2_grpc) with grpc_tools.

Used by setup.py at build time (stubs land inside the wheel) and, when they are missing (editable
installs), on first import of `paged_backend.tgi.proto` into a cache directory keyed by the proto's hash.
"""

from __future__ import annotations

import re
from pathlib import Path

PROTO_NAME = "generate.proto"
_PACKAGED_PROTO = Path(__file__).parent / PROTO_NAME
_SOURCE_PROTO = Path(__file__).resolve().parents[3] / "proto" / "generate" / "v3" / PROTO_NAME


def proto_path() -> Path:
    """The .proto shipped in the package (wheels) or the repository's proto/ (editable installs)."""
    for candidate in (_PACKAGED_PROTO, _SOURCE_PROTO):
        if candidate.exists():
            return candidate
    raise FileNotFoundError(f"generate.v3 proto not found at {_PACKAGED_PROTO} or {_SOURCE_PROTO}")


def compile_stubs(proto: Path, out_dir: Path) -> None:
    """Write generate_pb2.py and generate_pb2_grpc.py into `out_dir`, the grpc module importing pb2 relatively."""
    from grpc_tools import protoc

    out_dir.mkdir(parents=True, exist_ok=True)
    include = str(Path(protoc.__file__).parent / "_proto")
    args = ["protoc", f"-I{proto.parent}", f"-I{include}", f"--python_out={out_dir}", f"--grpc_python_out={out_dir}"]
    if protoc.main([*args, str(proto)]) != 0:
        raise RuntimeError(f"grpc_tools.protoc failed to compile {proto}")
    grpc_module = out_dir / "generate_pb2_grpc.py"
    # The stubs live in a package, so the grpc module must import its messages relatively (TGI seds the same).
    text = re.sub(r"^import generate_pb2", "from . import generate_pb2", grpc_module.read_text(), flags=re.M)
    grpc_module.write_text(text)


def cached_stubs_dir() -> Path:
    """A directory holding stubs compiled from the current proto, compiling them once if needed."""
    import grpc_tools

    # imported here: setup.py loads this file by path, before the package is importable
    from paged_backend.core.build_cache import build_once, cache_root, fingerprint

    proto = proto_path()
    key = fingerprint([proto.read_bytes(), getattr(grpc_tools, "__version__", "")])
    return build_once(cache_root() / "tgi-stubs" / key, lambda scratch: compile_stubs(proto, scratch))
