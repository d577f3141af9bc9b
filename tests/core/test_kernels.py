"""The transition kernel (specsamp.kernels): its table against eqs. 36--37 written out, and a kernel of one's own."""

import math

import pytest
import torch

from specsamp.kernels import KERNELS, EulerMaruyama, Kernel, get_kernel, register_kernel
from specsamp.sampler import sample_standard
from specsamp.schedule import Schedule


def test_euler_maruyama_table_is_eqs_36_37_step_by_step():
    # T = 9, eps = 0.6, shift 3: each coefficient against the paper's formula in Python floats (float64), to 1 ulp
    sch = Schedule.make(9, 0.6, shift=3.0)
    k = sch.kernel
    assert isinstance(k, EulerMaruyama) and get_kernel("euler_maruyama") is EulerMaruyama
    tab = k.table("cpu", torch.float64)
    s = sch.sigmas.tolist()
    for n in range(sch.steps):
        row = dict(zip(k.columns, tab[n].tolist()))
        stochastic = 1 <= n <= sch.steps - 2
        g2 = 2 * s[n] / (1 - s[n]) if stochastic else 0.0
        want = {
            "dt": s[n + 1] - s[n],
            "a": 1 + 0.36 if stochastic else 1.0,
            "b": 0.36 / (1 - s[n]) if stochastic else 0.0,
            "sigma": s[n],
            "std": 0.6 * math.sqrt(g2 * (s[n] - s[n + 1])) if stochastic else 0.0,
        }
        for name, value in want.items():
            assert row[name] == pytest.approx(value, rel=2e-16, abs=1e-300), (n, name)
    # the mean with the score written out: x + dt (v - eps^2 g^2 s / 2), s = -(x + (1 - sigma) v) / sigma
    g = torch.Generator().manual_seed(0)
    x, v = torch.randn(2, 2, 5, generator=g, dtype=torch.float64)
    n = torch.tensor([3, 3])
    sig, dt = s[3], s[4] - s[3]
    score = -(x + (1 - sig) * v) / sig
    want = x + dt * (v - 0.36 * (2 * sig / (1 - sig)) * score / 2)
    assert torch.allclose(sch.mean(x, v, n), want, rtol=1e-14, atol=1e-15)


def test_schedule_mean_and_std_are_the_kernel_table_gathered():
    # what every caller of the kernel reads: one table per device and dtype, gathered (T = 12, eps = 0.4)
    sch = Schedule.make(12, 0.4)
    n = torch.arange(sch.steps)
    tab = sch.kernel.table("cpu", torch.float32)
    assert sch.kernel.table("cpu", torch.float32) is tab  # built once
    assert torch.equal(sch.std(n), sch.kernel.table("cpu", torch.float64)[:, sch.kernel.col("std")])
    x = torch.ones(sch.steps, 3, dtype=torch.float32)
    c = sch.kernel.coefs(n, x)
    assert "kernel" not in c and c["dt"].shape == (sch.steps, 1)
    assert torch.equal(sch.mean(x, x, n), sch.kernel.mean(x, x, c))


def test_a_kernel_is_one_class_and_a_registration():
    # a noiseless Euler kernel (mean = x + dt v, std = 0): the standard sampler runs it; 3 trajectories, T = 6
    @register_kernel("test_euler_ode")
    class EulerODE(Kernel):
        columns = ("dt", "sigma", "std", "lsnr")

        def columns64(self, device):
            sig = self.sigmas.to(device)
            return {"dt": sig[1:] - sig[:-1], "sigma": sig[:-1], "std": torch.zeros_like(sig[:-1])}

        def mean(self, x, out, c):
            return x + c["dt"] * out

    try:
        base = Schedule.make(6, 0.5)
        sch = Schedule(base.sigmas, base.eps, kernel_name="test_euler_ode")
        assert isinstance(sch.kernel, EulerODE)

        class Zero:  # velocity 0: the ODE keeps the initial noise
            event_shape, dtype, device = (4,), torch.float64, "cpu"

            def __call__(self, x, sigma, **cond):
                return torch.zeros_like(x)

        res = sample_standard(Zero(), sch, 3, seed=2)
        ref = sample_standard(Zero(), Schedule.make(6, 0.5), 3, seed=2)
        assert not torch.equal(res.samples, ref.samples)  # the EM kernel adds noise, this one does not
        from specsamp.round import initial_noise

        assert torch.equal(res.samples, initial_noise(2, torch.arange(3), (4,), torch.float64))
    finally:
        KERNELS._entries.pop("test_euler_ode", None)


def test_every_coupling_and_draft_runs_on_every_scheduler_kernel_with_equal_counts_in_both_executions():
    # d = 4 mixture, 12 trajectories, T = 12: each registered draft with rmc (a chain of 6) and two with markmax (a tree
    # of 2 x 2), the pairs spread over ddpm (thresholding), euler_ancestral and flow_stochastic; path and tree count
    # the same and agree to
    # the batched mixture's rounding (16 T eps)
    pytest.importorskip("diffusers")
    from diffusers import DDPMScheduler, EulerAncestralDiscreteScheduler, FlowMatchEulerDiscreteScheduler

    from specsamp.integrations.schedulers import from_scheduler
    from specsamp.models.gmm import GaussianMixture
    from specsamp.sampler import sample_speculative
    from specsamp.trees import DraftTree

    gmm = GaussianMixture(dim=4, components=3, layout_seed=1)
    plans = [
        from_scheduler(DDPMScheduler(thresholding=True), 12, event_ndim=1),
        from_scheduler(EulerAncestralDiscreteScheduler(), 12),
        from_scheduler(FlowMatchEulerDiscreteScheduler(shift=3.0, stochastic_sampling=True), 12),
    ]
    drafts = ("velocity", "x0", "x0_extrap", "drift", "x0_affine")
    pairs = [("markmax", DraftTree.uniform(2, 2), d) for d in ("x0", "x0_affine")] + [
        ("rmc", DraftTree.chain(6), d) for d in drafts
    ]  # markmax's share tables cost most: two drafts
    for i, (coupling, tree, draft) in enumerate(pairs):
        for plan in (plans[i % 3],):  # each kernel meets most drafts and both couplings across the pairs
            a, b = (
                sample_speculative(gmm, plan.schedule, tree, coupling, 12, draft=draft, execution=ex, seed=3)
                for ex in ("path", "tree")
            )
            where = (plan.kernel, coupling, draft)
            assert torch.equal(a.nfe, b.nfe) and torch.equal(a.accepts, b.accepts), where
            assert torch.allclose(a.samples, b.samples, rtol=0, atol=16 * 12 * 2.2e-16 * 10), where
