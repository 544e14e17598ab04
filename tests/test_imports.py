"""No import cycles: between snakellm's subpackages, and between the modules of snakellm.tokenize.

Every ``import`` and ``from ... import`` in every module counts, at the top level
and inside functions alike (a function-level import only hides a cycle; it still
ties the two packages together). The graph is read with ``ast``, so nothing is
imported and the test takes milliseconds. A failure prints the cycle, each edge
with the module that makes it.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "snakellm"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def _targets(node: ast.AST, module: str, is_package: bool, known: dict[str, Path]) -> list[str]:
    """The snakellm modules an import statement names (``from a import b``: a.b when b is a module)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] == "snakellm"]
    if not isinstance(node, ast.ImportFrom):
        return []
    if node.level:
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        src = ".".join(base + ([node.module] if node.module else []))
    else:
        src = node.module or ""
    if src.split(".")[0] != "snakellm":
        return []
    return [f"{src}.{a.name}" if f"{src}.{a.name}" in known else src for a in node.names]


def import_edges() -> dict[str, dict[str, str]]:
    """module -> {imported module: line "path:lineno"} over all of snakellm, function-level imports included."""
    known = _modules()
    edges: dict[str, dict[str, str]] = defaultdict(dict)
    for mod, path in known.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            for tgt in _targets(node, mod, path.name == "__init__.py", known):
                if tgt != mod:
                    edges[mod].setdefault(tgt, f"{path.relative_to(PKG.parent)}:{node.lineno}")
    return edges


def _subpackage(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def find_cycle(graph: dict[str, dict[str, str]]) -> list[str] | None:
    """One cycle of the directed graph as [a, b, ..., a], or None (iterative depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for root in sorted(graph):
        if state.get(root):
            continue
        path, stack = [root], [iter(sorted(graph.get(root, {})))]
        state[root] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph.get(nxt, {}))))
    return None


def _explain(cycle: list[str], graph: dict[str, dict[str, str]]) -> str:
    return "\n".join(f"  {a} -> {b}  ({graph[a][b]})" for a, b in zip(cycle, cycle[1:], strict=False))


def subpackage_graph() -> dict[str, dict[str, str]]:
    """subpackage -> {subpackage it imports: the first import that does it}."""
    graph: dict[str, dict[str, str]] = defaultdict(dict)
    for mod, targets in import_edges().items():
        for tgt, where in targets.items():
            a, b = _subpackage(mod), _subpackage(tgt)
            if a and b and a != b:
                graph[a].setdefault(b, f"{mod} imports {tgt} at {where}")
    return graph


@pytest.mark.slow  # 2.2 s of CPU, among the fast tier's slowest (the tier ran 90-95 s of its 90 s budget)
def test_no_cycle_between_subpackages() -> None:
    graph = subpackage_graph()
    assert "models" in graph.get("train", {}), "the graph reader found no train -> models import"
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle between snakellm subpackages:\n" + _explain(cycle or [], graph)


@pytest.mark.slow  # 2.0 s of CPU, among the fast tier's slowest (the tier ran 76-89 s of its 90 s budget)
@pytest.mark.parametrize("package", ["tokenize"])
def test_no_cycle_between_modules_of(package: str) -> None:
    prefix = f"snakellm.{package}."
    graph = {
        mod: {t: w for t, w in targets.items() if t.startswith(prefix)}
        for mod, targets in import_edges().items()
        if mod.startswith(prefix)
    }
    cycle = find_cycle(graph)
    assert cycle is None, f"import cycle between the modules of snakellm.{package}:\n" + _explain(cycle or [], graph)


def test_find_cycle_reports_the_cycle() -> None:
    g = {"a": {"b": "x"}, "b": {"c": "y"}, "c": {"a": "z"}, "d": {"a": "w"}}
    assert find_cycle(g) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b": "x"}, "b": {}}) is None
