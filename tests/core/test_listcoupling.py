"""Tests of the marked-maximum list coupling (:mod:`specsamp.listcoupling`, registered as ``markmax``).

Exactness: ``specsamp`` registers ``markmax``, so ``tests/core/test_coupling.py`` runs
:func:`specsamp.testing.check_exactness` on it (delta 0..300, K up to 32, float32/float64) like on
every other rule. Here, a 1-D check of the scalar
rule (n = 200000) also asserts that each of its four branches was taken and the output is exact. Acceptance and positional
probabilities are compared with theory within 4 standard errors (fixed seeds, n stated per test).
"""

import math

import numpy as np
import pytest
import torch
from scipy import stats

from specsamp import listcoupling as lc
from specsamp import theory
from specsamp.coupling import COUPLINGS, get_coupling
from specsamp.rng import KeyedRows, base_key
from specsamp.testing import make_problem

P_MIN = 1e-4

markmax = lc.markmax


def test_registered_for_any_k():
    assert COUPLINGS["markmax"] is markmax
    assert get_coupling("markmax").max_children is None


@pytest.mark.parametrize("K,delta", [(2, 0.25), (4, 0.5), (7, 0.75)])
def test_scalar_rule_exact_in_every_branch(K, delta):
    # seed 3, n = 200000 rows of the scalar rule: output projection ~ N(delta, 1) (KS p > 1e-4), and each
    # branch (highest marked, GRS on the unmarked, lower residual, upper residual) is taken
    n = 200_000
    g = torch.Generator().manual_seed(3)
    pl = lc.plan(torch.full((n,), delta, dtype=torch.float64), K)
    assert bool(pl.use.all()) and float(pl.params.t[0]) < 1
    s_hat = torch.randn(n, K, generator=g, dtype=torch.float64)
    u = [torch.rand(n, m, generator=g, dtype=torch.float64).clamp_min(2.0**-60) for m in (K, K, 2)]
    index, s_res = lc.select(pl.params, pl.levels, s_hat, *u)
    out = torch.where(index < K, s_hat.gather(1, index.clamp(max=K - 1)[:, None])[:, 0], s_res)
    assert stats.kstest((out - delta).numpy(), "norm").pvalue > P_MIN
    marked = (torch.log(u[0]) <= lc.log_kappa(s_hat, pl.params)).any(1)
    c = pl.params.c
    branches = {
        "marked": marked & (index < K),
        "grs": ~marked & (index < K),
        "lower residual": (index == K) & (s_res <= c),
        "upper residual": (index == K) & (s_res > c),
    }
    assert all(int(b.sum()) > 0 for b in branches.values()), {k: int(b.sum()) for k, b in branches.items()}


@pytest.mark.parametrize("K,delta", [(2, 0.1), (4, 0.3), (7, 0.75), (4, 1.0), (16, 2.0), (1, 1.0)])
def test_acceptance_matches_theory(K, delta):
    # seed 7, n = 20000: |measured - markmax_acceptance| < 4 standard errors
    n = 20000
    children, mean_p, mean_q, sigma, _, g = make_problem(delta, K, torch.float64, n=n, dim=3, seed=7)
    acc = markmax(children, mean_p, mean_q, sigma, generator=g).accepted.double().mean().item()
    ref = float(lc.markmax_acceptance(delta, K))
    se = math.sqrt(max(ref * (1 - ref), 1e-12) / n)
    assert abs(acc - ref) < 4 * se + 1e-12


@pytest.mark.parametrize("K,delta", [(4, 0.3), (4, 1.0)])
def test_positional_probabilities(K, delta):
    # seed 11, n = 40000: each P(J = k) within 4 standard errors of markmax_positional
    n = 40000
    children, mean_p, mean_q, sigma, _, g = make_problem(delta, K, torch.float64, n=n, dim=3, seed=11)
    v = markmax(children, mean_p, mean_q, sigma, generator=g)
    ref = lc.markmax_positional(delta, K)
    for k in range(K):
        got = (v.index == k).double().mean().item()
        se = math.sqrt(ref[k] * (1 - ref[k]) / n)
        assert abs(got - ref[k]) < 4 * se, (k, got, ref[k])


def test_positional_theory_identities():
    d = np.array([[0.0, 0.3], [1.0, 4.0]])
    pos = lc.markmax_positional(d, 5)
    assert pos.shape == (2, 2, 5)
    np.testing.assert_allclose(pos.sum(-1), lc.markmax_acceptance(d, 5), rtol=0, atol=1e-12)
    # full share (t = 1): only the exchangeable highest-marked child is ever accepted
    t = lc.markmax_share(1.0, 5)
    assert t == 1.0
    np.testing.assert_allclose(pos[1, 0], pos[1, 0].mean(), rtol=0, atol=1e-12)
    # GRS over the unmarked favours early children when t < 1
    assert lc.markmax_share(0.3, 5) < 1 and np.all(np.diff(pos[0, 1]) <= 1e-15)


def test_between_dgrs_and_the_list_bound():
    # delta in [0, 5] x K in 1..16: D-GRS <= markmax <= alpha*_K (an exact coupling above the bound would
    # be a bug), and markmax > 1.01 x D-GRS where it matters (delta in [0.3, 3], K in 2..16; the least
    # gain there is 1.9%, at delta = 3, K = 2: 0.1839 vs 0.1800; the largest 0.125 absolute)
    deltas = np.linspace(0.0, 5.0, 26)
    for K in range(1, 17):
        mm = lc.markmax_acceptance(deltas, K)
        dg = theory.dgrs_acceptance(deltas, K)
        bd = theory.list_coupling_bound(deltas, K)
        assert np.all(mm >= dg - 1e-12), K
        assert np.all(mm <= bd + 1e-9), K
        if K >= 2:
            mid = (deltas >= 0.3) & (deltas <= 3.0)
            assert np.all(mm[mid] > 1.01 * dg[mid]), (K, mm[mid] / dg[mid])


@pytest.mark.parametrize("K", [2, 4, 8, 16])
def test_attains_the_bound_at_moderate_delta(K):
    d = np.array([1.0, 2.0, 3.0])
    np.testing.assert_array_equal(lc.markmax_share(d, K), 1.0)
    np.testing.assert_allclose(lc.markmax_acceptance(d, K), theory.list_coupling_bound(d, K), rtol=0, atol=1e-8)


def test_k1_is_the_maximal_coupling():
    d = np.array([0.01, 0.3, 1.0, 2.5])
    np.testing.assert_allclose(lc.markmax_acceptance(d, 1), theory.rmc_acceptance(d), rtol=0, atol=1e-10)


@pytest.mark.parametrize("K", [2, 7, 32])
def test_certified_parameters_hold_on_a_dense_grid(K):
    # brute force behind the analytic certificate: 0 <= kappa <= 1 and a nondecreasing GRS ratio on
    # 20001 points of [-40, min(c, delta + 40)], for 60 deltas in [1e-5, 300]
    d = torch.tensor(np.geomspace(1e-5, 300.0, 60), dtype=torch.float64)
    pl = lc.plan(d, K)
    p = pl.params
    top = torch.minimum(p.c, p.delta + 40.0)[:, None]
    y = lc.Y_LO + (top - lc.Y_LO) * torch.linspace(0, 1, 20001, dtype=torch.float64)[None]
    assert float(lc.log_kappa(y, p).max()) <= 1e-9
    lr = lc.log_ratio(y, p)
    steps = (lr[:, 1:] - lr[:, :-1]).min(1).values
    assert bool(torch.all((steps >= -1e-9) | (p.t >= 1)))


def test_rows_do_not_depend_on_the_batch():
    # keyed uniforms: a row's verdict depends on its key and data only, whatever the other rows are
    # (deltas mixing the D-GRS hand-off, small and full shares, and huge delta)
    g = torch.Generator().manual_seed(2)
    n, K, d = 10, 4, 6
    deltas = torch.tensor([0.0, 1e-8, 0.02, 0.3, 0.3, 1.0, 2.0, 14.0, 60.0, 0.7], dtype=torch.float64)
    mean_p = torch.randn(n, d, generator=g, dtype=torch.float64)
    e = torch.nn.functional.normalize(torch.randn(n, d, generator=g, dtype=torch.float64), dim=1)
    mean_q = mean_p + 0.5 * deltas[:, None] * e
    children = mean_p[:, None] + 0.5 * torch.randn(n, K, d, generator=g, dtype=torch.float64)
    keys = base_key(9, torch.arange(n), "verify")
    full = markmax(children, mean_p, mean_q, 0.5, generator=KeyedRows(keys))
    sub = torch.tensor([8, 3, 0, 6])
    part = markmax(children[sub], mean_p[sub], mean_q[sub], 0.5, generator=KeyedRows(keys[sub]))
    assert torch.equal(part.sample, full.sample[sub])
    assert torch.equal(part.index, full.index[sub])


def test_theory_rejects_bad_arguments():
    with pytest.raises(ValueError, match="delta"):
        lc.markmax_acceptance(-0.1, 2)
    with pytest.raises(ValueError, match="delta"):
        lc.markmax_positional(float("nan"), 2)
    for bad in (0, True, 2.5):
        with pytest.raises(ValueError, match="K="):
            lc.markmax_acceptance(1.0, bad)


def test_bad_inputs_raise_value_error():
    children, mean_p, mean_q, sigma, _, _ = make_problem(1.0, 2, torch.float64, n=10)
    with pytest.raises(ValueError, match="mean_q"):
        markmax(children, mean_p, mean_q[:, :3], sigma)
    with pytest.raises(ValueError, match="sigma"):
        markmax(children, mean_p, mean_q, 0.0)
