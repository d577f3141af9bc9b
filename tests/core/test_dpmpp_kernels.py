"""The DPM-Solver++ SDE kernels (:mod:`specsamp.dpmpp`) inside the samplers, trajectory by trajectory.

The reference is k-diffusion's ``sample_dpmpp_2m_sde`` and ``sample_dpmpp_3m_sde`` transcribed here as that library
writes them (``t, s = -log sigma_i, -log sigma_{i+1}``, ``h = s - t``; a step to 0 returns the denoised sample; the
2M's ``eta_h``, its midpoint and Heun corrections, the 3M's ``h_1``, ``h_2`` branching and phi_2 / phi_3 terms), in
the variance-exploding coordinates of a Karras grid, fed the standard sampler's keyed noise (k-diffusion is not a
dependency). Tests: the standard sampler's trajectories are that loop's on the same numbers (to 1e-10 over the whole
run: the kernel's coefficients are the loop's, its history is the trajectory's own, its first state is ``sigma_0 xi``);
they are bit for bit the loop written on the linear path with the kernel's columns and mean; the speculative
executions (path and tree, several drafts and prefetch rules) agree bit for bit with each other; a mean without
history (``None``, what a draft's proposal asks for) is the first-order form; and a power check: on a denoiser that
does not undo a wrong noise scale, the law test passes the speculative samples against the loop and rejects the loop
with ``s_noise`` 1.05.
"""

from __future__ import annotations

import pytest
import torch
from helpers import RowwiseMixture, karras

from specsamp import rng, sampler
from specsamp.models import GaussianMixture
from specsamp.round import initial_state
from specsamp.round.loop import initial_noise
from specsamp.schedule import Schedule
from specsamp.trees import DraftTree

GMM = GaussianMixture(dim=8, components=3, layout_seed=1, std_range=(0.5, 0.8), dtype=torch.float64)
FIELDS = ("nfe", "nfe_total", "target_rows", "rounds", "committed", "attempts", "accepts")
CASES = [
    ("dpmpp_2m_sde", {"eta": 1.0, "s_noise": 1.0, "solver_type": "midpoint"}),
    ("dpmpp_2m_sde", {"eta": 0.7, "s_noise": 1.05, "solver_type": "heun"}),
    ("dpmpp_3m_sde", {"eta": 1.0, "s_noise": 1.0}),
    ("dpmpp_3m_sde", {"eta": 0.6, "s_noise": 0.95}),
]


def kd_2m_sde(denoiser, x, sigmas, noise, eta=1.0, s_noise=1.0, solver_type="midpoint"):
    """k-diffusion's ``sample_dpmpp_2m_sde`` loop as it writes it; ``noise(i)`` stands for its noise sampler."""
    old_denoised = h_last = h = None
    for i in range(len(sigmas) - 1):
        denoised = denoiser(x, sigmas[i])
        if sigmas[i + 1] == 0:
            x = denoised
        else:
            t, s = -sigmas[i].log(), -sigmas[i + 1].log()
            h = s - t
            eta_h = eta * h
            x = sigmas[i + 1] / sigmas[i] * (-eta_h).exp() * x + (-h - eta_h).expm1().neg() * denoised
            if old_denoised is not None:
                r = h_last / h
                if solver_type == "heun":
                    x = x + ((-h - eta_h).expm1().neg() / (-h - eta_h) + 1) * (1 / r) * (denoised - old_denoised)
                elif solver_type == "midpoint":
                    x = x + 0.5 * (-h - eta_h).expm1().neg() * (1 / r) * (denoised - old_denoised)
            x = x + noise(i) * sigmas[i + 1] * (-2 * eta_h).expm1().neg().sqrt() * s_noise
        old_denoised = denoised
        h_last = h
    return x


def kd_3m_sde(denoiser, x, sigmas, noise, eta=1.0, s_noise=1.0):
    """k-diffusion's ``sample_dpmpp_3m_sde`` loop as it writes it; ``noise(i)`` stands for its noise sampler."""
    denoised_1 = denoised_2 = None
    h = h_1 = h_2 = None
    for i in range(len(sigmas) - 1):
        denoised = denoiser(x, sigmas[i])
        if sigmas[i + 1] == 0:
            x = denoised
        else:
            t, s = -sigmas[i].log(), -sigmas[i + 1].log()
            h = s - t
            h_eta = h * (eta + 1)
            x = torch.exp(-h_eta) * x + (-h_eta).expm1().neg() * denoised
            if h_2 is not None:
                r0, r1 = h_1 / h, h_2 / h
                d1_0 = (denoised - denoised_1) / r0
                d1_1 = (denoised_1 - denoised_2) / r1
                d1 = d1_0 + (d1_0 - d1_1) * r0 / (r0 + r1)
                d2 = (d1_0 - d1_1) / (r0 + r1)
                phi_2 = h_eta.neg().expm1() / h_eta + 1
                phi_3 = phi_2 / h_eta - 0.5
                x = x + phi_2 * d1 - phi_3 * d2
            elif h_1 is not None:
                r = h_1 / h
                d = (denoised - denoised_1) / r
                phi_2 = h_eta.neg().expm1() / h_eta + 1
                x = x + phi_2 * d
            x = x + noise(i) * sigmas[i + 1] * (-2 * h * eta).expm1().neg().sqrt() * s_noise
        denoised_1, denoised_2 = denoised, denoised_1
        h_1, h_2 = h, h_1
    return x


def ve_denoiser(model):
    """``model``'s exact posterior mean as a k-diffusion denoiser at variance-exploding level ``s``."""
    return lambda y, s: model.denoise(y / (1 + s), torch.full((y.shape[0],), float(s / (1 + s)), dtype=y.dtype))


def schedule(name, opts, steps=8, sigma_max=20.0):
    """Karras' ``steps`` levels from ``sigma_max`` to 0.03 (then 0), variance exploding, and the kernel's schedule on
    the linear path."""
    sig = karras(steps, sigma_max=sigma_max)
    lin = sig / (1 + sig)
    lin[-1] = 0.0
    return sig, Schedule(lin, 1.0, name, opts)


@pytest.mark.parametrize("name,opts", CASES)
def test_the_standard_sampler_is_k_diffusions_loop_on_the_same_noise(name, opts):
    # 16 trajectories, 8 Karras steps from 20, seed 7: the loop's y_0 = s_0 xi and z_i are the sampler's keyed numbers
    sig, sch = schedule(name, opts)
    m, seed = 16, 7
    ids = torch.arange(m)
    x = initial_state(sch, seed, ids, GMM.event_shape, torch.float64)
    keys = rng.base_key(seed, ids, "step")
    noise = lambda i: rng.normal(rng.fold(keys, i), GMM.event_shape, dtype=torch.float64)  # noqa: E731
    loop = kd_2m_sde if name == "dpmpp_2m_sde" else kd_3m_sde
    want = loop(ve_denoiser(GMM), x * (1 + sig[0]), sig, noise, **opts)
    got = sampler.sample_standard(GMM, sch, m, seed=seed).samples
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(x * (1 + sig[0]), sig[0] * initial_noise(seed, ids, GMM.event_shape, torch.float64))
    # a coefficient off shows: the loop with the other solver type, or 3M's loop for 2M, differs visibly
    other = (
        kd_3m_sde(ve_denoiser(GMM), x * (1 + sig[0]), sig, noise, opts["eta"], opts["s_noise"])
        if name == "dpmpp_2m_sde"
        else kd_2m_sde(ve_denoiser(GMM), x * (1 + sig[0]), sig, noise, opts["eta"], opts["s_noise"])
    )
    assert float((other - got).abs().max()) > 1e-4


def linear_loop(model, sch, x, noise):
    """The kernel's sequential sampler on the linear path: the network, :meth:`record`, :meth:`mean` with the earlier
    records (this step's standing in before the first), the step's ``std`` times ``noise(n)``."""
    k, tab = sch.kernel, sch.kernel.columns64("cpu")
    history = None
    for n in range(sch.steps):
        c = {name: col[n] for name, col in tab.items()}
        c["lsnr"] = torch.log1p(-c["sigma"]) - torch.log(c["sigma"])
        out = model(x, torch.full((x.shape[0],), float(c["sigma"]), dtype=x.dtype))
        d = k.record(x, out, c)
        history = (d,) * (k.order - 1) if history is None else history
        x_next = k.mean(x, out, c, history) + c["std"] * noise(n)
        history = (d, *history[:-1])
        x = x_next
    return x


@pytest.mark.parametrize("name,opts", CASES)
def test_the_standard_sampler_is_the_linear_loop_bit_for_bit(name, opts):
    # 6 trajectories, 8 steps, seed 4, the standard sampler's keyed start and noise
    _, sch = schedule(name, opts)
    m, seed = 6, 4
    ids = torch.arange(m)
    x = initial_state(sch, seed, ids, GMM.event_shape, torch.float64)
    keys = rng.base_key(seed, ids, "step")
    want = linear_loop(GMM, sch, x, lambda n: rng.normal(rng.fold(keys, n), GMM.event_shape, dtype=torch.float64))
    assert torch.equal(sampler.sample_standard(GMM, sch, m, seed=seed).samples, want)


def _same(got, want):
    for f in FIELDS:
        assert torch.equal(getattr(got, f), getattr(want, f)), f
    assert torch.equal(got.samples, want.samples)


@pytest.mark.parametrize("name,opts", [CASES[1], CASES[2]])
def test_the_executions_agree_bit_for_bit(name, opts):
    # a target evaluated row by row (dim 4, 8 Karras steps, 16 trajectories, seed 3): the tree execution equals the
    # path execution for D-GRS and RMC with several drafts (the kernel's mean without history among them) and
    # prefetch rules
    model = RowwiseMixture(dim=4, components=3, layout_seed=1, std_range=(0.5, 0.8))
    _, sch = schedule(name, opts)
    for coupling, tree, prefetch, draft in (
        ("dgrs", DraftTree.uniform(2, 3), "nearest", "x0_extrap_gated"),
        ("rmc", DraftTree.chain(4), "parent", "drift"),
        ("dgrs", DraftTree.uniform(2, 2), "none", "x0"),
    ):
        kw = dict(seed=3, prefetch=prefetch, draft=draft)
        path = sampler.sample_speculative(model, sch, tree, coupling, 16, execution="path", **kw)
        _same(sampler.sample_speculative(model, sch, tree, coupling, 16, execution="tree", **kw), path)
        if draft == "x0_extrap_gated":
            assert float(path.nfe.double().mean()) < sch.steps


@pytest.mark.parametrize("name,opts", CASES)
def test_a_draft_without_history_takes_the_first_order_form(name, opts):
    # history=None: the mean with the step's own record in each earlier one's place, i.e. c_x x + B / k' D
    _, sch = schedule(name, opts)
    k, tab = sch.kernel, sch.kernel.columns64("cpu")
    g = torch.Generator().manual_seed(0)
    x, out = torch.randn(2, 5, 8, generator=g, dtype=torch.float64)
    for n in range(sch.steps):
        c = {name: col[n] for name, col in tab.items()}
        d = k.record(x, out, c)
        first = c["c_x"] * x + sum(c[col] for col in ("c_x0", "c_h", "c_h2") if col in c) * d
        torch.testing.assert_close(k.mean(x, out, c), first, rtol=1e-13, atol=1e-13)
        assert torch.equal(k.mean(x, out, c), k.mean(x, out, c, (d,) * (k.order - 1)))


def shrinking(y, s, **extra):
    """A denoiser that is no posterior mean: ``0.2 y / (1 + s^2)`` (a fifth of the standard Gaussian's), so that later
    steps do not undo a wrong noise scale; the samplers are exact for any network."""
    return 0.2 * y / (1 + s[:, None] ** 2)


def kd_samples(n, sig, seed, name, **opts):
    """k-diffusion's loop on :func:`shrinking`, the start and noise from a ``torch.Generator`` seeded ``seed``."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randn(n, 8, generator=g, dtype=torch.float64) * sig[0]
    noise = lambda i: torch.randn(n, 8, generator=g, dtype=torch.float64)  # noqa: E731
    loop = kd_2m_sde if name == "dpmpp_2m_sde" else kd_3m_sde
    return loop(lambda x, s: shrinking(x, s.expand(x.shape[0])), y, sig, noise, **opts)


@pytest.mark.parametrize("name,opts", [CASES[0], CASES[2]])
def test_the_law_test_sees_a_five_percent_noise_scale(name, opts):
    """Loop seed 0, speculative seed 31; n = 4000, d = 8; 4 Karras steps from 2 to 0.3 on :func:`shrinking` (where the
    last steps' noise makes most of the samples' spread). The speculative samples (D-GRS and RMC, both executions,
    identical counts) pass against k-diffusion's loop (min KS p over 5 projections and the norm > 1e-3) and reject
    its loop with ``s_noise`` 1.05 (p < 1e-6). An ``eta`` of 0.9 is not rejected here, nor could it be by any law
    test at this size: every ``eta`` samples the same marginals in the continuous limit, so only the discretisation
    tells them apart; the per-step and per-trajectory tests above are what pin ``eta``."""
    from helpers import min_ks_p

    from specsamp.integrations.k_diffusion import sample_dpmpp_2m_sde, sample_dpmpp_3m_sde

    sig = karras(4, sigma_min=0.3, sigma_max=2.0)
    ref = kd_samples(4000, sig, 0, name, **opts)
    wrong = kd_samples(4000, sig, 0, name, **{**opts, "s_noise": 1.05})
    run = sample_dpmpp_2m_sde if name == "dpmpp_2m_sde" else sample_dpmpp_3m_sde
    x = torch.randn(4000, 8, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * sig[0]
    for coupling in ("dgrs", "rmc"):
        results = {}
        for execution in ("path", "tree"):
            info = {}
            out = run(
                shrinking, x, sig, disable=True, coupling=coupling, execution=execution, seed=31, stats=info, **opts
            )
            results[execution] = info["result"]
            assert min_ks_p(out, ref) > 1e-3
            assert min_ks_p(out, wrong) < 1e-6
        for f in FIELDS:
            assert torch.equal(getattr(results["path"], f), getattr(results["tree"], f)), f
