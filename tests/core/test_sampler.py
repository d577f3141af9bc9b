"""The speculative sampler (Algorithm 1): exact output law, tree/path equivalence, accounting, validation.

Setup shared by the law tests: ``GaussianMixture(dim=4, components=3, layout_seed=1)`` and
``Schedule.make(8, 1.0)``, where per-depth acceptance is about 0.4--0.75 so that residual draws are
exercised in most rounds. The reference is the standard Euler--Maruyama sampler (seed 10000, 4000
trajectories); each speculative case draws 2000 trajectories with its own seed (100 + case number),
never the reference's (the same seed shares the initial noise, and the samples would not be
independent). Statistics: two-sample KS on projections onto 3 fixed random directions (seed 0) and a
chi-square test on the mixture component of each sample (``model.component``). Tolerance: every
p-value > 1e-3 (4 p-values x ~16 cases: a false alarm under exactness has probability ~6%, and the
seeds are fixed so the outcome is deterministic). The sensitivity tests show, on the same setup, that
a biased coupling gives p < 1e-3.
"""

import re

import pytest
import torch
from helpers import (
    BY_ROOT,
    IRREGULAR,
    MODEL,
    N_SPEC,
    P_MIN,
    REF_SEED,
    ROWWISE,
    SCHED,
    CountingModel,
    NaNBelow,
    law_pvalues,
    law_reference,
    tree_of,
)

from specsamp.coupling import Verdict, dgrs, rmc
from specsamp.models import GaussianMixture
from specsamp.sampler import sample_speculative, sample_standard
from specsamp.schedule import Schedule
from specsamp.trees import DraftTree
from specsamp.treesearch import TreesByRoot


@pytest.fixture(scope="module")
def reference():
    return law_reference()


# (tree, coupling, draft, prefetch, evaluate_leaves, execution): every coupling, draft, prefetch and
# leaf protocol appears several times, on uniform, chain, non-uniform and irregular trees.
LAW_CASES = [
    (("chain", 3), "rmc", "velocity", "nearest", True, "path"),
    (("chain", 5), "rmc", "drift", "parent", False, "path"),
    (("chain", 3), "rmc", "x0", "none", True, "path"),
    (("uniform", (1, 1)), "dgrs", "velocity", "nearest", True, "path"),
    (("uniform", (1, 1)), "dgrs", "x0", "nearest", False, "path"),
    (("uniform", (2, 3)), "dgrs", "velocity", "nearest", True, "path"),
    (("uniform", (2, 3)), "dgrs", "drift", "none", False, "path"),
    (("uniform", (2, 3)), "dgrs", "x0", "parent", True, "tree"),
    (("uniform", (3, 2)), "dgrs", "velocity", "parent", False, "path"),
    (("uniform", (3, 2)), "dgrs", "x0", "nearest", True, "path"),
    (("uniform", (3, 2)), "dgrs", "drift", "nearest", True, "path"),
    (("widths", [3, 1, 2]), "dgrs", "velocity", "none", True, "path"),
    (("widths", [3, 1, 2]), "dgrs", "x0", "nearest", False, "path"),
    (("widths", [3, 1, 2]), "dgrs", "drift", "parent", True, "tree"),
    (("parent", IRREGULAR), "dgrs", "velocity", "nearest", True, "path"),
    (("chain", 4), "rmc_as_callable", "velocity", "nearest", True, "path"),
    # beyond the paper: the markmax list coupling and a tree of the shape tree=optimal builds
    (("uniform", (2, 3)), "markmax", "x0", "nearest", True, "path"),
    (("parent", [-1, 0, 0, 1, 1, 3, 5]), "markmax", "velocity", "nearest", True, "path"),
    (("parent", [-1, 0, 0, 1, 1, 3, 5]), "dgrs", "x0", "nearest", True, "tree"),
    # step-dependent trees (tree=optimal_per_step): the tree of a round depends on its root step
    (("by_root", BY_ROOT), "dgrs", "x0", "nearest", True, "path"),
    (("by_root", BY_ROOT), "dgrs", "velocity", "parent", False, "tree"),
    (("by_root", BY_ROOT), "markmax", "x0", "nearest", True, "path"),
    # drafts that read the trajectory's history of exact data predictions, under every prefetch
    (("uniform", (2, 3)), "dgrs", "x0_extrap", "nearest", True, "path"),
    (("chain", 4), "rmc", "x0_extrap", "none", False, "tree"),
    (("widths", [3, 1, 2]), "dgrs", "x0_extrap", "parent", False, "path"),
    (("uniform", (3, 2)), "dgrs", "x0_extrap_gated", "nearest", True, "tree"),
    (("parent", IRREGULAR), "dgrs", "x0_extrap_gated", "parent", True, "path"),
    (("chain", 5), "rmc", "x0_extrap_gated", "none", True, "path"),
    # the local-affine draft (reads the records' states too), under every prefetch and both executions
    (("uniform", (2, 3)), "dgrs", "x0_affine", "nearest", True, "path"),
    (("parent", IRREGULAR), "dgrs", "x0_affine", "parent", False, "tree"),
    (("chain", 5), "rmc", "x0_affine", "none", True, "path"),
    (("by_root", BY_ROOT), "markmax", "x0_affine", "nearest", True, "tree"),
]


def case_id(case):
    spec, coupling, draft, prefetch, leaves, execution = case
    return f"{tree_of(spec).describe()}-{coupling}-{draft}-{prefetch}-{'V' if leaves else 'I'}-{execution}"


# in the slow set: cases whose coupling and draft appear at least three more times in the default run, on the same
# trees, prefetches, leaf protocols and executions (each case keeps its seed, 100 + its index)
LAW_SLOW = [
    (("uniform", (2, 3)), "dgrs", "velocity", "nearest", True, "path"),
    (("uniform", (3, 2)), "dgrs", "velocity", "parent", False, "path"),
    (("uniform", (3, 2)), "dgrs", "x0", "nearest", True, "path"),
    (("uniform", (3, 2)), "dgrs", "drift", "nearest", True, "path"),
    (("widths", [3, 1, 2]), "dgrs", "x0", "nearest", False, "path"),
]


def _law_params():
    return [
        pytest.param(i, case, marks=pytest.mark.slow) if case in LAW_SLOW else pytest.param(i, case)
        for i, case in enumerate(LAW_CASES)
    ]


@pytest.mark.parametrize("i,case", _law_params(), ids=[case_id(c) for c in LAW_CASES])
def test_output_law_equals_standard_sampler(i, case, reference):
    spec, coupling, draft, prefetch, leaves, execution = case
    tree = tree_of(spec)
    if coupling == "rmc_as_callable":  # a rule passed as a plain function (no registry metadata)
        coupling = lambda *a, **k: rmc(*a, **k)  # noqa: E731
    r = sample_speculative(
        MODEL,
        SCHED,
        tree,
        coupling,
        N_SPEC,
        draft=draft,
        prefetch=prefetch,
        evaluate_leaves=leaves,
        execution=execution,
        seed=100 + i,
    )
    assert torch.isfinite(r.samples).all()
    p = law_pvalues(r.samples, reference)
    assert min(p) > P_MIN, p
    # (1, 1) with an exact root velocity in every round (leaves evaluated, or prefetch = none) never rejects
    exact_root_every_round = getattr(tree, "budget", 0) == 1 and (leaves or prefetch == "none")
    if not exact_root_every_round:
        # residuals were drawn: the test exercises the rejection branch, not only accepted drafts
        assert (r.accepts < r.attempts).any()


def test_two_standard_runs_agree(reference):
    # null check of the statistic itself: seed 10001, 2000 trajectories against the reference
    r = sample_standard(MODEL, SCHED, N_SPEC, seed=REF_SEED + 1)
    assert min(law_pvalues(r.samples, reference)) > P_MIN


# --- sensitivity: the law test detects a biased coupling -----------------------------------------


def always_accept_first(children, mean_p, mean_q, sigma, generator=None):
    """Biased rule: return the first child, always (the draft's law, not the target's)."""
    n = children.shape[0]
    return Verdict(children[:, 0].clone(), torch.ones(n, dtype=torch.bool), torch.zeros(n, dtype=torch.long))


def over_accept(fraction):
    """Biased rule: D-GRS, but a ``fraction`` of its rejections keep the first child instead."""

    def rule(children, mean_p, mean_q, sigma, generator=None):
        v = dgrs(children, mean_p, mean_q, sigma, generator)
        flip = (~v.accepted) & (generator.uniform(1)[:, 0] < fraction)
        sample = torch.where(flip[:, None], children[:, 0], v.sample)
        return Verdict(sample, v.accepted | flip, torch.where(flip, torch.zeros_like(v.index), v.index))

    return rule


@pytest.mark.parametrize(
    "rule,spec",
    [
        (always_accept_first, ("chain", 3)),
        (always_accept_first, ("uniform", (3, 2))),
        (over_accept(0.5), ("uniform", (2, 3))),
        (over_accept(0.5), ("chain", 3)),
    ],
    ids=["always-chain3", "always-uniform32", "over50-uniform23", "over50-chain3"],
)
def test_law_test_detects_biased_coupling(rule, spec, reference):
    # same setup, seed 105, 2000 trajectories: the smallest p-value must fall below 1e-3
    r = sample_speculative(MODEL, SCHED, tree_of(spec), rule, N_SPEC, seed=105)
    p = law_pvalues(r.samples, reference)
    assert min(p) < P_MIN, p


# --- tree and path executions ----------------------------------------------------------------------

COUNT_FIELDS = ("nfe", "nfe_total", "target_rows", "rounds", "committed", "attempts", "accepts")

EQUIV_CASES = [
    (("chain", 3), "rmc", "velocity", "nearest", True),
    (("chain", 6), "rmc", "x0", "none", False),
    (("uniform", (1, 1)), "dgrs", "velocity", "parent", True),
    (("uniform", (2, 3)), "dgrs", "velocity", "nearest", True),
    (("uniform", (2, 3)), "dgrs", "drift", "nearest", False),
    (("uniform", (2, 3)), "dgrs", "x0", "none", True),
    (("uniform", (3, 2)), "dgrs", "velocity", "parent", False),
    (("widths", [3, 1, 2]), "dgrs", "x0", "nearest", True),
    (("widths", [3, 1, 2]), "dgrs", "drift", "none", False),
    (("parent", IRREGULAR), "dgrs", "velocity", "nearest", True),
    (("parent", IRREGULAR), "dgrs", "x0", "parent", False),
    (("uniform", (2, 7)), "dgrs", "velocity", "nearest", True),  # deeper than the 6 speculative steps
    (("by_root", BY_ROOT), "dgrs", "x0", "nearest", True),
    (("by_root", BY_ROOT), "dgrs", "velocity", "parent", False),
    (("uniform", (2, 3)), "dgrs", "x0_extrap", "nearest", True),
    (("chain", 6), "rmc", "x0_extrap", "none", False),
    (("parent", IRREGULAR), "dgrs", "x0_extrap", "parent", False),
    (("widths", [3, 1, 2]), "dgrs", "x0_extrap_gated", "nearest", False),
    (("uniform", (3, 2)), "dgrs", "x0_extrap_gated", "parent", True),
    (("uniform", (2, 7)), "dgrs", "x0_extrap_gated", "none", True),
    (("uniform", (2, 3)), "dgrs", "x0_affine", "nearest", True),
    (("parent", IRREGULAR), "dgrs", "x0_affine", "parent", False),
    (("chain", 6), "rmc", "x0_affine", "none", True),
    (("by_root", BY_ROOT), "dgrs", "x0_affine", "nearest", False),
]


def _tree_and_path(model, case):
    """Both executions of ``case`` on ``model`` (seed 7, 40 trajectories), their counts asserted identical."""
    spec, coupling, draft, prefetch, leaves = case
    kw = dict(draft=draft, prefetch=prefetch, evaluate_leaves=leaves, seed=7)
    a = sample_speculative(model, SCHED, tree_of(spec), coupling, 40, execution="tree", **kw)
    b = sample_speculative(model, SCHED, tree_of(spec), coupling, 40, execution="path", **kw)
    for f in COUNT_FIELDS:
        assert torch.equal(getattr(a, f), getattr(b, f)), f
    return a, b


@pytest.mark.parametrize("case", EQUIV_CASES, ids=[case_id(c + ("tree-vs-path",)) for c in EQUIV_CASES])
def test_tree_and_path_executions_agree(case):
    # seed 7, 40 trajectories, a target evaluated row by row (helpers.RowwiseMixture: the executions batch a
    # node differently, and a batched product rounds a row's last bits by the batch): identical counts and
    # samples, bitwise
    a, b = _tree_and_path(ROWWISE, case)
    assert a.batch_nfe == b.batch_nfe
    assert torch.equal(a.samples, b.samples)


@pytest.mark.parametrize(
    "case",
    [c for c in EQUIV_CASES if c[2] in ("velocity", "x0")][:6],
    ids=[case_id(c + ("batched",)) for c in EQUIV_CASES if c[2] in ("velocity", "x0")][:6],
)
def test_tree_and_path_agree_with_a_batched_target(case):
    # the batched mixture (its products round a row's last bits by the batch, which the executions form
    # differently): identical counts, samples within 16 T eps of float64 (T = 8 steps of a few roundings each,
    # samples of scale 1), the bound docs/architecture.md states; seed 7, 40 trajectories
    a, b = _tree_and_path(MODEL, case)
    bound = 16 * SCHED.steps * torch.finfo(torch.float64).eps * max(1.0, float(b.samples.abs().max()))
    assert float((a.samples - b.samples).abs().max()) <= bound


def test_tree_and_path_agree_float32():
    model = GaussianMixture(dim=4, components=3, layout_seed=1, dtype=torch.float32)
    kw = dict(seed=3)
    a = sample_speculative(model, SCHED, DraftTree.uniform(2, 3), "dgrs", 60, execution="tree", **kw)
    b = sample_speculative(model, SCHED, DraftTree.uniform(2, 3), "dgrs", 60, execution="path", **kw)
    assert a.samples.dtype == torch.float32 and torch.isfinite(a.samples).all()
    for f in COUNT_FIELDS:
        assert torch.equal(getattr(a, f), getattr(b, f)), f
    torch.testing.assert_close(a.samples, b.samples, rtol=1e-5, atol=1e-5)


# --- batch independence --------------------------------------------------------------------------


@pytest.mark.parametrize("execution", ["tree", "path"])
@pytest.mark.parametrize(
    "spec,coupling", [(("uniform", (2, 3)), "dgrs"), (("chain", 4), "rmc"), (("parent", IRREGULAR), "dgrs")]
)
def test_batch_independence(execution, spec, coupling):
    # seed 11: trajectories 3..5 run alone equal rows 3..5 of an 8-trajectory run
    full = sample_speculative(MODEL, SCHED, tree_of(spec), coupling, 8, seed=11, execution=execution)
    part = sample_speculative(MODEL, SCHED, tree_of(spec), coupling, seed=11, indices=[3, 4, 5], execution=execution)
    for f in COUNT_FIELDS:
        assert torch.equal(getattr(full, f)[3:6], getattr(part, f)), f
    torch.testing.assert_close(full.samples[3:6], part.samples, rtol=0, atol=1e-12)


def test_batch_independence_standard():
    full = sample_standard(MODEL, SCHED, 8, seed=11)
    part = sample_standard(MODEL, SCHED, seed=11, indices=[3, 4, 5])
    torch.testing.assert_close(full.samples[3:6], part.samples, rtol=0, atol=1e-12)


def test_max_batch_does_not_change_results():
    kw = dict(seed=5, execution="tree")
    a = sample_speculative(MODEL, SCHED, DraftTree.uniform(2, 3), "dgrs", 20, **kw)
    b = sample_speculative(MODEL, SCHED, DraftTree.uniform(2, 3), "dgrs", 20, max_batch=7, **kw)
    for f in COUNT_FIELDS:
        assert torch.equal(getattr(a, f), getattr(b, f)), f
    torch.testing.assert_close(a.samples, b.samples, rtol=0, atol=1e-12)


def test_seeds_matter_and_repeat():
    a = sample_speculative(MODEL, SCHED, DraftTree.uniform(2, 2), "dgrs", 5, seed=1)
    b = sample_speculative(MODEL, SCHED, DraftTree.uniform(2, 2), "dgrs", 5, seed=1)
    c = sample_speculative(MODEL, SCHED, DraftTree.uniform(2, 2), "dgrs", 5, seed=2)
    assert torch.equal(a.samples, b.samples)
    assert not torch.allclose(a.samples, c.samples)


# --- counting the target's actual invocations ----------------------------------------------------


def run_counted(T, spec, coupling="dgrs", m=6, **kw):
    model = CountingModel(MODEL)
    r = sample_speculative(
        model,
        Schedule.make(T, 1.0),
        tree_of(spec),
        coupling,
        m,
        execution="tree",
        cond={"tid": torch.arange(m)},
        seed=3,
        **kw,
    )
    return r, model


def check_counts_match_invocations(r, model, m):
    calls, rows = model.per_trajectory(m)
    final = r.nfe_total - 1 - r.nfe  # the endpoint step to sigma = 0 when it needed its own call
    assert torch.equal(calls, r.nfe_total)
    assert torch.equal(rows - 1 - final, r.target_rows)


@pytest.mark.parametrize("T", [4, 8])
@pytest.mark.parametrize("prefetch", ["nearest", "parent", "none"])
@pytest.mark.parametrize(
    "spec",
    [("uniform", (1, 1)), ("uniform", (2, 3)), ("chain", 3), ("parent", IRREGULAR)],
    ids=lambda s: tree_of(s).describe(),
)
def test_recorded_counts_equal_model_invocations_leaves(T, prefetch, spec):
    # tree execution, B = |V| protocol: recorded nfe_total = target invocations each trajectory took part in,
    # recorded target_rows = rows it sent to the speculative calls
    r, model = run_counted(T, spec, prefetch=prefetch, evaluate_leaves=True)
    check_counts_match_invocations(r, model, 6)


@pytest.mark.parametrize("prefetch", ["nearest", "parent"])
@pytest.mark.parametrize(
    "spec", [("uniform", (2, 3)), ("chain", 3), ("uniform", (3, 2))], ids=lambda s: tree_of(s).describe()
)
def test_recorded_counts_equal_model_invocations_internal(prefetch, spec):
    # B = |I| protocol with depth >= 2 (every round's batch is non-empty)
    r, model = run_counted(8, spec, prefetch=prefetch, evaluate_leaves=False)
    check_counts_match_invocations(r, model, 6)


@pytest.mark.parametrize(
    "spec,prefetch",
    [
        (("uniform", (1, 1)), "nearest"),
        (("uniform", (1, 1)), "parent"),
        (("uniform", (1, 1)), "none"),
        (("uniform", (2, 1)), "nearest"),
        (("uniform", (2, 3)), "none"),
        (("chain", 3), "none"),
    ],
    ids=["1x1-nearest", "1x1-parent", "1x1-none", "2x1-nearest", "2x3-none", "chain3-none"],
)
def test_recorded_counts_equal_model_invocations_empty_batches(spec, prefetch):
    r, model = run_counted(8, spec, prefetch=prefetch, evaluate_leaves=False)
    check_counts_match_invocations(r, model, 6)


# --- (K, L) = (1, 1): no speculation ---------------------------------------------------------------


@pytest.mark.parametrize("T", [3, 5, 8])
@pytest.mark.parametrize("coupling", ["dgrs", "rmc"])
@pytest.mark.parametrize("draft", ["velocity", "drift", "x0", "x0_extrap", "x0_extrap_gated", "x0_affine"])
@pytest.mark.parametrize("prefetch", ["nearest", "parent"])
def test_no_speculation_costs_one_call_per_step(T, coupling, draft, prefetch):
    """(K, L) = (1, 1) with the B = |V| protocol costs exactly what the standard sampler costs: nfe_total = T.

    The warm-up call at state 1 is the call the standard sampler makes there; each of the T - 2 rounds
    then evaluates its single drafted child (the root's exact velocity is already known, so delta = 0 and
    the child is always accepted), and the last round's leaf evaluation, at state T - 1, serves the final
    Euler step. So nfe = 1 + (T - 2) = T - 1 (the paper's protocol charges the warm-up to
    speculation), target_rows = T - 1, and nfe_total = 1 (step 0) + (T - 1) = T.
    """
    m = 5
    model = CountingModel(MODEL)
    r = sample_speculative(
        model,
        Schedule.make(T, 1.0),
        DraftTree.uniform(1, 1),
        coupling,
        m,
        draft=draft,
        prefetch=prefetch,
        evaluate_leaves=True,
        execution="tree",
        cond={"tid": torch.arange(m)},
        seed=4,
    )
    assert torch.all(r.nfe_total == T)
    assert torch.all(r.nfe == T - 1)
    assert torch.all(r.target_rows == T - 1)
    assert torch.all(r.rounds == T - 2)
    assert torch.all(r.committed == 1)
    assert torch.equal(r.accepts, r.attempts) and torch.all(r.attempts == T - 2)
    assert r.batch_nfe == T - 1
    # every target invocation after step 0 evaluates exactly one row per trajectory
    assert len(model.log) == T
    for t in model.log:
        assert torch.equal(torch.sort(t).values, torch.arange(m))
    check_counts_match_invocations(r, model, m)
    std = sample_standard(MODEL, Schedule.make(T, 1.0), m)
    assert torch.all(std.nfe_total == T) and torch.all(std.nfe == T - 2)


def test_no_speculation_prefetch_none_pays_the_root_each_round():
    # prefetch = none: every round pays a root call plus its batch -> nfe = 2 (T - 2), and the final step its own call
    T = 8
    r = sample_speculative(MODEL, SCHED, DraftTree.uniform(1, 1), "dgrs", 5, prefetch="none", seed=4)
    assert torch.all(r.nfe == 2 * (T - 2)) and torch.all(r.nfe_total == 2 * T - 2)
    assert torch.all(r.target_rows == 2 * (T - 2))


# --- accounting identities -----------------------------------------------------------------------

ACCOUNT_CASES = [
    (spec, coupling, prefetch, leaves, execution)
    for spec, coupling in [
        (("chain", 4), "rmc"),
        (("uniform", (2, 3)), "dgrs"),
        (("widths", [3, 1, 2]), "dgrs"),
        (("parent", IRREGULAR), "dgrs"),
        (("uniform", (1, 1)), "dgrs"),
        (("uniform", (2, 9)), "dgrs"),
    ]
    for prefetch in ["nearest", "parent", "none"]
    for leaves in [True, False]
    for execution in ["path"]
] + [(("uniform", (2, 3)), "dgrs", p, lv, "tree") for p in ["nearest", "none"] for lv in [True, False]]


@pytest.mark.parametrize("case", ACCOUNT_CASES, ids=lambda c: case_id((c[0], c[1], "velocity", c[2], c[3], c[4])))
def test_accounting_identities(case):
    # seed 21, 30 trajectories, T = 8 (6 speculative steps)
    spec, coupling, prefetch, leaves, execution = case
    T, M = SCHED.steps, 30
    tree = tree_of(spec)
    r = sample_speculative(
        MODEL, SCHED, tree, coupling, M, prefetch=prefetch, evaluate_leaves=leaves, execution=execution, seed=21
    )
    L = min(tree.max_depth, T - 2)
    assert r.speculative_steps == T - 2
    assert r.committed.shape == (M, T - 2) and r.attempts.shape == (M, L) and r.accepts.shape == (M, L)
    # rounds commit T - 2 steps in total, each between 1 and L_n
    assert torch.all(r.committed.sum(1) == T - 2)
    internal_rows, all_rows = tree.restrict(T - 2).call_rows_by_depth
    table = all_rows if leaves else internal_rows
    empty_rounds = torch.zeros(M, dtype=torch.long)
    for i in range(M):
        R = int(r.rounds[i])
        c = r.committed[i]
        assert torch.all(c[:R] >= 1) and torch.all(c[R:] == 0)
        n, rows, empty = 1, 0, 0
        for j, k in enumerate(c[:R].tolist()):
            Ln = min(L, T - 1 - n)
            assert k <= Ln
            rows += int(table[Ln])
            # without leaves, a round whose only internal node is a root of known velocity calls nothing
            root_known = prefetch == "none" or j == 0
            empty += int(not leaves and root_known and int(table[Ln]) == 1)
            n += k
        assert n == T - 1
        empty_rounds[i] = empty
        # target rows: each round's restricted tree (|V| or |I|), less the root where its velocity was known,
        # plus one row per separate root call (the warm-up; with prefetch = none, every round)
        if prefetch == "none":
            assert int(r.target_rows[i]) == rows
        elif not leaves:
            assert int(r.target_rows[i]) == rows  # the warm-up row replaces round 1's root row
        else:
            rejections = (T - 2) - int(r.accepts[i].sum())
            clean = R - rejections  # rounds that walked to a leaf, whose exact velocity is reused
            last_clean = int(r.nfe_total[i] == 1 + r.nfe[i])
            exact_roots = 1 + clean - last_clean
            assert int(r.target_rows[i]) == 1 + rows - exact_roots
    # acceptance per depth: a verification per committed step, accepts <= attempts,
    # depth l + 1 is attempted only below an accepted node of depth l
    assert torch.all(r.attempts.sum(1) == T - 2)
    assert torch.all(r.accepts <= r.attempts) and torch.all(r.accepts >= 0)
    assert torch.equal(r.attempts[:, 0], r.rounds)
    assert torch.all(r.attempts[:, 1:] <= r.accepts[:, :-1])
    # nfe: warm-up + one per round, or two per round without prefetch; a round with an empty batch is free
    if prefetch == "none":
        assert torch.all(r.nfe == 2 * r.rounds - empty_rounds)
    else:
        assert torch.all(r.nfe == 1 + r.rounds - empty_rounds)
    # nfe_total = step 0 + nfe + the final step when no exact velocity was left for it
    final = r.nfe_total - 1 - r.nfe
    assert torch.all((final == 0) | (final == 1))
    if prefetch == "none" or not leaves:
        assert torch.all(final == 1)
    torch.testing.assert_close(r.speedup, (T - 2) / r.nfe.double())
    # the batch moves in lockstep: its nfe is those of its most expensive member
    assert r.batch_nfe == int(r.nfe.max())
    assert r.batch_speedup == pytest.approx((T - 2) / r.batch_nfe)


def test_callback_reports_rounds():
    seen = []
    r = sample_speculative(MODEL, SCHED, DraftTree.uniform(2, 2), "dgrs", 10, seed=2, callback=seen.append)
    assert [s["round"] for s in seen] == list(range(1, int(r.rounds.max()) + 1))
    assert seen[-1]["batch_nfe"] == r.batch_nfe
    assert seen[0]["live"] == 10 and all(s["live"] >= 1 for s in seen)


def test_cond_rows_follow_their_trajectory():
    """A conditional target: the mixture shifted by a per-trajectory offset ``c`` (v' = v(x - (1-s) c) - c).

    Offsets of +-40 on the first coordinate: every final sample must sit near its own offset, which fails
    if conditioning rows were routed to the wrong trajectory in either execution.
    """

    class Shifted:
        event_shape, dtype = MODEL.event_shape, MODEL.dtype

        def __call__(self, x, sigma, c):
            s = sigma.to(x.dtype)[:, None]
            return MODEL(x - (1 - s) * c, sigma) - c

    m = 8
    c = torch.zeros(m, 4, dtype=torch.float64)
    c[:, 0] = 40.0 * torch.tensor([1, -1, -1, 1, -1, 1, 1, -1], dtype=torch.float64)
    for execution in ("tree", "path"):
        r = sample_speculative(
            Shifted(), SCHED, DraftTree.uniform(2, 3), "dgrs", m, cond={"c": c}, execution=execution, seed=6
        )
        assert torch.all((r.samples[:, 0] - c[:, 0]).abs() < 5.0)
    s = sample_standard(Shifted(), SCHED, m, cond={"c": c}, seed=6)
    assert torch.all((s.samples[:, 0] - c[:, 0]).abs() < 5.0)


# --- bad input -----------------------------------------------------------------------------------


def test_bad_tree_sizes():
    with pytest.raises(ValueError, match=r"K=0 is invalid.*>= 1"):
        DraftTree.uniform(0, 2)
    with pytest.raises(ValueError, match=r"L=0 is invalid.*>= 1"):
        DraftTree.uniform(2, 0)
    with pytest.raises(ValueError, match="at least one state"):
        sample_speculative(MODEL, SCHED, DraftTree([-1]), "dgrs", 2)


@pytest.mark.parametrize("eps", [0.0, 1.5, -0.2])
def test_bad_eps(eps):
    with pytest.raises(ValueError, match=rf"eps={eps!r} is invalid.*\(0, 1\]"):
        Schedule.make(8, eps)


def test_bad_steps():
    with pytest.raises(ValueError, match=r"steps=2 is invalid.*>= 3"):
        Schedule.make(2, 0.5)


@pytest.mark.parametrize("sigma", [0.0, -1.0, float("nan"), float("inf")])
@pytest.mark.parametrize("name", ["dgrs", "rmc"])
def test_coupling_bad_sigma(name, sigma):
    from specsamp.coupling import get_coupling

    kids = torch.zeros(3, 1, 2, dtype=torch.float64)
    mp = torch.zeros(3, 2, dtype=torch.float64)
    with pytest.raises(ValueError, match="sigma must be finite and > 0"):
        get_coupling(name)(kids, mp, mp + 1, sigma)


@pytest.mark.parametrize(
    "kwargs,pattern",
    [
        (
            {"coupling": "nope"},
            r"coupling='nope' is not registered; valid: (\w+, )*dgrs, (\w+, )*rmc(, \w+)* \(registered\)",
        ),
        (
            {"draft": "nope"},
            r"draft='nope' is not registered; valid: drift, velocity, x0, x0_affine, x0_extrap, x0_extrap_gated \(registered\)",
        ),
        ({"prefetch": "nope"}, r"prefetch='nope' is invalid: must be one of nearest, parent, none\.$"),
        ({"execution": "nope"}, r"execution='nope' is invalid: must be one of tree, path\.$"),
        ({"max_batch": 0}, r"max_batch=0 is invalid: must be an integer >= 1, or None\.$"),
        ({"max_batch": "4"}, r"max_batch='4' is invalid"),
        ({"evaluate_leaves": "false"}, r"evaluate_leaves='false' is invalid: must be True or False"),
        ({"warmup": 1}, r"warmup=1 is invalid: must be one of call, step0"),
        ({"callback": 3}, r"callback=3 is invalid: must be a callable, or None"),
        ({"refine": -1}, r"refine=-1 is invalid: the number of Picard sweeps per round must be an integer >= 0"),
        ({"tree": "abc"}, r"tree='abc' is invalid: must be a specsamp.trees.DraftTree"),
        ({"n_samples": 0}, r"n_samples=0 is invalid.*>= 1"),
        ({"n_samples": -3}, r"n_samples=-3 is invalid"),
        ({"n_samples": None}, r"n_samples=None is invalid"),
        ({"n_samples": None, "indices": []}, r"indices"),
    ],
)
def test_bad_sampler_arguments(kwargs, pattern):
    kw = {"coupling": "dgrs", "n_samples": 4, "tree": DraftTree.uniform(2, 2)}
    kw.update(kwargs)
    with pytest.raises(ValueError, match=pattern):
        sample_speculative(MODEL, SCHED, **kw)


def test_rmc_refuses_a_wide_tree():
    with pytest.raises(ValueError, match=r"'rmc' accepts at most K=1 .* has a node with 2"):
        sample_speculative(MODEL, SCHED, DraftTree.uniform(2, 3), "rmc", 4)
    with pytest.raises(ValueError, match=r"'rmc' accepts at most K=1 .* has a node with 3"):
        sample_speculative(MODEL, SCHED, DraftTree(IRREGULAR), "rmc", 4)


def test_standard_bad_n_samples():
    with pytest.raises(ValueError, match=r"n_samples=0 is invalid"):
        sample_standard(MODEL, SCHED, 0)


# --- section 5.1 sanity ---------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    "tree,coupling,lo,hi",
    [(DraftTree.chain(155), "rmc", 1.90, 2.05), (DraftTree.uniform(5, 3), "dgrs", 2.0, 2.25)],
    ids=["rmc-chain155", "dgrs-uniform53"],
)
def test_gmm_section_5_1_speedup(tree, coupling, lo, hi):
    """Paper section 5.1: d = 500, 5 components (layout seed 0), T = 30, eps = 0.1, 100 trajectories, seed 0.

    Paper: RMC plateaus at 1.96--2.00x, D-GRS 2.14x at B = 155. Band: mean per-trajectory speedup within
    [lo, hi] (observed 1.978 and 2.109 at this seed).
    """
    model = GaussianMixture(dim=500, components=5, layout_seed=0)
    r = sample_speculative(model, Schedule.make(30, 0.1), tree, coupling, 100, seed=0)
    s = r.speedup.mean().item()
    assert lo <= s <= hi, s
    assert torch.all(r.committed.sum(1) == 28)


@pytest.mark.parametrize("spec,coupling", [(("uniform", (2, 3)), "dgrs"), (("chain", 4), "rmc")])
def test_warmup_step0_keeps_the_law_and_saves_the_warmup_call(spec, coupling, reference):
    # seed 300, 2000 trajectories against the standard sampler's 4000 (p > 1e-3 on every statistic);
    # the first round drafts from the sigma = 1 velocity, so the warm-up call disappears: nfe = rounds
    tree = tree_of(spec)
    r = sample_speculative(MODEL, SCHED, tree, coupling, N_SPEC, warmup="step0", seed=300)
    assert min(law_pvalues(r.samples, reference)) > P_MIN
    assert torch.equal(r.nfe, r.rounds)
    base = sample_speculative(MODEL, SCHED, tree, coupling, 50, seed=300)
    assert torch.equal(base.nfe, base.rounds + 1)
    with pytest.raises(ValueError, match="warmup"):
        sample_speculative(MODEL, SCHED, tree, coupling, 2, warmup="nope")


@pytest.mark.parametrize("execution", ["path", "tree"])
def test_non_finite_velocity_is_refused_naming_trajectory_step_and_node(execution):
    from specsamp.coupling import NonFiniteError

    with pytest.raises(
        NonFiniteError, match=r"non-finite states at trajectory \d+, step [3-7], children of node \d+ \(depth \d\)"
    ) as err:
        sample_speculative(NaNBelow(), SCHED, DraftTree.uniform(2, 2), "dgrs", 8, execution=execution, seed=4)
    assert err.value.rows and all(0 <= r < 8 for r in err.value.rows)


@pytest.mark.parametrize("execution", ["path", "tree"])
def test_one_tree_for_every_root_equals_the_plain_tree(execution):
    # the per-root grouping changes nothing when every root gets the same tree: same numbers, same counts
    # (a target evaluated row by row: the path execution's per-root groups batch the rows differently)
    tree = DraftTree.from_widths([3, 1, 2])
    kw = dict(draft="x0", seed=5, execution=execution)
    a = sample_speculative(ROWWISE, SCHED, tree, "dgrs", 30, **kw)
    b = sample_speculative(ROWWISE, SCHED, TreesByRoot({n: tree for n in range(1, 7)}), "dgrs", 30, **kw)
    for f in COUNT_FIELDS + ("attempts_by_root", "accepts_by_root"):
        assert torch.equal(getattr(a, f), getattr(b, f)), f
    assert a.batch_nfe == b.batch_nfe
    assert torch.equal(a.samples, b.samples)
    # per-root counts add up to the per-depth ones
    assert torch.equal(a.attempts_by_root.sum(0), a.attempts.sum(0)) and torch.equal(
        a.accepts_by_root.sum(0), a.accepts.sum(0)
    )


def test_step_dependent_tree_errors():
    with pytest.raises(ValueError, match="not a DraftTree"):
        sample_speculative(MODEL, SCHED, lambda n: None, "dgrs", 4)
    with pytest.raises(ValueError, match="root 2"):
        sample_speculative(MODEL, SCHED, lambda n: DraftTree([-1]) if n == 2 else DraftTree.chain(1), "dgrs", 4)
    with pytest.raises(ValueError, match="children"):
        sample_speculative(MODEL, SCHED, lambda n: DraftTree.uniform(2, 1), "rmc", 4)


# --- drafts with a history of exact data predictions --------------------------------------------


def test_x0_extrap_rebuilds_a_data_prediction_linear_in_log_snr():
    # records of D(lambda) = A + B lambda at states 3 and 4, an exact root at 5: the drafted velocity at
    # step 7 is (x - D(lambda_7)) / sigma_7, fed to the kernel mean; a record at step 0 gives slope 0
    from specsamp.drafts import DraftHistory, DraftRoot, get_draft

    draft = get_draft("x0_extrap")
    lam = lambda n: torch.log1p(-SCHED.sigmas[n]) - torch.log(SCHED.sigmas[n])  # noqa: E731
    g = torch.Generator().manual_seed(0)
    A, B, x_r, x_u = (torch.randn(2, 4, generator=g, dtype=torch.float64) for _ in range(4))
    D = lambda n: A + B * lam(n)  # noqa: E731
    n_r = torch.tensor([5, 5])
    s_r = SCHED.sigmas[5]
    root = DraftRoot(
        x=x_r,
        v=(x_r - D(5)) / s_r,
        n=n_r,
        exact=torch.tensor([True, True]),
        history=DraftHistory(torch.stack([D(4), D(3)], 1), torch.tensor([[4, 3], [4, 3]])),
    )
    n_u = torch.tensor([6, 6])
    want = SCHED.mean(x_u, (x_u - D(6)) / SCHED.sigmas[6], n_u)
    torch.testing.assert_close(draft.mean(draft.freeze(root, SCHED), x_u[:, None], n_u, SCHED)[:, 0], want)
    # root not exact: the slope comes from the two records (same line), the anchor from the root's v
    root2 = DraftRoot(x=x_r, v=root.v, n=n_r, exact=torch.tensor([False, False]), history=root.history)
    torch.testing.assert_close(draft.mean(draft.freeze(root2, SCHED), x_u[:, None], n_u, SCHED)[:, 0], want)
    # a pair reaching back to step 0 (lambda = -inf) or an empty slot: slope 0, the x0 draft
    x0 = get_draft("x0")
    want0 = x0.mean(x0.freeze(root, SCHED), x_u[:, None], n_u, SCHED)
    for hist_n in ([[4, 0], [4, -1]], [[0, -1], [-1, -1]]):
        r3 = DraftRoot(
            x=x_r,
            v=root.v,
            n=n_r,
            exact=torch.tensor([False, False]),
            history=DraftHistory(root.history.x0, torch.tensor(hist_n)),
        )
        torch.testing.assert_close(draft.mean(draft.freeze(r3, SCHED), x_u[:, None], n_u, SCHED), want0)


@pytest.mark.parametrize("prefetch", ["nearest", "parent", "none"])
@pytest.mark.parametrize("warmup", ["call", "step0"])
def test_history_holds_the_trajectorys_exact_data_predictions(prefetch, warmup):
    # a probe draft (the x0 draft plus history=3) sees, at every root: records at earlier states, most
    # recent first, strictly decreasing; the state just before the root where the root's own velocity is
    # not exact; the step-0 record at the first round; and each record equals the model's data prediction
    from specsamp.drafts import DRAFTS, Draft, data_prediction, get_draft

    seen, states = [], []
    x0 = get_draft("x0")

    def freeze(root, sch):
        seen.append(
            (root.x.clone(), root.n.clone(), root.exact.clone(), root.history.x0.clone(), root.history.n.clone())
        )
        states.append(root.history.x.clone())
        return x0.freeze(root, sch)

    DRAFTS.register("_probe", Draft("_probe", freeze, x0.mean, history=3))
    try:
        r = sample_speculative(
            MODEL, SCHED, DraftTree.uniform(2, 3), "dgrs", 12, draft="_probe", prefetch=prefetch, warmup=warmup, seed=8
        )
        base = sample_speculative(
            MODEL, SCHED, DraftTree.uniform(2, 3), "dgrs", 12, draft="x0", prefetch=prefetch, warmup=warmup, seed=8
        )
    finally:
        del DRAFTS._entries["_probe"]
    torch.testing.assert_close(r.samples, base.samples, rtol=0, atol=0)  # history changes no number
    first = seen[0][4]
    assert torch.all(first[:, 0] == 0) and torch.all(first[:, 1:] == -1)
    for _x, n, exact, hx, hn in seen:
        assert torch.all(hn[:, 0] < n) and torch.all(hn[:, 0] >= 0)
        assert torch.all((hn[:, 1:] < hn[:, :-1]) | (hn[:, 1:] == -1))
        assert torch.all(exact | (hn[:, 0] == n - 1))
        assert torch.all(hx[hn == -1] == 0)
    assert len(seen) >= 3
    # each record's state: empty slots 0, else the state whose exact data prediction the record holds
    for (_, _, _, hx, hn), hs in zip(seen, states):
        assert torch.all(hs[hn == -1] == 0)
        ok = hn >= 0
        torch.testing.assert_close(data_prediction(hs[ok], MODEL(hs[ok], SCHED.sigmas[hn[ok]]), hn[ok], SCHED), hx[ok])
    # the records' values: step 0's at the first round, the first root's at the second (all rows live)
    from specsamp.sampler import initial_noise

    sig = SCHED.sigmas
    x_init = initial_noise(8, torch.arange(12), MODEL.event_shape, MODEL.dtype)
    torch.testing.assert_close(seen[0][3][:, 0], x_init - MODEL(x_init, sig[torch.zeros(12, dtype=torch.long)]))
    x1, n1 = seen[0][0], seen[0][1]
    d1 = data_prediction(x1, MODEL(x1, sig[n1]), n1, SCHED)
    hx, hn = seen[1][3], seen[1][4]
    assert seen[1][1].numel() == 12 and (hn == 1).any()
    for j in range(hx.shape[1]):
        at1 = hn[:, j] == 1
        torch.testing.assert_close(hx[at1, j], d1[at1])


def test_x0_affine_is_exact_for_one_gaussian_and_falls_back_otherwise():
    # records of one isotropic Gaussian N(mu, s^2 I) at states 3 and 4 (E[x0|x] = mu + c (x - (1-sigma) mu)):
    # the draft recovers s^2 and mu, so its mean at any node and later step is the target kernel's mean,
    # whether the root's own velocity is exact (records: root, 4) or not (records: 4, 3)
    from specsamp.drafts import DraftHistory, DraftRoot, get_draft

    draft = get_draft("x0_affine")
    g = torch.Generator().manual_seed(0)
    mu = torch.randn(2, 6, generator=g, dtype=torch.float64)
    s2 = torch.tensor([0.04, 0.3], dtype=torch.float64)[:, None]
    sig = SCHED.sigmas

    def D(x, n):
        a, sg = 1 - sig[n], sig[n]
        c = a * s2 / (a * a * s2 + sg * sg)
        return mu + c * (x - a * mu)

    xs = {n: torch.randn(2, 6, generator=g, dtype=torch.float64) for n in (3, 4, 5)}
    x_u = torch.randn(2, 6, generator=g, dtype=torch.float64)
    n_u = torch.tensor([6, 6])
    want = SCHED.mean(x_u, (x_u - D(x_u, 6)) / sig[6], n_u)
    x_r, n_r = xs[5], torch.tensor([5, 5])
    hist = dict(
        history=DraftHistory(
            x0=torch.stack([D(xs[4], 4), D(xs[3], 3), D(xs[3], 3) * 0], 1),
            x=torch.stack([xs[4], xs[3], xs[3] * 0], 1),
            n=torch.tensor([[4, 3, -1], [4, 3, -1]]),
        )
    )
    root = DraftRoot(x=x_r, v=(x_r - D(x_r, 5)) / sig[5], n=n_r, exact=torch.tensor([True, True]), **hist)
    fr = draft.freeze(root, SCHED)
    torch.testing.assert_close(fr[:, 3, 0], s2[:, 0], rtol=1e-4, atol=0)
    torch.testing.assert_close(draft.mean(fr, x_u[:, None], n_u, SCHED)[:, 0], want, rtol=1e-6, atol=1e-9)
    wrong_v = DraftRoot(x=x_r, v=torch.zeros_like(x_r), n=n_r, exact=torch.tensor([False, False]), **hist)
    torch.testing.assert_close(
        draft.mean(draft.freeze(wrong_v, SCHED), x_u[:, None], n_u, SCHED)[:, 0], want, rtol=1e-6, atol=1e-9
    )
    # a record at step 0 (sigma = 1) or an empty slot: no fit, the x0_extrap_gated draft exactly
    gated = get_draft("x0_extrap_gated")
    for hist_n in ([[4, 0, -1], [4, -1, -1]], [[0, -1, -1], [-1, -1, -1]]):
        h = hist["history"]
        r3 = DraftRoot(
            x=x_r,
            v=root.v,
            n=n_r,
            exact=torch.tensor([False, False]),
            history=DraftHistory(x0=h.x0, x=h.x, n=torch.tensor(hist_n)),
        )
        fr3 = draft.freeze(r3, SCHED)
        assert torch.all(fr3[:, 3] == -1)
        want3 = gated.mean(gated.freeze(r3, SCHED), x_u[:, None], n_u, SCHED)
        torch.testing.assert_close(draft.mean(fr3, x_u[:, None], n_u, SCHED), want3, rtol=0, atol=0)


def test_a_bad_model_schedule_or_cond_is_refused_before_any_call():
    from specsamp.errors import ConfigError

    sch, tr = Schedule.make(steps=10, eps=0.1), DraftTree.uniform(2, 3)

    class Net:
        event_shape, dtype, calls = (4,), torch.float32, 0

        def __call__(self, x, sigma, **cond):
            Net.calls += 1
            return x

    def without_shape(x, sigma, **cond):
        return x

    bad_shape, bad_dtype = Net(), Net()
    bad_shape.event_shape, bad_dtype.dtype = "4", "float32"
    cases = [
        ((None, sch), {}, "model=None"),
        ((Net(), 30), {}, "schedule=30"),
        ((without_shape, sch), {}, "model.event_shape=None"),
        ((bad_shape, sch), {}, "model.event_shape='4'"),
        ((bad_dtype, sch), {}, "model.dtype='float32'"),
        ((Net(), sch), {"cond": [1]}, "cond=[1]"),
    ]
    for args, kw, named in cases:
        for fn, extra in ((sample_speculative, (tr, "dgrs")), (sample_standard, ())):
            with pytest.raises(ConfigError, match=re.escape(named) + " is invalid"):
                fn(*args, *extra, n_samples=2, **kw)
    assert Net.calls == 0
