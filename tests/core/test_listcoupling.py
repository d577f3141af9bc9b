"""Tests of the marked-maximum list coupling (:mod:`specsamp.listcoupling`, registered as ``markmax``).

Exactness: ``specsamp`` registers ``markmax``, so ``tests/core/test_coupling.py`` runs
:func:`specsamp.testing.check_exactness` on it (delta 0..300, K up to 32, float32/float64) like on
every other rule. Here, a 1-D check of the scalar
rule (n = 200000) also asserts that each of its four branches was taken and the output is exact. Acceptance and positional
probabilities are compared with theory within 4 standard errors (fixed seeds, n stated per test). The static
path (inside ``deferred_checks``) is held to the eager path's bits, to no host synchronisation, and to flagging
every row its share table cannot certify; the table to the shares ``share`` computes key by key.
"""

import math

import numpy as np
import pytest
import torch
from scipy import stats

from specsamp import listcoupling as lc, theory
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


# ----------------------------------------------------------------------------------------------
# The static path (inside deferred_checks): no host synchronisation, the same bits as the eager path.

PINNED_DELTAS = (0.0, 1e-7, 1e-3, 0.1, 1.0, 5.0, 50.0, 300.0)
# sha256 (first 16 hex digits) of index, accepted and sample of markmax on _pinned_problem, computed by the rule
# before it had a static path (its plan and branches on the rows that need them), with this torch build and CPU
# kernels: a transcendental function of another build or vector width may round differently in its last bit
PINNED_BUILD = ("2.14.1+cu130", "AVX512")
# re-pinned when the projections and logaddexp became row-independent: index and accepted unchanged, samples
# within 1 ulp (float64) and 2 ulps (float32) of the earlier pins
PINS = {
    ("float64", 1): "3c22b4dbf0f7dcac",
    ("float64", 2): "24912ced8c3b5887",
    ("float64", 4): "2bebacdb13b5f1d8",
    ("float64", 16): "7b85c34dda4e7da2",
    ("float32", 1): "de49410e953e524b",
    ("float32", 2): "b59b66a8bc8b06f1",
    ("float32", 4): "78a084fec02d715d",
    ("float32", 16): "a8a035cef52d1706",
}


def _pinned_problem(K, dtype, per=24, dim=6, seed=17):
    """``per`` rows at each of PINNED_DELTAS, shuffled (D-GRS and marked-maximum rows interleaved), and a generator."""
    g = torch.Generator().manual_seed(seed + 97 * K + (dtype == torch.float32))
    nominal = torch.tensor(PINNED_DELTAS, dtype=torch.float64).repeat_interleave(per)
    nominal = nominal[torch.randperm(nominal.numel(), generator=g)]
    n, sigma = nominal.numel(), 0.37
    mean_p = torch.randn(n, dim, generator=g, dtype=torch.float64)
    e = torch.nn.functional.normalize(torch.randn(n, dim, generator=g, dtype=torch.float64), dim=1)
    mean_q = mean_p + sigma * nominal[:, None] * e
    children = mean_p[:, None] + sigma * torch.randn(n, K, dim, generator=g, dtype=torch.float64)
    return children.to(dtype), mean_p.to(dtype), mean_q.to(dtype), sigma, torch.Generator().manual_seed(seed + K)


def _digest(v) -> str:
    import hashlib

    h = hashlib.sha256()
    for t in (v.index, v.accepted, v.sample):
        h.update(t.contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def _uncertified_rows(children, mean_p, mean_q, sigma):
    from specsamp.coupling import project

    delta = project(children, mean_p, mean_q, sigma).delta
    return lc.static_plan(delta, children.shape[1])[1]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("K", [1, 2, 4, 16])
def test_static_path_gives_the_eager_bits_and_those_pinned(dtype, K):
    # deltas 0 .. 300 (24 rows each), K = 1, 2, 4, 16: inside deferred_checks the same index, accepted and sample
    # bits as outside, on every row whose share the table certifies (the flag is set iff one is not; here only
    # rows near delta = 300 can fail, and their samples agree too, since the upper residual does not depend on t);
    # outside, the bits of the rule before the static path (where this torch build and CPU kernels are the pinned ones)
    from specsamp.coupling import deferred_checks

    eager = markmax(*_pinned_problem(K, dtype))
    with deferred_checks() as checks:
        static = markmax(*_pinned_problem(K, dtype))
    bad = _uncertified_rows(*_pinned_problem(K, dtype)[:4])
    assert (checks.bad is not None and bool(checks.bad)) == bool(bad.any())
    ok = ~bad
    for a, b in ((eager.index, static.index), (eager.accepted, static.accepted), (eager.sample, static.sample)):
        assert torch.equal(a[ok], b[ok])
    assert (~eager.accepted).any() and eager.accepted.any()
    if (torch.__version__, torch.backends.cpu.get_cpu_capability()) == PINNED_BUILD:
        assert _digest(eager) == PINS[str(dtype).replace("torch.", ""), K]


@pytest.mark.parametrize("K", [1, 2, 4, 16])
def test_static_path_asks_the_host_nothing(K):
    # inside deferred_checks, verify and decide (the choice alone) make no host synchronisation, at n = 1 and
    # n = 192 (deltas 0 .. 300), the share table already built; decide's choice is verify's
    from benchmarks.opcount import counting
    from specsamp.coupling import COUPLINGS, deferred_checks

    rule = COUPLINGS.get("markmax")
    lc.share_table(K, "cpu")
    for n in (1, 192):
        args = [a[:n] for a in _pinned_problem(K, torch.float32)[:3]]
        with deferred_checks(), counting() as c:
            full = rule(*args, 0.37, torch.Generator().manual_seed(1))
            only = rule.decide(*args, 0.37, torch.Generator().manual_seed(1))
        assert c.total_syncs == 0, {k: v for k, v in c.by_op.items() if "nonzero" in k[1] or "dense" in k[1]}
        assert only.sample is None
        assert torch.equal(only.index, full.index) and torch.equal(only.accepted, full.accepted)
    eager_only = rule.decide(*_pinned_problem(K, torch.float32)[:4], torch.Generator().manual_seed(1))
    eager_full = rule(*_pinned_problem(K, torch.float32)[:4], torch.Generator().manual_seed(1))
    assert torch.equal(eager_only.index, eager_full.index)


def test_rows_the_table_cannot_certify_set_the_flag():
    # a row beyond the table (delta 2000 > TABLE_DELTA_MAX) or failing its own certificate at the table's share
    # sets the deferred flag; rows below DELTA_MIN (D-GRS) and certified ones do not
    from specsamp.coupling import deferred_checks

    K = 4
    table = lc.share_table(K, "cpu")
    grid = torch.tensor(np.geomspace(100.0, 1000.0, 4000), dtype=torch.float64)
    keys = torch.round(lc.KEY_STEPS * torch.log2(grid)).long() - lc.KEY_MIN
    failing = grid[~lc.feasible(lc.make_params(grid, K, table[keys]))]
    assert failing.numel() > 0  # the certificate's rounding above delta = 100 (share_table's docstring)
    cases = {(0.0, 1e-7): False, (0.5, 3.0, 40.0): False, (0.5, 2000.0): True, (0.5, float(failing[0])): True}
    for deltas, flagged in cases.items():
        n = len(deltas)
        mean_p = torch.zeros(n, 3, dtype=torch.float64)
        mean_q = mean_p.clone()
        mean_q[:, 0] = torch.tensor(deltas, dtype=torch.float64)
        children = torch.randn(n, K, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
        with deferred_checks() as checks:
            markmax(children, mean_p, mean_q, 1.0, torch.Generator().manual_seed(0))
        assert (checks.bad is not None and bool(checks.bad)) == flagged, deltas


@pytest.mark.slow  # 12-28 s: kept out of the default run's 15 minutes; CI runs it with -m slow
def test_share_table_equals_the_shares_share_caches(monkeypatch):
    # K = 2..16, 120 bin keys each (seed 0; the table's two ends among them) presented to share, as bin centres,
    # in shuffled batches of 1 to 40 rows: the values share computes and caches equal the table's bit for bit
    # (with exp2 of the bins' deltas taken directly, key 542 at K = 2 differed: bin_shares' docstring)
    from specsamp import markmax_params as mp

    monkeypatch.setattr(mp, "_SHARE_CACHE", {})  # share computes every key afresh
    rng = np.random.default_rng(0)
    for K in range(2, 17):
        table = lc.share_table(K, "cpu")
        inner = rng.choice(np.arange(lc.KEY_MIN + 1, lc.KEY_MAX), 118, replace=False)
        keys = np.concatenate([[lc.KEY_MIN, lc.KEY_MAX], inner])
        rng.shuffle(keys)
        start = 0
        while start < keys.size:
            stop = start + int(rng.integers(1, 41))
            centres = torch.exp2(torch.tensor(keys[start:stop], dtype=torch.float64) / lc.KEY_STEPS)
            lc.share(centres.clamp_min(lc.DELTA_MIN), K)
            start = stop
        got = torch.tensor([mp._SHARE_CACHE[(K, int(k))] for k in keys], dtype=torch.float64)
        assert torch.equal(got, table[torch.from_numpy(keys - lc.KEY_MIN)]), K


def test_static_level_roots_equal_the_skipping_ones():
    # grs_on_unmarked(static=True) runs every level root's Newton steps for every row; the eager form skips them
    # where every row has t = 1 or no row's level lies inside the grid: the final wheres overwrite those rows, so
    # the levels are equal bit for bit (all t = 1; all t < 1; mixed)
    for K in (2, 4, 16):
        for deltas in ([1.0, 2.0, 30.0], [0.01, 0.1, 0.3], [0.01, 1.0, 0.3, 50.0]):
            p = lc.share(torch.tensor(deltas, dtype=torch.float64), K)
            a, b = lc.grs_on_unmarked(p), lc.grs_on_unmarked(p, static=True)
            for f in ("mu", "gamma", "y"):
                assert torch.equal(getattr(a, f), getattr(b, f)), (K, deltas, f)
    # one root whose level lies outside the grid on every row: Newton is skipped in the eager form
    p = lc.share(torch.tensor([0.2, 0.4], dtype=torch.float64), 3)
    top = torch.minimum(p.c, p.delta + lc.Y_SPAN)
    grid_y = lc.Y_LO + (top - lc.Y_LO)[:, None] * torch.linspace(0.0, 1.0, lc.LEVEL_GRID, dtype=torch.float64)[None]
    grid_lr = lc.log_ratio(grid_y, p)
    for log_m in (grid_lr[:, 0] - 1.0, grid_lr[:, -1] + 1.0):
        from specsamp.markmax_params import _level_root

        assert torch.equal(_level_root(p, grid_y, grid_lr, log_m), _level_root(p, grid_y, grid_lr, log_m, static=True))


def test_lean_round_hands_uncertified_rounds_to_the_reference_round(monkeypatch):
    # a static share that certifies nothing and is wrong (t = 0) flags every dense round, so the reference round
    # serves each one: the tree execution's counts and samples equal the path execution's (GMM dim 4, 8 steps,
    # 40 trajectories, seed 3, (2, 3) tree); without the flag the wrong share would change the law's numbers
    from specsamp import markmax_params as mp, sampler
    from specsamp.models import GaussianMixture
    from specsamp.schedule import Schedule
    from specsamp.trees import DraftTree

    model = GaussianMixture(dim=4, components=3, layout_seed=1)
    kw = dict(draft="x0", prefetch="nearest", seed=3)
    sched, tree = Schedule.make(8, 1.0), DraftTree.uniform(2, 3)
    path = sampler.sample_speculative(model, sched, tree, "markmax", 40, execution="path", **kw)
    real = mp.static_share

    def wrong(delta, K):
        p, _ = real(delta, K)
        none = torch.zeros_like(delta, dtype=torch.bool)
        return lc.make_params(delta, K, torch.zeros_like(delta), p.c, p.log_R), none

    monkeypatch.setattr(lc, "static_share", wrong)
    got = sampler.sample_speculative(model, sched, tree, "markmax", 40, execution="tree", **kw)
    for f in ("nfe", "nfe_total", "target_rows", "rounds", "committed", "attempts", "accepts"):
        assert torch.equal(getattr(got, f), getattr(path, f)), f
    assert torch.allclose(got.samples, path.samples, rtol=0, atol=1e-12)


@pytest.mark.slow
def test_share_table_equals_bin_shares_of_every_key_in_any_batch():
    # every bin of the table, K = 2..16, computed again by bin_shares in shuffled batches of 1 to 40 keys (seed 1)
    from specsamp import markmax_params as mp

    rng = np.random.default_rng(1)
    for K in range(2, 17):
        keys = np.arange(lc.KEY_MIN, lc.KEY_MAX + 1)
        rng.shuffle(keys)
        got = torch.empty(keys.size, dtype=torch.float64)
        start = 0
        while start < keys.size:
            stop = start + int(rng.integers(1, 41))
            got[start:stop] = mp.bin_shares(torch.tensor(keys[start:stop], dtype=torch.float64), K)
            start = stop
        assert torch.equal(got, lc.share_table(K, "cpu")[torch.from_numpy(keys - lc.KEY_MIN)]), K


def test_lean_round_without_kept_samples_decides_markmax_then_draws_one_residual_per_row(monkeypatch):
    # RESIDUAL_CACHE = 0: the chunks call markmax's decide (its choice alone, no residual branches), the walk's
    # residuals are drawn by verify for the M rows; counts identical and samples bitwise equal to the default
    # dense round (GMM dim 4, 8 steps, 40 trajectories, seed 3, (2, 3) tree), one host sync per round in all
    from benchmarks import opcount
    from specsamp import sampler
    from specsamp.models import GaussianMixture
    from specsamp.round import tables
    from specsamp.schedule import Schedule
    from specsamp.trees import DraftTree

    model = GaussianMixture(dim=4, components=3, layout_seed=1)
    kw = dict(draft="x0", prefetch="nearest", seed=3, execution="tree")
    sched, tree = Schedule.make(8, 1.0), DraftTree.uniform(2, 3)
    ref = sampler.sample_speculative(model, sched, tree, "markmax", 40, **kw)
    rows = []  # (rows, whether the residual was drawn) of each markmax call
    choose = lc._choose
    monkeypatch.setattr(
        lc, "_choose", lambda proj, *u: rows.append((proj.delta.numel(), u[2] is not None)) or choose(proj, *u)
    )
    monkeypatch.setattr(tables, "RESIDUAL_CACHE", 0)
    with opcount.counting() as c:
        got = sampler.sample_speculative(model, sched, tree, "markmax", 40, **kw)
    assert {r for r, res in rows if res} == {40} and any(not res for _, res in rows), set(rows)
    assert c.syncs["round"] + c.syncs["coupling"] <= int(got.rounds.max()), dict(c.by_op)
    for f in ("nfe", "nfe_total", "target_rows", "rounds", "committed", "attempts", "accepts"):
        assert torch.equal(getattr(got, f), getattr(ref, f)), f
    assert torch.equal(got.samples, ref.samples)
