"""Block verification of chains (experiments.blockverify): the law of the committed path, acceptance, the sampler.

Law test: chains of ``L = 4`` nodes in ``d = 3`` with linear target kernels ``mq(x) = 0.8 x + b_i`` (so the
target chain's law is Gaussian in closed form) and a *nonlinear* draft whose displacement length depends on
the parent's coordinate orthogonal to every displacement (so later stop decisions depend on the orthogonal
part of earlier nodes, and a residual that reused a drafted node's orthogonal part would be biased). The
committed path is continued by target kernels to depth ``L``; at every depth the standardised state is
tested against N(0, I): KS on its projection on that depth's displacement direction, on the orthogonal
coordinate, and chi^2(d) on its squared norm. 4000 chains per base ``delta``; every p-value > 1e-3 (fixed
seeds, so the outcome is deterministic; 12 p-values per case, so a false alarm under exactness has
probability about 1% per case: over 10 seeds per case both rules gave minimum p-values spread as under
the null). Power: a residual drawn as if ``w = 1`` fails with p < 1e-6.
"""

import math

import pytest
import torch
from helpers import chi2_same_counts, two_sample_pvalues
from scipy import stats

from experiments.blockverify import (
    block_verify_chain,
    chain_acceptance,
    gmm_rows,
    implied_nfe,
    node_verify_chain,
    sample_block_chain,
    synthetic_rows,
)
from specsamp.models import GaussianMixture
from specsamp.sampler import sample_standard
from specsamp.schedule import Schedule

P_MIN = 1e-3
D, L, S, A = 3, 4, 0.5, 0.8
U = [torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64), torch.tensor([0.0, 1.0, 0.0], dtype=torch.float64)]  # displacement directions, alternating
V = torch.tensor([0.0, 0.0, 1.0], dtype=torch.float64)  # the draft's error length depends on this coordinate of the parent
B = [torch.tensor([0.3 * i, -0.2 * i, 0.1], dtype=torch.float64) for i in range(L)]


def draft_chains(n, delta, seed):
    g = torch.Generator().manual_seed(seed)
    root = torch.randn(n, D, generator=g, dtype=torch.float64)
    x, kids, mps, mqs = root, [], [], []
    for i in range(L):
        mq = A * x + B[i]
        scale = delta * 2.0 * torch.sigmoid(4.0 * x @ V)
        mp = mq - S * scale[:, None] * U[i % 2]
        x = mp + S * torch.randn(n, D, generator=g, dtype=torch.float64)
        kids.append(x)
        mps.append(mp)
        mqs.append(mq)
    return root, torch.stack(kids, 1), torch.stack(mps, 1), torch.stack(mqs, 1), g


def completed_paths(root, verdict, kids, g):
    """Depth-1..L states of the committed path, continued by the target kernels."""
    n = root.shape[0]
    path = []
    x = root
    for j in range(1, L + 1):
        nxt = A * x + B[j - 1] + S * torch.randn(n, D, generator=g, dtype=torch.float64)  # continuation
        nxt = torch.where((verdict.accepted >= j)[:, None], kids[:, j - 1], nxt)
        nxt = torch.where((verdict.steps == j)[:, None], verdict.sample, nxt)
        path.append(nxt)
        x = nxt
    return path


def target_moments(root):
    mu, var, out = root, 0.0, []
    for j in range(L):
        mu = A * mu + B[j]
        var = A * A * var + S * S
        out.append((mu, var))
    return out


@pytest.mark.parametrize("rule", ["block", "node"])
@pytest.mark.parametrize("delta", [0.3, 1.0, 2.5])
def test_committed_path_has_the_target_chain_law(rule, delta):
    verify = block_verify_chain if rule == "block" else node_verify_chain
    root, kids, mps, mqs, g = draft_chains(4000, delta, seed=100 + int(10 * delta))
    v = verify(kids, mps, mqs, S, torch.Generator().manual_seed(7))
    assert v.sample.shape == (4000, D) and torch.isfinite(v.sample).all()
    assert ((v.accepted >= 0) & (v.accepted <= L)).all() and (v.steps == (v.accepted + 1).clamp(max=L)).all()
    full = v.accepted == L
    assert torch.equal(v.sample[full], kids[full, L - 1])
    assert 0 < int(full.sum()) < 4000  # both branches exercised
    path = completed_paths(root, v, kids, g)
    pv = []
    for j, (mu, var) in enumerate(target_moments(root)):
        z = (path[j] - mu) / math.sqrt(var)
        pv.append(stats.kstest((z @ U[j % 2]).numpy(), "norm").pvalue)
        pv.append(stats.kstest((z @ V).numpy(), "norm").pvalue)
        pv.append(stats.kstest((z**2).sum(1).numpy(), stats.chi2(D).cdf).pvalue)
    assert min(pv) > P_MIN, pv


def test_law_test_catches_a_residual_that_ignores_the_running_weight(monkeypatch):
    """Power: clamping ln w at 0 (the node-wise residual and stop masses, as if w_tau = 1) is caught."""
    import experiments.blockverify as bv

    monkeypatch.setattr(bv, "LOG_W_FLOOR", 0.0)
    root, kids, mps, mqs, g = draft_chains(4000, 0.3, seed=103)
    v = block_verify_chain(kids, mps, mqs, S, torch.Generator().manual_seed(7))
    path = completed_paths(root, v, kids, g)
    pv = [stats.kstest(((path[j] - mu) / math.sqrt(var) @ U[j % 2]).numpy(), "norm").pvalue
          for j, (mu, var) in enumerate(target_moments(root))]
    assert min(pv) < 1e-6, pv


def test_block_accepts_at_least_node_wise_and_within_the_joint_tv_bound():
    rows = synthetic_rows(deltas=(0.5, 1.0), lengths=(8,), n=40_000, seed=1)
    for r in rows:
        assert abs(r["node_tau"] - r["node_exact"]) < 4 * r["node_tau_se"] + 1e-9
        assert r["block_tau"] > r["node_tau"]
    z = torch.randn(40_000, 8, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    for d in (0.5, 1.0):
        block, node = chain_acceptance(d * z - d * d / 2)
        assert (block >= node - 1e-15).all()
        # no valid rule accepts j nodes more often than 1 - TV of the j-step joints: 2 Phibar(delta sqrt(j) / 2)
        j = torch.arange(1, 9, dtype=torch.float64)
        bound = 2 * torch.special.ndtr(-d * j.sqrt() / 2)
        assert (block.mean(0) <= bound + 4 * block.std(0) / 200).all()


def test_zero_displacement_accepts_the_whole_chain():
    _root, kids, mps, _mqs, _ = draft_chains(50, 0.0, seed=0)
    v = block_verify_chain(kids, mps, mps.clone(), S)
    assert (v.accepted == L).all() and torch.equal(v.sample, kids[:, -1])


def test_bad_shapes_are_refused():
    _root, kids, mps, mqs, _ = draft_chains(5, 1.0, seed=0)
    with pytest.raises(ValueError, match="must match"):
        block_verify_chain(kids, mps[:, :2], mqs, S)
    with pytest.raises(ValueError, match="sigma"):
        block_verify_chain(kids, mps, mqs, torch.ones(3))


# --- the standalone sampler, end to end (same setup as tests/test_sampler.py) -----------------------

MODEL = GaussianMixture(dim=4, components=3, layout_seed=1)
SCHED = Schedule.make(8, 1.0)


@pytest.mark.parametrize("rule,L,draft,anchor", [("block", 5, "x0", "node"), ("block", 3, "velocity", "root"), ("node", 4, "x0", "node")])
def test_sampler_output_law_equals_standard_sampler(rule, L, draft, anchor):
    ref = sample_standard(MODEL, SCHED, 4000, seed=10_000).samples
    r = sample_block_chain(MODEL, SCHED, L, 2000, rule=rule, draft=draft, anchor=anchor, seed=400 + L)
    p = two_sample_pvalues(r.samples, ref, directions=3, seed=0)
    p.append(chi2_same_counts(MODEL.component(r.samples).numpy(), MODEL.component(ref).numpy(), 3))
    assert min(p) > P_MIN, p
    assert (r.nfe == r.rounds + 1).all() and (r.nfe <= SCHED.steps - 1).all()


def test_tables_small():
    rows = gmm_rows(lengths=(4,), n_roots=8, n_samples=4, dim=20)
    (r,) = rows
    assert r["block_tau"] >= r["node_tau"] and r["block_implied_speedup"] >= r["node_implied_speedup"] > 1.0
    assert {"block_run_speedup", "node_run_speedup"} <= set(r)


def test_implied_nfe_without_speculation_is_one_call_per_step():
    sch = Schedule.make(10, 0.5)
    tails = {n: (torch.zeros(1, 1), torch.zeros(1, 1)) for n in range(1, 9)}
    assert implied_nfe(sch, tails, 0) == pytest.approx(1 + 8)


@pytest.mark.parametrize("draft", ["x0_extrap", "x0_extrap_gated", "x0_affine"])
def test_drafts_that_read_a_history_are_refused(draft):
    """The chains draft from the root alone: a draft that reads earlier exact data predictions is refused
    by name (a ValueError listing the valid drafts), not an AttributeError halfway through."""
    import experiments.blockverify as bv
    from specsamp.errors import ConfigError

    with pytest.raises(ConfigError, match=f"draft='{draft}' is invalid for block verification.*'x0'"):
        bv.sample_block_chain(MODEL, SCHED, 3, 4, draft=draft)
    with pytest.raises(ConfigError, match=f"draft='{draft}' is invalid"):
        bv.gmm_chain_tails(MODEL, SCHED, 3, n_roots=4, draft=draft)
