"""No import cycle among the modules of recipes/ (nor of benchmarks/), lazy imports included.

``lint-imports`` (pyproject's contracts) checks the same packages with grimp, which also
sees imports inside functions; this test reads every import statement of every module
itself (module level, inside functions, under ``if TYPE_CHECKING``), so a cycle closed by a
function-level import fails here too, with the cycle named.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def imports(package: str, root: Path = ROOT) -> dict[str, set[str]]:
    """Module → the modules of ``package`` (a folder of ``root``) it imports anywhere in its
    source."""
    folder = root / package
    modules = {f"{package}.{p.stem}" if p.stem != "__init__" else package: p
               for p in folder.glob("*.py")}  # fmt: skip
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        here = name if path.stem == "__init__" else name.rpartition(".")[0]
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the package the module is in
                    base = ".".join([*here.split(".")[: len(here.split(".")) - node.level + 1],
                                     *([base] if base else [])])  # fmt: skip
                subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in modules]
                targets = subs or [base]  # ``from . import a``: the module a, not the package
            else:
                continue
            found |= {t for t in targets if t in modules and t != name}
        graph[name] = found
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` (its modules in order, the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_checker_finds_a_cycle_closed_by_a_lazy_import(tmp_path):
    """The test's own precondition: a function-level import that closes a cycle is seen."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .b import f\n")
    (pkg / "b.py").write_text("def f():\n    from . import a\n    return a\n")
    graph = imports("pkg", tmp_path)
    assert graph["pkg.a"] == {"pkg.b"} and graph["pkg.b"] == {"pkg.a"}
    assert find_cycle(graph) in (["pkg.a", "pkg.b", "pkg.a"], ["pkg.b", "pkg.a", "pkg.b"])


@pytest.mark.parametrize("package", ["recipes", "benchmarks"])
def test_no_import_cycle(package):
    graph = imports(package)
    assert len(graph) > 10 and any(graph.values())  # the modules were read
    cycle = find_cycle(graph)
    assert cycle is None, f"import cycle in {package}/: {' -> '.join(cycle or [])}"
