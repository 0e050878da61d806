"""The package's import graph: no circle, and configuration below the models.

Imports are read from the source (function-level ones included, `if TYPE_CHECKING:`
blocks excluded since they never run), so a lazy import cannot hide a circle.
"""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def module_files() -> dict[str, Path]:
    files = {}
    for path in (ROOT / "atom").rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        files[".".join(parts)] = path
    return files


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imported_modules(path: Path, modules: set[str]) -> set[str]:
    """The atom modules `path` imports at run time; `from pkg import sub` names the
    submodule, not the package."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            subs = {f"{node.module}.{alias.name}" for alias in node.names}
            found.update(subs & modules or {node.module})
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return {name for name in found if name in modules}


def import_graph() -> dict[str, set[str]]:
    files = module_files()
    names = set(files)
    return {
        name: imported_modules(path, names) - {name} for name, path in files.items()
    }


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as a path [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def walk(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                return path[path.index(dep) :] + [dep]
            if dep not in state and (cycle := walk(dep)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := walk(node)):
            return cycle
    return None


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for dep in graph[todo.pop()] - seen:
            seen.add(dep)
            todo.append(dep)
    return seen


def test_no_import_circle():
    assert find_cycle(import_graph()) is None


def test_the_checker_sees_a_lazy_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]


def builds_layers(path: Path) -> bool:
    source = path.read_text()
    return bool(
        re.search(
            r"^\s*(from torch import nn|import torch\.nn|from torch\.nn )", source, re.M
        )
        or re.search(r"^\s*from atom\.(model_ops|distributed)", source, re.M)
    )


def test_config_imports_no_model_code():
    # `Config(model="tiny-kimi-k3")` builds the tiny checkpoint, so the config
    # reaches the tiny builders and the config readers they use, but nothing that
    # builds layers, and neither the registry nor the PP helpers.
    files = module_files()
    below_config = reachable(import_graph(), "atom.config")
    assert not below_config & {"atom.models.registry", "atom.models.utils"}
    assert [m for m in sorted(below_config) if builds_layers(files[m])] == []


def package_graph() -> dict[str, set[str]]:
    """Imports between the subpackages of atom (atom.model_engine, ...); the
    top-level modules (atom.config, ...) are settings every layer may read and are
    left out, as `test_config_imports_no_model_code` bounds what they reach."""
    files = module_files()

    def package(name: str) -> str | None:
        parts = name.split(".")
        nested = (
            files[name].parent != ROOT / "atom" or files[name].name == "__init__.py"
        )
        return ".".join(parts[:2]) if len(parts) > 1 and nested else None

    graph: dict[str, set[str]] = {}
    for name, deps in import_graph().items():
        if (source := package(name)) is None:
            continue
        targets = {package(dep) for dep in deps} - {None, source}
        graph.setdefault(source, set()).update(targets)
    for targets in list(graph.values()):
        for target in targets:
            graph.setdefault(target, set())
    return graph


def test_no_package_circle():
    # e.g. spec_decode importing model_engine while the runner imports the drafter.
    assert find_cycle(package_graph()) is None
