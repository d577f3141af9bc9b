"""Bad input at the edges of run.py and the calibration command: each exits with its documented status
(2: the user's config, 3: the machine) and one paragraph naming the key, its value and what is valid,
with no traceback and nothing already written lost. In-process where the check is a function; a
subprocess only where the exit status itself is what is checked.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import ROOT, TINY

from specsamp.errors import ConfigError
from specsamp.runner import exits
from specsamp.runner.config import PROFILE_DIR, compose, load_config

NO_GPU = not torch.cuda.is_available()


def run(args, cwd, module=None):
    """``python run.py ARGS`` (or ``python -m MODULE ARGS``) in ``cwd``; ``.err`` is stderr stripped."""
    env = dict(os.environ, WANDB_MODE="offline", HYDRA_FULL_ERROR="0",
               PYTHONPATH=os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    head = ["-m", module] if module else [str(ROOT / "run.py")]
    p = subprocess.run([sys.executable, *head, *args], cwd=cwd, capture_output=True, text=True, env=env, timeout=300)
    p.err = p.stderr.strip()
    return p


def one_paragraph(p, status: int) -> str:
    assert p.returncode == status, p.stdout + p.stderr
    assert p.err.startswith("error: ") and "\n" not in p.err and "Traceback" not in p.stdout + p.stderr, p.err
    return p.err


# ------------------------------------------------------------------------------------------------
# messages name the keys the user sets


def test_memory_refusal_names_the_sampler_value():
    from specsamp.runner.loop import run_config

    with pytest.raises(ConfigError, match=r"sampler=dgrs \(execution=path\) needs about"):
        run_config(compose(["K=1000000", "L=1"]))


def test_demo_prompts_count_names_n_samples():
    from specsamp.models.sd3.prompts import demo_prompts, load_prompts

    with pytest.raises(ValueError, match="n_samples=100 is invalid with the demo prompts.*use n_samples<=20"):
        load_prompts("demo", 100, n_key="n_samples")
    with pytest.raises(ValueError, match="n=21 is invalid"):
        demo_prompts(21)


def test_a_checkpoint_not_in_the_cache_says_what_loading_it_needs(tmp_path):
    from specsamp.models.edm import load_edm

    with pytest.raises(FileNotFoundError) as e:
        load_edm("edm-cifar10-32x32-cond-vp", cache_dir=tmp_path, download=False)
    assert "model.sha256=<its SHA-256>" in str(e.value) and "model.trust_checkpoint=true" in str(e.value)
    with pytest.raises(FileNotFoundError) as e:
        load_edm("edm-cifar10-32x32-cond-vp", cache_dir=tmp_path, download=False, trust_checkpoint=True)
    assert "model.sha256" not in str(e.value)
