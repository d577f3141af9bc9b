"""The documents' examples run as written: every fenced Python block that a ``<!-- runnable -->`` line precedes, in
``README.md`` and ``docs/integrations.md``, is executed in a fresh namespace, and the README opens with what a
newcomer needs. Deterministic, offline, tiny sizes (a few seconds in all once torch and diffusers are imported).

The blocks are executed in this process, where ``tests/`` is on ``sys.path`` (``conftest.py``); so that a block
cannot lean on the tests' helpers (``tiny_diffusers``, ``helpers``, ...), every module a block imports must
resolve outside ``tests/``.
"""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import io
import re
from pathlib import Path

import pytest
import torch
from helpers import ROOT

MARKER = "<!-- runnable -->"
BLOCK = re.compile(r"^" + re.escape(MARKER) + r"[ \t]*\n```python[ \t]*\n(.*?)^```[ \t]*$", re.M | re.S)
DOCUMENTS = {"README.md": 2, "docs/integrations.md": 2}  # document: how many runnable blocks it holds at least


def runnable_blocks(name: str) -> list[tuple[int, str]]:
    """``(line, code)`` of every fenced ``python`` block directly after a ``<!-- runnable -->`` line of ``name``."""
    text = (ROOT / name).read_text()
    return [(text.count("\n", 0, m.start()) + 1, m.group(1)) for m in BLOCK.finditer(text)]


def _imported_modules(code: str) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def _cases():
    return [
        pytest.param(name, line, code, id=f"{name}:{line}")
        for name in DOCUMENTS
        for line, code in runnable_blocks(name)
    ]


def test_every_document_keeps_its_runnable_blocks():
    """The marker convention is in use: each document holds at least the runnable blocks it is known to hold, and a
    marker is always followed by a python block (a marker before anything else would silently run nothing)."""
    for name, least in DOCUMENTS.items():
        text = (ROOT / name).read_text()
        assert len(runnable_blocks(name)) >= least, name
        assert text.count(MARKER) == len(runnable_blocks(name)), (
            f"{name}: a {MARKER} line not followed by a python block"
        )


@pytest.mark.parametrize(("name", "line", "code"), _cases())
def test_runnable_block_runs_as_written(name, line, code):
    tests_dir = (ROOT / "tests").resolve()
    for module in sorted(_imported_modules(code)):
        spec = importlib.util.find_spec(module.split(".")[0])
        assert spec is not None, f"{name}:{line} imports {module}, which is not installed"
        origin = Path(spec.origin or next(iter(spec.submodule_search_locations or []), "")).resolve()
        assert tests_dir not in origin.parents, f"{name}:{line} imports {module} from tests/: a reader does not have it"
    printed = io.StringIO()
    with torch.random.fork_rng(), contextlib.redirect_stdout(printed):
        exec(compile(code, f"{name}:{line}", "exec"), {"__name__": "__main__"})
    assert printed.getvalue().strip(), f"{name}:{line} printed nothing"


def test_readme_opens_with_setup_quick_start_and_every_entry_point():
    """Within its first 60 lines the README says what specsamp is, how to install and test it, and shows run.py,
    your own model, a diffusers pipeline and k-diffusion's sampler, before any table of measurements."""
    head = "\n".join((ROOT / "README.md").read_text().splitlines()[:60])
    for needed in (
        "## Set up",
        'pip install -e ".[all]"',
        "python -m pytest -q --cov",
        "## Quick start",
        "python run.py",
        "sample_speculative(",
        "from specsamp.integrations.diffusers import speculative",
        "from specsamp.integrations.k_diffusion import sample_euler_ancestral",
    ):
        assert needed in head, needed
    assert "\n|" not in head, "a table in the README's first 60 lines"
