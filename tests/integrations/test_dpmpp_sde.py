"""k-diffusion's DPM-Solver++(2M) SDE and (3M) SDE through :func:`specsamp.integrations.k_diffusion.sample_dpmpp_2m_sde`
and :func:`~specsamp.integrations.k_diffusion.sample_dpmpp_3m_sde`.

The reference is k-diffusion's loop as it writes it (``kd_dpmpp_sde`` below, for a variance-exploding denoiser:
``h = log(s / s')``, ``h_eta = (1 + eta) h``, the midpoint or Heun correction of 2M, the phi_2 / phi_3 terms of 3M, a
step to 0 returning the denoised sample; noise from a ``torch.Generator``, which has the one-trajectory law of its
Brownian-tree noise). k-diffusion is not a dependency. The tests: each step's mean and standard deviation are the loop's
(to 1e-12, history included); the law of the speculative sampler, with D-GRS and RMC in both executions (identical
counts), is the loop's by two-sample tests on the wide mixture (KS on 5 projections and the norm, a chi-square on the
components; seeds and n stated, a case passes when the smallest p > 1e-3), with power checks in the same tests; the
shipped digits network runs the samplers.
"""

from __future__ import annotations

import pytest
import torch
from helpers import WIDE, karras, wide_denoiser
from scheduler_models import law_pvalues

from specsamp.errors import ConfigError
from specsamp.integrations.k_diffusion import sample_dpmpp_2m_sde, sample_dpmpp_3m_sde
from specsamp.schedule import Schedule

P_MIN = 1e-3
FIELDS = ("nfe", "nfe_total", "target_rows", "rounds", "committed", "attempts", "accepts")


def kd_mean(x, denoised, s, s1, d1, d2, h1, h2, order=2, eta=1.0, solver_type="midpoint"):
    """The noise-free part of one step of k-diffusion's ``sample_dpmpp_2m_sde`` (``order=2``) or
    ``sample_dpmpp_3m_sde`` (``order=3``), as it writes it: ``d1``, ``d2`` the earlier data predictions and ``h1``,
    ``h2`` the earlier steps' ``h`` (None where there are none)."""
    if s1 == 0:
        return denoised
    h = s.log() - s1.log()
    he = h * (eta + 1)
    x = s1 / s * (-h * eta).exp() * x + (-he).expm1().neg() * denoised
    phi2 = (-he).expm1() / he + 1
    if order == 2 and d1 is not None:
        r = h1 / h
        if solver_type == "heun":
            x = x + ((-he).expm1().neg() / (-he) + 1) * (1 / r) * (denoised - d1)
        else:
            x = x + 0.5 * (-he).expm1().neg() * (1 / r) * (denoised - d1)
    elif order == 3 and h2 is not None:
        r0, r1 = h1 / h, h2 / h
        d1_0, d1_1 = (denoised - d1) / r0, (d1 - d2) / r1
        dd1 = d1_0 + (d1_0 - d1_1) * r0 / (r0 + r1)
        dd2 = (d1_0 - d1_1) / (r0 + r1)
        x = x + phi2 * dd1 - (phi2 / he - 0.5) * dd2
    elif order == 3 and h1 is not None:
        x = x + phi2 * (denoised - d1) / (h1 / h)
    return x


def kd_dpmpp_sde(model, x, sigmas, generator, order=2, eta=1.0, s_noise=1.0, solver_type="midpoint", history=True):
    """k-diffusion's loop (:func:`kd_mean` plus ``s_noise s' sqrt(1 - e^{-2 eta h}) z`` where ``s' > 0``), the noise from
    ``generator``. ``history=False``: the earlier data predictions ignored (a power check's wrong loop)."""
    s_in = x.new_ones([x.shape[0]])
    d1 = d2 = h1 = h2 = None
    for i in range(len(sigmas) - 1):
        s, s1 = sigmas[i], sigmas[i + 1]
        denoised = model(x, s * s_in)
        if history:
            x_next = kd_mean(x, denoised, s, s1, d1, d2, h1, h2, order, eta, solver_type)
        else:
            x_next = kd_mean(x, denoised, s, s1, None, None, None, None, order, eta, solver_type)
        if s1 > 0:
            h = s.log() - s1.log()
            z = torch.randn(x.shape, generator=generator, dtype=x.dtype)
            x_next = x_next + z * s1 * (-2 * h * eta).expm1().neg().sqrt() * s_noise
            h1, h2 = h, h1
        x, d1, d2 = x_next, denoised, d1
    return x


CASES = [
    ("dpmpp_2m_sde", 2, {"eta": 1.0, "s_noise": 1.0, "solver_type": "midpoint"}),
    ("dpmpp_2m_sde", 2, {"eta": 0.6, "s_noise": 1.02, "solver_type": "heun"}),
    ("dpmpp_3m_sde", 3, {"eta": 1.0, "s_noise": 1.0}),
    ("dpmpp_3m_sde", 3, {"eta": 0.7, "s_noise": 0.98}),
]


@pytest.mark.parametrize("name,order,opts", CASES)
def test_each_step_is_k_diffusions_with_its_history(name, order, opts):
    """On a Karras grid of 9 steps, every step's mean (random states and data predictions, the earlier steps' as the
    history) and standard deviation equal k-diffusion's update mapped to the linear path, to 1e-12."""
    sig = karras(9)
    lin = sig / (1 + sig)
    lin[-1] = 0.0
    kernel = Schedule(lin, 1.0, name, opts).kernel
    c = kernel.columns64("cpu")
    g = torch.Generator().manual_seed(3)
    states = torch.randn(9, 4, 8, generator=g, dtype=torch.float64) * (1 + sig[:-1, None, None])
    preds = torch.randn(9, 4, 8, generator=g, dtype=torch.float64)  # the data prediction at each step
    hs = torch.log(sig[:-2] / sig[1:-1])
    for n in range(9):
        back = [preds[n - k] if n - k >= 0 else None for k in (1, 2)]
        hh = [hs[n - k] if n - k >= 0 else None for k in (1, 2)]
        want = kd_mean(
            states[n], preds[n], sig[n], sig[n + 1], *back, *hh, order, opts["eta"], opts.get("solver_type", "")
        )
        x_lin = states[n] / (1 + sig[n])
        v = (x_lin - preds[n]) / lin[n]
        history = tuple(preds[max(n - k, 0)] for k in range(1, order))  # before step 0: a stand-in, weight 0
        mean = kernel.mean(x_lin, v, {k: col[n] for k, col in c.items()}, history)
        torch.testing.assert_close(mean * (1 + sig[n + 1]), want, rtol=1e-12, atol=1e-12)
    h = torch.log(sig[:-2] / sig[1:-1])
    noise = opts["s_noise"] * sig[1:-1] * torch.sqrt(-torch.expm1(-2 * opts["eta"] * h))
    torch.testing.assert_close(c["std"][:-1] * (1 + sig[1:-1]), noise, rtol=1e-12, atol=0)
    assert float(c["std"][-1]) == 0.0


def loop_samples(n, sig, seed=0, **kw):
    """k-diffusion's samples on the wide mixture, the start and noise from a generator seeded ``seed``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g, dtype=torch.float64) * sig[0]
    return kd_dpmpp_sde(wide_denoiser, x, sig, g, **kw)


def start(n, sig, seed=1):
    return torch.randn(n, 8, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * sig[0]


SAMPLERS = {2: sample_dpmpp_2m_sde, 3: sample_dpmpp_3m_sde}


@pytest.mark.parametrize("coupling", ["dgrs", "rmc"])
@pytest.mark.parametrize("order,opts", [(2, {"solver_type": "midpoint"}), (2, {"solver_type": "heun"}), (3, {})])
def test_law_against_k_diffusions_loop_in_both_executions(coupling, order, opts):
    """Loop seed 0, speculative seed 21; n = 2000; d = 8, 6 Karras steps from 20 to 0.03 on the wide mixture; min p >
    1e-3; the two executions' counts identical; fewer calls than the loop's 6."""
    sig = karras(6, sigma_max=20.0)
    ref = loop_samples(2000, sig, order=order, **opts)
    x = start(2000, sig)
    runs = {}
    for execution in ("path", "tree"):
        info = {}
        out = SAMPLERS[order](
            wide_denoiser, x, sig, disable=True, coupling=coupling, execution=execution, seed=21, stats=info, **opts
        )
        runs[execution] = info["result"]
        p = law_pvalues(out, ref, WIDE)
        assert min(p.values()) > P_MIN, p
    for field in FIELDS:
        assert torch.equal(getattr(runs["path"], field), getattr(runs["tree"], field)), field
    assert float(runs["tree"].nfe_total.double().mean()) < 6


@pytest.mark.parametrize("order", [2, 3])
def test_the_law_test_rejects_a_wrong_noise_scale_and_the_loop_without_history(order):
    """Power, with the statistic, n, grid and seeds of the law test: the speculative samples against the loop with 1.2
    times the noise, and against the loop that ignores the earlier data predictions: min p < 1e-6 for both."""
    sig = karras(6, sigma_max=20.0)
    out = SAMPLERS[order](wide_denoiser, start(2000, sig), sig, disable=True, coupling="rmc", seed=21)
    for wrong in (
        loop_samples(2000, sig, order=order, s_noise=1.2),
        loop_samples(2000, sig, order=order, history=False),
    ):
        assert min(law_pvalues(out, wrong, WIDE).values()) < 1e-6


def test_bad_options_are_refused_by_name_before_any_call():
    sig = karras(6, sigma_max=20.0)
    calls = []

    def model(x, s):
        calls.append(1)
        return x

    x = start(2, sig)
    for kwargs, match in [
        ({"solver_type": "euler"}, r"solver_type='euler' is invalid: must be one of midpoint, heun"),
        ({"eta": 0.0}, r"eta=0.0 is invalid: must be a finite number > 0 \(eta=0 is the deterministic sampler"),
        ({"s_noise": -1}, r"s_noise=-1 is invalid"),
        ({"noise_sampler": object()}, r"noise_sampler is not supported"),
        ({"Kk": 2}, r"Kk=2 is not an option of sample_dpmpp_2m_sde"),
    ]:
        with pytest.raises(ConfigError, match=match):
            sample_dpmpp_2m_sde(model, x, sig, **kwargs)
    with pytest.raises(ConfigError, match=r"eta=-1 is invalid"):
        sample_dpmpp_3m_sde(model, x, sig, eta=-1)
    assert calls == []


@pytest.fixture(scope="module")
def digits():
    from specsamp.models.edm import load_edm

    net = load_edm("edm-digits-8x8-cond", download=False)
    return lambda x, sigma, class_labels=None: net(x, sigma, class_labels=class_labels)


@pytest.mark.parametrize("order", [2, 3])
def test_the_digits_network_runs_both_samplers_in_fewer_calls(digits, order):
    sig = karras(12, sigma_min=0.02).float()
    labels = torch.nn.functional.one_hot(torch.arange(6) % 10, 10).float()
    x = torch.randn(6, 1, 8, 8, generator=torch.Generator().manual_seed(0)) * sig[0]
    info = {}
    out = SAMPLERS[order](digits, x, sig, {"class_labels": labels}, disable=True, seed=3, stats=info, K=2, L=3)
    assert out.shape == x.shape and out.dtype == torch.float32 and bool(torch.isfinite(out).all())
    assert info["steps"] == 12 and info["calls"] < 12 and float(out.abs().max()) < 3


@pytest.mark.slow
@pytest.mark.parametrize("coupling", ["dgrs", "rmc"])
@pytest.mark.parametrize("order", [2, 3])
def test_digits_law_against_k_diffusions_loop(digits, coupling, order):
    """Loop seed 0, speculative seed 13; n = 1000 (labels i mod 10); min KS p > 1e-3 over 5 projections of the 64
    pixels and the norm; 12 Karras steps from 80 to 0.02, float32."""
    from helpers import min_ks_p

    sig = karras(12, sigma_min=0.02).float()
    labels = torch.nn.functional.one_hot(torch.arange(1000) % 10, 10).float()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1000, 1, 8, 8, generator=g) * sig[0]
    model = lambda x, s: digits(x, s, class_labels=labels)  # noqa: E731
    ref = kd_dpmpp_sde(model, x, sig, g, order=order)
    x = torch.randn(1000, 1, 8, 8, generator=g) * sig[0]
    out = SAMPLERS[order](digits, x, sig, {"class_labels": labels}, disable=True, coupling=coupling, seed=13)
    assert min_ks_p(out, ref) > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("coupling", ["dgrs", "rmc"])
@pytest.mark.parametrize("order,opts", [(2, {"solver_type": "midpoint", "eta": 0.8}), (3, {"s_noise": 1.03})])
def test_law_against_k_diffusions_loop_large(coupling, order, opts):
    """Loop seed 0, speculative seed 22; n = 20,000; 10 Karras steps from 20 to 0.03 on the wide mixture; min p >
    1e-3."""
    sig = karras(10, sigma_max=20.0)
    ref = loop_samples(20000, sig, order=order, **opts)
    out = SAMPLERS[order](wide_denoiser, start(20000, sig), sig, disable=True, coupling=coupling, seed=22, **opts)
    assert min(law_pvalues(out, ref, WIDE).values()) > P_MIN
