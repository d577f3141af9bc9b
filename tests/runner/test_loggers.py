"""logger=wandb through the runner: an offline wandb run holding the record's scalars; logger=none logs nothing."""

from __future__ import annotations

import json
import os
import sys

import pytest
from helpers import ROOT, python

TINY = ["model.dim=8", "steps=6", "n_samples=4", "K=2", "L=2", "progress=false"]


def test_wandb_offline_run_holds_the_record(tmp_path):
    pytest.importorskip("wandb")
    out = tmp_path / "out"
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    p = python(
        [sys.executable, str(ROOT / "run.py"), "logger=wandb", *TINY, f"hydra.run.dir={out}"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
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


def _run(args, out, **env):
    env = {
        **os.environ,
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "HYDRA_FULL_ERROR": "0",
        "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), *filter(None, [os.environ.get("PYTHONPATH")])]),
        **env,
    }
    return python(
        [sys.executable, str(ROOT / "run.py"), *args, *TINY, f"hydra.run.dir={out}"],
        cwd=out.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize(
    "args, needle",
    [
        (["logger=wandb", "logger.mode=bogus"], "logger.mode='bogus' is invalid: must be one of online, offline"),
        (
            ["logger=wandb", "logger.mode=online"],
            "logger.mode='online' is invalid here: it uploads to W&B, and no credentials",
        ),
    ],
)
def test_bad_logger_values_exit_2_before_sampling(tmp_path, args, needle):
    """A logger value that cannot log is refused at the start: exit 2, one paragraph, no record."""
    out = tmp_path / "out"
    p = _run(args, out, WANDB_API_KEY="", NETRC=str(tmp_path / "no-netrc"))
    err = p.stderr.strip()
    assert p.returncode == 2 and needle in err and "\n" not in err and "Traceback" not in err, err
    assert not (out / "result.json").exists()


def test_a_logger_failure_is_recorded_and_the_relaunch_retries_it(tmp_path):
    """The logger fails after the record is written: exit 3, the record keeps its numbers with
    logger_error set; the same command relaunched skips the sampling, logs, and clears logger_error."""
    out = tmp_path / "out"
    args = ["logger._target_=helpers.FlakyLogger", "logger.name=flaky"]
    p = _run(args, out, FLAKY_LOGGER_DOWN="1")
    assert p.returncode == 3 and "Traceback" not in p.stderr, p.stderr
    assert (
        "logger=flaky failed: ConnectionError" in p.stderr
        and f"rerun the same command with hydra.run.dir={out.name} " in p.stderr
        and "to retry the logging" in p.stderr
    )
    rec = json.loads((out / "result.json").read_text())
    assert (
        rec["status"] == "ok"
        and rec["logger_error"].startswith("logger=flaky failed")
        and not (out / "logged.txt").exists()
    )
    again = _run(args, out)
    assert again.returncode == 0, again.stderr
    assert again.stdout.startswith("skipped (done") and "logged (retried)" in again.stdout
    after = json.loads((out / "result.json").read_text())
    assert "logger_error" not in after and after["speedup"] == rec["speedup"]
    assert (out / "logged.txt").read_text() == f"{rec['speedup']['mean']}\n"
    third = _run(args, out)  # logged once: a further launch logs nothing again
    assert third.returncode == 0 and "logged (retried)" not in third.stdout
    assert (out / "logged.txt").read_text().count("\n") == 1


def test_a_logger_failure_in_a_sweep_is_listed_exits_3_and_is_retried(tmp_path):
    """In a sweep the jobs keep their records (each with logger_error), the summary lists them as not logged
    and the sweep exits 3; the relaunch skips the sampling, logs each job once and exits 0."""
    env = {
        **os.environ,
        "WANDB_MODE": "offline",
        "HYDRA_FULL_ERROR": "0",
        "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), *filter(None, [os.environ.get("PYTHONPATH")])]),
    }
    cmd = [
        sys.executable,
        str(ROOT / "run.py"),
        "-m",
        "logger._target_=helpers.FlakyLogger",
        "logger.name=flaky",
        *TINY[:-2],
        "K=1,2",
        "L=2",
        "progress=false",
        "sweep_name=lg",
    ]
    p = python(cmd, cwd=tmp_path, env={**env, "FLAKY_LOGGER_DOWN": "1"}, capture_output=True, text=True, timeout=300)
    assert p.returncode == 3, p.stdout + p.stderr
    assert p.stdout.count("not logged: ") == 2 and "Traceback" not in p.stderr
    jobs = [d for d in (tmp_path / "multirun" / "lg").iterdir() if (d / "result.json").exists()]
    assert len(jobs) == 2 and all("logger_error" in json.loads((d / "result.json").read_text()) for d in jobs)
    again = python(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stdout + again.stderr
    assert again.stdout.count("logged (retried)") == 2 and "not logged" not in again.stdout
    assert all((d / "logged.txt").read_text().count("\n") == 1 for d in jobs)
