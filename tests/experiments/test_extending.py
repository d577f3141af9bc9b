"""Every example of ``docs/extending.md`` runs as written: each section's files (blocks whose first line is
``# file: PATH``) go into a temporary folder ``ext/``, its command runs through ``python run.py`` (a
child process, with ``ext`` on ``PYTHONPATH`` and ``hydra.searchpath`` pointing at ``ext/myconf``), and
the one line it prints starts with the section's ``text`` block."""

from __future__ import annotations

import os
import re
import shlex
import sys

import pytest
from helpers import ROOT, python

DOC = ROOT / "docs" / "extending.md"
SECTIONS = ("A coupling", "A draft", "A tree rule", "A model")


def section(title: str) -> str:
    text = DOC.read_text()
    start = text.index(f"## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:] if end < 0 else text[start:end]


def blocks(text: str) -> list[tuple[str, str]]:
    """``(language, body)`` of each fenced block."""
    return re.findall(r"```(\w+)\n(.*?)```", text, re.S)


def test_every_part_has_a_section():
    assert [t for t in SECTIONS if f"## {t}\n" in DOC.read_text()] == list(SECTIONS)


@pytest.mark.parametrize("title", SECTIONS)
def test_example_runs_through_run_py(title, tmp_path):
    ext = tmp_path / "ext"
    found = blocks(section(title))
    files = [
        (body.split("\n", 1)[0][len("# file: ") :].strip(), body)
        for lang, body in found
        if lang in ("python", "yaml") and body.startswith("# file: ")
    ]
    assert files, f"section {title!r} has no file block"
    for path, body in files:
        (ext / path).parent.mkdir(parents=True, exist_ok=True)
        (ext / path).write_text(body)
    (command,) = [body.strip() for lang, body in found if lang == "bash"]
    (expected,) = [body.strip() for lang, body in found if lang == "text"]
    words = shlex.split(command.replace("$PWD/ext", str(ext)))
    assert words[:3] == ["PYTHONPATH=ext", "python", "run.py"], command
    env = dict(os.environ, PYTHONPATH=str(ext), WANDB_MODE="offline", HYDRA_FULL_ERROR="0", OMP_NUM_THREADS="1")
    p = python(
        [sys.executable, str(ROOT / "run.py"), *words[3:], f"hydra.run.dir={tmp_path / 'out'}"], cwd=ROOT, env=env
    )
    assert p.returncode == 0, p.stderr
    (line,) = [ln for ln in p.stdout.splitlines() if ln.startswith("model=")]
    assert line.startswith(expected + "  speedup "), line


def test_a_typo_in_the_models_keys_names_its_own(tmp_path):
    """The model section's claim: a mistyped key of the user's model exits 2 naming the class's keys."""
    ext = tmp_path / "ext"
    for _lang, body in blocks(section("A model")):
        if body.startswith("# file: "):
            path = ext / body.split("\n", 1)[0][len("# file: ") :].strip()
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(body)
    env = dict(os.environ, PYTHONPATH=str(ext), WANDB_MODE="offline", HYDRA_FULL_ERROR="0", OMP_NUM_THREADS="1")
    args = [
        "model=gaussian",
        "model.ss=1",
        f"hydra.searchpath=[file://{ext / 'myconf'}]",
        f"hydra.run.dir={tmp_path / 'out'}",
    ]
    p = python([sys.executable, str(ROOT / "run.py"), *args], cwd=ROOT, env=env)
    claim = re.search(r'exits 2 with "(.*?)"', section("A model"), re.S).group(1)
    assert p.returncode == 2 and " ".join(claim.split()) in p.stderr, p.stderr
    assert "model.label_dim" not in p.stderr  # none of the built-in models' keys
