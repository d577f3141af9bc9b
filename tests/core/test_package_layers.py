"""The package's layers: ``specsamp.models`` does not import ``specsamp.integrations``, and no two subpackages import
each other (each direction read from the source with ``ast``, imports inside functions included)."""

from __future__ import annotations

import ast
from pathlib import Path

import specsamp

ROOT = Path(specsamp.__file__).parent


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every ``specsamp...`` module that ``path`` imports, at any depth of its code."""
    mod = _module(path)
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.add(target)
            found.update(f"{target}.{a.name}" for a in node.names)  # `from .. import x` may name a module
    return {m for m in found if m == "specsamp" or m.startswith("specsamp.")}


def _subpackage(module: str) -> str | None:
    """``specsamp.<sub>`` where ``<sub>`` is a subpackage (a folder with ``__init__.py``), else None."""
    parts = module.split(".")
    if len(parts) < 2 or not (ROOT / parts[1] / "__init__.py").exists():
        return None
    return f"specsamp.{parts[1]}"


def _edges() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for path in ROOT.rglob("*.py"):
        edges[_module(path)] = _imports(path)
    return edges


def test_the_import_reader_sees_imports_inside_functions():
    src = ROOT / "models" / "diffusers_pipeline.py"
    assert "specsamp.models.pipelines" in _imports(src)  # imported inside a method


def test_models_do_not_import_integrations():
    bad = sorted(
        (m, t)
        for m, ts in _edges().items()
        if m.startswith("specsamp.models")
        for t in ts
        if t.startswith("specsamp.integrations")
    )
    assert not bad, f"specsamp.models imports specsamp.integrations: {bad}"


def test_no_two_subpackages_import_each_other():
    pairs: dict[tuple[str, str], list[str]] = {}
    for m, targets in _edges().items():
        a = _subpackage(m)
        for t in targets:
            b = _subpackage(t)
            if a and b and a != b:
                pairs.setdefault((a, b), []).append(f"{m} -> {t}")
    both = sorted((a, b, pairs[a, b][:3], pairs[b, a][:3]) for a, b in pairs if (b, a) in pairs and a < b)
    assert not both, f"subpackages that import each other: {both}"
