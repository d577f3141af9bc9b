"""A built wheel carries what a run needs beyond the Python modules: the Hydra configs (``specsamp/conf/``,
which ``conf/`` at the repository root links to) and the sweeper plugin (``hydra_plugins/specsamp_sweeper``),
and composes from them with no checkout in sight.

The wheel is built offline (``pip wheel --no-build-isolation``, with the setuptools installed here) from a
copy of the sources, so the checkout gets no ``build/`` or ``*.egg-info``."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from importlib import metadata

import pytest
from helpers import ROOT

SOURCES = ("pyproject.toml", "README.md", "specsamp", "hydra_plugins")


def _cannot_build_wheels() -> str | None:
    """Why setuptools here cannot build a wheel offline (None when it can)."""
    try:
        version = metadata.version("setuptools")
    except metadata.PackageNotFoundError:
        return "setuptools is not installed"
    major, minor = (int(p) for p in (version.split(".") + ["0"])[:2])
    if (major, minor) < (70, 1):  # bdist_wheel moved into setuptools in 70.1; before, the wheel package had it
        try:
            metadata.version("wheel")
        except metadata.PackageNotFoundError:
            return (
                f"setuptools {version} needs the wheel package to build a wheel "
                "(pip install 'setuptools>=70.1', or pip install wheel)"
            )
    return None


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    why = _cannot_build_wheels()
    if why:
        pytest.skip(why)
    src = tmp_path_factory.mktemp("src")
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            shutil.copy2(ROOT / name, src / name)
    out = tmp_path_factory.mktemp("wheel")
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            str(src),
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "-q",
            "-w",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    (whl,) = out.glob("specsamp-*.whl")
    return whl


def test_the_wheel_carries_every_config_profile_and_the_sweeper_plugin(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    conf = ROOT / "specsamp" / "conf"
    configs = sorted(
        f"specsamp/conf/{p.relative_to(conf).as_posix()}" for p in conf.rglob("*") if p.suffix in (".yaml", ".json")
    )
    assert "specsamp/conf/config.yaml" in configs and any(c.startswith("specsamp/conf/profiles/") for c in configs)
    assert not [c for c in configs if c not in names], "configs missing from the wheel"
    plugin = sorted(
        f"hydra_plugins/specsamp_sweeper/{p.name}" for p in (ROOT / "hydra_plugins" / "specsamp_sweeper").glob("*.py")
    )
    assert "hydra_plugins/specsamp_sweeper/__init__.py" in plugin
    assert not [f for f in plugin if f not in names], "sweeper plugin files missing from the wheel"
    # hydra_plugins stays a namespace package, shared with the other Hydra plugins installed
    assert "hydra_plugins/__init__.py" not in names
    data = sorted(f"specsamp/data/{p.name}" for p in (ROOT / "specsamp" / "data").iterdir() if p.is_file())
    assert not [f for f in data if f not in names], "data files missing from the wheel"


def test_the_unpacked_wheel_composes_and_finds_the_sweeper_away_from_the_checkout(wheel, tmp_path):
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    code = "\n".join(
        [
            "import specsamp",
            "from hydra.core.plugins import Plugins",
            "from hydra.plugins.sweeper import Sweeper",
            "from specsamp.runner.config import CONF_DIR, compose, load_config",
            "run, _ = load_config(compose(['sampler=dgrs', 'K=2', 'delta_profile=gmm_x0']))",
            "print(specsamp.__file__)",
            "print(CONF_DIR)",
            "print(run.sampler.name, run.K)",
            "import sys",
            "found = [p for p in Plugins.instance().discover(Sweeper) if p.__name__ == 'SpecsampSweeper']",
            "print(sys.modules[found[0].__module__].__file__ if found else 'no SpecsampSweeper')",
        ]
    )
    # the unpacked wheel first on the path (an editable install's finder comes after sys.path)
    env = dict(os.environ, PYTHONPATH=str(site))
    p = subprocess.run(
        [sys.executable, "-c", code], cwd=elsewhere, capture_output=True, text=True, env=env, timeout=300
    )
    assert p.returncode == 0, p.stderr
    module, conf_dir, run, sweeper = p.stdout.strip().splitlines()[-4:]
    assert module == str(site / "specsamp" / "__init__.py")
    assert conf_dir == str(site / "specsamp" / "conf")
    assert run == "dgrs 2"
    assert sweeper.startswith(str(site / "hydra_plugins" / "specsamp_sweeper" / ""))
