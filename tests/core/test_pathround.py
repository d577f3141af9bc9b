"""The path execution's reference round: how it batches its work changes neither its numbers nor its counts.

Setup: ``GaussianMixture(dim=6, components=3, layout_seed=1)`` in float64 and float32, ``Schedule.make(8, 1.0)``
(acceptance about 0.4-0.75 per depth: rejections and residual draws in most rounds), 30 trajectories, seed 5.
Everything is compared for equality (counts exactly, samples bit for bit): keyed random numbers are a function of
their key alone, so drawing them per verification or per round must give the same bits.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.opcount import counting
from specsamp import rng
from specsamp.models import GaussianMixture
from specsamp.round import draws
from specsamp.sampler import sample_speculative
from specsamp.schedule import Schedule
from specsamp.trees import DraftTree

SCHED = Schedule.make(8, 1.0)
FIELDS = (
    "nfe",
    "nfe_total",
    "target_rows",
    "rounds",
    "committed",
    "attempts",
    "accepts",
    "attempts_by_root",
    "accepts_by_root",
)
IRREGULAR = DraftTree([-1, 0, 0, 0, 1, 1, 2, 4, 4])  # widths 3, 2, 1 and 2 at depths 1-3: narrower than K_max
CASES = {
    "dgrs 2x3": (DraftTree.uniform(2, 3), "dgrs"),
    "dgrs irregular": (IRREGULAR, "dgrs"),
    "markmax irregular": (IRREGULAR, "markmax"),
    "rmc chain5": (DraftTree.chain(5), "rmc"),
}


def _run(model, tree, coupling, **kw):
    return sample_speculative(model, SCHED, tree, coupling, 30, execution="path", seed=5, **kw)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("prefetch", ["nearest", "none"])
def test_a_rounds_uniform_table_draws_what_each_verification_would(monkeypatch, dtype, name, prefetch):
    model = GaussianMixture(dim=6, components=3, layout_seed=1, dtype=dtype)
    tree, coupling = CASES[name]
    tables = []
    real = rng.uniform_table
    monkeypatch.setattr(rng, "uniform_table", lambda keys, widths: tables.append(keys.ndim) or real(keys, widths))
    table = _run(model, tree, coupling, prefetch=prefetch)
    assert tables and set(tables) == {2}  # one [m, I] draw per round: the table ran
    assert len(tables) == int(table.rounds.max())
    tables.clear()
    monkeypatch.setattr(draws, "UNIFORM_TABLE", 0)  # every verification draws its own
    each = _run(model, tree, coupling, prefetch=prefetch)
    assert tables and set(tables) == {1}
    for f in FIELDS:
        assert torch.equal(getattr(table, f), getattr(each, f)), f
    assert torch.equal(table.samples, each.samples)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_kernel_coefficients_from_the_table_equal_the_schedule_bit_for_bit(dtype):
    # the round gathers a step's coefficients from the run's table (events of two dimensions, T = 12, eps = 0.4)
    sch = Schedule.make(12, 0.4)
    g = torch.Generator().manual_seed(0)
    n = torch.randint(1, sch.steps - 1, (40,), generator=g)
    x, v = (torch.randn(40, 3, 2, generator=g, dtype=torch.float64).to(dtype) for _ in range(2))
    c = sch.kernel.coefs(n, x)
    assert c["std"].shape == (40, 1, 1) and c["std"].dtype == dtype
    assert torch.equal(sch.kernel.mean(x, v, c), sch.mean(x, v, n))
    assert torch.equal(c["std"].reshape(-1), sch.std(n).to(dtype))


def test_the_path_round_stays_lean():
    # D-GRS (2,3) on the section 5.1 kernel (T = 30, eps = 0.1), 8 trajectories, counted (not timed): the round
    # and the coupling dispatch about 1,220 ATen operations and the round 14 host synchronisations per round with
    # this torch; coefficients recomputed per call, two keyed draws per verification, boolean-mask moves and
    # counts written per verification cost about 1,850 and 58
    model = GaussianMixture(dim=8, components=3, layout_seed=1)
    with counting() as c:
        res = sample_speculative(
            model, Schedule.make(30, 0.1), DraftTree.uniform(2, 3), "dgrs", 8, execution="path", seed=0
        )
    per_round = int(res.rounds.max())
    assert (c.ops["round"] + c.ops["coupling"]) / per_round <= 1400, dict(c.ops)
    assert c.syncs["round"] / per_round <= 20, dict(c.syncs)
