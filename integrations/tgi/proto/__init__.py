"""generate.v3 stubs: `from paged_backend.tgi.proto import generate_pb2, generate_pb2_grpc`.

Wheels carry the modules here (compiled by setup.py). Editable installs compile them on first import into a
cache directory (see `paged_backend.tgi.proto.stubs`), which joins this package's module search path.
"""

from pathlib import Path

if not (Path(__file__).parent / "generate_pb2.py").exists():
    from paged_backend.tgi.proto.stubs import cached_stubs_dir

    __path__.append(str(cached_stubs_dir()))
