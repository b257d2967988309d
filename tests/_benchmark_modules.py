"""benchmarks/*.py scripts loaded as modules, so tests can call their functions."""

import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def load_benchmark(name: str) -> ModuleType:
    """benchmarks/<name>.py as the module `<name>_bench` (registered, since dataclasses look their module up)."""
    module_name = f"{name}_bench"
    spec = importlib.util.spec_from_file_location(module_name, Path(__file__).parents[1] / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module
