"""Build hooks: find the packages below pyproject's package-dir roots, and compile the generate.v3 gRPC stubs
into the wheel (all other metadata lives in pyproject.toml)."""

import importlib.util
import shutil
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py
from setuptools.config.pyprojecttoml import load_file

PROTO = Path(__file__).parent / "proto" / "generate" / "v3" / "generate.proto"


class BuildPyWithStubs(build_py):
    """build_py that also writes paged_backend/tgi/proto/{generate.proto, generate_pb2*.py}."""

    def run(self) -> None:
        super().run()
        if self.editable_mode:
            return  # editable installs compile the stubs on first import instead
        target = Path(self.build_lib) / "paged_backend" / "tgi" / "proto"
        target.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(PROTO, target / PROTO.name)  # the first-import fallback compiles from this copy
        if importlib.util.find_spec("grpc_tools") is None:
            self.warn("grpcio-tools not installed at build time: generate.v3 stubs will be compiled on first import")
            return
        _load_compiler()(target / PROTO.name, target)


def _load_compiler():
    # The package is not importable while it is being built; load the compiler module by path.
    path = Path(__file__).parent / "integrations" / "tgi" / "proto" / "stubs.py"
    spec = importlib.util.spec_from_file_location("paged_backend_tgi_stubs", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.compile_stubs


def discover_packages() -> list[str]:
    """Every import root that pyproject maps to a folder, and each package (a folder with __init__.py) below it."""
    roots = load_file(Path(__file__).parent / "pyproject.toml")["tool"]["setuptools"]["package-dir"]
    found = []
    for name, folder in roots.items():
        found.append(name)
        found += [f"{name}.{sub}" for sub in find_packages(folder) if f"{name}.{sub}" not in roots]
    return found


setup(packages=discover_packages(), cmdclass={"build_py": BuildPyWithStubs})
