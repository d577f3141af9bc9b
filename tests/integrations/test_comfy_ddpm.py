"""ComfyUI's ``ddpm`` sampler through :func:`specsamp.integrations.k_diffusion.sample_ddpm`.

The reference is ComfyUI's loop as it writes it (``comfy_ddpm`` below: its ``generic_step_sampler`` around
``DDPMSampler_step``, the noise from a ``torch.Generator``); ComfyUI is not a dependency. The law tests compare the
speculative sampler's samples with that loop's by two-sample tests (KS on 5 fixed projections and the norm, and a
chi-square on the mixture's components) at fixed seeds; the power check shows that the same test rejects a loop whose
noise is 20% larger. The mixture's components are wide (standard deviations 0.5 to 0.8 around means in [-2, 2]^8), so
that the samples' law depends on every step's noise: with tight components every sampler ends on the data law and
the power check fails (20% more noise: p = 0.07 there).
"""

from __future__ import annotations

import pytest
import torch
from helpers import WIDE, karras, wide_denoiser
from scheduler_models import law_pvalues

from specsamp.integrations.k_diffusion import sample_ddpm
from specsamp.schedule import Schedule

P_MIN = 1e-3  # a law case passes when the smallest of its 7 p-values is above this (seeds fixed: deterministic)
FIELDS = ("nfe", "nfe_total", "target_rows", "rounds", "committed", "attempts", "accepts")


def comfy_ddpm(model, x, sigmas, generator, noise_scale: float = 1.0):
    """ComfyUI's ``sample_ddpm`` loop: per step the denoiser, the VP state and the epsilon it implies, the DDPM
    posterior step with ``fixed_small`` noise where the next sigma is above 0, then back to VE coordinates.
    ``noise_scale``: the noise's standard deviation times this (1 is ComfyUI's; the power check's wrong loop)."""
    s_in = x.new_ones([x.shape[0]])
    for i in range(len(sigmas) - 1):
        s, s1 = sigmas[i], sigmas[i + 1]
        denoised = model(x, s * s_in)
        eps = (x - denoised) / s
        x_vp = x / torch.sqrt(1.0 + s**2)
        a, a1 = 1 / (s * s + 1), 1 / (s1 * s1 + 1)
        alpha = a / a1
        mu = (1.0 / alpha).sqrt() * (x_vp - (1 - alpha) * eps / (1 - a).sqrt())
        if s1 > 0:
            z = torch.randn(x.shape, generator=generator, dtype=x.dtype)
            mu = mu + noise_scale * ((1 - alpha) * (1.0 - a1) / (1.0 - a)).sqrt() * z
        x = mu * torch.sqrt(1.0 + s1**2) if s1 != 0 else mu
    return x


def test_the_kernel_is_comfyuis_ddpm_step_on_a_karras_grid():
    """Mean and standard deviation of each step equal ComfyUI's (in VE coordinates) to 1e-12."""
    sig = karras(10)
    lin = sig / (1 + sig)
    lin[-1] = 0.0
    kernel = Schedule(lin, 1.0, "ddpm", {"variance_type": "fixed_small", "final_noise": False}).kernel
    c = kernel.columns64("cpu")
    g = torch.Generator().manual_seed(1)
    for n in range(10):
        s0, s1 = sig[n], sig[n + 1]
        x_ve = torch.randn(3, 8, generator=g, dtype=torch.float64) * (1 + s0)
        x0 = torch.randn(3, 8, generator=g, dtype=torch.float64)
        mean_ve = comfy_ddpm(lambda x, s, d=x0: d, x_ve, torch.stack([s0, s1]), g, noise_scale=0.0)
        x_lin, v = x_ve / (1 + s0), (x_ve / (1 + s0) - x0) / lin[n]
        mean = kernel.mean(x_lin, v, {k: col[n] for k, col in c.items()})
        torch.testing.assert_close(mean * (1 + s1), mean_ve, rtol=1e-12, atol=1e-12)
        a, a1 = 1 / (1 + s0**2), 1 / (1 + s1**2)
        std_ve = ((1 - a / a1) * (1 - a1) / (1 - a)).sqrt() * torch.sqrt(1 + s1**2) if s1 > 0 else 0.0
        assert float(c["std"][n]) * (1 + float(s1)) == pytest.approx(float(std_ve), rel=1e-12, abs=1e-15)


def comfy_samples(n: int, sig, noise_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """ComfyUI's samples (generator seed 0) and an independent start for the speculative sampler."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 8, generator=g, dtype=torch.float64) * sig[0]
    ref = comfy_ddpm(wide_denoiser, x, sig, g, noise_scale)
    return ref, torch.randn(n, 8, generator=g, dtype=torch.float64) * sig[0]


@pytest.mark.parametrize("coupling", ["dgrs", "rmc"])
def test_law_against_comfyuis_loop_on_the_mixture_in_both_executions_with_a_power_check(coupling):
    """seed 0 (reference), 17 (speculative); n = 2000; d = 8, 6 Karras steps from 20 to 0.03; tolerance: min p >
    1e-3 (measured 0.095 rmc, 0.17 dgrs); the two executions' counts identical; the power check: a loop with 1.2x
    the noise gives min p < 1e-6 (measured 8e-10)."""
    sig = karras(6, sigma_max=20.0)
    ref, x = comfy_samples(2000, sig)
    runs = {}
    for execution in ("path", "tree"):
        info = {}
        out = sample_ddpm(
            wide_denoiser, x, sig, disable=True, coupling=coupling, execution=execution, seed=17, stats=info
        )
        runs[execution] = info["result"]
        assert min(law_pvalues(out, ref, WIDE).values()) > P_MIN
    for field in FIELDS:
        assert torch.equal(getattr(runs["path"], field), getattr(runs["tree"], field)), field
    assert float(runs["tree"].nfe_total.double().mean()) < 6
    wrong, _ = comfy_samples(2000, sig, noise_scale=1.2)
    assert min(law_pvalues(out, wrong, WIDE).values()) < 1e-6
