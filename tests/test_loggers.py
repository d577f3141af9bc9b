"""logger=wandb through the runner: an offline wandb run holding the record's scalars; logger=none logs nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY = ["model.dim=8", "steps=6", "n_samples=4", "K=2", "L=2", "progress=false"]


def test_wandb_offline_run_holds_the_record(tmp_path):
    pytest.importorskip("wandb")
    out = tmp_path / "out"
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    p = subprocess.run([sys.executable, str(ROOT / "run.py"), "logger=wandb", *TINY, f"hydra.run.dir={out}"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    rec = json.loads((out / "result.json").read_text())
    runs = list((out / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1, list((out / "wandb").rglob("*"))
    blob = runs[0].read_bytes()
    for key in (b"speedup", b"speedup_sem", b"target_rows", b"acceptance/depth1", b"budget"):
        assert key in blob, key
    assert rec["config"]["logger"]["name"] == "wandb"


def test_logger_none_and_missing_wandb(tmp_path, monkeypatch, capsys):
    from specsamp.runner.config import LoggerConfig
    from specsamp.runner.loggers import log_record

    log_record(LoggerConfig(), {}, {}, tmp_path)  # logger=none: nothing to do, nothing written
    assert not any(tmp_path.iterdir())
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    log_record(LoggerConfig(name="wandb", _target_="specsamp.runner.loggers.WandbLogger"), {}, {}, tmp_path)
    assert "wandb package is not installed" in capsys.readouterr().out
