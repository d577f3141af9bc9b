import os
import sys

import pytest
import torch

HERE = os.path.dirname(__file__)
sys.path.insert(
    0, HERE
)  # tests/: helpers.py, tiny_edm.py, tiny_sd3.py, tiny_weights.py, bare_env.py, from every group folder
sys.path.insert(0, os.path.dirname(HERE))  # the repo root: experiments/, hydra_plugins/ (our sweeper)

import specsamp.runner.config  # noqa: E402,F401  (Hydra's ConfigStore knows the schemas before any compose)

# auto's measured costs and profiles go to a folder of this test process, not the user's ~/.cache (subprocesses inherit)
os.environ.setdefault("SPECSAMP_CACHE_DIR", __import__("tempfile").mkdtemp(prefix="specsamp-auto-"))


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    """Small tensors: one intra-op thread avoids OpenMP oversubscription on small CPU machines."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


_CLUSTER: list[str | None] = []


def slurm_cluster_missing() -> str | None:
    """Why the `slurm`-marked tests cannot run here (None when a SLURM controller answers), asked once."""
    if not _CLUSTER:
        import shutil
        import subprocess

        missing = [c for c in ("sbatch", "squeue", "sacct", "scancel", "scontrol") if shutil.which(c) is None]
        if missing:
            why = f"no SLURM commands here ({', '.join(missing)} missing)"
        else:
            try:
                p = subprocess.run(["scontrol", "ping"], capture_output=True, text=True, timeout=20)
                said = (p.stdout.strip() or p.stderr.strip() or "no answer").splitlines()[0]
                why = None if p.returncode == 0 and "UP" in p.stdout else f"no SLURM controller answers ({said})"
            except (OSError, subprocess.TimeoutExpired) as e:
                why = f"no SLURM controller answers ({e})"
        _CLUSTER.append(
            None
            if why is None
            else f"{why}: start the test cluster with `tests/slurm/cluster.sh start` (root), then `python -m pytest -m slurm`"
        )
    return _CLUSTER[0]


def pytest_collection_modifyitems(config, items):
    """Skip the `slurm`-marked tests, with the reason, when no SLURM cluster is up."""
    marked = [item for item in items if item.get_closest_marker("slurm") is not None]
    if marked and (why := slurm_cluster_missing()) is not None:
        for item in marked:
            item.add_marker(pytest.mark.skip(reason=why))
