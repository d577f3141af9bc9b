"""The documents agree with the repository: the README stays short and points to where the rest lives,
every relative link and anchor of README.md, results/README.md and docs/*.md resolves, every ``make``
target, ``python -m`` module and ``+experiment=`` preset they name exists, and the README's install and
test commands are the ones CI runs. Deterministic checks on text; nothing is run or timed."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from helpers import ROOT

DOCS = [ROOT / "README.md", ROOT / "results" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def _prose(path: Path) -> str:
    """The file's text without its fenced code blocks (a ``[x](y)`` there is code, not a link)."""
    return FENCE.sub("", path.read_text())


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in _prose(path).splitlines():
        m = re.match(r"#{1,6} (.*)", line)
        if m:
            s = _slug(m.group(1))
            out.add(s if s not in seen else f"{s}-{seen[s]}")
            seen[s] = seen.get(s, 0) + 1
    return out


def test_readme_is_under_300_lines_and_links_every_document():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) < 300
    for target in (
        "results/README.md",
        "docs/architecture.md",
        "docs/extending.md",
        "docs/protocol.md",
        "docs/running.md",
    ):
        assert f"]({target})" in text, target


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_and_anchors_resolve(doc):
    """Every link that is not a URL names a file of the repository, and its ``#anchor`` a heading there."""
    bad = []
    for target in LINK.findall(_prose(doc)):
        if re.match(r"[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        dest = (doc.parent / file).resolve() if file else doc
        if not dest.exists():
            bad.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            bad.append(target)
    assert not bad, bad


def _spans(pattern: str) -> set[str]:
    found = set()
    for doc in DOCS:
        found |= set(re.findall(pattern, doc.read_text()))
    return found


def test_named_make_targets_exist():
    targets = set(re.findall(r"^([a-zA-Z][\w-]*):", (ROOT / "Makefile").read_text(), re.M))
    named = _spans(r"`make ([a-z][\w-]*)")
    assert {"gmm", "figures", "digits", "patches", "bench"} <= named
    assert named - targets == set()


def test_named_python_modules_exist():
    named = _spans(r"python3? -m ((?:specsamp|experiments|benchmarks)[\w.]*)")
    assert {"experiments.gmm", "experiments.beyond", "specsamp.runner.report"} <= named
    missing = [m for m in sorted(named) if importlib.util.find_spec(m) is None]
    assert not missing, missing


def test_named_experiment_presets_exist():
    named = _spans(r"\+experiment=(\w+)")
    assert {"fig4_cifar10", "fid_cifar10", "table1_clip"} <= named
    missing = [n for n in sorted(named) if not (ROOT / "conf" / "experiment" / f"{n}.yaml").exists()]
    assert not missing, missing


def test_readme_install_and_test_commands_are_what_ci_runs():
    """CI (``.ci/run``) installs and tests exactly as the README's set-up says, and the ``[all]`` extra it
    installs brings the developer tools the README names (pytest, pytest-cov, vulture)."""
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    install = re.search(r"^(pip install -e \"\.\[all\]\")\s", readme, re.M).group(1)
    test = re.search(r"^(python -m pytest -q --cov[^#\n]*?)\s+#", readme, re.M).group(1)
    assert f"python -m {install}" in ci
    assert re.search(rf"^{re.escape(test)}$", ci, re.M)
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    dev = {re.split(r"[<>=!\[ ]", r, maxsplit=1)[0] for r in extras["dev"]}
    assert {"pytest", "pytest-cov", "vulture"} <= dev
    assert any("dev" in r for r in extras["all"])
    assert "dead-code scan is `vulture`" in readme
    assert "specsamp" in tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["vulture"]["paths"]


def test_dead_code_scan_is_clean():
    """``vulture`` as the README runs it (paths and kept names in pyproject.toml) reports nothing."""
    pytest.importorskip("vulture")
    scan = subprocess.run([sys.executable, "-m", "vulture"], cwd=ROOT, capture_output=True, text=True)
    assert scan.returncode == 0, scan.stdout + scan.stderr


def test_subprocesses_start_python_by_sys_executable():
    """A test, benchmark or experiment that starts Python in a subprocess names the running interpreter
    (``sys.executable``), never a bare ``python``/``python3``: a venv called by path rather than activated
    puts no ``python`` of its own on PATH, so the child would run another interpreter or none. Checked on
    the syntax tree: every call of ``subprocess.*``/``os.*`` whose command is a literal list or string."""
    import ast

    calls = {"run", "Popen", "call", "check_call", "check_output", "system", "execv", "execvp", "spawnv"}
    bare = re.compile(r"^(python3?(\.\d+)?)(\s|$)")
    found = []
    for folder in ("tests", "benchmarks", "experiments"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if not (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Attribute)
                    and node.func.attr in calls
                    and node.args
                ):
                    continue
                first = node.args[0]
                if isinstance(first, (ast.List, ast.Tuple)) and first.elts:
                    first = first.elts[0]
                if isinstance(first, ast.Constant) and isinstance(first.value, str) and bare.match(first.value):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not found, f"subprocesses started with a bare python (use sys.executable): {found}"
