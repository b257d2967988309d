"""Every package directory ships in the wheel: a package missing from pyproject's list installs fine in editable
mode (which these tests run under) and is absent from a pip install, so only this test notices."""

from __future__ import annotations

from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_directory_is_listed_in_pyproject():
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    directories = {name: Path(path) for name, path in setuptools["package-dir"].items()}
    found = set()
    for package, directory in directories.items():
        for init in (ROOT / directory).rglob("__init__.py"):
            relative = init.parent.relative_to(ROOT / directory)
            found.add(".".join([package, *relative.parts]))
    nested_roots = {name for name in directories if any(name.startswith(other + ".") for other in directories)}
    missing = sorted(found - listed - nested_roots)
    assert not missing, f"add {missing} to [tool.setuptools] packages in pyproject.toml"
