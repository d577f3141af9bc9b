"""The dense round of the tree execution: its memory-saving variants draw the same numbers; it serves drafts
with history and step-dependent trees with the path execution's counts and samples.

Setup: ``GaussianMixture(dim=4, components=3, layout_seed=1)`` in float64 and float32, ``Schedule.make(8, 1.0)``
(acceptance about 0.4-0.75 per depth: rejections in most rounds), 40 trajectories, seed 3. Each variant
(residuals drawn again instead of kept, verification in one-node chunks, keys folded per round instead of
tabled, draft noise or coupling uniforms drawn per round instead of once per run) must give counts identical and
samples bitwise equal to the default dense round, and counts identical
to the path execution.
"""

from __future__ import annotations

import pytest
import torch
from helpers import RowwiseMixture

from specsamp import sampler
from specsamp.models import GaussianMixture
from specsamp.round import draws, layouts, tables
from specsamp.schedule import Schedule
from specsamp.trees import DraftTree

SCHED = Schedule.make(8, 1.0)
FIELDS = ("nfe", "nfe_total", "target_rows", "rounds", "committed", "attempts", "accepts")
TREES = {
    "2x3": (DraftTree.uniform(2, 3), "dgrs"),
    "irregular": (DraftTree([-1, 0, 0, 0, 1, 1, 2, 4, 4]), "dgrs"),
    "chain5": (DraftTree.chain(5), "rmc"),
}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("name", list(TREES))
@pytest.mark.parametrize(
    "variant",
    [("RESIDUAL_CACHE", 0), ("VERIFY_MEMORY", 0.0), ("KEY_CACHE", 0), ("NOISE_CACHE", 0), ("UNIFORM_CACHE", 0)],
)
@pytest.mark.parametrize("draft", ["x0", "x0_extrap_gated", "x0_affine"])
def test_memory_variants_draw_the_same_numbers(monkeypatch, dtype, name, variant, draft):
    model = GaussianMixture(dim=4, components=3, layout_seed=1, dtype=dtype)
    tree, coupling = TREES[name]
    kw = dict(draft=draft, prefetch="nearest", seed=3)
    ref = sampler.sample_speculative(model, SCHED, tree, coupling, 40, execution="tree", **kw)
    path = sampler.sample_speculative(model, SCHED, tree, coupling, 40, execution="path", **kw)
    monkeypatch.setattr(
        draws if variant[0].endswith(("KEY_CACHE", "NOISE_CACHE", "UNIFORM_CACHE")) else tables, *variant
    )
    if variant[0] == "VERIFY_MEMORY":  # one node per chunk: the floor of 2**20 elements would keep one chunk
        monkeypatch.setattr(tables, "VERIFY_FLOOR", 0)
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
    # Draft.table_mean (the dense round's form) against Draft.mean, 3 rows x 4 nodes of 6 coordinates, seed 1
    from specsamp.drafts import DraftRoot, get_draft

    draft, sch = get_draft(name), Schedule.make(10, 0.7)
    g = torch.Generator().manual_seed(1)
    M, m, D = 3, 4, 6
    root = DraftRoot(
        x=torch.randn(M, D, generator=g, dtype=dtype),
        v=torch.randn(M, D, generator=g, dtype=dtype),
        n=torch.tensor([1, 4, 8]),
        exact=torch.ones(M, dtype=torch.bool),
    )
    fr = draft.freeze(root, sch)
    x = torch.randn(M, m, D, generator=g, dtype=dtype)
    step = torch.tensor([2, 5, 8])
    tab = sch.kernel.table("cpu", dtype)[step]  # [M, C]
    coef = sch.kernel.named(tab[:, None, :, None].unbind(2))  # [M, 1, 1] each
    assert torch.equal(draft.table_mean(fr.reshape(M, 1, D), x, coef, sch.kernel), draft.mean(fr, x, step, sch))


def _per_step_rule(n):
    # a tree per root index: three shapes in turn, so the rows of one round use different trees
    return [DraftTree.uniform(2, 3), DraftTree([-1, 0, 0, 0, 1, 1, 2, 4, 4]), DraftTree.chain(3)][n % 3]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("draft", ["x0_extrap", "x0_extrap_gated", "x0_affine", "x0"])
@pytest.mark.parametrize("tree", ["fixed", "per_step"])
def test_history_drafts_and_per_step_trees_run_the_dense_round(monkeypatch, dtype, draft, tree):
    # the dense round serves drafts with history and step-dependent trees (the sparse round's walk is never
    # called: no check fails here), with counts identical and samples bitwise equal to the path execution
    # (a target evaluated row by row: the executions batch a node differently, helpers.RowwiseMixture)
    model = RowwiseMixture(dim=4, components=3, layout_seed=1, dtype=dtype)
    rule = DraftTree.uniform(2, 3) if tree == "fixed" else _per_step_rule
    kw = dict(draft=draft, prefetch="nearest", seed=3)
    path = sampler.sample_speculative(model, SCHED, rule, "dgrs", 40, execution="path", **kw)

    def no_sparse(*a, **k):
        raise AssertionError("the sparse round ran")

    monkeypatch.setattr(layouts, "sparse_round", no_sparse)  # the checked walk's and the path execution's
    got = sampler.sample_speculative(model, SCHED, rule, "dgrs", 40, execution="tree", **kw)
    for f in FIELDS:
        assert torch.equal(getattr(got, f), getattr(path, f)), f
    assert torch.equal(got.samples, path.samples)


def test_per_step_dense_round_serves_several_trees_in_one_round(monkeypatch):
    # 40 trajectories of _per_step_rule (T = 8, float64, seed 3): some round has rows rooted at state
    # indices of different trees, so one host round runs more than one tree's dense tables
    model = GaussianMixture(dim=4, components=3, layout_seed=1)
    seen, real = [], layouts.dense_round

    def spy(ctx, lt, st, sel, plans, *rest, **kw):
        seen.append(sel is not None)
        return real(ctx, lt, st, sel, plans, *rest, **kw)

    monkeypatch.setattr(layouts, "dense_round", spy)
    sampler.sample_speculative(
        model, SCHED, _per_step_rule, "dgrs", 40, execution="tree", draft="x0_extrap_gated", seed=3
    )
    assert any(seen)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("name", ["x0_extrap", "x0_extrap_gated", "x0_affine"])
def test_table_frozen_and_mean_equal_the_draft_mean_bit_for_bit(dtype, name):
    # Draft.table_frozen + table_mean (the dense round's form) against Draft.mean for a frozen quantity of
    # several components ((a, s); x0_affine adds mu and s2, here s2 = 0.5, -1 (the fallback) and 2 for the
    # three rows): 3 rows x 4 nodes of 6 coordinates, seed 1, the sampler's coefficient table (lsnr column)
    from specsamp.drafts import get_draft

    draft, sch = get_draft(name), Schedule.make(10, 0.7)
    g = torch.Generator().manual_seed(1)
    M, m, D = 3, 4, 6
    fr = torch.randn(M, 4 if name == "x0_affine" else 2, D, generator=g, dtype=dtype)
    if name == "x0_affine":
        fr[:, 3] = torch.tensor([0.5, -1.0, 2.0], dtype=dtype)[:, None]
    x = torch.randn(M, m, D, generator=g, dtype=dtype)
    step = torch.tensor([2, 5, 8])
    tab = sch.kernel.table("cpu", dtype)[step]  # [M, C]
    coef = sch.kernel.named(tab[:, None, :, None].unbind(2))  # [M, 1, 1] each
    got = draft.table_mean(draft.table_frozen(fr.permute(1, 0, 2)[:, :, None], coef), x, coef, sch.kernel)
    assert torch.equal(got, draft.mean(fr, x, step, sch))


def test_uniform_table_serves_a_coupling_that_asks_for_more_calls(monkeypatch):
    # markmax draws (K, K, 2) uniforms: its first call comes from the per-run table, the others from the keys;
    # the numbers are those of drawing every call from the keys (counts identical, samples bitwise equal)
    model = GaussianMixture(dim=4, components=3, layout_seed=1)
    kw = dict(draft="x0", prefetch="nearest", seed=3)
    ref = sampler.sample_speculative(model, SCHED, DraftTree.uniform(2, 3), "markmax", 40, execution="tree", **kw)
    monkeypatch.setattr(draws, "UNIFORM_CACHE", 0)
    got = sampler.sample_speculative(model, SCHED, DraftTree.uniform(2, 3), "markmax", 40, execution="tree", **kw)
    for f in FIELDS:
        assert torch.equal(getattr(got, f), getattr(ref, f)), f
    assert torch.equal(got.samples, ref.samples)


def test_dgrs_decide_gives_verify_choice_and_draws_the_same_numbers():
    # the choice alone (Coupling.decide) equals verify's accepted and index on the same numbers: deltas from 0
    # to 300, K = 1..5, float32 and float64; the sample is None
    from specsamp.coupling import COUPLINGS
    from specsamp.rng import KeyedRows

    dgrs = COUPLINGS.get("dgrs")
    g = torch.Generator().manual_seed(5)
    for dtype in (torch.float32, torch.float64):
        for k in (1, 2, 5):
            n, d = 64, 6
            mean_p = torch.randn(n, d, generator=g, dtype=dtype)
            shift = torch.logspace(-8, 2.5, n, dtype=torch.float64).to(dtype)[:, None] * torch.randn(
                n, d, generator=g, dtype=dtype
            )
            mean_q = mean_p + shift
            mean_q[:4] = mean_p[:4]  # delta = 0
            kids = mean_p[:, None] + torch.randn(n, k, d, generator=g, dtype=dtype)
            keys = torch.arange(n, dtype=torch.long) * 7919
            full = dgrs(kids, mean_p, mean_q, 1.0, KeyedRows(keys))
            only = dgrs.decide(kids, mean_p, mean_q, 1.0, KeyedRows(keys))
            assert only.sample is None
            assert torch.equal(only.accepted, full.accepted) and torch.equal(only.index, full.index)


def test_round_without_kept_samples_decides_then_draws_one_residual_per_row_without_syncs(monkeypatch):
    # RESIDUAL_CACHE = 0: no verdict sample is kept; the chunks call dgrs.decide (no residual inversion), the
    # walk's residuals are drawn for the M rows only, and the round still synchronises the host once
    from benchmarks import opcount
    from specsamp import grs

    model = GaussianMixture(dim=4, components=3, layout_seed=1, dtype=torch.float64)
    ref = sampler.sample_speculative(model, SCHED, DraftTree.uniform(2, 3), "dgrs", 40, execution="tree", seed=3)
    monkeypatch.setattr(tables, "RESIDUAL_CACHE", 0)
    inversion = grs.sample_grs_residual
    rows = []
    monkeypatch.setattr(
        grs, "sample_grs_residual", lambda delta, *a, **k: rows.append(delta.shape[0]) or inversion(delta, *a, **k)
    )
    with opcount.counting() as c:
        got = sampler.sample_speculative(model, SCHED, DraftTree.uniform(2, 3), "dgrs", 40, execution="tree", seed=3)
    assert rows and set(rows) == {40}, rows  # one inversion per round, over the batch's rows
    assert c.syncs["round"] + c.syncs["coupling"] <= int(got.rounds.max()), dict(c.by_op)
    for f in FIELDS:
        assert torch.equal(getattr(got, f), getattr(ref, f)), f
