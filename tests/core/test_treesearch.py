"""Tests of the draft-tree search (:mod:`specsamp.treesearch`).

The dynamic program is checked against brute-force enumeration of every ordered tree with at most 7
drafted states (depth <= 4) for four positional models, including width-dependent ones; its trees
are valid breadth-first DraftTrees whose expected steps equal the program's value and are never below
any uniform (K, L) tree of the same or a smaller budget. Tolerance 1e-12 throughout.
"""

import numpy as np
import pytest

from specsamp import theory, treesearch as ts
from specsamp.trees import DraftTree, budget as uniform_budget


def forests(n: int, depth: int):
    """Every ordered forest with ``n`` nodes whose trees have depth <= ``depth`` (nested lists)."""
    if n == 0:
        yield []
        return
    if depth == 0:
        return
    for first in range(1, n + 1):
        for sub in forests(first - 1, depth - 1):
            for rest in forests(n - first, depth):
                yield [sub] + rest


def brute_force(budget: int, positional, max_depth: int) -> float:
    best = 0.0
    for n in range(1, budget + 1):
        for f in forests(n, max_depth):
            best = max(best, theory.expected_steps(ts.tree_from_nested(f), positional))
    return best


def _synthetic(depth: int, K: int) -> np.ndarray:
    # width-dependent and depth-dependent, not monotone in the child index
    rng = np.random.default_rng(1000 * depth + K)
    p = rng.random(K)
    return p / p.sum() * (1 - 0.5**K) * 0.9**depth


POSITIONALS = {
    "dgrs-flat": ts.profile_positional([1.0], "dgrs"),
    "dgrs-growing": ts.profile_positional([0.2, 0.6, 1.2, 2.0], "dgrs"),
    "markmax-growing": ts.profile_positional([0.3, 0.8, 1.5], "markmax"),
    "synthetic": _synthetic,
}


def assert_valid(tree: DraftTree, budget: int, max_depth: int, max_width: int | None = None):
    DraftTree(tree.parent)  # re-validates breadth-first order and contiguous siblings
    assert 1 <= tree.budget <= budget
    assert tree.max_depth <= max_depth
    if max_width is not None:
        assert tree.num_children.max() <= max_width


@pytest.mark.parametrize("name", sorted(POSITIONALS))
@pytest.mark.parametrize("budget,max_depth", [(1, 1), (3, 2), (5, 3), (7, 4)])
def test_matches_brute_force(name, budget, max_depth):
    pos = POSITIONALS[name]
    tree = ts.optimal_tree(budget, pos, max_depth)
    value = ts.optimal_value(budget, pos, max_depth)
    assert_valid(tree, budget, max_depth)
    assert theory.expected_steps(tree, pos) == pytest.approx(value, abs=1e-12)
    assert value == pytest.approx(brute_force(budget, pos, max_depth), abs=1e-12)


@pytest.mark.parametrize("coupling", ["dgrs", "markmax"])
@pytest.mark.parametrize("budget", [14, 62])
def test_beats_every_uniform_tree_within_budget(coupling, budget):
    pos = ts.profile_positional([0.3, 0.7, 1.1, 1.5, 1.9, 2.3], coupling)
    max_depth = 6
    tree = ts.optimal_tree(budget, pos, max_depth, max_width=16)
    assert_valid(tree, budget, max_depth, 16)
    best = theory.expected_steps(tree, pos)
    for K in range(1, 17):
        for L in range(1, max_depth + 1):
            if uniform_budget(K, L) <= budget:
                assert best >= theory.expected_steps(DraftTree.uniform(K, L), pos) - 1e-12, (K, L)


def test_exact_first_step_gives_a_chain():
    # delta = 0 everywhere: child 1 is always accepted, so one child per node is optimal and ties
    # go to the smaller tree: the chain of max_depth states
    pos = ts.profile_positional([0.0], "dgrs")
    tree = ts.optimal_tree(20, pos, 5)
    assert tree.describe() == "chain(5)"
    assert theory.expected_steps(tree, pos) == pytest.approx(5.0)


def test_depth_one_commits_one_step():
    # a depth-1 round commits exactly one step whatever the width: the smallest tree wins
    tree = ts.optimal_tree(9, ts.profile_positional([1.0], "dgrs"), 1)
    assert tree.describe() == "chain(1)"


def test_max_width_is_respected():
    pos = ts.profile_positional([0.8, 1.6], "dgrs")
    tree = ts.optimal_tree(40, pos, 2, max_width=3)
    assert tree.num_children.max() <= 3
    assert ts.optimal_value(40, pos, 2, max_width=3) <= ts.optimal_value(40, pos, 2) + 1e-12


def test_profile_positional_reads_depths_and_repeats_the_last():
    pos = ts.profile_positional([0.2, 0.9], "dgrs")
    np.testing.assert_allclose(pos(0, 3), theory.dgrs_positional(0.2, 3))
    np.testing.assert_allclose(pos(1, 3), theory.dgrs_positional(0.9, 3))
    np.testing.assert_allclose(pos(7, 3), theory.dgrs_positional(0.9, 3))
    np.testing.assert_allclose(ts.profile_positional([1.0], "rmc")(0, 1), [theory.rmc_acceptance(1.0)])


# markmax: 11 s (60 bisection steps of its numerical acceptance), -m slow; the same bisection runs here for dgrs, rmc
@pytest.mark.parametrize("coupling,K", [("dgrs", 3), pytest.param("markmax", 3, marks=pytest.mark.slow), ("rmc", 1)])
def test_deltas_from_acceptance_round_trip(coupling, K):
    deltas = np.array([0.0, 0.35, 1.2, 2.5])
    acc = ts.profile_positional(deltas, coupling)
    rates = [acc(d, K).sum() for d in range(deltas.size)]
    np.testing.assert_allclose(ts.deltas_from_acceptance(rates, K, coupling), deltas, atol=1e-6)


def test_tree_for_the_runner():
    from specsamp.errors import ConfigError
    from specsamp.runner import build, compose, load_config

    run, _ = load_config(compose(["tree=optimal", "budget=14"]))
    coupling = build.build_coupling(run)
    tree, B = build.build_tree(run, coupling, 28, [0.5, 1.0])
    assert B == 14 and tree.budget <= 14 and tree.max_depth <= 14
    with pytest.raises(ConfigError, match="delta"):
        build.build_tree(run, coupling, 28, [0.5, -1.0])
    with pytest.raises(ConfigError, match="max_width=0"):
        load_config(compose(["tree=optimal", "max_width=0"]))


def test_bad_arguments_raise_value_error():
    pos = ts.profile_positional([1.0], "dgrs")
    with pytest.raises(ValueError, match="budget=0"):
        ts.optimal_tree(0, pos, 3)
    with pytest.raises(ValueError, match="max_depth=True"):
        ts.optimal_tree(5, pos, True)
    with pytest.raises(ValueError, match="max_width=0"):
        ts.optimal_tree(5, pos, 3, max_width=0)
    with pytest.raises(ValueError, match=r"positional\(\d+, 1\)"):
        ts.optimal_tree(5, lambda d, K: np.ones(K + 1), 3)
    with pytest.raises(ValueError, match="deltas"):
        ts.profile_positional([-1.0], "dgrs")
    with pytest.raises(ValueError, match="coupling='nope'"):
        ts.profile_positional([1.0], "nope")
    with pytest.raises(ValueError, match="K=2"):
        ts.profile_positional([1.0], "rmc")(0, 2)
    with pytest.raises(ValueError, match="acceptance"):
        ts.deltas_from_acceptance([1.5], 2)


# --- step-dependent trees (tree=optimal_per_step) ------------------------------------------------


def test_deltas_by_root_pools_neighbours_and_inverts():
    from specsamp.treesearch import deltas_by_root

    att = np.zeros((6, 3))
    acc = np.zeros((6, 3))
    att[2, 0], acc[2, 0] = 30, 24  # enough alone at root 2
    att[3, 0], acc[3, 0] = 5, 5  # too few: pools roots 2..4
    att[4, 0], acc[4, 0] = 10, 2
    att[:, 1], acc[:, 1] = 10, 5  # depth 2 everywhere; depth 3 never attempted
    tab = deltas_by_root(att, acc, K=2, min_attempts=24)
    assert tab.shape == (6, 3)
    want = ts.deltas_from_acceptance([24 / 30, 31 / 45], 2)
    np.testing.assert_allclose([tab[2, 0], tab[3, 0]], want)
    np.testing.assert_allclose(tab[:, 2], tab[:, 1])  # unattempted depth: the shallower depth's value
    with pytest.raises(ValueError, match="accepts"):
        deltas_by_root(att, att + 1, K=2)


def test_optimal_trees_by_root_budget_horizon_and_gains():
    from specsamp.treesearch import TreesByRoot, optimal_trees_by_root

    prof = [0.4, 0.6, 0.9, 1.2]
    trees = optimal_trees_by_root(20, prof, 1, 7, max_depth=6, max_width=8)
    assert sorted(trees) == [1, 2, 3, 4, 5, 6]
    for n, t in trees.items():
        assert 2 <= len(t) <= 21 and t.max_depth <= 7 - n
    # unit gains are the plain objective (expected committed steps)
    pos = ts.profile_positional(prof)
    a = ts.optimal_tree(20, pos, 4, 8)
    b = ts.optimal_tree(20, pos, 4, 8, gains=[1.0] * 4)
    assert np.array_equal(a.parent, b.parent)
    with pytest.raises(ValueError, match="gains"):
        ts.optimal_tree(20, pos, 4, 8, gains=[1.0])
    tb = TreesByRoot(trees)
    assert tb(3) is trees[3] and tb.call_rows() == max(len(t) for t in trees.values())
    assert tb.describe().startswith("per-root(6 trees") and tb.largest in trees.values()
