"""The runner's modules import one another top down, in the order its package docstring lists them, deferred
(in-function) imports included. That no module of the project imports itself through others:
``tests/experiments/test_import_cycles.py``."""

from __future__ import annotations

import ast
from pathlib import Path

import specsamp.runner

RUNNER = Path(specsamp.runner.__file__).parent


def _imports(path: Path) -> set[str]:
    """Runner modules that ``path`` imports anywhere (module level or inside a function), by module name."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1:  # from .x import y / from . import x
                base = [node.module] if node.module else [a.name for a in node.names]
            elif node.level == 0 and (node.module or "").startswith("specsamp.runner."):
                base = [node.module.removeprefix("specsamp.runner.")]
            else:
                continue
            names.update(b.split(".")[0] for b in base)
        elif isinstance(node, ast.Import):
            names.update(
                a.name.removeprefix("specsamp.runner.").split(".")[0]
                for a in node.names
                if a.name.startswith("specsamp.runner.")
            )
    return {n for n in names if (RUNNER / f"{n}.py").is_file()} - {path.stem}


def test_the_package_docstring_lists_the_modules_so_that_each_imports_only_those_after_it():
    import re

    order = re.findall(r":mod:`~specsamp\.runner\.(\w+)`", specsamp.runner.__doc__)
    modules = sorted(p.stem for p in RUNNER.glob("*.py") if p.stem != "__init__")
    assert sorted(order) == modules  # every module once
    for i, name in enumerate(order):
        above = _imports(RUNNER / f"{name}.py") & set(order[:i])
        assert not above, f"{name} imports {sorted(above)}, listed above it"
