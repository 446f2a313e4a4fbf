"""The shape of the verst package: no import cycles, no function over 80 lines.

The import graph counts every import statement anywhere in a module (top level, inside
functions, under `TYPE_CHECKING`): a function-local import only hides a cycle, it does not
break it. `from pkg import name` is an edge to the submodule `pkg.name` when there is one, else
to `pkg` itself.
"""

from __future__ import annotations

import ast
from collections import deque
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "verst"
MAX_FUNCTION_LINES = 80


def modules() -> dict[str, Path]:
    """Every module of the package by dotted name; a package is named by its `__init__.py`."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _targets(node: ast.Import | ast.ImportFrom, module: str, mods: dict[str, Path]) -> set[str]:
    """The package's modules one import statement loads (itself left out)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:  # relative: from the module's package, up `level - 1` packages
            package = module.split(".")
            if mods[module].name != "__init__.py":
                package = package[:-1]
            anchor = package[: len(package) - (node.level - 1)]
            base = ".".join(anchor + ([base] if base else []))
        names = [f"{base}.{alias.name}" for alias in node.names]
        names = [name if name in mods else base for name in names]
    return {name for name in names if name in mods and name != module}


def import_graph() -> dict[str, set[str]]:
    """module -> the package's modules it imports."""
    mods = modules()
    graph: dict[str, set[str]] = {name: set() for name in mods}
    for name, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                graph[name] |= _targets(node, name, mods)
    return graph


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's components with more than one module, each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def shortest_cycle(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """A shortest cycle through the component's first module, as a path back to it."""
    start, members = component[0], set(component)
    parent: dict[str, str] = {}
    queue = deque([start])
    while queue:
        v = queue.popleft()
        for w in sorted(graph[v] & members):
            if w == start:  # close the cycle: start -> ... -> v -> start
                path = [v]
                while path[-1] != start:
                    path.append(parent[path[-1]])
                return [*reversed(path), start]
            if w not in parent:
                parent[w] = v
                queue.append(w)
    raise AssertionError(f"{component} is not strongly connected")


def long_functions(limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """'file:line qualname (n lines)' for every function or method over `limit` lines, counted
    from its `def` line to its last line (nested functions count in their parent too)."""
    found = []

    def visit(node: ast.AST, prefix: str, path: Path) -> None:
        for child in ast.iter_child_nodes(node):
            if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                visit(child, prefix, path)
                continue
            name = prefix + child.name
            if not isinstance(child, ast.ClassDef) and child.end_lineno is not None:
                lines = child.end_lineno - child.lineno + 1
                if lines > limit:
                    found.append(f"{path.relative_to(ROOT)}:{child.lineno} {name} ({lines} lines)")
            visit(child, name + ".", path)

    for path in modules().values():
        visit(ast.parse(path.read_text(), str(path)), "", path)
    return found


def test_the_graph_sees_every_kind_of_import() -> None:
    graph = import_graph()
    assert "verst.types" in graph["verst.plugins"]  # top-level `from ... import`
    assert "verst.sync.broadcast" in graph["verst.engine.weight_updates"]  # inside a method
    assert "verst.distributed" in graph["verst.rollout.agent"]  # `from verst import distributed`


def test_no_import_cycles() -> None:
    graph = import_graph()
    cycles = [" -> ".join(shortest_cycle(graph, c)) for c in strongly_connected(graph)]
    assert not cycles, "import cycles in verst/:\n  " + "\n  ".join(cycles)


def test_no_function_over_80_lines() -> None:
    found = long_functions()
    assert not found, f"functions over {MAX_FUNCTION_LINES} lines:\n  " + "\n  ".join(found)
