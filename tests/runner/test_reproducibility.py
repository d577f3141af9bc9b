"""Trajectory i's result does not depend on how many trajectories the run has, for every tree rule.

What is equal (docs/architecture.md, "What is equal across splits"): the counts bitwise; the samples to the rounding
of the model's
batched evaluation (a row's output may differ by a few ulps with the batch it is in, and the sampler
carries that rounding through its steps).
"""

from __future__ import annotations

import pytest
import torch

from specsamp.runner import compose, run_config

COUNTS = ("nfe", "nfe_total", "target_rows", "rounds", "attempts", "accepts")
BASE = ["model.dim=8", "steps=8", "progress=false", "threads=1"]

RULES = {
    "uniform": ["sampler=dgrs", "K=2", "L=3"],
    "widths": ["sampler=dgrs", "tree=widths", "widths=[3,1,2]"],
    "chain": ["sampler=rmc", "K=2", "L=2"],
    "optimal": ["sampler=dgrs", "tree=optimal", "budget=6", "draft=x0_extrap_gated"],
    "optimal_per_step": ["sampler=dgrs", "tree=optimal_per_step", "budget=6", "draft=x0_extrap_gated"],
    "optimal_per_step_x0": ["sampler=dgrs", "tree=optimal_per_step", "budget=6", "draft=x0"],
}


def _committed(res, i):
    row = res.committed[i]
    return row[row != 0]


@pytest.mark.parametrize("rule", list(RULES))
def test_trajectory_results_do_not_depend_on_n_samples(rule):
    """Seed 0, GMM d=8, T=8: trajectories 0..2 of n_samples=3 and of n_samples=11 (batch_size=5, so the
    batches differ too) have bitwise equal counts and committed steps, the same calibrated profile
    and trees, and samples within 16 T eps of float64 (docs/architecture.md, "What is equal across splits")."""
    small_rec, small = run_config(compose([*BASE, *RULES[rule], "n_samples=3"]))
    big_rec, big = run_config(compose([*BASE, *RULES[rule], "n_samples=11", "batch_size=5"]))
    for f in COUNTS:
        assert torch.equal(getattr(small, f), getattr(big, f)[:3]), f
    for i in range(3):
        assert torch.equal(_committed(small, i), _committed(big, i))
    for key in ("delta_profile", "trees_by_root", "tree_parent", "tree"):
        assert small_rec.get(key) == big_rec.get(key), key
    if "calibration" in small_rec:
        assert small_rec["calibration"] == big_rec["calibration"]
    torch.testing.assert_close(small.samples, big.samples[:3], rtol=0, atol=_bound(torch.float64, 8, big.samples))


def _bound(dtype, steps, samples):
    """The documented tolerance for samples across splits (docs/architecture.md): 16 T eps(dtype), relative to the
    samples' scale."""
    return 16 * steps * torch.finfo(dtype).eps * max(1.0, float(samples.abs().max()))


SPLIT_COUNTS = ("nfe", "nfe_total", "target_rows", "rounds", "committed", "attempts", "accepts")


@pytest.mark.parametrize("draft", ["velocity", "x0", "x0_extrap_gated"])
def test_splits_give_equal_counts_and_samples_within_the_stated_rounding_gmm(draft):
    """GMM d=16 float64, T=30, seed 3, 24 trajectories: tree vs path execution, max_batch=5, and the
    trajectories 7..18 run alone give bitwise equal counts and samples within 16 T eps (docs/architecture.md)."""
    from specsamp import DraftTree, Schedule, sample_speculative
    from specsamp.models import GaussianMixture

    model, sched = GaussianMixture(dim=16, components=5, layout_seed=0), Schedule.make(30, 0.1)
    kw = dict(seed=3, draft=draft)
    ref = sample_speculative(model, sched, DraftTree.uniform(2, 3), "dgrs", 24, execution="tree", **kw)
    others = [
        sample_speculative(model, sched, DraftTree.uniform(2, 3), "dgrs", 24, execution="path", **kw),
        sample_speculative(model, sched, DraftTree.uniform(2, 3), "dgrs", 24, execution="tree", max_batch=5, **kw),
    ]
    part = sample_speculative(
        model, sched, DraftTree.uniform(2, 3), "dgrs", indices=list(range(7, 19)), execution="tree", **kw
    )
    tol = _bound(torch.float64, 30, ref.samples)
    for other, rows in [(o, slice(None)) for o in others] + [(part, slice(7, 19))]:
        for f in SPLIT_COUNTS:
            a, b = getattr(ref, f)[rows], getattr(other, f)
            width = min(a.shape[-1], b.shape[-1]) if a.ndim > 1 else None
            if width is not None:  # committed is 0-padded to the batch's most rounds
                assert not a[:, width:].any() and not b[:, width:].any(), f
                a, b = a[:, :width], b[:, :width]
            assert torch.equal(a, b), f
        torch.testing.assert_close(other.samples, ref.samples[rows], rtol=0, atol=tol)


def test_batches_give_equal_counts_and_samples_within_the_stated_rounding_digits():
    """The trained digits network in float32, T=12, seed 5: 10 trajectories in one batch, and 3..8 alone,
    give bitwise equal counts and samples within 16 T eps(float32) (docs/architecture.md)."""
    from specsamp import DraftTree, Schedule, sample_speculative
    from specsamp.models.edm import EDMConfig

    target = EDMConfig(name="edm-digits-8x8-cond", download=False, labels="uniform").build("cpu")
    sched = Schedule.make(12, 0.3)
    ids = torch.arange(10)
    full = sample_speculative(
        target.model,
        sched,
        DraftTree.uniform(2, 3),
        "dgrs",
        seed=5,
        indices=ids,
        cond=target.cond_for(ids, 5),
        execution="path",
    )
    sub = ids[3:9]
    part = sample_speculative(
        target.model,
        sched,
        DraftTree.uniform(2, 3),
        "dgrs",
        seed=5,
        indices=sub,
        cond=target.cond_for(sub, 5),
        execution="path",
    )
    assert full.samples.dtype == torch.float32
    for f in ("nfe", "nfe_total", "target_rows", "rounds", "attempts", "accepts"):
        assert torch.equal(getattr(full, f)[3:9], getattr(part, f)), f
    torch.testing.assert_close(part.samples, full.samples[3:9], rtol=0, atol=_bound(torch.float32, 12, full.samples))


@pytest.mark.slow
def test_x0_affine_splits_stay_within_the_stated_rounding_at_the_mixtures_dimension():
    """The section 5.1 mixture (d=500, float64, T=30, seed 0) with draft=x0_affine and its shipped profile (B=155):
    trajectories 0..9 of a 10- and a 40-trajectory run, and the tree and path executions of the 40, give bitwise
    equal counts and samples within 16 T eps (docs/architecture.md). Its per-trajectory fit takes the minimiser of
    a squared residual; evaluated from the records' Gram matrix, whose rounding swamps a small residual, that
    minimiser moved with the square root of the target's batched rounding: 1e-9 to 1e-7 here, against 1e-13."""
    base = [
        "progress=false",
        "sampler=dgrs",
        "tree=optimal",
        "budget=155",
        "draft=x0_affine",
        "delta_profile=gmm_x0_affine",
        "seed=0",
    ]
    _, small = run_config(compose([*base, "n_samples=10"]))
    _, tree = run_config(compose([*base, "n_samples=40", "execution=tree"]))
    _, path = run_config(compose([*base, "n_samples=40", "execution=path"]))
    for f in COUNTS:
        assert torch.equal(getattr(small, f), getattr(tree, f)[:10]), f
        assert torch.equal(getattr(tree, f), getattr(path, f)), f
    tol = _bound(torch.float64, 30, tree.samples)
    torch.testing.assert_close(small.samples, tree.samples[:10], rtol=0, atol=tol)
    torch.testing.assert_close(path.samples, tree.samples, rtol=0, atol=tol)
