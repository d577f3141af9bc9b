"""A kernel with history: a multistep kernel's mean reads the outputs of earlier steps of the same trajectory.

The test kernel (:class:`TwoStepSDE`, order 2) is DPM-Solver++(2M) SDE (midpoint form, ``eta = 1``; Lu et al. 2022,
arXiv:2211.01095) on the linear path: in the variance-exploding coordinates ``y = x / (1 - sigma)`` of levels
``s = sigma / (1 - sigma)``, with ``h = log(s_n / s_{n+1})``, ``r = h_{n-1} / h``::

    y' = (s_{n+1} / s_n) e^{-h} y + (1 - e^{-2h}) D_n + (1 - e^{-2h}) / (2 r) (D_n - D_{n-1}) + s_{n+1} sqrt(1 - e^{-2h}) z,

``D`` the data prediction ``x - sigma v`` (the kernel's record), the correction absent at the first step (no
``D_{n-1}``) and a last step to 0 ``x' = D_n`` (the grids here stop at 0.004, so every later step is a two-step
one). Its mean is ``c_x x + c_x0 D_n + c_h D_{n-1}`` with per-step columns, ``c_h = 0`` at step 0: the lower-order
first step as the original sampler takes it.

Tests: the standard sampler is the kernel's own loop written here (bit for bit, on the same keyed noise); the target
means the couplings are handed at tree nodes read each node's parent (and, at a round's root, the committed path's
previous state); the executions agree bit for bit (path, tree, the checked walk, trees per root step); the law of
speculative sampling with D-GRS and RMC in both executions is the loop's (two-sample tests, with a power check:
the same test rejects the loop that ignores the history); the theory (per-depth acceptance, optimal trees) and Picard
sweeps run with it.
"""

from __future__ import annotations

import pytest
import torch
from helpers import RowwiseMixture
from scheduler_models import law_pvalues

from specsamp import listcoupling, rng, sampler
from specsamp.coupling import Coupling, Verdict
from specsamp.kernels import KERNELS, Kernel, register_kernel
from specsamp.models import GaussianMixture
from specsamp.round import initial_state, layouts
from specsamp.schedule import Schedule
from specsamp.trees import DraftTree

P_MIN = 1e-3  # a law case passes when the smallest of its 7 p-values is above this (seeds fixed: deterministic)
GMM = GaussianMixture(dim=8, components=3, layout_seed=1, dtype=torch.float64)
LOOP_SEED, SPEC_SEED = 0, 5
TREES = {"dgrs": DraftTree.uniform(2, 4), "rmc": DraftTree.chain(6)}
FIELDS = ("nfe", "nfe_total", "target_rows", "rounds", "committed", "attempts", "accepts")


class TwoStepSDE(Kernel):
    """DPM-Solver++(2M) SDE on the linear path (module docstring): order 2, records the data prediction."""

    columns = ("c_x", "c_x0", "c_h", "sigma", "std", "lsnr")
    order = 2
    stochastic_endpoints = True  # step 0 is a noisy step, drawn with the standard sampler's step keys

    @property
    def init_scale(self) -> float:
        return float(self.sigmas[0])  # y = s_0 xi, i.e. x = sigma_0 xi

    def columns64(self, device):
        sig = self.sigmas.to(device)
        ve = sig / (1.0 - sig)
        k = 1.0 + ve  # y = k x
        s0, s1 = ve[:-1], ve[1:]
        last = s1 == 0
        one = torch.ones_like(s0)
        h = torch.where(last, one, torch.log(s0) - torch.log(torch.where(last, one, s1)))
        A = torch.where(last, 0 * one, s1 / s0 * torch.exp(-h))
        B = torch.where(last, one, -torch.expm1(-2.0 * h))
        r = torch.cat([one[:1], h[:-1]]) / h
        first = torch.arange(s0.numel(), device=device) == 0
        E = torch.where(first | last, 0 * one, 0.5 * B / r)
        S = torch.where(last, 0 * one, s1 * torch.sqrt(-torch.expm1(-2.0 * h)))
        return {
            "c_x": A * k[:-1] / k[1:],
            "c_x0": (B + E) / k[1:],
            "c_h": -E / k[1:],
            "sigma": sig[:-1],
            "std": S / k[1:],
        }

    def record(self, x, out, c):
        return x - c["sigma"] * out

    def mean(self, x, out, c, history=None):
        d = self.record(x, out, c)
        prev = d if history is None else history[0]  # None (a draft): the first-order form
        return c["c_x"] * x + c["c_x0"] * d + c["c_h"] * prev


class ThreeStepSDE(TwoStepSDE):
    """An order-3 variant: the correction also reads ``D_{n-2}``, ``+ F (D_{n-1} - D_{n-2})`` with ``F = E / 4`` from
    step 2 on (not a published sampler: a kernel whose history has two entries, for the layouts' gathers)."""

    columns = ("c_x", "c_x0", "c_h", "c_h2", "sigma", "std", "lsnr")
    order = 3

    def columns64(self, device):
        cols = super().columns64(device)
        step = torch.arange(cols["c_h"].numel(), device=device)
        f = torch.where(step >= 2, -0.25 * cols["c_h"], torch.zeros_like(cols["c_h"]))  # E / (4 k')
        return {**cols, "c_h": cols["c_h"] + f, "c_h2": -f}

    def mean(self, x, out, c, history=None):
        d = self.record(x, out, c)
        p1, p2 = (d, d) if history is None else history
        return c["c_x"] * x + c["c_x0"] * d + c["c_h"] * p1 + c["c_h2"] * p2


for _name, _cls in (("test_dpmpp_2m_sde", TwoStepSDE), ("test_three_step_sde", ThreeStepSDE)):
    if _name not in KERNELS:
        register_kernel(_name)(_cls)


def schedule(steps: int, kernel: str = "test_dpmpp_2m_sde") -> Schedule:
    """``steps`` levels from 0.9 to 0.02 (linear), then 0.004, with the test kernel: the grid stops short of 0, so
    that the last step (outside speculation) is a two-step one too and reads the committed path's record."""
    grid = torch.linspace(0.9, 0.02, steps, dtype=torch.float64)
    return Schedule(torch.cat([grid, grid.new_full((1,), 0.004)]), 1.0, kernel_name=kernel)


def plain_loop(model, sch: Schedule, x: torch.Tensor, noise, history: bool = True) -> torch.Tensor:
    """The kernel's sequential sampler, written out: per step the network, the data prediction, the mean from the
    step's columns and the previous steps' data predictions (the oldest one standing in for those before step 0),
    plus the step's noise ``noise(n) [b, *e]``. ``history`` False: the previous data predictions ignored (the power
    check's wrong sampler)."""
    tab = sch.kernel.columns64("cpu")
    prev = []  # the earlier steps' data predictions, most recent first
    for n in range(sch.steps):
        s = tab["sigma"][n]
        d = x - s * model(x, torch.full((x.shape[0],), float(s), dtype=x.dtype))
        p = [d] * 2 if not prev or not history else (prev + prev[-1:])[:2]
        mean = tab["c_x"][n] * x + tab["c_x0"][n] * d + tab["c_h"][n] * p[0]
        if "c_h2" in tab:
            mean = mean + tab["c_h2"][n] * p[1]
        x = mean + tab["std"][n] * noise(n)
        prev = [d, *prev][:2]
    return x


def loop_samples(sch: Schedule, n: int, seed: int, history: bool = True) -> torch.Tensor:
    """``n`` samples of :func:`plain_loop` on ``GMM``, its noise from a ``torch.Generator`` seeded ``seed``."""
    g = torch.Generator().manual_seed(seed)
    x = sch.kernel.init_scale * torch.randn(n, *GMM.event_shape, generator=g, dtype=torch.float64)
    return plain_loop(
        GMM, sch, x, lambda _: torch.randn(n, *GMM.event_shape, generator=g, dtype=torch.float64), history
    )


@pytest.mark.parametrize("kernel", ["test_dpmpp_2m_sde", "test_three_step_sde"])
def test_the_standard_sampler_is_the_plain_loop_bit_for_bit(kernel):
    # 6 trajectories, T = 8, seed 4: the loop above on the standard sampler's keyed initial state and step noise
    sch, m, seed = schedule(8, kernel), 6, 4
    ids = torch.arange(m)
    x = initial_state(sch, seed, ids, GMM.event_shape, torch.float64)
    keys = rng.base_key(seed, ids, "step")
    want = plain_loop(GMM, sch, x, lambda n: rng.normal(rng.fold(keys, n), GMM.event_shape, dtype=torch.float64))
    got = sampler.sample_standard(GMM, sch, m, seed=seed).samples
    assert torch.equal(got, want)
    ignored = plain_loop(
        GMM, sch, x, lambda n: rng.normal(rng.fold(keys, n), GMM.event_shape, dtype=torch.float64), False
    )
    assert not torch.allclose(got, ignored)  # the history matters


def scripted(rule: str, log: list) -> Coupling:
    """A coupling that is no coupling: it logs ``(children, mean_q)`` and accepts the first child (``accept``) or
    rejects with the target mean as the residual (``reject``), so that the committed trajectory is known."""

    def verify(children, mean_p, mean_q, sigma, generator=None):
        n, k = children.shape[:2]
        log.append((children.clone(), mean_q.clone()))
        if rule == "accept":
            return Verdict(children[:, 0].clone(), torch.ones(n, dtype=torch.bool), torch.zeros(n, dtype=torch.long))
        return Verdict(mean_q.clone(), torch.zeros(n, dtype=torch.bool), torch.full((n,), k, dtype=torch.long))

    return Coupling(f"scripted_{rule}", verify)


@pytest.mark.parametrize("rule", ["accept", "reject"])
@pytest.mark.parametrize("execution", ["path", "tree"])
def test_target_means_read_the_parents_output(execution, rule):
    # one trajectory (GMM dim 8, T = 9, seed 2) on the (2, 2) tree: each target mean the coupling is handed equals
    # c_x x_u + c_x0 D_u + c_h D_parent(u), with D_parent the parent node's data prediction in the tree, and at a
    # round's root the committed trajectory's previous state's (after a leaf: the leaf's parent; after a rejection:
    # the rejected node); every internal node of the tree execution's round, the visited ones of the path's
    sch, seed, tree = schedule(9), 2, DraftTree.uniform(2, 2)
    tab = sch.kernel.table("cpu", torch.float64)
    col = {name: tab[:, i] for i, name in enumerate(sch.kernel.columns)}
    ids = torch.arange(1)
    x_init = initial_state(sch, seed, ids, GMM.event_shape, torch.float64)
    noise0 = rng.normal(rng.fold(rng.base_key(seed, ids, "step"), 0), GMM.event_shape, dtype=torch.float64)
    d = lambda x, n: x - col["sigma"][n] * GMM(x, col["sigma"][n].expand(x.shape[0]))  # noqa: E731
    want = lambda x, n, prev: col["c_x"][n] * x + col["c_x0"][n] * d(x, n) + col["c_h"][n] * prev  # noqa: E731
    d_prev = d(x_init, 0)
    x, n = want(x_init, 0, d_prev) + col["std"][0] * noise0, 1  # step 0 (its c_h is 0)
    log = []
    res = sampler.sample_speculative(
        GMM, sch, tree, scripted(rule, log), 1, execution=execution, seed=seed, check_contract=False
    )
    end, checked = sch.end_speculative, 0
    for kids, mean_q in log:
        if execution == "path":  # one call per visited node, in the trajectory's order
            torch.testing.assert_close(mean_q, want(x, n, d_prev), rtol=1e-12, atol=1e-12)
            checked += 1
            d_prev, x, n = d(x, n), (kids[:, 0] if rule == "accept" else mean_q), n + 1
            continue
        # the tree execution: nodes 0, 1, 2 (the internal ones) in one call; 1 and 2 the children of 0
        limit = min(tree.max_depth, end - n)
        torch.testing.assert_close(mean_q[:1], want(x, n, d_prev), rtol=1e-12, atol=1e-12)
        checked += 1
        if limit > 1:
            for u in (1, 2):
                torch.testing.assert_close(
                    mean_q[u : u + 1], want(kids[0, u - 1 : u], n + 1, d(x, n)), rtol=1e-12, atol=1e-12
                )
                checked += 1
        if rule == "reject":
            d_prev, x, n = d(x, n), mean_q[:1], n + 1
        elif limit > 1:  # walk 0 -> 1 -> 3: the new root is node 3, its previous state node 1
            x1 = kids[0, :1]
            d_prev, x, n = d(x1, n + 1), kids[1, :1], n + 2
        else:
            d_prev, x, n = d(x, n), kids[0, :1], n + 1
    assert n == end and checked >= 6
    # the last step (outside speculation) reads the committed path's record too
    noise = rng.normal(rng.fold(rng.base_key(seed, ids, "step"), n), GMM.event_shape, dtype=torch.float64)
    torch.testing.assert_close(res.samples, want(x, n, d_prev) + col["std"][n] * noise, rtol=1e-12, atol=1e-12)


def _same(got, want):
    for f in FIELDS:
        assert torch.equal(getattr(got, f), getattr(want, f)), f
    assert torch.equal(got.samples, want.samples)


@pytest.mark.parametrize("kernel", ["test_dpmpp_2m_sde", "test_three_step_sde"])
def test_the_executions_agree_bit_for_bit(monkeypatch, kernel):
    # a target evaluated row by row (GMM dim 4, T = 8, 24 trajectories, seed 3): the tree execution equals the path
    # execution (D-GRS on (2, 3), RMC on a chain of 4, trees per root step; prefetch nearest/parent/none; drafts
    # x0_extrap_gated (its own history of the trajectory), drift (the kernel's mean without history), x0); the
    # checked walk (markmax rows reported uncertified) equals both, and with a Picard sweep equals the dense round's
    # (one sweep: the refined records of depth-1 nodes are not the exact ones, so the walk must read the sweep's)
    model = RowwiseMixture(dim=4, components=3, layout_seed=1)
    sch = schedule(8, kernel)
    by_root = lambda n: [DraftTree.uniform(2, 2), DraftTree.chain(3)][n % 2]  # noqa: E731
    for coupling, tree, prefetch, draft in (
        ("dgrs", DraftTree.uniform(2, 3), "nearest", "x0_extrap_gated"),
        ("rmc", DraftTree.chain(4), "parent", "drift"),
        ("dgrs", by_root, "none", "x0"),
    ):
        kw = dict(seed=3, prefetch=prefetch, draft=draft)
        path = sampler.sample_speculative(model, sch, tree, coupling, 24, execution="path", **kw)
        _same(sampler.sample_speculative(model, sch, tree, coupling, 24, execution="tree", **kw), path)
    tree = DraftTree.uniform(2, 3)
    path = sampler.sample_speculative(model, sch, tree, "markmax", 24, execution="path", seed=3)
    dense_refined = sampler.sample_speculative(model, sch, tree, "markmax", 24, execution="tree", seed=3, refine=1)
    share = listcoupling.static_share
    monkeypatch.setattr(
        listcoupling, "static_share", lambda delta, K: (share(delta, K)[0], torch.zeros_like(delta, dtype=torch.bool))
    )
    walks = []
    real = layouts.sparse_round
    monkeypatch.setattr(layouts, "sparse_round", lambda *a, **k: walks.append(1) or real(*a, **k))
    _same(sampler.sample_speculative(model, sch, tree, "markmax", 24, execution="tree", seed=3), path)
    _same(
        sampler.sample_speculative(model, sch, tree, "markmax", 24, execution="tree", seed=3, refine=1), dense_refined
    )
    assert walks  # the checked walk served the rounds


@pytest.mark.parametrize(
    "tree,coupling", [(DraftTree.uniform(2, 3), "dgrs"), (DraftTree.chain(3), "rmc")], ids=["dgrs", "rmc"]
)
def test_picard_sweeps_at_depth_hand_the_verifier_the_target_mean(tree, coupling):
    # refine = L (tree execution, 32 trajectories, T = 9, seed 5): every proposal mean is the target mean at its
    # parent, the history from the sweep's own records included, so |mean_p - mean_q| / sigma vanishes to rounding
    # at every verified node (the tree execution hands unverified nodes, beyond L_n, sigma = 1) and every draft is
    # accepted
    from specsamp.coupling import get_coupling

    rule, seen = get_coupling(coupling), []

    def verify(children, mean_p, mean_q, sigma, generator=None):
        s = torch.as_tensor(sigma, dtype=torch.float64).reshape(-1)
        verified = s < 1  # the kernel's std is below 1 at every step
        seen.append(
            ((mean_p - mean_q)[verified].reshape(int(verified.sum()), -1).norm(dim=1) / s[verified]).max().item()
        )
        return rule(children, mean_p, mean_q, sigma, generator)

    r = sampler.sample_speculative(
        GMM,
        schedule(9),
        tree,
        Coupling(coupling, verify, rule.max_children),
        32,
        execution="tree",
        refine=3,
        seed=5,
        check_contract=False,
    )
    assert seen and max(seen) < 1e-10, max(seen)
    assert torch.equal(r.accepts, r.attempts)


def test_the_records_table_of_an_order_3_kernel():
    # back_table: where the records of a node and of the 2 states before it lie (root's past: rows 0, 1, oldest
    # first; node u: row 2 + u) on the tree 0 -> (1, 2), 1 -> 3, 3 -> 4
    import numpy as np

    from specsamp.round.tables import back_table

    tree = DraftTree([-1, 0, 0, 1, 3])
    up = np.tile(np.arange(5)[:, None], (1, tree.max_depth + 1))
    for v in range(1, 5):
        up[v, : tree.depth[v]] = up[tree.parent[v], : tree.depth[v]]
    back = back_table(tree, up, 2, "cpu").tolist()
    assert back == [[2, 1, 0], [3, 2, 1], [4, 2, 1], [5, 3, 2], [6, 5, 3]]
    assert back_table(tree, up, 0, "cpu") is None


def check_law(
    steps: int, n: int, couplings=("dgrs", "rmc"), refine: int = 0, kernel: str = "test_dpmpp_2m_sde"
) -> dict:
    """Each coupling's path and tree executions (``n`` samples each, seed ``SPEC_SEED``, velocity draft) against the
    loop's ``n`` (seed ``LOOP_SEED``); the two executions draw the same keyed numbers, so they have equal counts and
    samples to the batched mixture's rounding. Returns the smallest p-value per run."""
    sch = schedule(steps, kernel)
    ref = loop_samples(sch, n, LOOP_SEED)
    report = {}
    for coupling in couplings:
        runs = {
            ex: sampler.sample_speculative(
                GMM,
                sch,
                TREES[coupling],
                coupling,
                n,
                execution=ex,
                seed=SPEC_SEED,
                refine=refine if ex == "tree" else 0,
            )
            for ex in ("path", "tree")
        }
        for ex, r in runs.items():
            report[coupling, ex] = p = min(law_pvalues(r.samples, ref, GMM).values())
            assert p > P_MIN, (coupling, ex, p)
        if not refine:
            a, b = runs["path"], runs["tree"]
            for field in ("nfe", "accepts", "attempts"):
                assert torch.equal(getattr(a, field), getattr(b, field)), field
            torch.testing.assert_close(a.samples, b.samples, rtol=0, atol=1e-10)
    return report


def test_law_matches_the_plain_loop_with_a_power_check():
    # d = 8, 3 components, T = 8, n = 2000: D-GRS on (2, 4) and RMC on a chain of 6, path and tree, against the
    # loop (KS on 5 projections and the norm, chi-square of the components: min p > 1e-3), and the order-3 kernel
    # with D-GRS (path and tree) against its loop; power: the same statistic
    # on the loop that ignores the previous output (the first-order sampler) against the loop: min p < 1e-6
    report = check_law(8, 2000)
    report["order 3"] = check_law(8, 2000, couplings=("dgrs",), kernel="test_three_step_sde")
    wrong = min(
        law_pvalues(
            loop_samples(schedule(8), 2000, 1, history=False), loop_samples(schedule(8), 2000, LOOP_SEED), GMM
        ).values()
    )
    print(report, wrong)
    assert wrong < 1e-6


@pytest.mark.slow
def test_law_matches_the_plain_loop_thorough():
    # T = 12, n = 20,000 (each execution's law), then Picard sweeps (refine = 2, tree execution) at n = 2000, T = 8
    print(check_law(12, 20_000))
    print(check_law(8, 2000, refine=2))


def test_theory_calibrates_and_its_trees_sample():
    # the theory reads the counts: per-depth acceptance of a D-GRS run on (2, 4) (64 trajectories, T = 10) gives a
    # delta profile; an optimal tree of budget 12 and optimal trees per root step sample with the kernel
    from specsamp.treesearch import (
        TreesByRoot,
        deltas_by_root,
        deltas_from_acceptance,
        optimal_tree,
        optimal_trees_by_root,
        profile_positional,
    )

    sch = schedule(10)
    r = sampler.sample_speculative(GMM, sch, DraftTree.uniform(2, 4), "dgrs", 64, seed=1)
    rates = (r.accepts.sum(0).double() / r.attempts.sum(0).double().clamp_min(1)).numpy()
    deltas = deltas_from_acceptance(rates, 2, "dgrs")
    assert len(deltas) == 4 and all(d >= 0 for d in deltas)
    tree = optimal_tree(12, profile_positional(deltas), 4, 3)
    table = deltas_by_root(r.attempts_by_root.numpy(), r.accepts_by_root.numpy(), 2, "dgrs", 8)
    trees = TreesByRoot(optimal_trees_by_root(12, table, sch.first_speculative, sch.end_speculative, 4, 3))
    for t, execution in ((tree, "path"), (trees, "tree")):
        got = sampler.sample_speculative(GMM, sch, t, "dgrs", 16, seed=2, execution=execution)
        assert torch.isfinite(got.samples).all() and int(got.committed.sum()) == 16 * (sch.steps - 2)


@pytest.mark.slow
def test_compiled_round_equals_eager():
    # compile=True (D-GRS on (2, 3), x0 draft, 40 trajectories, T = 8): identical counts, samples to rounding
    from specsamp import inductor

    if inductor.unavailable("cpu") is not None:
        pytest.skip(inductor.unavailable("cpu"))
    sch, tree = schedule(8), DraftTree.uniform(2, 3)
    kw = dict(draft="x0", execution="tree", seed=3)
    ref = sampler.sample_speculative(GMM, sch, tree, "dgrs", 40, **kw)
    got = sampler.sample_speculative(GMM, sch, tree, "dgrs", 40, compile=True, **kw)
    for f in FIELDS:
        assert torch.equal(getattr(got, f), getattr(ref, f)), f
    torch.testing.assert_close(got.samples, ref.samples, rtol=0, atol=2.0**18 * torch.finfo(torch.float64).eps)
