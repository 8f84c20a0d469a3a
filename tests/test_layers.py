"""The packages import one way (README, "Layout"): ``core`` <- ``inference`` <- ``data_prep`` <- ``spectrain``, and
the ``benchmarks`` scripts on top.

Parses every module with ``ast`` (nothing is imported): a module may import its own layer and the ones below,
imports of our packages sit at file level (a function-local one would hide a dependency), and the file-level
imports between our modules form no cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = {"core": 0, "inference": 1, "data_prep": 2, "spectrain": 3, "benchmarks": 4}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for package in LAYERS for p in sorted((ROOT / package).rglob("*.py"))}


def imported_names(node: ast.AST, module: str, is_package: bool) -> list[str]:
    """Dotted names an import statement reads (``from a.b import c`` gives ``a.b`` and ``a.b.c``)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:
        parts = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
        base = ".".join(parts + ([node.module] if node.module else []))
    return [base] + [f"{base}.{alias.name}" for alias in node.names]


def our_module(name: str) -> str | None:
    """The longest of our modules that ``name`` starts with, if any."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in MODULES:
            return ".".join(parts[:end])
    return None


def imports_of(module: str) -> tuple[set[str], list[tuple[int, str]]]:
    """(our modules imported at file level, (line, name) of our imports inside a function or class)."""
    path = MODULES[module]
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    scoped = {
        id(n)
        for top in tree.body
        if isinstance(top, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
        for n in ast.walk(top)
    }
    file_level, local = set(), []
    for node in ast.walk(tree):
        for name in imported_names(node, module, is_package):
            target = our_module(name)
            if target is None or target == module:
                continue
            if id(node) in scoped:
                local.append((node.lineno, target))
            else:
                file_level.add(target)
    return file_level, local


GRAPH = {module: imports_of(module) for module in MODULES}


def layer(module: str) -> int:
    return LAYERS[module.split(".")[0]]


def test_every_package_is_parsed():
    assert {m.split(".")[0] for m in MODULES} == set(LAYERS)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_a_module_imports_only_its_own_layer_and_those_below(module):
    upward = sorted(t for t in GRAPH[module][0] if layer(t) > layer(module))
    assert not upward, f"{module} (layer {module.split('.')[0]}) imports a higher layer: {upward}"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_our_packages_are_imported_at_file_level(module):
    local = GRAPH[module][1]
    assert not local, f"{module} imports our modules inside a function: {local}"


def test_file_level_imports_have_no_cycle():
    edges = {module: imports for module, (imports, _) in GRAPH.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(path: list[str]) -> list[str] | None:
        """Depth-first from ``path[-1]``; a cycle back into ``path`` is returned as the modules along it."""
        state[path[-1]] = 1
        for target in sorted(edges[path[-1]]):
            if state.get(target) == 1:
                return path[path.index(target) :] + [target]
            if target not in state and (cycle := visit(path + [target])):
                return cycle
        state[path[-1]] = 2
        return None

    for module in sorted(edges):
        if module not in state:
            cycle = visit([module])
            assert cycle is None, "import cycle: " + " -> ".join(cycle)
