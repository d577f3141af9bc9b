"""The lean round of the tree execution: its memory-saving variants draw the same numbers.

Setup: ``GaussianMixture(dim=4, components=3, layout_seed=1)`` in float64 and float32, ``Schedule.make(8, 1.0)``
(acceptance about 0.4-0.75 per depth: rejections in most rounds), 40 trajectories, seed 3. Each variant
(residuals drawn again instead of kept, verification in one-node chunks, keys folded per round instead of
tabled) must give counts identical and samples bitwise equal to the default lean round, and counts identical
to the path execution.
"""

from __future__ import annotations

import pytest
import torch

from specsamp import sampler
from specsamp.models import GaussianMixture
from specsamp.schedule import Schedule
from specsamp.trees import DraftTree

SCHED = Schedule.make(8, 1.0)
FIELDS = ("nfe", "nfe_total", "target_rows", "rounds", "committed", "attempts", "accepts")
TREES = {"2x3": (DraftTree.uniform(2, 3), "dgrs"), "irregular": (DraftTree([-1, 0, 0, 0, 1, 1, 2, 4, 4]), "dgrs"),
         "chain5": (DraftTree.chain(5), "rmc")}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("name", list(TREES))
@pytest.mark.parametrize("variant", [("RESIDUAL_CACHE", 0), ("VERIFY_MEMORY", 0.0), ("KEY_CACHE", 0)])
def test_memory_variants_draw_the_same_numbers(monkeypatch, dtype, name, variant):
    model = GaussianMixture(dim=4, components=3, layout_seed=1, dtype=dtype)
    tree, coupling = TREES[name]
    kw = dict(draft="x0", prefetch="nearest", seed=3)
    ref = sampler.sample_speculative(model, SCHED, tree, coupling, 40, execution="tree", **kw)
    path = sampler.sample_speculative(model, SCHED, tree, coupling, 40, execution="path", **kw)
    monkeypatch.setattr(sampler, variant[0], variant[1])
    if variant[0] == "VERIFY_MEMORY":  # one node per chunk: the floor of 2**20 elements would keep one chunk
        monkeypatch.setattr(sampler, "VERIFY_FLOOR", 0)
    got = sampler.sample_speculative(model, SCHED, tree, coupling, 40, execution="tree", **kw)
    for f in FIELDS:
        assert torch.equal(getattr(got, f), getattr(ref, f)), f
        assert torch.equal(getattr(got, f), getattr(path, f)), f
    assert torch.equal(got.samples, ref.samples)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_schedule_tables_equal_the_kernel_bit_for_bit(dtype):
    # Schedule.tables: per-step coefficients that give exactly Schedule.mean and Schedule.std (T = 12, eps = 0.4)
    sch = Schedule.make(12, 0.4)
    tab = sch.tables("cpu")
    n = torch.arange(sch.steps)
    assert torch.equal(tab["std"], sch.std(n))
    g = torch.Generator().manual_seed(0)
    x, v = torch.randn(sch.steps, 5, generator=g, dtype=dtype), torch.randn(sch.steps, 5, generator=g, dtype=dtype)
    dt, a, b = (tab[k].to(dtype)[:, None] for k in ("dt", "a", "b"))
    assert torch.equal(x + dt * (a * v + b * x), sch.mean(x, v, n))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("name", ["velocity", "drift", "x0"])
def test_table_mean_equals_the_draft_mean_bit_for_bit(dtype, name):
    # Draft.table_mean (the lean round's form) against Draft.mean, 3 rows x 4 nodes of 6 coordinates, seed 1
    from specsamp.drafts import DraftRoot, get_draft

    draft, sch = get_draft(name), Schedule.make(10, 0.7)
    g = torch.Generator().manual_seed(1)
    M, m, D = 3, 4, 6
    root = DraftRoot(x=torch.randn(M, D, generator=g, dtype=dtype), v=torch.randn(M, D, generator=g, dtype=dtype),
                     n=torch.tensor([1, 4, 8]), exact=torch.ones(M, dtype=torch.bool))
    fr = draft.freeze(root, sch)
    x = torch.randn(M, m, D, generator=g, dtype=dtype)
    step = torch.tensor([2, 5, 8])
    tab = torch.stack([sch.tables("cpu")[k] for k in sampler.COEFS], 1).to(dtype)[step]  # [M, 5]
    coef = dict(zip(sampler.COEFS, tab[:, None, :, None].unbind(2)))  # [M, 1, 1] each
    assert torch.equal(draft.table_mean(fr.reshape(M, 1, D), x, coef), draft.mean(fr, x, step, sch))
