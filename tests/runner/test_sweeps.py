"""Sweeps at cluster scale: launchers, deterministic sweep directories, resume, failures, shards, tables.

Every sweep here is a tiny GMM (d=8, T=6, 4 trajectories). Subprocess runs of run.py cost a few
seconds each, so one basic-launcher sweep is shared (module fixture) and copied, mtimes preserved, into
each test that relaunches it. The submitit_local sweep (one interpreter per job) is marked slow.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch
from helpers import ROOT, python, write_shard_job
from omegaconf import OmegaConf

from specsamp.errors import ConfigError
from specsamp.runner import jobs, report, shards
from specsamp.runner.config import compose, load_config
from specsamp.runner.loop import run_config

CONF = ROOT / "conf"
TINY = ["model.dim=8", "steps=6", "n_samples=4"]
GRID = [*TINY, "K=1,2", "L=2,3"]  # 4 jobs


def run(args, cwd, check=True, timeout=300):
    """``python run.py ARGS`` in ``cwd``; returns the CompletedProcess (stdout + stderr in ``.out``)."""
    env = dict(os.environ, WANDB_MODE="offline", HYDRA_FULL_ERROR="0")
    p = python(
        [sys.executable, str(ROOT / "run.py"), *args], cwd=cwd, capture_output=True, text=True, env=env, timeout=timeout
    )
    p.out = p.stdout + p.stderr
    if check:
        assert p.returncode == 0, p.out
    return p


def results(sweep: Path) -> dict[str, float]:
    """``{job dir name: result.json mtime}``."""
    return {p.parent.name: p.stat().st_mtime_ns for p in sweep.glob("*/result.json")}


def compose_cfg(overrides, hydra=False):
    if not hydra:
        return compose(overrides)
    from hydra import compose as hydra_compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return hydra_compose(config_name="config", overrides=overrides, return_hydra_config=True)


@pytest.fixture(scope="module")
def grid(tmp_path_factory):
    """A finished 4-job basic-launcher sweep in ``<tmp>/multirun/grid`` (run once per module)."""
    cwd = tmp_path_factory.mktemp("grid")
    p = run(["-m", *GRID, "sweep_name=grid"], cwd)
    return cwd, p


def copy_grid(grid, tmp_path) -> Path:
    cwd, _ = grid
    shutil.copytree(cwd / "multirun", tmp_path / "multirun", copy_function=shutil.copy2)
    return tmp_path / "multirun" / "grid"


# ------------------------------------------------------------------------------------------------
# launchers and directories


@pytest.mark.parametrize("launcher", ["basic", "local", "slurm"])
def test_launcher_options_compose(launcher):
    cfg = compose_cfg([f"hydra/launcher={launcher}", "sweep_name=x"], hydra=True)
    target = cfg.hydra.launcher._target_
    assert target.endswith({"basic": "BasicLauncher", "local": "LocalLauncher", "slurm": "SlurmLauncher"}[launcher])
    assert cfg.hydra.sweep.dir == "multirun/x"


def test_slurm_overrides_reach_the_sbatch_script(tmp_path, monkeypatch):
    """Our `slurm` option's keys are valid submitit parameters and end up in the sbatch header."""
    submitit = pytest.importorskip("submitit")
    from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf

    bindir = tmp_path / "bin"  # submitit's SlurmExecutor insists on finding `srun`
    bindir.mkdir()
    (bindir / "srun").write_text("#!/bin/sh\nexit 0\n")
    (bindir / "srun").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    ov = [
        "partition=gpu",
        "account=proj",
        "qos=high",
        "gpus_per_node=2",
        "cpus_per_task=4",
        "mem_gb=32",
        "timeout_min=90",
    ]
    cfg = compose_cfg(["hydra/launcher=slurm", "sweep_name=x", *(f"hydra.launcher.{o}" for o in ov)], hydra=True)
    params = OmegaConf.to_container(cfg.hydra.launcher, resolve=False)
    params.pop("_target_")
    from hydra_plugins.specsamp_sweeper.slurm import LAUNCHER_KEYS

    for key in LAUNCHER_KEYS:  # our launcher's own keys, not submitit's
        params.pop(key)
    params["name"] = "specsamp"
    folder = str(tmp_path / "submitit")
    params.pop("submitit_folder")
    # what hydra_submitit_launcher's launch() does with these parameters
    ex = submitit.AutoExecutor(folder=folder, cluster="slurm", slurm_max_num_timeout=params.pop("max_num_timeout"))
    base = set(OmegaConf.structured(BaseQueueConf).keys())
    ex.update_parameters(**{k if k in base else f"slurm_{k}": v for k, v in params.items()})
    text = ex._executor._make_submission_file_text("python -m submitit.core._submit x", "uid")
    for line in (
        "--partition=gpu",
        "--account=proj",
        "--qos=high",
        "--gpus-per-node=2",
        "--cpus-per-task=4",
        "--mem=32GB",
        "--time=90",
    ):
        assert f"#SBATCH {line}" in text, text


def test_sweep_dir_is_named_by_sweep_name_and_jobs_by_overrides(grid):
    cwd, p = grid
    sweep = cwd / "multirun" / "grid"
    names = sorted(d.name for d in sweep.iterdir() if d.is_dir() and not d.name.startswith("."))
    # sweep_name names the sweep directory, so it is excluded from the job directory names
    assert names == [f"K={k},L={l},model.dim=8,n_samples=4,steps=6" for k in (1, 2) for l in (2, 3)]
    assert len(results(sweep)) == 4
    assert "4 jobs, 4 ran, 0 skipped" in p.stdout
    rec = json.loads((sweep / names[0] / "result.json").read_text())
    assert rec["sweep"] == "grid" and "sweep_name" not in rec["config"] and "shard" not in rec["config"]


def test_default_sweep_name_is_a_timestamp_and_single_run_hash_ignores_it():
    name = OmegaConf.to_container(compose_cfg([]), resolve=True)["sweep_name"]
    assert len(name.split("/")) == 2 and name[:2] == "20"
    a = load_config(compose_cfg(["sweep_name=a"]))[1]
    b = load_config(compose_cfg(["sweep_name=b"]))[1]
    assert a == b and "sweep_name" not in a and "num_shards" not in a


def test_wandb_group_is_the_sweep_name_unless_set(monkeypatch):
    from specsamp.runner import loggers

    seen = []
    monkeypatch.setattr(loggers.WandbLogger, "log", lambda self, *a: seen.append(self.group))
    wandb = load_config(compose_cfg(["logger=wandb"]))[0].logger
    loggers.log_record(wandb, {}, {}, Path("."), "grid")
    loggers.log_record(wandb, {}, {}, Path("."), None)  # single run: no group
    loggers.log_record(
        load_config(compose_cfg(["logger=wandb", "logger.group=mine"]))[0].logger, {}, {}, Path("."), "grid"
    )
    loggers.log_record(load_config(compose_cfg([]))[0].logger, {}, {}, Path("."), "grid")  # logger=none: nothing
    assert seen == ["grid", None, "mine"]


# ------------------------------------------------------------------------------------------------
# tables


def test_collect_gives_one_tidy_row_per_job(grid, tmp_path):
    cwd, _ = grid
    sweep = cwd / "multirun" / "grid"
    df = report.collect(sweep)
    assert len(df) == 4 and set(df["status"]) == {"ok"}
    assert sorted(zip(df["K"], df["L"])) == [(1, 2), (1, 3), (2, 2), (2, 3)]
    assert sorted(df["budget"]) == [2, 3, 6, 14]  # chains for K=1, B = K + ... + K^L otherwise
    for col in (
        "speedup_mean",
        "speedup_sem",
        "nfe_mean",
        "nfe_total_mean",
        "target_rows_mean",
        "batch_speedup",
        "wall_seconds",
        "acc_d1",
    ):
        assert df[col].notna().all(), col
    assert (df["model.dim"] == "8").all()  # a swept/overridden key that is not a standard column
    assert df["acceptance"].str.count("/").tolist() == [l - 1 for l in df["L"]]
    out = tmp_path / "t.csv"
    p = python(
        [sys.executable, "-m", "specsamp.runner.report", "collect", str(sweep), "--csv", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert p.returncode == 0, p.stderr
    assert "4 jobs: 4 ok, 0 failed, 0 running, 0 killed, 0 missing" in p.stdout
    csv = pd.read_csv(out)
    assert len(csv) == 4 and list(csv["speedup_mean"]) == list(df["speedup_mean"])


def test_collect_while_running_marks_running_and_missing(grid, tmp_path):
    sweep = copy_grid(grid, tmp_path)
    (sweep / "K=1,L=2,model.dim=8,n_samples=4,steps=6" / "result.json").unlink()  # started, not finished
    shutil.rmtree(sweep / "K=2,L=3,model.dim=8,n_samples=4,steps=6")  # planned, not started
    df = report.collect(sweep).set_index("job")
    assert df.loc["K=1,L=2,model.dim=8,n_samples=4,steps=6", "status"] == "running"
    assert df.loc["K=1,L=2,model.dim=8,n_samples=4,steps=6", "K"] == 1  # from the job's .hydra/config.yaml
    assert df.loc["K=2,L=3,model.dim=8,n_samples=4,steps=6", "status"] == "missing"
    assert (df["status"] == "ok").sum() == 2


def test_collect_names_each_jobs_kernel_beside_eps(grid, tmp_path):
    """The kernel column follows eps: the record's kernel (em where a record leaves the key out, as em's do),
    a failed job's recorded config, a job without a record Hydra's config; the CSV has it in the same place."""
    sweep = copy_grid(grid, tmp_path)
    jobs = sorted(p for p in sweep.iterdir() if p.is_dir())
    ddpm = json.loads((jobs[0] / "result.json").read_text())
    assert "kernel" not in ddpm and "kernel" not in ddpm["config"]  # em, the default
    ddpm.update(kernel="ddpm", eps=None, config={**ddpm["config"], "kernel": {"name": "ddpm"}, "eps": None})
    (jobs[0] / "result.json").write_text(json.dumps(ddpm))
    config = json.loads((jobs[1] / "result.json").read_text())["config"]
    (jobs[1] / "result.json").unlink()
    (jobs[1] / "failed.json").write_text(
        json.dumps(
            {
                "status": "failed",
                "kind": "exception",
                "error": "boom",
                "config": {**config, "kernel": {"name": "euler_ancestral"}},
            }
        )
    )
    (jobs[2] / "result.json").unlink()  # no record: Hydra's .hydra/config.yaml names the kernel
    df = report.collect(sweep)
    columns = list(df.columns)
    assert columns[columns.index("eps") : columns.index("eps") + 3] == ["eps", "kernel", "steps"]
    assert [c for c in columns if c in report.COLUMNS] == report.COLUMNS  # the standard columns in their order
    kernels = dict(zip(df["job"], df["kernel"]))
    assert [kernels[j.name] for j in jobs] == ["ddpm", "euler_ancestral", "em", "em"], kernels
    out = tmp_path / "t.csv"
    assert report.main(["collect", str(sweep), "--csv", str(out)]) == 0
    header = out.read_text().splitlines()[0].split(",")
    assert header[header.index("eps") + 1] == "kernel" and header.count("kernel") == 1


def test_collect_cli_bad_dir_exits_2(tmp_path):
    p = python(
        [sys.executable, "-m", "specsamp.runner.report", "collect", str(tmp_path / "nope")],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert p.returncode == 2 and "SWEEP_DIR=" in p.stderr and "Traceback" not in p.stderr


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_tables_without_a_sweep_names_the_variable():
    p = subprocess.run(["make", "-s", "tables", f"PYTHON={sys.executable}"], cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 2 and "error: SWEEP is unset" in p.stderr and "make tables SWEEP=multirun/" in p.stderr
    assert "the following arguments are required" not in p.stderr  # stopped before the collector ran


# ------------------------------------------------------------------------------------------------
# resume


# default guards: test_deleted_record_is_recomputed_alone (3 skips, records kept) and the path-valued resume below
@pytest.mark.slow
def test_relaunch_skips_every_finished_job(grid, tmp_path):
    sweep = copy_grid(grid, tmp_path)
    before = results(sweep)
    p = run(["-m", *GRID, "sweep_name=grid"], tmp_path)
    assert p.stdout.count("skipped (done, config") == 4, p.out
    assert "4 jobs, 0 ran, 4 skipped" in p.stdout
    assert results(sweep) == before


def test_deleted_record_is_recomputed_alone(grid, tmp_path):
    sweep = copy_grid(grid, tmp_path)
    before = results(sweep)
    gone = "K=2,L=2,model.dim=8,n_samples=4,steps=6"
    old = json.loads((sweep / gone / "result.json").read_text())
    (sweep / gone / "result.json").unlink()  # what a job killed mid-run leaves behind
    p = run(["-m", *GRID, "sweep_name=grid"], tmp_path)
    assert p.stdout.count("skipped (done, config") == 3 and "4 jobs, 1 ran, 3 skipped" in p.stdout, p.out
    after = results(sweep)
    assert {k for k in after if after[k] != before.get(k)} == {gone}
    new = json.loads((sweep / gone / "result.json").read_text())
    assert new["speedup"] == old["speedup"] and new["config_hash"] == old["config_hash"]  # keyed randomness


# ------------------------------------------------------------------------------------------------
# failures


def test_failed_job_is_reported_and_the_others_stand(tmp_path):
    p = run(["-m", *TINY, "K=1,0", "sweep_name=bad"], tmp_path, check=False)
    assert p.returncode == 2, p.out  # the only failure is a bad value: a user error
    sweep = tmp_path / "multirun" / "bad"
    good, bad = sweep / "K=1,model.dim=8,n_samples=4,steps=6", sweep / "K=0,model.dim=8,n_samples=4,steps=6"
    assert (good / "result.json").exists() and not (bad / "result.json").exists()
    failed = json.loads((bad / "failed.json").read_text())
    assert failed["kind"] == "config" and "K=0 is invalid" in failed["error"] and "K=0" in failed["overrides"]
    assert "1 ran, 0 skipped (done before), 1 failed" in p.stdout
    assert "failed: K=0,model.dim=8,n_samples=4,steps=6: K=0 is invalid" in p.stdout
    assert "Traceback" not in p.out
    df = report.collect(sweep).set_index("job")
    assert df.loc[good.name, "status"] == "ok" and df.loc[bad.name, "status"] == "failed"
    assert "K=0 is invalid" in df.loc[bad.name, "error"] and df.loc[bad.name, "K"] == 0


def test_bad_shard_keys_name_key_and_value():
    cases = (
        (["num_shards=0"], "num_shards=0"),
        (["num_shards=2", "shard=2"], "shard=2"),
        (["num_shards=8", "n_samples=4"], "num_shards=8"),
        (["num_shards=3", "n_samples=4", "batch_size=2"], "batch_size"),
    )
    for ov, needle in cases:
        with pytest.raises(ConfigError, match=needle):
            load_config(compose_cfg([*TINY, *ov]))


# ------------------------------------------------------------------------------------------------
# shards


def test_shard_indices_partition_in_order_and_respect_batches():
    for n, s, bs in ((10, 3, None), (7, 7, None), (10, 3, 2), (9, 2, 4), (100, 8, 5)):
        blocks = [shards.shard_indices(n, k, s, bs) for k in range(s)]
        assert [i for b in blocks for i in b] == list(range(n)) and all(len(b) for b in blocks)
        if bs:
            assert all(b.start % bs == 0 for b in blocks)


@pytest.fixture(scope="module")
def tiny_cfg():
    return load_config(compose_cfg([*TINY, "n_samples=6", "batch_size=2"]))[1]  # the recorded dict


def test_run_config_indices_reproduce_the_full_run(tiny_cfg):
    _, full = run_config(tiny_cfg)
    parts = [run_config(tiny_cfg, indices=shards.shard_indices(6, k, 2, 2))[1] for k in range(2)]
    assert torch.equal(full.samples, torch.cat([p.samples for p in parts]))  # batch-aligned: bitwise
    assert torch.equal(full.nfe, torch.cat([p.nfe for p in parts]))
    one_batch = {**tiny_cfg, "batch_size": None}
    _, whole = run_config(one_batch)
    _, tail = run_config(one_batch, indices=[3, 4, 5])
    # other batch shapes: BLAS may round differently in the last bit, the trajectories are the same
    torch.testing.assert_close(whole.samples[3:], tail.samples, rtol=1e-12, atol=1e-12)
    with pytest.raises(ConfigError, match="indices"):
        run_config(tiny_cfg, indices=[6])


def test_merge_names_a_missing_shard_then_merges_when_complete(tiny_cfg, tmp_path, capsys):
    write_shard_job(tmp_path, tiny_cfg, 0, 3)
    write_shard_job(tmp_path, tiny_cfg, 2, 3)
    assert shards.main(["merge", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "missing shard 1" in err and "num_shards=3,seed=0,shard=1" in err
    assert not (tmp_path / "seed=0" / "result.json").exists()  # nothing merged, nothing skipped silently
    write_shard_job(tmp_path, tiny_cfg, 1, 3)
    assert shards.main(["merge", str(tmp_path)]) == 0
    merged = json.loads((tmp_path / "seed=0" / "result.json").read_text())
    full_rec, full = run_config(tiny_cfg)
    assert torch.equal(torch.load(tmp_path / "seed=0" / "samples.pt"), full.samples)
    # the merged record is the unsharded run's record (same keys, same statistics, same config hash)
    assert set(full_rec) <= set(merged)
    for key in set(full_rec) - {"wall_seconds", "batch_speedup", "versions"}:
        assert merged[key] == full_rec[key], key
    assert shards.main(["merge", str(tmp_path)]) == 0 and "already merged" in capsys.readouterr().out
    assert shards.main(["merge", str(tmp_path / "nope")]) == 2


def test_two_shard_jobs_plus_merge_equal_one_unsharded_run_bitwise(tmp_path):
    common = [*TINY, "batch_size=2", "save_samples=true"]
    run([*common, f"hydra.run.dir={tmp_path / 'single'}"], tmp_path)
    p = run(["-m", *common, "num_shards=2", "shard=0,1", "sweep_name=sh"], tmp_path)
    assert "[shard 0/2]" in p.stdout and "[shard 1/2]" in p.stdout
    # each shard's line counts its own 2 of the 4 trajectories, as its record does
    assert p.stdout.count("(2 trajectories,") == 2 and "(4 trajectories," not in p.stdout
    sweep = tmp_path / "multirun" / "sh"
    merged_dir = sweep / "batch_size=2,model.dim=8,n_samples=4,save_samples=True,steps=6"
    assert f"shards merged: multirun/sh/{merged_dir.name}" in p.stdout  # merged at the end of the sweep
    one = torch.load(tmp_path / "single" / "samples.pt")
    merged = torch.load(merged_dir / "samples.pt")
    assert one.dtype == merged.dtype and torch.equal(one, merged)
    a = json.loads((tmp_path / "single" / "result.json").read_text())
    b = json.loads((merged_dir / "result.json").read_text())
    assert (
        a["config_hash"] == b["config_hash"]
        and a["speedup"] == b["speedup"]
        and a["acceptance_per_depth"] == b["acceptance_per_depth"]
    )
    assert shards.main(["merge", str(sweep)]) == 0  # idempotent
    df = report.collect(sweep)
    assert sorted(df["shard"].fillna(-1).astype(int)) == [-1, 0, 1] and (df["status"] == "ok").all()


# ------------------------------------------------------------------------------------------------
# slow: the submitit engine on this machine, and a job that raises


@pytest.mark.slow
def test_submitit_local_sweep_completes_relaunch_skips(tmp_path):
    args = ["-m", "hydra/launcher=local", "hydra.sweeper.max_batch_size=2", *GRID, "sweep_name=loc"]
    run(args, tmp_path, timeout=600)
    sweep = tmp_path / "multirun" / "loc"
    assert len(results(sweep)) == 4 and (sweep / ".submitit").is_dir()
    assert not list(sweep.rglob("%j")), "the local launcher left a directory literally named %j"
    out = tmp_path / "loc.csv"
    assert report.main(["collect", str(sweep), "--csv", str(out)]) == 0
    assert len(pd.read_csv(out)) == 4
    before = results(sweep)
    p = run(args, tmp_path, timeout=600)
    assert "4 jobs, 0 ran, 4 skipped" in p.stdout and results(sweep) == before
    logs = "".join(f.read_text() for f in (sweep / ".submitit").rglob("*_log.out"))
    assert logs.count("skipped (done, config") == 4


@pytest.mark.slow
def test_submitit_local_failure_does_not_stop_the_others(tmp_path):
    # L=0 fails validation; sampler=nope does not even compose (in the job's own process under submitit)
    p = run(
        ["-m", "hydra/launcher=local", *TINY, "L=2,0", "sampler=dgrs,nope", "sweep_name=locbad"],
        tmp_path,
        check=False,
        timeout=600,
    )
    assert p.returncode == 2, p.out
    assert "4 jobs, 1 ran, 0 skipped (done before), 3 failed" in p.stdout, p.out
    df = report.collect(tmp_path / "multirun" / "locbad")
    ok = df[df["sampler"] == "dgrs"].set_index("L")
    assert ok.loc[2, "status"] == "ok" and ok.loc[0, "status"] == "failed" and "L=0 is invalid" in ok.loc[0, "error"]
    nope = df[df["sampler"] == "nope"]
    assert (
        len(nope) == 2
        and (nope["status"] == "failed").all()
        and nope["error"].str.contains("sampler=nope is not an option").all()
    )


@pytest.mark.slow
def test_job_raising_an_exception_is_recorded_with_its_traceback(tmp_path):
    # a network that raises inside the sampler: not a config error (every value is valid), so status 1
    from tiny_edm import TINY_SRC, tiny_precond, write_persistent_pickle

    good, bad = tmp_path / "good.pkl", tmp_path / "bad.pkl"
    write_persistent_pickle(good, tiny_precond(), TINY_SRC, "TinyPrecond")
    boom = TINY_SRC.replace("x = x.to(torch.float32)", "raise RuntimeError('boom in the network')")
    write_persistent_pickle(bad, tiny_precond(), boom, "TinyPrecond")
    p = run(
        [
            "-m",
            "model=ffhq",
            f"model.path={good},{bad}",
            "model.trust_checkpoint=true",
            "steps=4",
            "n_samples=2",
            "K=2",
            "L=2",
            "sweep_name=exc",
        ],
        tmp_path,
        check=False,
    )
    assert p.returncode == 1, p.out
    sweep = tmp_path / "multirun" / "exc"
    failed = [json.loads(f.read_text()) for f in sweep.glob("*/failed.json")]
    assert len(failed) == 1 and failed[0]["kind"] == "exception", p.out
    assert "Traceback" in failed[0]["traceback"] and "boom in the network" in failed[0]["traceback"]
    assert len(list(sweep.glob("*/result.json"))) == 1


# ------------------------------------------------------------------------------------------------
# job directory names: unique per job whatever the values hold; resume finds them


def test_job_dirname_is_one_unique_bounded_component():
    plain = ["K=2", "L=3", "sampler=rmc", "eps=0.1", "seed=-1", "save_samples=True"]
    assert jobs.job_dirname(plain) == "K=2,L=3,eps=0.1,sampler=rmc,save_samples=True,seed=-1"  # Hydra's name
    assert jobs.job_dirname(["K=2", "device=cpu"], ["device"]) == "K=2"
    assert jobs.job_dirname([]) == ""
    tricky = [
        ["model.path=../../tiny.pkl", "L=2"],
        ["model.path=../../tiny.pkl", "L=3"],
        ["model.path=..", "L=2"],
        ["model.path=a/b", "L=2"],
        ["model.path=a_b", "L=2"],
        ["model.path=a/b,L=2"],
        ["model.path='a,b'", "L=2"],
        ["model.path='a=b'", "L=2"],
        ["model.path=a", "b=L=2"],
        ["widths=[3,2]"],
        ["widths=[3,2", "2]"],
        ["model.name=" + "x" * 300],
        ["model.name=" + "x" * 299 + "y"],
        [f"k{i}=v" for i in range(60)],
        ["model.name=.hidden"],
        ["model.name=/abs/path"],
    ]
    names = [jobs.job_dirname(o) for o in tricky]
    assert len(set(names)) == len(names), names
    for name in names:
        assert "/" not in name and not name.startswith(".") and name not in ("", "..") and len(name) <= 120
        assert "@" in name or name == "L=2,model.path=a_b"  # hashed form (never equal to a plain name)
    assert jobs.job_dirname(["L=2", "model.path=a/b"]) == jobs.job_dirname(["model.path=a/b", "L=2"])  # order-free


@pytest.fixture(scope="module")
def tiny_pickle(tmp_path_factory):
    from tiny_edm import TINY_SRC, tiny_precond, write_persistent_pickle

    root = tmp_path_factory.mktemp("ckpt")
    net = tiny_precond(img_channels=3, label_dim=10)
    sha = write_persistent_pickle(root / "tiny.pkl", net, TINY_SRC, "TinyPrecond")
    return root, sha


def test_path_valued_override_gives_each_job_its_own_directory_and_resume_finds_it(tiny_pickle):
    """From two levels below a checkpoint, ``model.path=../../tiny.pkl L=2,3``: two records, then two skips."""
    root, sha = tiny_pickle
    cwd = root / "a" / "b"
    cwd.mkdir(parents=True, exist_ok=True)
    args = [
        "-m",
        "model=cifar10",
        "model.path=../../tiny.pkl",
        f"model.sha256={sha}",
        "L=2,3",
        "K=2",
        "steps=5",
        "n_samples=2",
        "sweep_name=paths",
    ]
    env_cache = {"SPECSAMP_OFFLINE": "1", "SPECSAMP_CACHE": str(root / "cache")}
    os.environ.update(env_cache)
    try:
        p = run(args, cwd)
        assert "2 jobs, 2 ran, 0 skipped (done before), 0 failed" in p.stdout, p.out
        sweep = cwd / "multirun" / "paths"
        recs = {json.loads(f.read_text())["L"]: f for f in sweep.glob("*/result.json")}
        assert sorted(recs) == [2, 3] and recs[2].parent != recs[3].parent
        assert all(f.parent.parent == sweep for f in recs.values())  # one path component per job
        df = report.collect(sweep)
        assert sorted(df["status"]) == ["ok", "ok"]
        before = results(sweep)
        p = run(args, cwd)
        assert p.stdout.count("skipped (done, config") == 2 and "2 jobs, 0 ran, 2 skipped" in p.stdout, p.out
        assert results(sweep) == before
    finally:
        for k in env_cache:
            os.environ.pop(k, None)


def test_shards_of_a_path_valued_job_merge_where_the_unsharded_job_looks(tmp_path):
    common = [*TINY, "batch_size=2", "model.name='runs/x,y'", "sweep_name=shp"]  # a value with '/' and ','
    p = run(["-m", *common, "num_shards=2", "shard=0,1"], tmp_path)
    assert "shards merged:" in p.stdout, p.out
    p = run(["-m", *common], tmp_path)  # the unsharded job finds the merged record
    assert p.stdout.count("skipped (done, config") == 1 and "1 jobs, 0 ran, 1 skipped" in p.stdout, p.out


# ------------------------------------------------------------------------------------------------
# a job that does not compose fails alone


@pytest.mark.parametrize(
    "sweeper", [[], ["hydra/sweeper=specsamp", "hydra.sweeper.validate=false"]], ids=["default", "validate=false"]
)
def test_job_that_does_not_compose_is_recorded_and_the_others_run(tmp_path, sweeper):
    p = run(["-m", *sweeper, "sampler=nope,dgrs,rmc", *TINY, "K=2", "L=2", "sweep_name=comp"], tmp_path, check=False)
    assert p.returncode == 2, p.out
    assert "3 jobs, 2 ran, 0 skipped (done before), 1 failed" in p.stdout, p.out
    sweep = tmp_path / "multirun" / "comp"
    bad = sweep / "K=2,L=2,model.dim=8,n_samples=4,sampler=nope,steps=6"
    failed = json.loads((bad / "failed.json").read_text())
    assert (
        failed["kind"] == "config"
        and "sampler=nope is not an option of the config group sampler; valid: auto, dgrs, markmax, rmc, standard"
        in failed["error"]
    )
    assert not (bad / "result.json").exists() and not (bad / jobs.RUNNING).exists()
    for ok in ("dgrs", "rmc"):
        assert (sweep / f"K=2,L=2,model.dim=8,n_samples=4,sampler={ok},steps=6" / "result.json").exists()
    assert "Traceback" not in p.out
    df = report.collect(sweep).set_index("sampler")
    assert (
        df.loc["nope", "status"] == "failed" and df.loc["dgrs", "status"] == "ok" and (df["status"] != "missing").all()
    )


def test_a_bad_job_after_a_good_one_is_counted(tmp_path):
    p = run(["-m", "sampler=dgrs,nope", *TINY, "sweep_name=comp2"], tmp_path, check=False)
    assert p.returncode == 2 and "2 jobs, 1 ran, 0 skipped (done before), 1 failed" in p.stdout, p.out


def test_validate_true_refuses_the_sweep_before_launching(tmp_path):
    p = run(["-m", "hydra.sweeper.validate=true", "sampler=dgrs,nope", *TINY, "sweep_name=v"], tmp_path, check=False)
    assert (
        p.returncode == 2
        and "sampler=nope is not an option of the config group sampler" in p.stderr
        and "Traceback" not in p.out
    )
    assert not list((tmp_path / "multirun" / "v").glob("*/result.json"))


# ------------------------------------------------------------------------------------------------
# make sweep-local's demo


def _make_var(name: str) -> str:
    p = subprocess.run(
        ["make", "-s", "-C", str(ROOT), "--eval", f"print-var: ; @echo $({name})", "print-var"],
        capture_output=True,
        text=True,
    )
    return p.stdout.strip()


def test_sweep_local_demo_cells_differ(tmp_path):
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    args = _make_var("SWEEP_ARGS").split()
    assert args, "SWEEP_ARGS not found in the Makefile"
    run(["-m", *args, "sweep_name=demo"], tmp_path)  # the basic launcher: same jobs, same numbers
    df = report.collect(tmp_path / "multirun" / "demo")
    cells = [f"{m:.3f} ± {s:.3f}" for m, s in zip(df["speedup_mean"], df["speedup_sem"])]
    assert len(cells) == 4 and len(set(cells)) == 4, cells


def test_cell_seed_gives_each_cell_its_own_deterministic_seed():
    """``+cell_seed=independent``: cells of a grid get distinct seeds (independent Monte Carlo errors), the
    same cell always the same one (a rerun skips or reproduces it), within the seed's valid range; the
    resolved seed is what the record holds."""
    from specsamp.runner.config import SEED_BOUND, compose, load_config

    seeds = {}
    for sampler in ("rmc", "dgrs"):
        for K, L in ((2, 3), (3, 2), (5, 3)):
            run, rec = load_config(compose([f"sampler={sampler}", f"K={K}", f"L={L}", "+cell_seed=independent"]))
            assert rec["seed"] == run.seed and 0 <= run.seed < SEED_BOUND
            seeds[sampler, K, L] = run.seed
    assert len(set(seeds.values())) == len(seeds)
    again, _ = load_config(compose(["sampler=rmc", "K=2", "L=3", "+cell_seed=independent", "n_samples=7"]))
    assert again.seed == seeds["rmc", 2, 3]  # n_samples does not name the cell: the same trajectories, more of them
    plain, _ = load_config(compose(["sampler=rmc", "K=2", "L=3"]))
    assert plain.seed == 0


def test_sweep_over_models_checks_each_jobs_overrides_against_its_own_model(tmp_path):
    """``-m model=gmm,digits model.fid_extractor=...``: the key exists for the digits network, not for the GMM.
    The sweep is not refused as a whole: the digits job runs, the GMM job is recorded as failed (kind config,
    naming the key and GMMConfig), and the sweep exits 2."""
    from specsamp.runner.exits import per_job_model_overrides

    p = run(
        [
            "-m",
            "model=gmm,digits",
            "model.fid_extractor=digits-classifier",
            "steps=4",
            "n_samples=2",
            "progress=false",
            "sweep_name=models",
        ],
        tmp_path,
        check=False,
    )
    assert p.returncode == 2, p.out
    sweep = tmp_path / "multirun" / "models"
    ok = json.loads(
        (sweep / "model.fid_extractor=digits-classifier,model=digits,n_samples=2,steps=4" / "result.json").read_text()
    )
    assert ok["status"] == "ok" and ok["config"]["model"]["fid_extractor"] == "digits-classifier"
    bad = json.loads(
        (sweep / "model.fid_extractor=digits-classifier,model=gmm,n_samples=2,steps=4" / "failed.json").read_text()
    )
    assert bad["kind"] == "config" and "model.fid_extractor=digits-classifier is not a key of GMMConfig" in bad["error"]
    # only a sweep over the model group is rewritten; everything else reaches Hydra as typed
    assert per_job_model_overrides(["model=digits", "model.dim=3"]) == ["model=digits", "model.dim=3"]
    assert per_job_model_overrides(["-m", "K=1,2", "model.dim=3"]) == ["-m", "K=1,2", "model.dim=3"]
