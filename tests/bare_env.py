"""Run Python code in a subprocess where chosen packages cannot be imported (as on a bare device image).

A ``sys.meta_path`` finder placed first refuses the blocked names (a package and everything under it; dotted
names such as ``specsamp.models`` block that subpackage only) with ``ModuleNotFoundError``
(an ``ImportError``, so optional imports guarded by ``except ImportError`` behave as without the package).
"""

from __future__ import annotations

import os
import subprocess
import sys

from helpers import ROOT

# what the GPU machine's image lacks (the project's runner and metrics need them; the core must not)
DEVICE_LACKS = ("omegaconf", "hydra", "diffusers", "open_clip", "torch_fidelity", "wandb")
# beyond torch, numpy and scipy: what the core, the EDM adapter and the stand-ins must not need either
NOT_CORE = DEVICE_LACKS + ("pandas", "sklearn", "matplotlib", "tqdm", "transformers", "submitit", "PIL")

_PRELUDE = """
import sys
class _Blocker:
    blocked = frozenset({blocked!r})
    def find_spec(self, name, path=None, target=None):
        if any(name == b or name.startswith(b + '.') for b in self.blocked):
            raise ModuleNotFoundError(f"No module named {{name!r}} (blocked: absent from the bare image)", name=name)
        return None
sys.meta_path.insert(0, _Blocker())
"""


def run_blocked(
    code: str, blocked=DEVICE_LACKS, args=(), env=None, timeout: float = 300
) -> subprocess.CompletedProcess:
    """``python -c <blocker + code> args`` from the repository root; returns the completed process (text output)."""
    full = _PRELUDE.format(blocked=tuple(blocked)) + code
    e = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(
        [sys.executable, "-c", full, *args], cwd=ROOT, env=e, capture_output=True, text=True, timeout=timeout
    )
