"""The core stands alone: each core module imports with torch, numpy and scipy only.

Run in a subprocess where the runner's and the plotting stack's packages, and the library's own model adapters
and runner, cannot be imported (a ``sys.meta_path`` finder, :mod:`bare_env`). That subprocess imports torch and
numpy (and scipy.special, about 0.4 s a child otherwise) once, then forks one child per core module, which imports
that module alone and reports what else it
loaded: each module is checked in a process that holds nothing of specsamp beforehand, at the cost of one
interpreter's start instead of one per module. Deterministic: no sampling.
"""

from __future__ import annotations

import json

import pytest
from bare_env import run_blocked

CORE = (
    "sampler",
    "coupling",
    "listcoupling",
    "drafts",
    "trees",
    "treesearch",
    "schedule",
    "rng",
    "theory",
    "round",
    "round.tables",
    "round.compiled",
    "round.context",
    "round.loop",
    "round.sparse",
    "round.dense",
    "inductor",
    "batching",
    "testing",
    "result",
    "grs",
    "markmax_params",
)
BLOCKED = ("omegaconf", "hydra", "pandas", "matplotlib", "specsamp.models", "specsamp.runner")


def test_the_blocker_refuses_a_subpackage_and_allows_its_parent():
    code = "import specsamp\ntry:\n    import specsamp.models\nexcept ModuleNotFoundError:\n    print('refused')\n"
    proc = run_blocked(code, blocked=("specsamp.models",))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "refused"


# one child per module, forked after torch, numpy and scipy.special (allowed) are imported and before anything of specsamp is;
# each prints one JSON line: the module, its exit status, the blocked modules it loaded, the end of its traceback
_FORKED = """
import importlib, json, os, sys, traceback
import numpy, scipy.special, torch
assert not any(m == 'specsamp' or m.startswith('specsamp.') for m in sys.modules)
for name in {names!r}:
    sys.stdout.flush()
    pid = os.fork()
    if pid == 0:
        status, bad, err = 1, None, ''
        try:
            importlib.import_module('specsamp.' + name)
            bad = sorted(m for m in sys.modules if any(m == b or m.startswith(b + '.') for b in {blocked!r}))
            status = 0
        except BaseException:
            err = traceback.format_exc()[-2000:]
        finally:
            try:
                print(json.dumps([name, status, bad, err]), flush=True)
                import coverage
                cov = coverage.Coverage.current()
                if cov is not None:  # the child's own data file (coverage restarted it at the fork)
                    cov.stop()
                    cov.save()
            finally:
                os._exit(status)
    os.waitpid(pid, 0)
"""


@pytest.fixture(scope="module")
def imported():
    """Each core module's ``(exit status, blocked modules loaded, traceback)``, from its own forked child."""
    proc = run_blocked(_FORKED.format(names=CORE, blocked=BLOCKED), blocked=BLOCKED, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("[")]
    return {name: (status, bad, err) for name, status, bad, err in rows}


@pytest.mark.parametrize("name", CORE)
def test_core_module_imports_without_models_runner_or_config_stack(name, imported):
    assert name in imported, f"no report from the child that imports specsamp.{name}"
    status, bad, err = imported[name]
    assert status == 0, err
    assert bad == []


def test_models_base_still_exports_batched():
    from specsamp.batching import batched
    from specsamp.models import batched as from_models
    from specsamp.models.base import batched as from_base

    assert from_models is batched and from_base is batched


def test_no_module_of_the_package_is_over_600_lines():
    import specsamp

    root = __import__("pathlib").Path(specsamp.__file__).parent
    long = {
        str(p.relative_to(root)): n for p in sorted(root.rglob("*.py")) if (n := len(p.read_text().splitlines())) > 600
    }
    assert not long, f"split these modules by what each part owns: {long}"
