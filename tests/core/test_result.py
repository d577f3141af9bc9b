"""``SampleResult.concat``: the batches of one run put together as one result (deterministic counts only)."""

from __future__ import annotations

import pytest
import torch

from specsamp.models import GaussianMixture
from specsamp.sampler import SampleResult, sample_speculative, sample_standard
from specsamp.schedule import Schedule
from specsamp.trees import DraftTree

MODEL = GaussianMixture(dim=4, components=3, layout_seed=1)
SCHED = Schedule.make(8, 1.0)
TREE = DraftTree.uniform(2, 2)


def _run(ids, **kw):
    return sample_speculative(MODEL, SCHED, TREE, "dgrs", indices=ids, seed=3, **kw)


def test_concat_of_batches_has_the_counts_of_one_run():
    # keyed randomness: a trajectory's counts do not depend on its batch, so the concatenation of batches
    # 0..4 and 5..11 has the counts of the run of 0..11 exactly, and the per-root tables sum
    whole = _run(list(range(12)))
    parts = [_run(list(range(5))), _run(list(range(5, 12)))]
    cat = SampleResult.concat(parts)
    for name in SampleResult.PER_TRAJECTORY:
        if name != "samples":
            assert torch.equal(getattr(cat, name), getattr(whole, name)), name
    assert cat.samples.shape == whole.samples.shape
    for name in SampleResult.PER_ROOT:
        assert torch.equal(getattr(cat, name), getattr(parts[0], name) + getattr(parts[1], name))
        assert torch.equal(getattr(cat, name), getattr(whole, name))
    assert cat.batch_nfe == max(p.batch_nfe for p in parts)
    assert cat.extra["batch_speedups"] == [p.batch_speedup for p in parts]
    assert cat.extra["refine"] == 0  # a plain value every part agrees on is kept


def test_concat_flattens_nested_batch_speedups_and_keeps_one_part_as_is():
    a, b, c = (_run([i, i + 10]) for i in range(3))
    nested = SampleResult.concat([SampleResult.concat([a, b]), c])
    assert nested.extra["batch_speedups"] == [a.batch_speedup, b.batch_speedup, c.batch_speedup]
    assert SampleResult.concat([a]) is a


def test_concat_of_standard_results_has_no_per_root_tables_and_pads_committed():
    s = sample_standard(MODEL, SCHED, 3)
    cat = SampleResult.concat([s, s])
    assert cat.attempts_by_root is None and cat.attempts.shape == (6, 0)
    short = SampleResult(
        **{n: getattr(s, n) for n in SampleResult.PER_TRAJECTORY if n != "committed"},
        committed=s.committed[:, :2],
        speculative_steps=s.speculative_steps,
    )
    assert torch.equal(
        SampleResult.concat([short, s]).committed[:3, 2:], torch.zeros(3, s.committed.shape[1] - 2, dtype=torch.long)
    )


def test_concat_refuses_nothing_and_mixed_step_counts():
    with pytest.raises(ValueError, match="at least one"):
        SampleResult.concat([])
    other = sample_standard(MODEL, Schedule.make(6, 1.0), 2)
    with pytest.raises(ValueError, match="speculative_steps"):
        SampleResult.concat([sample_standard(MODEL, SCHED, 2), other])


def test_speedup_charged_is_the_mean_of_ratios_with_the_cost_shared():
    # 12 trajectories (seed 3): no cost gives the mean speedup exactly; a cost c over k trajectories adds
    # c / k to every trajectory's nfe before the ratio; the mean of ratios is at least the ratio of the
    # totals (1 / (nfe + c) is convex); bad arguments are refused
    res = _run(list(range(12)))
    spec, nfe = res.speculative_steps, res.nfe.double()
    assert res.speedup_charged(0, 12) == float(res.speedup.mean())
    assert res.speedup_charged(643, 100) == pytest.approx(float((spec / (nfe + 6.43)).mean()), rel=1e-15)
    assert res.speedup_charged(643, 12) >= 12 * spec / (float(nfe.sum()) + 643)
    for bad in ((-1, 12), (1, 0)):
        with pytest.raises(ValueError, match="calls="):
            res.speedup_charged(*bad)
