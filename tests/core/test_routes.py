"""Which round serves what. The tree execution always runs the dense round: a draft with a table form through it,
a draft given by ``mean`` alone through ``Draft.mean`` per depth, Picard sweeps inside it; rows the dense round cannot
finish without asking the host (markmax rows its share table cannot certify, a deferred value check) are served
again by the sparse round's walk over the dense round's drafted tree (the checked walk), on the same keys. The
path execution always runs the sparse round. Each route gives the path execution's counts and, with a target
evaluated row by row, its bits."""

import pytest
import torch
from helpers import RowwiseMixture

from specsamp import listcoupling, sampler
from specsamp.drafts import Draft, get_draft
from specsamp.round import layouts
from specsamp.schedule import Schedule
from specsamp.trees import DraftTree

SCHED = Schedule.make(8, 1.0)
FIELDS = ("nfe", "nfe_total", "target_rows", "rounds", "committed", "attempts", "accepts")


def _spy(monkeypatch):
    """Counts of calls of the dense round and of the reference round."""
    calls = {"dense": 0, "reference": 0}
    real, drafted, reference = layouts.dense_round, layouts.drafted_round, layouts.sparse_round

    def d(*a, **k):
        calls["dense"] += 1
        return real(*a, **k)

    def d2(*a, **k):  # a dense round drafted again for the checked walk
        calls["dense"] += 1
        return drafted(*a, **k)

    def r(*a, **k):
        calls["reference"] += 1
        return reference(*a, **k)

    monkeypatch.setattr(layouts, "dense_round", d)
    monkeypatch.setattr(layouts, "drafted_round", d2)
    monkeypatch.setattr(layouts, "sparse_round", r)
    return calls


def _same(got, want):
    for f in FIELDS:
        assert torch.equal(getattr(got, f), getattr(want, f)), f
    assert torch.equal(got.samples, want.samples)


@pytest.mark.parametrize(
    "tree", [DraftTree.uniform(2, 3), lambda n: [DraftTree.uniform(2, 2), DraftTree.chain(3)][n % 2]]
)
def test_a_draft_without_a_table_form_runs_the_dense_round_by_its_mean(monkeypatch, tree):
    # a draft given by its mean alone (the velocity draft's, so the same numbers): the tree execution runs the
    # dense round, calling Draft.mean per depth; GMM dim 4, T = 8, 30 trajectories, seed 3, float64
    model = RowwiseMixture(dim=4, components=3, layout_seed=1)
    plain = Draft("plain_velocity", freeze=get_draft("velocity").freeze, mean=get_draft("velocity").mean)
    assert plain.table_mean is None
    path = sampler.sample_speculative(model, SCHED, tree, "dgrs", 30, execution="path", draft="velocity", seed=3)
    calls = _spy(monkeypatch)
    got = sampler.sample_speculative(model, SCHED, tree, "dgrs", 30, execution="tree", draft=plain, seed=3)
    assert calls["dense"] > 0 and calls["reference"] == 0, calls
    _same(got, path)
    calls["reference"] = 0
    dense = sampler.sample_speculative(model, SCHED, tree, "dgrs", 30, execution="tree", draft="velocity", seed=3)
    assert calls["dense"] > 0 and calls["reference"] == 0, calls
    _same(dense, path)


def test_markmax_rows_the_share_table_cannot_certify_are_served_by_the_checked_walk(monkeypatch):
    # every row reported uncertified: each dense round raises the deferred flag, is discarded and served again by
    # the checked walk over its drafted tree on the same keys; the run equals the path execution (GMM dim 4, T = 8,
    # 30 trajectories, seed 3)
    model = RowwiseMixture(dim=4, components=3, layout_seed=1)
    tree = DraftTree.uniform(2, 3)
    path = sampler.sample_speculative(model, SCHED, tree, "markmax", 30, execution="path", draft="x0", seed=3)
    share = listcoupling.static_share
    monkeypatch.setattr(
        listcoupling, "static_share", lambda delta, K: (share(delta, K)[0], torch.zeros_like(delta, dtype=torch.bool))
    )
    calls = _spy(monkeypatch)
    got = sampler.sample_speculative(model, SCHED, tree, "markmax", 30, execution="tree", draft="x0", seed=3)
    # every dense round drafted again for the checked walk
    assert calls["reference"] > 0 and calls["dense"] == 2 * calls["reference"], calls
    _same(got, path)


def test_picard_sweeps_run_inside_the_dense_round_for_any_draft(monkeypatch):
    # refine=2 in the tree execution: the dense round drafts (by the table form, or by Draft.mean per depth), sweeps
    # and verifies without the sparse round; both drafts give the same counts and bits (the plain draft is the
    # velocity draft's mean), and each round charges 1 + 2 calls (GMM dim 4, T = 8, 30 trajectories, seed 3)
    model = RowwiseMixture(dim=4, components=3, layout_seed=1)
    tree = DraftTree.uniform(2, 3)
    plain = Draft("plain_velocity", freeze=get_draft("velocity").freeze, mean=get_draft("velocity").mean)
    calls = _spy(monkeypatch)
    table = sampler.sample_speculative(model, SCHED, tree, "dgrs", 30, execution="tree", refine=2, seed=3)
    got = sampler.sample_speculative(model, SCHED, tree, "dgrs", 30, execution="tree", draft=plain, refine=2, seed=3)
    assert calls["dense"] > 0 and calls["reference"] == 0, calls
    _same(got, table)
    assert torch.equal(table.nfe, 1 + 3 * table.rounds)  # the warm-up call, then the sweeps' and the round's own


def test_the_checked_walk_serves_every_tree_of_a_round_with_trees_per_root_step(monkeypatch):
    # trees per root step (two shapes alternating) and every markmax row reported uncertified: each tree of a
    # round is drafted again and walked in turn, charged as the dense round's calls; the run equals the path
    # execution (GMM dim 4, T = 8, 30 trajectories, seed 3)
    model = RowwiseMixture(dim=4, components=3, layout_seed=1)
    tree = lambda n: [DraftTree.uniform(2, 2), DraftTree.chain(3)][n % 2]  # noqa: E731
    path = sampler.sample_speculative(model, SCHED, tree, "markmax", 30, execution="path", draft="x0", seed=3)
    share = listcoupling.static_share
    monkeypatch.setattr(
        listcoupling, "static_share", lambda delta, K: (share(delta, K)[0], torch.zeros_like(delta, dtype=torch.bool))
    )
    calls = _spy(monkeypatch)
    got = sampler.sample_speculative(model, SCHED, tree, "markmax", 30, execution="tree", draft="x0", seed=3)
    assert calls["reference"] > int(got.rounds.max()), calls  # some round walked more than one tree
    _same(got, path)
    assert got.batch_nfe == path.batch_nfe


@pytest.mark.parametrize("refine,plain", [(1, False), (0, True)], ids=["refine1", "mean-only-draft"])
def test_walks_drawn_again_keep_the_numbers_with_sweeps_and_mean_only_drafts(monkeypatch, refine, plain):
    # two routes inside the dense round, each against the dense round's own default: (a) every markmax row reported
    # uncertified, so each round is drafted again and walked by the checked walk; (b) no verdict sample kept
    # (RESIDUAL_CACHE = 0), so the walk's residuals are drawn again per row. With Picard sweeps and with a draft
    # given by its mean alone, both give the default's counts and bits (GMM dim 4, T = 8, 30 trajectories, seed 3)
    from specsamp.round import tables

    model = RowwiseMixture(dim=4, components=3, layout_seed=1)
    tree = DraftTree.uniform(2, 3)
    draft = Draft("plain_x0", freeze=get_draft("x0").freeze, mean=get_draft("x0").mean) if plain else "x0"
    kw = dict(execution="tree", draft=draft, refine=refine, seed=3)
    want = sampler.sample_speculative(model, SCHED, tree, "markmax", 30, **kw)
    want_dgrs = sampler.sample_speculative(model, SCHED, tree, "dgrs", 30, **dict(kw, draft="x0"))
    with monkeypatch.context() as m:
        share = listcoupling.static_share
        m.setattr(
            listcoupling,
            "static_share",
            lambda delta, K: (share(delta, K)[0], torch.zeros_like(delta, dtype=torch.bool)),
        )
        calls = _spy(m)
        _same(sampler.sample_speculative(model, SCHED, tree, "markmax", 30, **kw), want)
        assert calls["reference"] > 0, calls
    monkeypatch.setattr(tables, "RESIDUAL_CACHE", 0)
    _same(sampler.sample_speculative(model, SCHED, tree, "dgrs", 30, **kw), want_dgrs)
