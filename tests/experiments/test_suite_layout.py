"""The tests are grouped as the package is, and share code through helper modules only.

Every test module sits in one of the group folders of :data:`GROUPS`; basenames are unique across them
(pytest imports a test module by its basename: no ``__init__.py`` in the folders); no file under ``tests/``
imports a test module (what tests share lives in ``helpers.py``, ``tiny_edm.py``, ``tiny_sd3.py``,
``tiny_weights.py``, ``bare_env.py`` and ``conftest.py``). Deterministic: the files are read, not run.
"""

from __future__ import annotations

import ast
from collections import Counter

from helpers import ROOT

TESTS = ROOT / "tests"
# core: the sampler and its parts; runner: run.py, sweeps, records; models: the target adapters and their
# configs; metrics: FID, CLIP, IS, images; experiments: the experiment, benchmark and document checks;
# integrations: the entry points for diffusers pipelines and k-diffusion's loop
GROUPS = ("core", "runner", "models", "metrics", "experiments", "integrations")


def test_every_test_module_sits_in_a_group_folder():
    outside = sorted(
        str(p.relative_to(TESTS))
        for p in TESTS.rglob("test_*.py")
        if p.parent.parent != TESTS or p.parent.name not in GROUPS
    )
    assert not outside, f"test modules outside tests/{{{','.join(GROUPS)}}}/: {outside}"


def test_test_module_basenames_are_unique():
    counts = Counter(p.name for p in TESTS.rglob("test_*.py"))
    assert not [name for name, n in counts.items() if n > 1], counts


def test_no_file_under_tests_imports_a_test_module():
    modules = {p.stem for p in TESTS.rglob("test_*.py")} | {"tests_root"}
    found = []
    for path in sorted(TESTS.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            found += [f"{path.relative_to(TESTS)}:{node.lineno} {n}" for n in names if n.split(".")[0] in modules]
    assert not found, found
