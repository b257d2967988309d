"""The layers of docs/architecture.md, enforced: every module's imports (function-level and TYPE_CHECKING ones
included) point to its own layer or below, faces never import each other, and no import closes a circle."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = {"paged_backend": ROOT / "paged_backend", "paged_backend.hf": ROOT / "integrations/hf",
           "paged_backend.tgi": ROOT / "integrations/tgi"}  # fmt: skip


def declared_layers() -> list[tuple[str, list[str]]]:
    """[(layer, module patterns)] bottom-up, from the ```layers block of docs/architecture.md."""
    text = (ROOT / "docs/architecture.md").read_text()
    block = re.search(r"```layers\n(.*?)```", text, re.S)
    assert block, "docs/architecture.md lost its ```layers block"
    return [(line.split()[0], line.split()[1:]) for line in block.group(1).splitlines() if line.strip()]


def modules() -> dict[str, Path]:
    found = {}
    for package, folder in SOURCES.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            if "proto" in parts and path.name.startswith("generate_pb2"):
                continue  # generated stubs
            found[".".join([package, *parts])] = path
    return found


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Project modules `name` imports anywhere in its file."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    targets = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            candidates = [f"{base}.{alias.name}" for alias in node.names]  # a module, or a name in `base`
        else:
            continue
        for candidate in candidates:
            while candidate and candidate not in known:
                candidate = candidate.rpartition(".")[0]
            if candidate and candidate != name:
                targets.add(candidate)
    return targets


def layer_of(name: str, layers) -> tuple[int, str]:
    """(layer rank, the pattern that names it): the longest pattern wins."""
    best = None
    for rank, (_, patterns) in enumerate(layers):
        for pattern in patterns:
            prefix = pattern.removesuffix(".*")
            matches = name == prefix or (pattern.endswith(".*") and name.startswith(prefix + "."))
            if matches and (best is None or len(prefix) > len(best[1])):
                best = (rank, prefix)
    if best is None:
        pytest.fail(f"{name} belongs to no layer: add it to the ```layers block of docs/architecture.md")
    return best


def test_imports_point_down_and_faces_stand_alone():
    layers, found = declared_layers(), modules()
    wrong = []
    for name, path in sorted(found.items()):
        rank, owner = layer_of(name, layers)
        for target in sorted(imports(name, path, set(found))):
            target_rank, target_owner = layer_of(target, layers)
            if target_rank > rank:
                wrong.append(f"{name} ({layers[rank][0]}) imports {target} ({layers[target_rank][0]})")
            elif layers[rank][0] == "faces" and target_rank == rank and target_owner != owner:
                wrong.append(f"face {name} imports another face's {target}")
    assert not wrong, "imports that point up:\n" + "\n".join(wrong)


def test_no_import_closes_a_circle():
    found = modules()
    graph = {name: imports(name, path, set(found)) for name, path in found.items()}
    circles = [sorted(component) for component in strongly_connected(graph) if len(component) > 1]
    assert not circles, "import circles:\n" + "\n".join(" <-> ".join(circle) for circle in circles)


def strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's algorithm, iteratively (no recursion limit on deep chains)."""
    index, low, on_stack, stack, components, counter = {}, {}, set(), [], [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                components.append(component)
    return components


def test_the_checker_sees_an_upward_function_level_import(tmp_path):
    """The parser follows imports inside functions and TYPE_CHECKING blocks, absolute and relative."""
    source = tmp_path / "mod.py"
    source.write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from paged_backend.engine import request\n"
        "def f():\n    from ..server import app\n"
    )
    known = {"paged_backend.engine.request", "paged_backend.server.app", "paged_backend.core.mod"}
    assert imports("paged_backend.core.mod", source, known) == {"paged_backend.engine.request", "paged_backend.server.app"}
