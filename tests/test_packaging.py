"""Every package directory ships in the wheel: a package the build misses still imports in editable mode (which
these tests run under) and is absent from a pip install, so only this test notices. setup.py discovers the packages
below the roots that pyproject's package-dir declares; this builds a real wheel and reads what is in it."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_directory_ships_in_the_wheel(tmp_path):
    roots = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    expected = set()
    for package, directory in roots.items():
        for init in (ROOT / directory).rglob("__init__.py"):
            relative = init.parent.relative_to(ROOT / directory)
            expected.add("/".join([*package.split("."), *relative.parts]))
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), str(ROOT)],
        check=True, capture_output=True, cwd=tmp_path,
    )  # fmt: skip
    (wheel,) = tmp_path.glob("paged_backend-*.whl")
    shipped = {Path(name).parent.as_posix() for name in zipfile.ZipFile(wheel).namelist() if name.endswith("__init__.py")}
    missing = sorted(expected - shipped)
    assert not missing, f"these packages are not in the wheel: {missing}; check [tool.setuptools.package-dir] and setup.py"
    assert "paged_backend/tgi/proto/generate_pb2.py" in zipfile.ZipFile(wheel).namelist()  # the build hook ran
