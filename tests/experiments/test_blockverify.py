"""Block verification of chains (experiments.blockverify): the law of the committed path, acceptance, chains
drafted as the library's sampler drafts them.

Rule-level law test: chains of ``L`` nodes in ``d = 3`` with linear target kernels ``mq(x) = 0.8 x + b_i`` (so
the target chain's law is Gaussian in closed form) and a *nonlinear* draft whose displacement length
(``delta_i`` in ``(0, 2 delta)``) depends on the parent's coordinate orthogonal to every displacement (so later
stop decisions depend on the orthogonal part of earlier nodes, and a residual that reused a drafted node's
orthogonal part would be biased). The committed path is continued by target kernels to depth ``L``; at every
depth the standardised state is tested against N(0, I): KS on its projection on that depth's displacement
direction, on the orthogonal coordinate, and chi^2(d) on its squared norm. 4000 chains per case, fixed seeds
(so the outcome is deterministic); each case's p-values are held to a Bonferroni level of 1% over the case
(``0.01 / (3 L)``), so a false alarm under exactness has probability at most 1% per case. Power: a residual
drawn as if ``w = 1`` fails with p < 1e-6.

Chain-level law test: roots are exact states of the target's own trajectories (state index 1 and 3), chains
are drafted by :func:`experiments.blockverify.draft_chain` (checked equal to the library sampler's own first
round), verified, continued by the target kernels to the end and compared with the standard sampler's output
(two-sample KS on 3 projections and chi^2 on the mixture component, 2000 vs 4000 samples, same 1% Bonferroni
level over the 4 p-values).
"""

import math

import pytest
import torch
from helpers import chi2_same_counts, two_sample_pvalues
from scipy import stats

from experiments.blockverify import (
    block_verify_chain,
    chain_acceptance,
    draft_chain,
    gmm_rows,
    implied_nfe,
    node_verify_chain,
    synthetic_rows,
)
from specsamp import rng
from specsamp.coupling import Verdict
from specsamp.models import GaussianMixture
from specsamp.sampler import initial_noise, sample_speculative, sample_standard
from specsamp.schedule import Schedule, per_row
from specsamp.trees import DraftTree

ALPHA = 0.01  # family-wise false-alarm level of one case (Bonferroni over its p-values)
D, S, A = 3, 0.5, 0.8
U = [
    torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64),
    torch.tensor([0.0, 1.0, 0.0], dtype=torch.float64),
]  # displacement directions, alternating
V = torch.tensor(
    [0.0, 0.0, 1.0], dtype=torch.float64
)  # the draft's error length depends on this coordinate of the parent


def bias(i):
    return torch.tensor([0.3 * (i % 5), -0.2 * (i % 5), 0.1], dtype=torch.float64)


def draft_chains(n, delta, seed, L=4, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    root = torch.randn(n, D, generator=g, dtype=torch.float64)
    x, kids, mps, mqs = root, [], [], []
    for i in range(L):
        mq = A * x + bias(i)
        scale = delta * 2.0 * torch.sigmoid(4.0 * x @ V)
        mp = mq - S * scale[:, None] * U[i % 2]
        x = (
            (mp + S * torch.randn(n, D, generator=g, dtype=torch.float64)).to(dtype).double()
        )  # the drafted node, as stored
        kids.append(x)
        mps.append(mp)
        mqs.append(mq)
    return root, *(torch.stack(t, 1).to(dtype) for t in (kids, mps, mqs)), g


def completed_paths(root, verdict, kids, g):
    """Depth-1..L states of the committed path, continued by the target kernels (float64)."""
    n, L = kids.shape[:2]
    kids, sample = kids.double(), verdict.sample.double()
    path = []
    x = root
    for j in range(1, L + 1):
        nxt = A * x + bias(j - 1) + S * torch.randn(n, D, generator=g, dtype=torch.float64)  # continuation
        nxt = torch.where((verdict.accepted >= j)[:, None], kids[:, j - 1], nxt)
        nxt = torch.where((verdict.steps == j)[:, None], sample, nxt)
        path.append(nxt)
        x = nxt
    return path


def target_moments(root, L):
    mu, var, out = root, 0.0, []
    for j in range(L):
        mu = A * mu + bias(j)
        var = A * A * var + S * S
        out.append((mu, var))
    return out


LAW_CASES = [("block", d, L, torch.float64) for d in (0.0, 0.3, 1.0, 2.5, 300.0) for L in (4, 24)]
LAW_CASES += [("block", 1.0, 24, torch.float32), ("block", 300.0, 4, torch.float32), ("block", 0.3, 4, torch.float32)]
LAW_CASES += [("node", d, 4, torch.float64) for d in (0.3, 1.0, 2.5)]


@pytest.mark.parametrize("rule,delta,L,dtype", LAW_CASES)
def test_committed_path_has_the_target_chain_law(rule, delta, L, dtype):
    verify = block_verify_chain if rule == "block" else node_verify_chain
    n = 4000
    root, kids, mps, mqs, g = draft_chains(n, delta, seed=100 + int(10 * delta) + L, L=L, dtype=dtype)
    v = verify(kids, mps, mqs, S, torch.Generator().manual_seed(7))
    assert v.sample.shape == (n, D) and v.sample.dtype == dtype and torch.isfinite(v.sample).all()
    assert ((v.accepted >= 0) & (v.accepted <= L)).all() and (v.steps == (v.accepted + 1).clamp(max=L)).all()
    full = v.accepted == L
    assert torch.equal(v.sample[full], kids[full, L - 1])
    if delta == 0.0:
        assert full.all()
    elif 0.3 <= delta <= 1.0 and L == 4:
        assert 0 < int(full.sum()) < n  # both branches exercised
    if delta >= 100:
        assert (
            float((v.accepted == 0).double().mean()) > 0.8
        )  # most chains stop at their first node: residuals carry the law
    path = completed_paths(root, v, kids, g)
    pv = []
    for j, (mu, var) in enumerate(target_moments(root, L)):
        z = (path[j] - mu) / math.sqrt(var)
        pv.append(stats.kstest((z @ U[j % 2]).numpy(), "norm").pvalue)
        pv.append(stats.kstest((z @ V).numpy(), "norm").pvalue)
        pv.append(stats.kstest((z**2).sum(1).numpy(), stats.chi2(D).cdf).pvalue)
    assert min(pv) > ALPHA / len(pv), pv


def test_law_test_catches_a_residual_that_ignores_the_running_weight(monkeypatch):
    """Power: clamping ln w at 0 (the node-wise residual and stop masses, as if w_tau = 1) is caught."""
    import experiments.blockverify as bv

    monkeypatch.setattr(bv, "LOG_W_FLOOR", 0.0)
    root, kids, mps, mqs, g = draft_chains(4000, 0.3, seed=103)
    v = block_verify_chain(kids, mps, mqs, S, torch.Generator().manual_seed(7))
    path = completed_paths(root, v, kids, g)
    pv = [
        stats.kstest(((path[j] - mu) / math.sqrt(var) @ U[j % 2]).numpy(), "norm").pvalue
        for j, (mu, var) in enumerate(target_moments(root, 4))
    ]
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
    assert (v.accepted == 4).all() and torch.equal(v.sample, kids[:, -1])


def test_bad_shapes_are_refused():
    _root, kids, mps, mqs, _ = draft_chains(5, 1.0, seed=0)
    with pytest.raises(ValueError, match="must match"):
        block_verify_chain(kids, mps[:, :2], mqs, S)
    with pytest.raises(ValueError, match="sigma"):
        block_verify_chain(kids, mps, mqs, torch.ones(3))


# --- chains drafted as the library's sampler drafts them (same setup as tests/core/test_sampler.py) ----------

MODEL = GaussianMixture(dim=4, components=3, layout_seed=1)
SCHED = Schedule.make(8, 1.0)


def exact_state(seed, ids, n0, sched=SCHED):
    """States at index ``n0`` of the target's own trajectories, and their exact velocities."""
    x = initial_noise(seed, ids, MODEL.event_shape, MODEL.dtype)
    x = continue_by_target(x, torch.zeros_like(ids), seed, ids, stop=n0, sched=sched)
    nn = torch.full_like(ids, n0)
    return x, MODEL(x, sched.sigmas[nn]), nn


def continue_by_target(x, at, seed, ids, stop=None, sched=SCHED):
    """Advance each row from its state index ``at`` by the target kernels (eqs. 4--5) to ``stop`` (default: the end)."""
    keys = rng.base_key(seed, ids, "step")
    x, at = x.clone(), at.clone()
    for k in range(sched.steps if stop is None else stop):
        r = (at == k).nonzero(as_tuple=True)[0]
        if r.numel():
            nk = at[r]
            mean = sched.mean(x[r], MODEL(x[r], sched.sigmas[nk]), nk)
            x[r] = mean + per_row(sched.std(nk), x[r]) * rng.normal(rng.fold(keys[r], k), MODEL.event_shape)
            at[r] = k + 1
    return x


@pytest.mark.parametrize("draft,L", [("x0", 6), ("velocity", 3), ("drift", 2)])
def test_draft_chain_is_the_samplers_first_round(draft, L):
    """The chain's nodes and both kernel means equal those the library's sampler hands its coupling in the
    first round (rooted at state index 1, exact root velocity from the warm-up call), bit for bit."""
    seen = []

    def accept_first(children, mean_p, mean_q, sigma, generator):
        seen.append((children[:, 0].clone(), mean_p.clone(), mean_q.clone(), sigma.clone()))
        n = children.shape[0]
        return Verdict(children[:, 0].clone(), torch.ones(n, dtype=torch.bool), torch.zeros(n, dtype=torch.long))

    m, seed = 7, 3
    sample_speculative(MODEL, SCHED, DraftTree.chain(L), accept_first, m, draft=draft, seed=seed)
    ids = torch.arange(m)
    x1, v1, n1 = exact_state(seed, ids, 1)
    ch = draft_chain(MODEL, SCHED, x1, v1, n1, L, draft=draft, seed=seed)
    for i in range(L):  # the first L verifications are round 1's, depth by depth
        kids, mp, mq, sig = seen[i]
        assert torch.equal(ch.children[:, i], kids) and torch.equal(ch.mean_p[:, i], mp), i
        assert torch.equal(ch.mean_q[:, i], mq) and torch.equal(ch.sigma[:, i].to(sig.dtype), sig), i


@pytest.mark.parametrize("rule,n0,L,draft", [("block", 1, 6, "x0"), ("block", 3, 4, "velocity"), ("node", 1, 5, "x0")])
def test_one_round_from_exact_roots_keeps_the_target_law(rule, n0, L, draft):
    """Exact roots, one drafted and verified chain, target kernels to the end: the standard sampler's law."""
    verify = block_verify_chain if rule == "block" else node_verify_chain
    ids = torch.arange(2000)
    seed = 400 + L
    x, v, nn = exact_state(seed, ids, n0)
    ch = draft_chain(MODEL, SCHED, x, v, nn, L, draft=draft, seed=seed)
    verdict = verify(
        ch.children, ch.mean_p, ch.mean_q, ch.sigma, rng.KeyedRows(rng.fold(rng.base_key(seed, ids, "verify"), nn))
    )
    assert 0 < int((verdict.accepted == L).sum()) < ids.numel()  # both branches exercised
    out = continue_by_target(verdict.sample, nn + verdict.steps, seed + 1, ids)
    ref = sample_standard(MODEL, SCHED, 4000, seed=10_000).samples
    p = two_sample_pvalues(out, ref, directions=3, seed=0)
    p.append(chi2_same_counts(MODEL.component(out).numpy(), MODEL.component(ref).numpy(), 3))
    assert min(p) > ALPHA / len(p), p


def test_draft_chain_refuses_a_chain_past_the_last_speculative_state():
    x, v, nn = exact_state(0, torch.arange(3), 3)
    with pytest.raises(ValueError, match="passes the last speculative state"):
        draft_chain(MODEL, SCHED, x, v, nn, SCHED.end_speculative - 3 + 1)
    with pytest.raises(ValueError, match="L >= 1"):
        draft_chain(MODEL, SCHED, x, v, nn, 0)


def test_tables_small():
    rows = gmm_rows(lengths=(4,), n_roots=8, n_samples=4, dim=20)
    (r,) = rows
    assert r["block_tau"] >= r["node_tau"] and r["block_implied_speedup"] >= r["node_implied_speedup"] > 1.0
    assert {"node_run_speedup", "node_run_se"} <= set(r) and not any(k.startswith("block_run") for k in r)


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

    x, v, nn = exact_state(0, torch.arange(4), 1)
    with pytest.raises(ConfigError, match=f"draft='{draft}' is invalid for block verification.*'x0'"):
        bv.draft_chain(MODEL, SCHED, x, v, nn, 3, draft=draft)
    with pytest.raises(ConfigError, match=f"draft='{draft}' is invalid"):
        bv.gmm_chain_tails(MODEL, SCHED, 3, n_roots=4, draft=draft)


@pytest.mark.slow
def test_a_long_block_chain_from_exact_roots_keeps_the_target_law():
    """L = 24 on a 30-step grid, 20,000 chains vs 40,000 standard samples (seed 500; same tests and level as
    above): a long chain's residuals at every depth keep the law."""
    sched = Schedule.make(30, 0.1)
    ids = torch.arange(20_000)
    x, v, nn = exact_state(500, ids, 1, sched)
    ch = draft_chain(MODEL, sched, x, v, nn, 24, draft="x0", seed=500)
    verdict = block_verify_chain(
        ch.children, ch.mean_p, ch.mean_q, ch.sigma, rng.KeyedRows(rng.fold(rng.base_key(500, ids, "verify"), nn))
    )
    assert len(torch.unique(verdict.steps)) > 5  # residuals at many depths
    out = continue_by_target(verdict.sample, nn + verdict.steps, 501, ids, sched=sched)
    ref = sample_standard(MODEL, sched, 40_000, seed=10_001).samples
    p = two_sample_pvalues(out, ref, directions=3, seed=0)
    p.append(chi2_same_counts(MODEL.component(out).numpy(), MODEL.component(ref).numpy(), 3))
    assert min(p) > ALPHA / len(p), p
