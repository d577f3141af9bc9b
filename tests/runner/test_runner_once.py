"""The runner derives each thing once per job, and builds one record for a run and for a shard merge.

A job of ``python run.py`` (here :func:`specsamp.runner.task.run_task` in process, on a tiny GMM: d=8,
T=6, 4 trajectories) loads its config, builds its coupling, lists its unused keys, hashes its config and
checks its tree's size once each: the counts are deterministic, so they are asserted exactly.
"""

from __future__ import annotations

import functools
import importlib
import json
import pkgutil

import pytest
import torch
from helpers import write_shard_job

import specsamp.runner
from specsamp.runner import shards
from specsamp.runner.config import compose, load_config
from specsamp.runner.loop import PreparedRun, prepare, run_config
from specsamp.runner.task import run_task

TINY = ["model.dim=8", "steps=6", "n_samples=4", "progress=false"]
LOADS = ("load_config", "build_coupling", "unused_keys", "config_hash")
CHECKS = ("check_tree_nodes", "check_search")


def _count_calls(monkeypatch, names) -> dict:
    """Wrap every ``specsamp.runner`` module's binding of each name in one shared counter per name."""
    counts = dict.fromkeys(names, 0)
    originals: dict = {}
    for info in pkgutil.iter_modules(specsamp.runner.__path__):
        mod = importlib.import_module(f"specsamp.runner.{info.name}")
        for name in names:
            fn = getattr(mod, name, None)
            if not callable(fn):
                continue
            original = originals.setdefault(name, fn)

            @functools.wraps(original)
            def counted(*a, _name=name, _fn=original, **k):
                counts[_name] += 1
                return _fn(*a, **k)

            monkeypatch.setattr(mod, name, counted)
    assert set(originals) == set(names), f"not bound in any runner module: {set(names) - set(originals)}"
    return counts


@pytest.mark.parametrize(
    "overrides",
    [[], ["tree=widths", "widths=[3,2]"], ["sampler=rmc"], ["sampler=standard", "K=3"]],
    ids=["uniform", "widths", "chain", "standard-with-unused-K"],
)
def test_a_job_loads_checks_and_hashes_its_config_once(tmp_path, monkeypatch, capsys, overrides):
    monkeypatch.chdir(tmp_path)
    cfg = compose([*TINY, *overrides])
    counts = _count_calls(monkeypatch, LOADS + CHECKS)
    assert run_task(cfg) is not None
    has_tree = "sampler=standard" not in overrides  # the standard sampler drafts no tree: nothing to size
    assert counts == {**dict.fromkeys(LOADS, 1), "check_tree_nodes": int(has_tree), "check_search": 0}
    rec = json.loads((tmp_path / "result.json").read_text())
    assert rec["config_hash"] == prepare(cfg).config_hash
    assert ("unused" in rec) == ("K=3" in overrides)


def test_an_optimal_tree_job_loads_and_hashes_its_config_once(tmp_path, monkeypatch):
    """tree=optimal with a given profile (no calibration run): the config is loaded, its coupling built, its
    unused keys listed and its hash taken once."""
    monkeypatch.chdir(tmp_path)
    cfg = compose([*TINY, "tree=optimal", "delta_profile=[0.5,1.0,2.0,4.0]"])
    counts = _count_calls(monkeypatch, LOADS)
    assert run_task(cfg) is not None
    assert counts == dict.fromkeys(LOADS, 1)


def test_prepare_returns_a_prepared_run_as_it_is_and_run_config_takes_one():
    cfg = compose(TINY)
    prepared = prepare(cfg)
    assert isinstance(prepared, PreparedRun) and prepare(prepared) is prepared
    a, ra = run_config(prepared)
    b, rb = run_config(cfg)
    assert torch.equal(ra.samples, rb.samples) and a["config_hash"] == b["config_hash"]


BOOKKEEPING = {"wall_seconds", "output_dir", "merged_from", "overrides"}


@pytest.mark.parametrize(
    "overrides", [["K=3"], ["tree=optimal", "widths=[2,2]"]], ids=["uniform", "optimal-calibrated"]
)
def test_merged_shards_record_equals_the_unsharded_record_on_every_field(tmp_path, overrides):
    """Two shards merged (6 trajectories, batch_size=2: the shards run the unsharded run's batches) give the
    unsharded run's record: same keys in the same order and equal values, timing and shard bookkeeping aside.
    The optimal tree's run also records its calibration, its profile, its tree and an unused key (widths)."""
    cfg = load_config(compose([*TINY, "n_samples=6", "batch_size=2", *overrides]))[1]
    for k in range(2):
        write_shard_job(tmp_path, cfg, k, 2)
    assert shards.main(["merge", str(tmp_path)]) == 0
    merged = json.loads((tmp_path / "seed=0" / "result.json").read_text())
    full = json.loads(json.dumps(run_config(cfg)[0], default=str))
    assert [k for k in merged if k not in BOOKKEEPING] == [k for k in full if k not in BOOKKEEPING]
    for key in set(full) - BOOKKEEPING:
        assert merged[key] == full[key], key
    if "tree=optimal" in overrides:
        assert {"calibration", "speedup_with_calibration", "delta_profile", "tree_parent", "unused"} <= set(merged)


STAGES = ("prepare", "build", "sample", "make_record")


def _record_stages(monkeypatch) -> list:
    """Wrap the stage functions where the task and ``run_config`` call them; the calls, in order."""
    from specsamp.runner import loop, task

    seen: list = []
    for mod in (loop, task):
        for name in STAGES:
            fn = getattr(mod, name, None)
            if callable(fn):
                monkeypatch.setattr(
                    mod, name, functools.wraps(fn)(lambda *a, _n=name, _f=fn, **k: seen.append(_n) or _f(*a, **k))
                )
    return seen


def test_a_job_and_run_config_make_the_same_stage_calls_in_order(tmp_path, monkeypatch):
    """prepare, build, sample, make_record: once each, in that order, from run.py's task and from run_config."""
    monkeypatch.chdir(tmp_path)
    seen = _record_stages(monkeypatch)
    assert run_task(compose(TINY)) is not None
    assert seen == list(STAGES)
    seen.clear()
    run_config(compose(TINY))
    assert seen == list(STAGES)


@pytest.mark.parametrize(
    "overrides, calibrations",
    [
        ([], 0),
        (["sampler=rmc"], 0),
        (["tree=optimal", "budget=6"], 1),
        (["tree=optimal_per_step", "budget=6", "delta_profile=[0.5,1.0]"], 0),
    ],
    ids=["uniform", "chain", "optimal-calibrated", "per-step-profile"],
)
def test_a_run_builds_its_tree_and_its_target_once(monkeypatch, overrides, calibrations):
    from specsamp.runner import build

    counts = dict.fromkeys(("build_tree", "build_target", "calibrate"), 0)
    for name in counts:
        fn = getattr(build, name)
        monkeypatch.setattr(
            build,
            name,
            functools.wraps(fn)(lambda *a, _n=name, _f=fn, **k: counts.__setitem__(_n, counts[_n] + 1) or _f(*a, **k)),
        )
    run_config(compose([*TINY, *overrides]))
    assert counts == {"build_tree": 1, "build_target": 1, "calibrate": calibrations}


def test_a_shard_jobs_record_holds_the_job_fields_last_in_their_order():
    """The record of a sweep's shard job: the run's fields, then output_dir, overrides, slurm, sweep, and the
    shard's block; its n_samples (in its usual place) counts the shard's own trajectories."""
    from specsamp.runner.loop import build, sample
    from specsamp.runner.records import Job, make_record

    cfg = compose([*TINY, "n_samples=6", "batch_size=2", "num_shards=2", "shard=1", "sweep_name=s"])
    prepared = prepare(cfg, job=Job("/d", ["shard=1"], multirun=True, slurm={"job_id": "7"}))
    assert prepared.indices == range(2, 6) and prepared.job.sweep == "s"  # batches 2 and 3 of 3
    rec = make_record(prepared, sample(build(prepared)))
    keys = list(rec)
    assert keys[keys.index("versions") + 1 :] == [
        "output_dir",
        "overrides",
        "slurm",
        "sweep",
        "shard",
        "num_shards",
        "indices",
    ]
    assert keys[keys.index("steps") + 1] == "n_samples" and rec["n_samples"] == 4 and rec["indices"] == [2, 6]
    assert (rec["output_dir"], rec["overrides"], rec["slurm"], rec["sweep"]) == (
        "/d",
        ["shard=1"],
        {"job_id": "7"},
        "s",
    )
    library = run_config(cfg)[0]  # a library call is no job: all trajectories, no job fields
    assert library["n_samples"] == 6 and "output_dir" not in library and "shard" not in library


def test_one_job_enters_the_stage_module_once_per_stage():
    """benchmarks.runner_entries: a run.py job enters loop from the rest of the runner three times (prepare,
    build, sample) and never calls back into the task."""
    from benchmarks.runner_entries import count_entries

    inner, _, code = count_entries([*TINY, "n_samples=2"])
    assert code == 0 and inner["loop"] == 3 and "task" not in inner and inner["records"] <= 5
