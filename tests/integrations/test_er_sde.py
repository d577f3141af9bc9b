"""ComfyUI's ER-SDE and ancestral RES multistep through :func:`specsamp.integrations.k_diffusion.sample_er_sde` and
:func:`~specsamp.integrations.k_diffusion.sample_res_multistep_ancestral`.

The references are ComfyUI's loops as it writes them (``comfy_er_sde``, ``comfy_res_multistep`` below, float64; noise
from a ``torch.Generator``), for a variance-exploding denoiser (the wide mixture's) and a ComfyUI flow model (the same
mixture's on the linear path, ``model_sampling`` a CONST with ``percent_to_sigma``); ComfyUI is not a dependency. The
tests: each step's mean equals the loop's noise-free update (to 1e-10, history included); the law of the speculative
sampler, with D-GRS and RMC in both executions (identical counts), is the loop's by two-sample tests (KS on 5
projections and the norm, a chi-square on the components; seeds and n stated, a case passes when the smallest p >
1e-3), with power checks in the same file.
"""

from __future__ import annotations

import pytest
import torch
from helpers import WIDE, karras, wide_denoiser
from scheduler_models import law_pvalues

from specsamp.errors import ConfigError
from specsamp.integrations.k_diffusion import sample_er_sde, sample_res_multistep_ancestral

P_MIN = 1e-3
FIELDS = ("nfe", "nfe_total", "target_rows", "rounds", "committed", "attempts", "accepts")
SHIFT = 3.0


class CONST:  # ComfyUI's flow model_sampling, as its samplers test it (by class), with the shift-3 percent_to_sigma
    def percent_to_sigma(self, percent):
        t = 1.0 - percent
        return SHIFT * t / (1 + (SHIFT - 1) * t)


class FlowModel:
    """A ComfyUI-style flow model: the wide mixture's exact data prediction at ``x = (1 - sigma) x0 + sigma noise``."""

    def __init__(self):
        self.inner_model = type("Guider", (), {"inner_model": type("Model", (), {"model_sampling": CONST()})()})()

    def __call__(self, x, sigma, **kw):
        return WIDE.denoise(x.to(torch.float64), sigma.to(torch.float64)).to(x.dtype)


def flow_sigmas(steps: int) -> torch.Tensor:
    """SD3's shift-3 flow levels from 1 (ComfyUI's ``simple`` schedule), then 0."""
    t = torch.linspace(1.0, 1.0 / steps, steps, dtype=torch.float64)
    return torch.cat([SHIFT * t / (1 + (SHIFT - 1) * t), torch.zeros(1, dtype=torch.float64)])


def default_phi(x):
    return x * ((x**0.3).exp() + 10.0)


def reverse_time_sde(x):
    """The ``SamplerER_SDE`` node's reverse-time SDE noise scaler at its eta 1, ``x^(eta + 1)``."""
    return x**2


def comfy_er_sde(model, x, sigmas, generator, flow=False, s_noise=1.0, max_stage=3, noise_scaler=None):
    """ComfyUI's ``sample_er_sde`` loop (``noise_scaler=None``: the default; ``generator=None``: no noise)."""
    phi = noise_scaler or default_phi
    if flow and sigmas[0] >= 1:
        sigmas = sigmas.clone()
        sigmas[0] = CONST().percent_to_sigma(1e-4)
    lam = sigmas / (1 - sigmas) if flow else sigmas.clone()  # exp(-half_log_snr)
    s_in = x.new_ones([x.shape[0]])
    points = torch.arange(0, 200.0, dtype=torch.float64)
    old, old_d = None, None
    for i in range(len(sigmas) - 1):
        denoised = model(x, sigmas[i] * s_in)
        stage = min(max_stage, i + 1)
        if sigmas[i + 1] == 0:
            x = denoised
        else:
            ls, lt = lam[i], lam[i + 1]
            alpha_s, alpha_t = sigmas[i] / ls, sigmas[i + 1] / lt
            r = phi(lt) / phi(ls)
            x = alpha_t / alpha_s * r * x + alpha_t * (1 - r) * denoised
            if stage >= 2:
                dt = lt - ls
                step = -dt / 200.0
                pos = lt + points * step
                scaled = phi(pos)
                s = torch.sum(1 / scaled) * step
                d = (denoised - old) / (ls - lam[i - 1])
                x = x + alpha_t * (dt + s * phi(lt)) * d
                if stage >= 3:
                    s_u = torch.sum((pos - ls) / scaled) * step
                    u = (d - old_d) / ((ls - lam[i - 2]) / 2)
                    x = x + alpha_t * (dt**2 / 2 + s_u * phi(lt)) * u
                old_d = d
            if generator is not None:
                z = torch.randn(x.shape, generator=generator, dtype=x.dtype)
                x = x + alpha_t * z * s_noise * (lt**2 - ls**2 * r**2).sqrt().nan_to_num(nan=0.0)
        old = denoised
    return x


def comfy_res_multistep(model, x, sigmas, generator, eta=1.0, s_noise=1.0, history=True):
    """ComfyUI's ``res_multistep`` loop (``sample_res_multistep_ancestral``; ``generator=None``: no noise;
    ``history=False``: every step Euler, a power check's wrong loop)."""
    s_in = x.new_ones([x.shape[0]])
    old, old_down = None, None
    for i in range(len(sigmas) - 1):
        denoised = model(x, sigmas[i] * s_in)
        s, s1 = sigmas[i], sigmas[i + 1]
        up = min(s1, eta * (s1**2 * (s**2 - s1**2) / s**2) ** 0.5)
        down = (s1**2 - up**2) ** 0.5
        if down == 0 or old is None or not history:
            x = x + (x - denoised) / s * (down - s)
        else:
            t, t_old, t_next, t_prev = -s.log(), -old_down.log(), -down.log(), -sigmas[i - 1].log()
            h = t_next - t
            c2 = (t_prev - t_old) / h
            phi1 = torch.expm1(-h) / -h
            phi2 = (phi1 - 1.0) / -h
            b1 = torch.nan_to_num(phi1 - phi2 / c2, nan=0.0)
            b2 = torch.nan_to_num(phi2 / c2, nan=0.0)
            x = (-h).exp() * x + h * (b1 * denoised + b2 * old)
        if s1 > 0 and generator is not None:
            x = x + torch.randn(x.shape, generator=generator, dtype=x.dtype) * s_noise * up
        old, old_down = denoised, down
    return x


LOOPS = {"er_sde": comfy_er_sde, "res": comfy_res_multistep}
SAMPLERS = {"er_sde": sample_er_sde, "res": sample_res_multistep_ancestral}


def setup(flow: bool, steps: int = 6):
    """``(model, sigmas, start scale)``: the flow model on shift-3 levels from 1, or the wide denoiser on Karras'."""
    if flow:
        return FlowModel(), flow_sigmas(steps), 1.0
    sig = karras(steps, sigma_max=20.0)
    return wide_denoiser, sig, float(sig[0])


@pytest.mark.parametrize("flow", [False, True])
@pytest.mark.parametrize(
    "name,opts",
    [
        ("er_sde", {}),
        ("er_sde", {"max_stage": 2}),
        ("er_sde", {"noise_scaler": reverse_time_sde}),
        ("res", {"eta": 0.8}),
    ],
)
def test_each_step_is_comfyuis_noise_free_update(name, opts, flow):
    """On 9 steps, the sampler's kernel mean at each state ComfyUI's noise-free loop visits (the model returning random
    data predictions, the earlier ones as the history) equals the loop's next state, and its standard deviation the
    loop's noise scale, to 1e-10."""
    from specsamp.schedule import Schedule

    model, sig, scale = setup(flow, 9)
    g = torch.Generator().manual_seed(3)
    preds = torch.randn(9, 4, 8, generator=g, dtype=torch.float64)
    seen = []

    def fake(x, s):
        seen.append(x.clone())
        return preds[len(seen) - 1]

    x = torch.randn(4, 8, generator=g, dtype=torch.float64) * scale
    final = LOOPS[name](fake, x, sig, None, flow=flow, **opts) if name == "er_sde" else None
    if name == "res":
        final = comfy_res_multistep(fake, x, sig, None, **opts)
    levels = sig.clone()
    if flow and name == "er_sde":
        levels[0] = CONST().percent_to_sigma(1e-4)
    lin = levels if flow else levels / (1 + levels)
    k = torch.ones_like(levels) if flow else 1 + levels
    kernel_opts = dict(opts, flow=flow) if name == "res" else opts
    kernel = Schedule(lin, 1.0, "er_sde" if name == "er_sde" else "res_multistep_ancestral", kernel_opts).kernel
    c = kernel.columns64("cpu")
    states = seen[1:] + [final]
    for n in range(9):
        x_lin = seen[n] / k[n]
        v = (x_lin - preds[n]) / lin[n]
        history = tuple(preds[max(n - j, 0)] for j in range(1, kernel.order))
        mean = kernel.mean(x_lin, v, {key: col[n] for key, col in c.items()}, history)
        torch.testing.assert_close(mean * k[n + 1] if n < 8 else mean, states[n], rtol=1e-10, atol=1e-10)
    lam = levels / (1 - levels) if name == "er_sde" and flow else levels  # the loop's lambda, or its levels
    s0, s1 = lam[:-2], lam[1:-1]
    if name == "er_sde":
        phi = opts.get("noise_scaler", default_phi)
        want = (s1**2 - s0**2 * (phi(s1) / phi(s0)) ** 2).sqrt() * (1 - levels[1:-1] if flow else 1)
    else:
        want = torch.minimum(s1, opts["eta"] * (s1**2 * (s0**2 - s1**2) / s0**2).sqrt())
    torch.testing.assert_close(c["std"][:-1] * k[1:-1], want, rtol=1e-10, atol=0)
    assert float(c["std"][-1]) == 0.0


def loop_samples(name, flow, n, seed=0, **kw):
    model, sig, scale = setup(flow)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g, dtype=torch.float64) * scale
    if name == "er_sde":
        return comfy_er_sde(model, x, sig, g, flow=flow, **kw)
    return comfy_res_multistep(model, x, sig, g, **kw)


def speculative(name, flow, n, seed=21, **kw):
    model, sig, scale = setup(flow)
    x = torch.randn(n, 8, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * scale
    return SAMPLERS[name](model, x, sig, disable=True, seed=seed, **kw)


@pytest.mark.parametrize("coupling", ["dgrs", "rmc"])
@pytest.mark.parametrize(
    "name,flow,opts",
    [
        ("er_sde", False, {}),
        ("er_sde", True, {}),
        ("er_sde", False, {"noise_scaler": reverse_time_sde, "max_stage": 2}),
        ("res", False, {}),
        ("res", True, {}),
    ],
)
def test_law_against_comfyuis_loop_in_both_executions(name, flow, opts, coupling):
    """Loop seed 0, speculative seed 21; n = 2000; d = 8, 6 steps (Karras from 20 to 0.03 for the variance-exploding
    denoiser, shift-3 flow levels from 1 for the flow model) on the wide mixture; min p > 1e-3; the two executions'
    counts identical; fewer calls than the loop's 6. ER-SDE also with the node's reverse-time SDE scaler."""
    ref = loop_samples(name, flow, 2000, **opts)
    runs = {}
    for execution in ("path", "tree"):
        info = {}
        out = speculative(name, flow, 2000, coupling=coupling, execution=execution, stats=info, **opts)
        runs[execution] = info["result"]
        p = law_pvalues(out, ref, WIDE)
        assert min(p.values()) > P_MIN, p
    for field in FIELDS:
        assert torch.equal(getattr(runs["path"], field), getattr(runs["tree"], field)), field
    assert float(runs["tree"].nfe_total.double().mean()) < 6


@pytest.mark.parametrize(
    "name,flow,wrong",
    [
        ("er_sde", False, {"s_noise": 1.2}),
        ("er_sde", False, {"max_stage": 1}),
        ("er_sde", True, {"s_noise": 1.2}),
        ("res", False, {"eta": 0.9}),
        ("res", False, {"history": False}),
        ("res", True, {"eta": 0.9}),
    ],
)
def test_the_law_test_rejects_a_wrong_loop(name, flow, wrong):
    """Power, with the statistic, n, grid and seeds of the law test: the speculative samples against a loop with one
    coefficient wrong (1.2 times the noise, eta 0.9 for 1, no stage 2 and 3, no history): min p < 1e-6."""
    out = speculative(name, flow, 2000, coupling="rmc")
    assert min(law_pvalues(out, loop_samples(name, flow, 2000, **wrong), WIDE).values()) < 1e-6


def test_bad_options_are_refused_by_name_before_any_call():
    sig = karras(6, sigma_max=20.0)
    calls = []

    def model(x, s):
        calls.append(1)
        return x

    x = torch.zeros(2, 8, dtype=torch.float64)
    for kwargs, match in [
        ({"max_stage": 4}, r"max_stage=4 is invalid: must be 1, 2 or 3"),
        ({"s_noise": 0.0}, r"s_noise=0.0 is invalid: must be a finite number > 0"),
        ({"noise_scaler": 3}, r"noise_scaler"),
        ({"noise_scaler": lambda lam: lam}, r"noise_scaler is invalid on this grid"),
        ({"noise_sampler": object()}, r"noise_sampler is not supported"),
        ({"Kk": 2}, r"Kk=2 is not an option of sample_er_sde"),
    ]:
        with pytest.raises(ConfigError, match=match):
            sample_er_sde(model, x, sig, **kwargs)
    for kwargs, match in [
        ({"eta": 0.0}, r"eta=0.0 is invalid: must be a finite number > 0"),
        ({"s_noise": -1}, r"s_noise=-1 is invalid"),
    ]:
        with pytest.raises(ConfigError, match=match):
            sample_res_multistep_ancestral(model, x, sig, **kwargs)
    with pytest.raises(ConfigError, match=r"sigmas="):
        sample_er_sde(model, x, torch.tensor([1.0, 2.0]))
    assert calls == []
    bare = FlowModel()
    bare.inner_model.inner_model.model_sampling = type("CONST", (), {})()  # no percent_to_sigma
    with pytest.raises(ConfigError, match=r"sigmas\[0\]=1.0 is invalid for this flow model"):
        sample_er_sde(bare, x, flow_sigmas(6))


@pytest.mark.slow
@pytest.mark.parametrize("coupling", ["dgrs", "rmc"])
@pytest.mark.parametrize("name,flow,opts", [("er_sde", False, {}), ("er_sde", True, {}), ("res", False, {})])
def test_law_against_comfyuis_loop_large(name, flow, opts, coupling):
    """Loop seed 0, speculative seed 22; n = 20,000; 6 steps as the default law test; min p > 1e-3."""
    out = speculative(name, flow, 20000, seed=22, coupling=coupling, **opts)
    assert min(law_pvalues(out, loop_samples(name, flow, 20000, **opts), WIDE).values()) > P_MIN
