"""Denoisers as the networks diffusers' schedulers drive, in their own coordinates and time, and the loop a
pipeline runs with them (the reference for the scheduler kernels' exactness tests).

A mixture's posterior mean ``E[x0 | x]`` is exact (:meth:`GaussianMixture.denoise`), so it is an exact epsilon, x0,
v-prediction or flow network at every level; an EDM network (the shipped digits denoiser) is valid at any level
through its preconditioning. The network is written here from the scheduler's own tables (its
``alphas_cumprod`` or ``sigmas`` at the timestep it is handed), not through :mod:`specsamp.models.parametrisation`,
so the adapters are checked, not assumed.
"""

from __future__ import annotations

import torch


class PredictionNet:
    """``net(y, t) -> out``: a denoiser's prediction at the network's state ``y [b, *e]`` and timesteps ``t``.

    Args:
        denoise: ``denoise(x, s) -> x0`` at linear-path states ``x [b, *e]`` (float64) and levels ``s [b]``.
        prediction: ``epsilon``, ``sample``, ``v_prediction`` (variance-preserving state
            ``y = alpha x0 + sigma_vp xi``) or ``flow`` (``y = (1 - s) x0 + s xi``, out ``xi - x0``).
        timesteps, levels: the scheduler's timesteps ``[T]`` and what each stands for: the cumulative alpha
            (``alpha^2``) for the variance-preserving predictions, the flow level ``s`` for ``flow``.
        calls: a list the number of rows of each call is appended to.
        warp: ``0`` (exact) or the amplitude ``w`` of a deliberate error: the data prediction is moved by
            ``w sin(20 s) u`` (``u`` a fixed unit vector, ``s`` the linear level). The samplers are exact for any
            network, and with an exact one every sampler ends near the data law; the warp makes the final law
            depend on each level and coefficient a sampler uses, so a wrong grid or kernel shows.
    """

    def __init__(self, denoise, prediction: str, timesteps, levels, calls: list | None = None, warp: float = 0.0):
        self.denoise, self.prediction, self.warp = denoise, prediction, float(warp)
        self.ts = torch.as_tensor(timesteps).to(torch.float64).reshape(-1)
        self.levels = torch.as_tensor(levels).to(torch.float64).reshape(-1)
        self.calls = calls

    def level(self, t, b: int) -> torch.Tensor:
        t = torch.as_tensor(t).to(torch.float64).reshape(-1).expand(b)
        hit = t[:, None] == self.ts[None, :]
        assert bool(hit.any(1).all()), "the network was called off the scheduler's timesteps"
        return self.levels[hit.to(torch.int8).argmax(1)]

    def x0(self, x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        out = self.denoise(x, s.reshape(-1))
        if self.warp:
            flat = out.reshape(out.shape[0], -1)
            u = torch.ones(flat.shape[1], dtype=flat.dtype) / flat.shape[1] ** 0.5
            out = (flat + self.warp * torch.sin(20.0 * s.reshape(-1, 1)) * u).reshape(out.shape)
        return out

    def __call__(self, y: torch.Tensor, t, **cond) -> torch.Tensor:
        b = y.shape[0]
        if self.calls is not None:
            self.calls.append(b)
        lv = self.level(t, b).reshape((-1,) + (1,) * (y.ndim - 1))
        y64 = y.to(torch.float64)
        if self.prediction == "flow":
            return ((y64 - self.x0(y64, lv)) / lv).to(y.dtype)
        alpha, sig = lv.sqrt(), (1.0 - lv).sqrt()
        k = alpha + sig
        x0 = self.x0(y64 / k, sig / k)
        eps = (y64 - alpha * x0) / sig
        out = {"epsilon": eps, "sample": x0, "v_prediction": alpha * eps - sig * x0}[self.prediction]
        return out.to(y.dtype)


def mixture_denoiser(gmm):
    """``denoise(x, s)``: the mixture's exact posterior mean ``E[x0 | x]`` (states of any event shape)."""
    return lambda x, s: (
        gmm.denoise(x.reshape(x.shape[0], -1).to(gmm.dtype), s.to(gmm.dtype)).reshape(x.shape).to(torch.float64)
    )


def edm_denoiser(net, label: int | None = None, label_dim: int = 0):
    """``denoise(x, s)``: an EDM network ``D(x_ve; sigma_ve)`` (its preconditioning makes it valid at any sigma) on
    the linear path, ``x_ve = x / (1 - s)``, ``sigma_ve = s / (1 - s)``, in float32, every row of class ``label``."""

    def denoise(x, s):
        b = x.shape[0]
        sv = (s / (1.0 - s)).reshape(-1)
        xv = x / (1.0 - s).reshape((-1,) + (1,) * (x.ndim - 1))
        labels = None
        if label_dim:
            labels = torch.nn.functional.one_hot(torch.full((b,), int(label)), label_dim).float()
        with torch.no_grad():
            return net(xv.float(), sv.float(), class_labels=labels).to(torch.float64)

    return denoise


def scheduler_levels(sch) -> torch.Tensor:
    """What :class:`PredictionNet` reads at each of ``sch.timesteps`` (after ``set_timesteps``): ``alphas_cumprod[t]``
    for DDPM and DDIM, ``1 / (1 + sigma^2)`` at the step's sigma for Euler ancestral and DPM-Solver, the sigma for flow
    matching."""
    name = type(sch).__name__
    if name in ("DDPMScheduler", "DDIMScheduler"):
        return sch.alphas_cumprod.to(torch.float64)[sch.timesteps.long()]
    sig = sch.sigmas.to(torch.float64)[: len(sch.timesteps)]
    if name in ("EulerAncestralDiscreteScheduler", "DPMSolverMultistepScheduler"):
        return 1.0 / (1.0 + sig * sig)
    return sig


def mixture_net(gmm, sch, prediction: str, calls: list | None = None, warp: float = 0.0) -> PredictionNet:
    """The mixture as ``sch``'s network (``sch`` after ``set_timesteps``)."""
    return PredictionNet(mixture_denoiser(gmm), prediction, sch.timesteps, scheduler_levels(sch), calls, warp)


def pipeline_loop(sch, net, latents: torch.Tensor, generator: torch.Generator, **step) -> torch.Tensor:
    """A pipeline's denoising loop: ``latents * init_noise_sigma`` (1 where the scheduler has none), then for each
    timestep the network at
    ``scale_model_input`` of the state (where the scheduler has it) and ``sch.step(..., generator=generator, **step)``
    (``step``: DDIM's ``eta``, ``use_clipped_model_output``)."""
    y = latents * getattr(sch, "init_noise_sigma", 1.0)  # flow matching has none (SD3 starts at N(0, I))
    for t in sch.timesteps:
        y_in = sch.scale_model_input(y, t) if hasattr(sch, "scale_model_input") else y
        out = net(y_in, t)
        y = sch.step(out, t, y, generator=generator, **step).prev_sample
    return y


def law_pvalues(a: torch.Tensor, b: torch.Tensor, gmm=None, directions: int = 5, seed: int = 7) -> dict[str, float]:
    """Two-sample p-values of ``a`` against ``b`` (``[n, *e]``): KS on ``directions`` fixed random projections
    (directions from ``seed``) and on the norm, and (with ``gmm``) the chi-square of the mixture components."""
    import numpy as np
    from scipy import stats

    a, b = a.double().reshape(a.shape[0], -1), b.double().reshape(b.shape[0], -1)
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i in range(directions):
        w = torch.randn(a.shape[1], generator=g, dtype=torch.float64)
        out[f"proj{i}"] = float(stats.ks_2samp((a @ w).numpy(), (b @ w).numpy()).pvalue)
    out["norm"] = float(stats.ks_2samp(a.norm(dim=1).numpy(), b.norm(dim=1).numpy()).pvalue)
    if gmm is not None:
        C = gmm.means.shape[0]
        ca = np.bincount(gmm.component(a.to(gmm.dtype)).numpy(), minlength=C)
        cb = np.bincount(gmm.component(b.to(gmm.dtype)).numpy(), minlength=C)
        keep = (ca + cb) > 0
        out["components"] = (
            float(stats.chi2_contingency(np.stack([ca[keep], cb[keep]])).pvalue) if keep.sum() > 1 else 1.0
        )
    return out
