"""The package's import graph: data flows one way (entry points -> engine -> scheduler
-> runner -> model -> attention backends -> ops), so no module imports itself back, and
no layer imports one above it (the sampler knows nothing of the engine, the model
nothing of tensor parallelism or the engine, the engine nothing of the entry points).
Every import counts: top level, TYPE_CHECKING and in functions."""

from __future__ import annotations

import ast
import pathlib

import pytest

import pyllm

ROOT = pathlib.Path(pyllm.__file__).parent


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Module -> the pyllm modules it imports (the package root's re-exports aside)."""
    modules = {module_name(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
            else:
                continue
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target not in (name, "pyllm") and not name.startswith(target + "."):
                    graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles():
    graph = import_graph()
    assert "pyllm.model.llama" in graph["pyllm.model.loader"], "the graph missed imports"
    assert cycles(graph) == []


def test_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def imports_between(graph: dict[str, set[str]], importer: str, imported: str) -> list:
    """(module, target) pairs where a module of package `importer` imports one of
    package `imported`."""
    return sorted(
        (m, t)
        for m, targets in graph.items()
        for t in targets
        if m.startswith(importer + ".") and t.startswith(imported + ".")
    )


def test_imports_between_finds_one():
    graph = {"p.a.x": {"p.b.y"}, "p.b.y": set(), "p.ab.z": {"p.b.y"}}
    assert imports_between(graph, "p.a", "p.b") == [("p.a.x", "p.b.y")]


@pytest.mark.parametrize(
    "importer, imported",
    [
        ("pyllm.sampling", "pyllm.engine"),  # the sampler knows nothing of the engine
        ("pyllm.model", "pyllm.distributed"),  # tensor parallelism drives the model
        ("pyllm.model", "pyllm.engine"),
        ("pyllm.engine", "pyllm.entrypoints"),  # entry points drive the engine
        ("pyllm.attention", "pyllm.model"),  # backends sit under the model
        ("pyllm.attention", "pyllm.engine"),
    ],
)
def test_layers_import_downwards(importer, imported):
    assert imports_between(import_graph(), importer, imported) == []
