"""A batch-wise run interrupted after k batches and run again continues from its finished batches
(:mod:`specsamp.runner.resume`), and its record and samples equal those of an uninterrupted run.

Deterministic: the tiny GMM (d=16, T=16, seed 0) with 24 trajectories in batches of 5 (5 batches, the
last one of 4); equalities are bitwise (the same batches are sampled, or read back, in both runs).
"""

from __future__ import annotations

import pytest
import torch

from specsamp.runner import compose, run_config
from specsamp.runner.resume import BATCHES, BatchStore, active

CFG = ["model.dim=16", "steps=16", "n_samples=24", "batch_size=5", "K=2", "L=3", "progress=false"]
SAME = (
    "config_hash",
    "nfe",
    "nfe_total",
    "speedup",
    "batch_speedup",
    "target_rows",
    "rounds",
    "committed_per_round",
    "acceptance_per_depth",
    "attempts_per_depth",
    "budget",
    "tree",
)


class Stop(Exception):
    pass


class StopAfter(BatchStore):
    """A store whose attempt is stopped (as by SLURM's signal) once ``k`` batches are written."""

    def __init__(self, *args, k: int):
        super().__init__(*args)
        self.k = k

    def save(self, ids, result):
        path = super().save(ids, result)
        assert active() is self  # the signal handler sees a run that can resume
        if self.saved == self.k:
            raise Stop
        return path


@pytest.mark.parametrize(
    "extra",
    [
        [],
        ["sampler=standard"],
        ["num_shards=2", "shard=1"],
        ["kernel=ddpm"],
        ["kernel=euler_ancestral", "sampler=standard"],
    ],
)
def test_a_run_interrupted_after_k_batches_resumes_and_records_what_an_uninterrupted_run_does(tmp_path, extra):
    cfg = compose(CFG + extra)
    indices = range(15, 24) if extra[:1] == ["num_shards=2"] else None  # shard 1 of 2: batches 3..4 (ids 15..23)
    whole, res = run_config(cfg, indices=indices)
    h = whole["config_hash"]
    n = 2 if indices is not None else 5
    k = 1 if indices is not None else 2
    with pytest.raises(Stop):
        run_config(cfg, indices=indices, batches=StopAfter(tmp_path, h, k=k))
    assert len(list((tmp_path / BATCHES).glob("*.pt"))) == k and active() is None
    again = BatchStore(tmp_path, h)
    rec, res2 = run_config(cfg, indices=indices, batches=again)
    assert (again.loaded, again.saved) == (k, n - k)  # the finished batches are read, not sampled again
    assert rec["resumed"] == {"batches": k, "of": n} and "resumed" not in whole
    assert {key: rec[key] for key in SAME} == {key: whole[key] for key in SAME}
    for name in ("samples", "nfe", "nfe_total", "target_rows", "rounds", "committed", "attempts", "accepts"):
        assert torch.equal(getattr(res2, name), getattr(res, name)), name
    assert torch.equal(res2.extra["indices"], res.extra["indices"])


def test_batches_of_another_config_or_max_batch_are_sampled_again(tmp_path):
    cfg = compose(CFG)
    whole, _ = run_config(cfg)
    with pytest.raises(Stop):
        run_config(cfg, batches=StopAfter(tmp_path, "another-hash", k=2))
    other = BatchStore(tmp_path, whole["config_hash"])
    rec, _ = run_config(cfg, batches=other)
    assert (other.loaded, other.saved) == (0, 5) and "resumed" not in rec
    with pytest.raises(Stop):
        run_config(compose(CFG + ["max_batch=3"]), batches=StopAfter(tmp_path, whole["config_hash"], k=5))
    chunks = BatchStore(tmp_path, whole["config_hash"])
    run_config(cfg, batches=chunks)
    assert (chunks.loaded, chunks.saved) == (0, 5)  # written under max_batch=3: the rounding may differ


def test_a_single_batch_run_keeps_nothing(tmp_path):
    store = BatchStore(tmp_path, "h")
    run_config(compose(CFG[:-2] + ["batch_size=null", "progress=false"]), batches=store)
    assert store.saved == 0 and not (tmp_path / BATCHES).exists()
