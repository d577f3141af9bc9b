"""The core stands alone: each core module imports with torch, numpy and scipy only.

Run in a subprocess where the runner's and the plotting stack's packages, and the library's own model adapters
and runner, cannot be imported (a ``sys.meta_path`` finder, :mod:`bare_env`). Deterministic: no sampling.
"""

from __future__ import annotations

import pytest
from bare_env import run_blocked

CORE = ("sampler", "coupling", "listcoupling", "drafts", "trees", "treesearch", "schedule", "rng", "theory", "leantree", "compiled",
        "batching", "testing", "result", "chains", "rounds", "lean", "grs", "markmax_params")
BLOCKED = ("omegaconf", "hydra", "pandas", "matplotlib", "specsamp.models", "specsamp.runner")


def test_the_blocker_refuses_a_subpackage_and_allows_its_parent():
    code = ("import specsamp\n"
            "try:\n    import specsamp.models\nexcept ModuleNotFoundError:\n    print('refused')\n")
    proc = run_blocked(code, blocked=("specsamp.models",))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "refused"


@pytest.mark.parametrize("name", CORE)
def test_core_module_imports_without_models_runner_or_config_stack(name):
    code = (f"import importlib, sys\nimportlib.import_module('specsamp.{name}')\n"
            f"bad = sorted(m for m in sys.modules if any(m == b or m.startswith(b + '.') for b in {BLOCKED!r}))\n"
            "print(bad)\n")
    proc = run_blocked(code, blocked=BLOCKED, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[]"


def test_models_base_still_exports_batched():
    from specsamp.batching import batched
    from specsamp.models import batched as from_models
    from specsamp.models.base import batched as from_base

    assert from_models is batched and from_base is batched


def test_no_module_of_the_package_is_over_600_lines():
    import specsamp

    root = __import__("pathlib").Path(specsamp.__file__).parent
    long = {str(p.relative_to(root)): n for p in sorted(root.rglob("*.py")) if (n := len(p.read_text().splitlines())) > 600}
    assert not long, f"split these modules by what each part owns: {long}"
