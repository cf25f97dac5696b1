"""Imports run one way: no module of grpo_kernels imports, directly or through others, a module that
imports it back (the house rule "layers import downward only").

The import graph is read from the source (ast), not by importing: every `import` / `from ... import`
statement counts, at module level or inside a function (a lazy import is still a dependency), except
those under `if TYPE_CHECKING:` (never executed: annotations only). An import of a package's own
`__init__` from inside that package is not an edge (Python runs it before any submodule anyway).
Every cycle found is listed, each as one concrete path, so one failure shows them all.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = "grpo_kernels"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE

# Cycles tolerated for now: none. An entry that no longer holds fails the test, so the list cannot go stale.
KNOWN_CYCLES: set[frozenset[str]] = set()


def _modules() -> dict[str, Path]:
    modules = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST):
    """Import nodes of a module, skipping the bodies of `if TYPE_CHECKING:`."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(base + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                # `from pkg import sub` imports the submodule when there is one, else a name of pkg
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            for target in targets:
                while target and target not in modules and "." in target:  # `import a.b.c` of a name
                    target = target.rpartition(".")[0]
                if target not in modules or target == name:
                    continue
                if name.startswith(target + "."):  # its own enclosing package's __init__
                    continue
                graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One concrete cycle per strongly connected component of more than one module (Tarjan)."""
    index, low, on_stack, stack, components = {}, {}, set(), [], []

    def visit(v):
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
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    found = []
    for component in components:  # a path back to the start inside the component (breadth first)
        start = min(component)
        paths = {start: [start]}
        queue = [start]
        while queue:
            v = queue.pop(0)
            for w in sorted(graph[v] & component):
                if w == start:
                    found.append(paths[v] + [start])
                    queue = []
                    break
                if w not in paths:
                    paths[w] = paths[v] + [w]
                    queue.append(w)
    return sorted(found)


def _show(found: list[list[str]]) -> str:
    return "\n".join("  " + " -> ".join(c) for c in found) or "  (none)"


def test_the_graph_reader_sees_lazy_imports_and_skips_type_checking_ones():
    graph = import_graph()
    assert "grpo_kernels.bench.oracle" in graph["grpo_kernels.bench.ops"]  # module level
    assert "grpo_kernels.bench.report" in graph["grpo_kernels.bench.cli"]  # inside main()
    assert "grpo_kernels.bench.ops" not in graph["grpo_kernels.bench.oracle"]  # under TYPE_CHECKING
    toy = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"e"}, "e": {"d"}, "f": {"a"}}
    assert cycles(toy) == [["a", "b", "c", "a"], ["d", "e", "d"]]


def test_no_import_cycle_inside_the_bench_harness():
    found = [c for c in cycles(import_graph()) if all(m.startswith("grpo_kernels.bench") for m in c)]
    assert not found, "import cycles inside grpo_kernels.bench:\n" + _show(found)


def test_no_import_cycle_in_the_package_beyond_the_known_ones():
    found = cycles(import_graph())
    components = {frozenset(c) for c in found}
    unexpected = [c for c in found if frozenset(c) not in KNOWN_CYCLES]
    gone = [sorted(k) for k in KNOWN_CYCLES if k not in components]
    assert not unexpected, "import cycles (each module imports the next, the last the first):\n" + _show(
        unexpected
    )
    assert not gone, f"these known cycles are gone: remove them from KNOWN_CYCLES: {gone}"
