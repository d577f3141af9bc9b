"""`python run.py model=cifar10 ...` end to end on a tiny network pickled in NVIDIA's persistence format.

No download: the pickle is written by the test (tests/test_edm.py's writer), its SHA-256 configured.
"""

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from test_edm import TINY_SRC, write_persistent_pickle

ROOT = Path(__file__).resolve().parents[1]


def tiny_cond_net():
    mod = types.ModuleType("_tiny_writer_run")
    mod.persistence = types.SimpleNamespace(persistent_class=lambda cls: cls)
    exec(TINY_SRC.replace("from torch_utils import persistence", ""), mod.__dict__)
    torch.manual_seed(0)
    return mod.TinyPrecond(img_resolution=4, img_channels=3, label_dim=10)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "tiny-cifar.pkl"
    sha = write_persistent_pickle(path, tiny_cond_net(), TINY_SRC, "TinyPrecond")
    return path, sha


def run(tmp_path, *args):
    env = dict(os.environ, SPECSAMP_OFFLINE="1", SPECSAMP_CACHE=str(tmp_path / "cache"), WANDB_MODE="offline")
    cmd = [sys.executable, str(ROOT / "run.py"), "model=cifar10", "steps=5", "n_samples=6", "K=2", "L=2",
           "device=cpu", f"hydra.run.dir={tmp_path}", *args]
    return subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, env=env, timeout=300)


@pytest.mark.parametrize("sampler", ["dgrs", "rmc", "standard"])
def test_cifar10_run_saves_images_by_index(tmp_path, checkpoint, sampler):
    path, sha = checkpoint
    p = run(tmp_path, f"sampler={sampler}", f"model.path={path}", f"model.sha256={sha}", "execution=tree", "save_samples=true")
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith(f"model=edm-cifar10-32x32-cond-vp sampler={sampler}")
    rec = json.loads((tmp_path / "result.json").read_text())
    assert rec["n_samples"] == 6 and rec["speedup"]["mean"] > 0
    names = sorted(f.name for f in (tmp_path / "images").iterdir())
    assert names == [f"{i:06d}.png" for i in range(6)]
    assert (tmp_path / "grid.png").exists()


def test_wrong_checksum_is_refused_with_exit_2(tmp_path, checkpoint):
    path, _ = checkpoint
    p = run(tmp_path, f"model.path={path}", "model.sha256=" + "0" * 64)
    assert p.returncode == 2, p.stderr
    assert "trust_checkpoint" in p.stderr and "Traceback" not in p.stderr
    assert not (tmp_path / "result.json").exists()


def test_unknown_checksum_needs_trust_flag(tmp_path, checkpoint):
    path, _ = checkpoint
    p = run(tmp_path, f"model.path={path}")
    assert p.returncode == 2 and "trust_checkpoint" in p.stderr
    p = run(tmp_path, f"model.path={path}", "model.trust_checkpoint=true")
    assert p.returncode == 0, p.stderr


def test_missing_checkpoint_names_url_and_path(tmp_path):
    p = run(tmp_path)
    assert p.returncode == 2, p.stderr
    assert "edm-cifar10-32x32-cond-vp.pkl" in p.stderr and str(tmp_path / "cache") in p.stderr
    assert "Traceback" not in p.stderr
