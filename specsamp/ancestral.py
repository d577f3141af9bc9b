"""ComfyUI's Euler ancestral step for flow models (``sample_euler_ancestral_RF``) and its LCM sampler, as kernels.

Both are written on the linear path ``x = (1 - s) x0 + s xi``, which is a flow model's own state (ComfyUI's
``model_sampling`` CONST: SD3, Flux); ``D`` is the denoiser's data prediction at the step's state.

**Euler ancestral, rectified flow** (``euler_ancestral_rf``): for ``s -> s' > 0`` with ``s_d = s' (1 + (s'/s - 1) eta)``,

    x' = (1 - s') / (1 - s_d) [ (s_d / s) x + (1 - s_d / s) D ] + s_noise sqrt(s'^2 - s_d^2 (1 - s')^2 / (1 - s_d)^2) z,

and ``x' = D`` at ``s' = 0``. At ``eta = 1`` it is the stochastic flow step ``(1 - s') D + s' z``.

**LCM** (``lcm``): ``x' = D`` and, where ``s' > 0``, the noise added at ``s'`` by the model's own noise scaling:
``(1 - s') D + s' z`` for a flow model; ``D + s_ve' z`` for a variance-exploding one, which on the linear path
(``x = y / (1 + s_ve)``, level ``s_ve / (1 + s_ve)``) is the same step. ComfyUI's ``s_noise`` and ``s_noise_end`` scale
the noise, linearly across the steps.
"""

from __future__ import annotations

import torch

from .dpmpp import karras_levels
from .kernels import DataPredictionKernel, positive_option, register_kernel


def flow_levels(steps: int, shift: float = 3.0) -> torch.Tensor:
    """float64 ``[steps + 1]``: a flow model's shifted levels ``shift t / (1 + (shift - 1) t)`` at ``t`` from 1 down to
    ``1 / steps`` in equal steps (SD3's and ComfyUI's ``simple`` schedule of a model with that shift), then 0."""
    t = torch.linspace(1.0, 1.0 / steps, steps, dtype=torch.float64)
    return torch.cat([shift * t / (1.0 + (shift - 1.0) * t), torch.zeros(1, dtype=torch.float64)])


@register_kernel("euler_ancestral_rf")
class EulerAncestralRF(DataPredictionKernel):
    """ComfyUI's ``sample_euler_ancestral_RF`` (module docstring): ``eta > 0``, ``s_noise > 0``; any decreasing grid
    in ``(0, 1]`` ending at 0. The initial state is ``sigma_0 xi`` (ComfyUI's flow noise scaling at ``sigma_0``). In a
    run (``run.py kernel=euler_ancestral_rf``) the grid is :func:`flow_levels` at the kernel's ``shift``."""

    reads_shift = False
    grid_keys = ("shift",)
    run_options = ("eta", "s_noise")

    @staticmethod
    def make_grid(steps: int, **keys) -> torch.Tensor:
        return flow_levels(steps, **keys)

    def __init__(self, sigmas, eps, eta: float = 1.0, s_noise: float = 1.0, **options):
        super().__init__(sigmas, eps, **options)
        self.eta, self.s_noise = (
            positive_option("eta", eta, "Euler sampler"),
            positive_option("s_noise", s_noise, "Euler sampler"),
        )
        s0, s1 = self.sigmas[:-1], self.sigmas[1:]
        sd = s1 * (1.0 + (s1 / s0 - 1.0) * self.eta)
        if bool(((sd <= 0) & (s1 > 0)).any()):
            raise ValueError(
                f"eta={eta!r} is invalid for this grid: the step down s' (1 + (s'/s - 1) eta) falls to 0 or below "
                "at a step (eta at most 1 never does)"
            )

    @property
    def init_scale(self) -> float:
        return float(self._init_scale) if self._init_scale is not None else float(self.sigmas[0])

    def step_coefficients(self, device):
        sig = self.sigmas.to(device)
        s0, s1 = sig[:-1], sig[1:]
        last = s1 == 0
        sd = s1 * (1.0 + (s1 / s0 - 1.0) * self.eta)
        ratio = sd / s0
        scale = (1.0 - s1) / (1.0 - sd)
        renoise = (s1 * s1 - sd * sd * scale * scale).clamp(min=0.0).sqrt()
        zero, one = torch.zeros_like(s0), torch.ones_like(s0)
        A = torch.where(last, zero, scale * ratio)
        B = torch.where(last, one, scale * (1.0 - ratio))
        S = torch.where(last, zero, self.s_noise * renoise)
        return A, B, S


@register_kernel("lcm")
class LCM(DataPredictionKernel):
    """ComfyUI's (and k-diffusion's) ``sample_lcm`` (module docstring): the data prediction renoised to the next
    level; ``s_noise`` and ``s_noise_end`` (None: ``s_noise``) scale the noise, linearly over the steps. In a run
    (``run.py kernel=lcm``) the grid is Karras' (:func:`specsamp.dpmpp.karras_levels`)."""

    reads_shift = False
    grid_keys = ("sigma_min", "sigma_max", "rho")
    run_options = ("s_noise", "s_noise_end")

    @staticmethod
    def make_grid(steps: int, **keys) -> torch.Tensor:
        return karras_levels(steps, **keys)

    def __init__(self, sigmas, eps, s_noise: float = 1.0, s_noise_end: float | None = None, **options):
        super().__init__(sigmas, eps, **options)
        self.s_noise = positive_option("s_noise", s_noise, "Euler sampler")
        self.s_noise_end = (
            self.s_noise if s_noise_end is None else positive_option("s_noise_end", s_noise_end, "Euler sampler")
        )

    @property
    def init_scale(self) -> float:
        return float(self._init_scale) if self._init_scale is not None else float(self.sigmas[0])

    def step_coefficients(self, device):
        s1 = self.sigmas.to(device)[1:]
        n = s1.numel()
        t = torch.arange(n, device=device, dtype=s1.dtype) / max(n - 1, 1)
        scale = self.s_noise + (self.s_noise_end - self.s_noise) * t
        return torch.zeros_like(s1), 1.0 - s1, scale * s1
