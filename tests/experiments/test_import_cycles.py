"""No module of the project imports itself, directly or through others, deferred imports included.

The graph is read from the source with :mod:`ast` (nothing is imported): every module under ``specsamp/``,
``experiments/``, ``benchmarks/`` and ``hydra_plugins/``, and every ``import`` statement in it, at module
level, inside a function or class, under ``if TYPE_CHECKING:`` or in a module-level ``__getattr__``. An edge
goes to the module a statement names: ``import a.b`` and ``from a.b import name`` to ``a.b``, and
``from a import b`` to ``a.b`` where ``b`` is a submodule; not to the packages above it (a package whose
``__init__`` imports its own submodules is no cycle). Relative imports are resolved against the importing
module's package. Imports by a computed name (``importlib.import_module``) are not read.
A cycle is a strongly connected component of more than one module, or a module that imports itself.
"""

from __future__ import annotations

import ast
import functools
from collections import deque
from pathlib import Path

from helpers import ROOT

PACKAGES = ("specsamp", "experiments", "benchmarks", "hydra_plugins")


def _modules() -> dict[str, Path]:
    """Module name -> file, for every module of :data:`PACKAGES` (a package by its ``__init__.py``)."""
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _targets(node: ast.Import | ast.ImportFrom, name: str, is_package: bool, known: set[str]) -> set[str]:
    """The project modules that one import statement in module ``name`` names."""
    if isinstance(node, ast.Import):
        return {a.name for a in node.names} & known
    if node.level:  # relative: resolved against the importing module's package
        package = name.split(".") if is_package else name.split(".")[:-1]
        base = ".".join(package[: len(package) - (node.level - 1)] + ([node.module] if node.module else []))
    else:
        base = node.module or ""
    found = {f"{base}.{a.name}" for a in node.names} & known  # `from pkg import submodule`
    if base in known and len(found) < len(node.names):  # some names are attributes of `base` itself
        found.add(base)
    return found


@functools.cache
def import_graph() -> dict[str, frozenset[str]]:
    """Module name -> the project modules it imports anywhere in its source (read once per session)."""
    modules = _modules()
    known = set(modules)
    graph = {}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        tree = ast.parse(path.read_text(), str(path))
        graph[name] = frozenset(
            t
            for node in ast.walk(tree)
            if isinstance(node, (ast.Import, ast.ImportFrom))
            for t in _targets(node, name, is_package, known)
        )
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module, and the modules that import themselves
    (Tarjan's algorithm, iterative), each as a sorted list."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1 or node in graph[node]:
                        found.append(sorted(component))
    return sorted(found)


def _loop(component: list[str], graph) -> list[str]:
    """A shortest chain of imports inside ``component`` from its first module back to it."""
    start, inside = component[0], set(component)
    came_from: dict[str, str] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for nxt in sorted(graph[node] & inside):
            if nxt == start:
                chain = [node]
                while chain[-1] != start:
                    chain.append(came_from[chain[-1]])
                return [*reversed(chain), start]
            if nxt not in came_from:
                came_from[nxt] = node
                queue.append(nxt)
    raise AssertionError(f"{component} is not a cycle")


def _describe(component: list[str], graph) -> str:
    """One component: a chain of imports around it, then each member's imports inside it."""
    inside = set(component)
    return (
        " -> ".join(_loop(component, graph))
        + "\n    ("
        + "; ".join(f"{m} imports {', '.join(sorted(graph[m] & inside))}" for m in component)
        + ")"
    )


def test_the_graph_is_read_as_written():
    graph = import_graph()
    assert {
        "specsamp",
        "specsamp.runner.loop",
        "experiments.gmm",
        "benchmarks.bench",
        "hydra_plugins.specsamp_sweeper",
    } <= set(graph)
    assert "specsamp.runner.config" in graph["specsamp.runner.loop"]  # relative, `from . import` or absolute
    assert "specsamp.sampler" in graph["specsamp"]  # the package's re-exports
    assert "specsamp.runner.slurm" in graph["specsamp.runner.report"]  # `from . import slurm as queue`
    assert "specsamp.runner.jobs" in graph["hydra_plugins.specsamp_sweeper"]  # `from specsamp.runner import jobs`
    assert "specsamp.runner" not in graph["hydra_plugins.specsamp_sweeper"]  # ... names the submodule only
    assert "specsamp.theory" in graph["specsamp.coupling"]  # inside a function
    assert not [m for m, to in graph.items() if not to <= set(graph)]


def test_the_cycle_finder_finds_components_and_self_imports():
    graph = {"a": {"b"}, "b": {"c", "d"}, "c": {"a"}, "d": {"b"}, "e": {"a"}}
    assert cycles(graph) == [["a", "b", "c", "d"]]
    assert _loop(["a", "b", "c", "d"], graph) == ["a", "b", "c", "a"]
    assert cycles({"a": {"a"}, "b": {"a"}}) == [["a"]] and _loop(["a"], {"a": {"a"}}) == ["a", "a"]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_imports_itself_through_others():
    graph = import_graph()
    found = cycles(graph)
    for component in found:
        print("import cycle:", _describe(component, graph))
    assert not found, "import cycles (a strongly connected component, or a self-import):\n" + "\n".join(
        _describe(c, graph) for c in found
    )


def test_the_compile_checks_reach_no_round_module():
    # specsamp.inductor (can this machine compile, can inductor's cache serve) is read by the runner's config
    # check and the benchmarks without the compiled round: nothing it imports, even through others, is a round module
    graph = import_graph()
    reached, todo = set(), ["specsamp.inductor"]
    while todo:
        for m in graph[todo.pop()] - reached:
            reached.add(m)
            todo.append(m)
    rounds = {m for m in graph if m == "specsamp.round" or m.startswith("specsamp.round.")} | {"specsamp.sampler"}
    assert not reached & rounds, sorted(reached & rounds)
    assert "specsamp.inductor" in graph["specsamp.round.compiled"]  # the dependency goes the other way
