"""Closed-form acceptance and expected progress (specsamp.theory) against each other and Monte Carlo.

Deterministic identities use tolerance 1e-9. Monte Carlo checks (seeds inline) walk the tree with the
real coupling at fixed per-depth ``delta`` and require the mean committed steps within 4 standard
errors of :func:`theory.expected_steps`.
"""

import math

import numpy as np
import pytest
import torch

from specsamp import theory
from specsamp.coupling import dgrs, rmc
from specsamp.trees import DraftTree

DELTAS = np.array([0.0, 1e-6, 0.05, 0.3, 1.0, 2.0, 3.5, 6.0, 12.0, 40.0])


@pytest.mark.parametrize("K", [1, 2, 3, 5, 7, 16])
def test_bound_dominates_dgrs(K):
    bound = theory.list_coupling_bound(DELTAS, K)
    acc = theory.dgrs_acceptance(DELTAS, K)
    assert bound.shape == acc.shape == DELTAS.shape
    assert np.all((acc >= 0) & (acc <= 1)) and np.all((bound >= 0) & (bound <= 1))
    assert np.all(bound >= acc - 1e-9)
    # both are non-increasing in delta and equal 1 at delta = 0
    assert np.all(np.diff(acc) <= 1e-12) and np.all(np.diff(bound) <= 1e-9)
    assert acc[0] == pytest.approx(1.0) and bound[0] == pytest.approx(1.0)


def test_equality_at_K1_with_rmc_eq20():
    rmc_acc = theory.rmc_acceptance(DELTAS)
    # eq. 20 written out: 2 Phibar(delta / 2)
    want = np.array([math.erfc(d / 2 / math.sqrt(2)) for d in DELTAS])
    np.testing.assert_allclose(rmc_acc, want, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(theory.list_coupling_bound(DELTAS, 1), rmc_acc, rtol=0, atol=1e-9)
    # with one proposal, greedy rejection sampling is a maximal coupling
    np.testing.assert_allclose(theory.dgrs_acceptance(DELTAS, 1), rmc_acc, rtol=0, atol=1e-12)


def test_dgrs_acceptance_grows_with_K():
    accs = np.stack([theory.dgrs_acceptance(DELTAS, K) for K in range(1, 9)])
    assert np.all(np.diff(accs, axis=0) >= -1e-12)
    # a strict gain where the single-proposal coupling is not already ~certain or ~hopeless
    mid = (DELTAS > 0.01) & (DELTAS < 6)
    assert np.all(accs[1, mid] > accs[0, mid])


@pytest.mark.parametrize("K", [1, 2, 4, 7])
def test_positional_sums_to_acceptance(K):
    pos = theory.dgrs_positional(DELTAS, K)
    assert pos.shape == (DELTAS.size, K)
    assert np.all(pos >= -1e-15)
    np.testing.assert_allclose(pos.sum(-1), theory.dgrs_acceptance(DELTAS, K), rtol=0, atol=1e-12)
    # the first child is accepted with the maximal-coupling probability; later ones less and less
    np.testing.assert_allclose(pos[:, 0], theory.rmc_acceptance(DELTAS), rtol=0, atol=1e-12)
    if K > 1:
        assert np.all(np.diff(pos, axis=-1) <= 1e-12)


def test_levels_shapes():
    lam, g = theory.dgrs_levels([0.5, 2.0], 3)
    assert lam.shape == g.shape == (2, 4)
    np.testing.assert_allclose(lam[:, 0], 0)
    np.testing.assert_allclose(g[:, 0], 1)
    np.testing.assert_allclose(lam[:, 1:], lam[:, :-1] + g[:, :-1], rtol=1e-12)


@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.75, 0.99, 1.0])
@pytest.mark.parametrize("L", [1, 2, 5, 28])
def test_expected_steps_chain_equals_chain_steps(alpha, L):
    got = theory.expected_steps(DraftTree.chain(L), lambda l, K: np.array([alpha]))
    assert got == pytest.approx(theory.chain_steps(alpha, L), rel=1e-12, abs=1e-12)
    # closed form sum_{i<L} alpha^i
    assert theory.chain_steps(alpha, L) == pytest.approx(sum(alpha**i for i in range(L)))


@pytest.mark.parametrize("K,L,delta", [(2, 3, 1.0), (5, 3, 0.7), (3, 4, 2.5)])
def test_expected_steps_uniform_tree_is_chain_of_acceptance(K, L, delta):
    # on a uniform tree with depth-independent delta, the walk continues with prob. 1 - G_{K+1} at each depth
    got = theory.expected_steps(DraftTree.uniform(K, L), lambda l, k: theory.dgrs_positional(delta, k))
    want = theory.chain_steps(float(theory.dgrs_acceptance(delta, K)), L)
    assert got == pytest.approx(want, rel=1e-12)


def test_expected_steps_irregular_by_hand():
    # root -> (1, 2); 1 -> (3, 4); 2 -> (5); positional p_depth(K) arbitrary but fixed
    tree = DraftTree([-1, 0, 0, 1, 1, 2])
    probs = {(0, 2): [0.5, 0.2], (1, 2): [0.6, 0.3], (1, 1): [0.4]}
    got = theory.expected_steps(tree, lambda l, K: np.array(probs[(l, K)]))
    e1 = 1 + 0.6 * 0 + 0.3 * 0
    e2 = 1 + 0.4 * 0
    assert got == pytest.approx(1 + 0.5 * e1 + 0.2 * e2)


def simulate_round(tree: DraftTree, deltas, coupling, n: int, seed: int, d: int = 3) -> np.ndarray:
    """Committed steps of ``n`` independent rounds of Algorithm 1's acceptance walk on ``tree``.

    At depth ``l`` the draft ``N(0, I)`` and target ``N(delta_l e_1, I)`` differ by ``deltas[l]``; the
    children of each visited node are fresh draws and ``coupling`` decides.
    """
    g = torch.Generator().manual_seed(seed)
    cur = torch.zeros(n, dtype=torch.long)
    walking = torch.ones(n, dtype=torch.bool)
    steps = torch.zeros(n, dtype=torch.long)
    nc = torch.as_tensor(tree.num_children)
    fc = torch.as_tensor(tree.first_child)
    for l in range(tree.max_depth):
        width = nc[cur]
        walking &= width > 0
        for k in torch.unique(width[walking]).tolist():
            sub = (walking & (width == k)).nonzero(as_tuple=True)[0]
            m = sub.numel()
            mean_p = torch.zeros(m, d, dtype=torch.float64)
            mean_q = mean_p.clone()
            mean_q[:, 0] = deltas[l]
            kids = torch.randn(m, k, d, generator=g, dtype=torch.float64)
            v = coupling(kids, mean_p, mean_q, 1.0, generator=g)
            steps[sub] += 1
            acc = v.accepted
            cur[sub[acc]] = fc[cur[sub[acc]]] + v.index[acc]
            walking[sub[~acc]] = False
    return steps.double().numpy()


@pytest.mark.parametrize(
    "tree,deltas",
    [
        (DraftTree.from_widths([3, 1, 2]), [0.8, 1.5, 2.0]),
        (DraftTree.uniform(2, 3), [1.0, 1.0, 1.0]),
        (DraftTree([-1, 0, 0, 0, 1, 1, 2, 4, 4]), [1.2, 0.4, 3.0]),
    ],
    ids=["widths(3,1,2)", "uniform(2,3)", "irregular"],
)
def test_expected_steps_monte_carlo_dgrs(tree, deltas):
    # seed 2024, n = 20000 rounds: |mean - expected_steps| < 4 SE
    n = 20000
    steps = simulate_round(tree, deltas, dgrs, n, seed=2024)
    want = theory.expected_steps(tree, lambda l, K: theory.dgrs_positional(deltas[l], K))
    se = steps.std(ddof=1) / math.sqrt(n)
    assert abs(steps.mean() - want) < 4 * se, (steps.mean(), want, se)


def test_expected_steps_monte_carlo_rmc_chain():
    # seed 7, n = 20000 rounds on chain(4) with rising delta: |mean - expected_steps| < 4 SE
    n = 20000
    deltas = [0.3, 0.8, 1.6, 2.4]
    tree = DraftTree.chain(4)
    steps = simulate_round(tree, deltas, rmc, n, seed=7)
    want = theory.expected_steps(tree, lambda l, K: theory.rmc_acceptance(deltas[l])[None])
    se = steps.std(ddof=1) / math.sqrt(n)
    assert abs(steps.mean() - want) < 4 * se, (steps.mean(), want, se)


@pytest.mark.parametrize(
    "fn", [theory.rmc_acceptance, lambda d: theory.dgrs_acceptance(d, 2), lambda d: theory.list_coupling_bound(d, 2)]
)
@pytest.mark.parametrize("bad", [-0.1, float("nan"), float("inf")])
def test_bad_delta(fn, bad):
    with pytest.raises(ValueError, match="delta"):
        fn(bad)


@pytest.mark.parametrize("K", [0, -1, 1.5, True])
def test_bad_K(K):
    with pytest.raises(ValueError, match=f"K={K!r}"):
        theory.dgrs_acceptance(1.0, K)
    with pytest.raises(ValueError, match=f"K={K!r}"):
        theory.list_coupling_bound(1.0, K)
