"""The runner's modules import one another without a circle, deferred (in-function) imports included."""

from __future__ import annotations

import ast
from pathlib import Path

import specsamp.runner

RUNNER = Path(specsamp.runner.__file__).parent


def _imports(path: Path) -> set[str]:
    """Runner modules that ``path`` imports anywhere (module level or inside a function), by module name.

    A module-level ``__getattr__`` (a former name kept importable, resolved on first use) is not counted:
    importing the module never runs it.
    """
    tree = ast.parse(path.read_text())
    skip = {id(n) for f in tree.body if isinstance(f, ast.FunctionDef) and f.name == "__getattr__" for n in ast.walk(f)}
    names: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom):
            if node.level == 1:  # from .x import y / from . import x
                base = [node.module] if node.module else [a.name for a in node.names]
            elif node.level == 0 and (node.module or "").startswith("specsamp.runner."):
                base = [node.module.removeprefix("specsamp.runner.")]
            else:
                continue
            names.update(b.split(".")[0] for b in base)
        elif isinstance(node, ast.Import):
            names.update(a.name.removeprefix("specsamp.runner.").split(".")[0] for a in node.names
                         if a.name.startswith("specsamp.runner."))
    return {n for n in names if (RUNNER / f"{n}.py").is_file()} - {path.stem}


def test_the_runner_import_graph_is_acyclic():
    graph = {p.stem: _imports(p) for p in RUNNER.glob("*.py") if p.stem != "__init__"}
    assert "report" in graph["callback"] and "callback" not in graph["report"]  # the graph is read as written
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            assert state.get(nxt) != 1, "import circle: " + " -> ".join([*path[path.index(nxt):], nxt])
            if nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for start in sorted(graph):
        if start not in state:
            visit(start, [start])


def test_former_names_of_the_sweep_callback_still_import():
    from specsamp.runner import callback, report

    assert report.SweepReport is callback.SweepReport and report.SWEEP_STATE is callback.SWEEP_STATE


def test_the_package_docstring_lists_the_modules_so_that_each_imports_only_those_after_it():
    import re

    order = re.findall(r":mod:`~specsamp\.runner\.(\w+)`", specsamp.runner.__doc__)
    modules = sorted(p.stem for p in RUNNER.glob("*.py") if p.stem != "__init__")
    assert sorted(order) == modules  # every module once
    for i, name in enumerate(order):
        above = _imports(RUNNER / f"{name}.py") & set(order[:i])
        assert not above, f"{name} imports {sorted(above)}, listed above it"
