"""ComfyUI's ER-SDE solver (``sample_er_sde``) and its ancestral RES multistep (``sample_res_multistep_ancestral``) as
kernels with history.

Both fit the kernel contract: each step is one network call, a Gaussian whose mean is affine in the state and the data
predictions ``D`` (this step's), ``D1``, ``D2`` (the one and two steps before on the same trajectory), and whose noise
is fresh and independent of the state, with a scale fixed by the grid.

**ER-SDE** (``er_sde``; Cui et al. 2023, arXiv:2309.06169, VP ER-SDE-Solver-3 as ComfyUI writes it). With
``lambda = sigma / alpha`` (a variance-exploding model: ``lambda = sigma``; a flow model: ``sigma / (1 - sigma)``;
in both, ``s / (1 - s)`` of the linear path's level ``s``), ``u = y / alpha`` the state in variance-exploding
coordinates, ``phi`` the noise scaler (default ``phi(l) = l (exp(l^0.3) + 10)``) and, for a step ``l -> l'``,
``r = phi(l') / phi(l)``::

    u' = r u + (1 - r) D + c2 (D - D1) / (l - l1) + c3 u_3 + s_noise sqrt(l'^2 - l^2 r^2) z,
    c2 = (l' - l) + phi(l') S1,   c3 = (l' - l)^2 / 2 + phi(l') S2,
    u_3 = [(D - D1) / (l - l1) - (D1 - D2) / (l1 - l2)] / ((l - l2) / 2),

with ``S1``, ``S2`` ComfyUI's 200-point left Riemann sums of ``1 / phi`` and ``(m - l) / phi`` over ``[l', l]``
(computed here in float64), stage 2 from the second step on and stage 3 from the third (``max_stage`` caps them),
and ``u' = D`` at ``l' = 0``. A flow model's first level 1 (``lambda`` infinite) is moved, as ComfyUI does, to the
model's ``percent_to_sigma(1e-4)`` by the entry point.

**RES multistep, ancestral** (``res_multistep_ancestral``; Zhang et al. 2023, arXiv:2308.02157). In the model's
coordinates ``y`` at levels ``sigma`` (k-diffusion's ``get_ancestral_step(sigma, sigma', eta)`` giving ``sigma_d``,
``sigma_u``; ``h = log(sigma / sigma_d)``)::

    y' = (sigma_d / sigma) y + (1 - sigma_d / sigma) D + s_noise sigma_u z              (first step, or sigma_d = 0)
    y' = e^{-h} y + h (b1 D + b2 D1) + s_noise sigma_u z                                  (later steps)

with ``c2 = log(sigma_d1 / sigma_1) / h`` (``sigma_d1`` the step before's ``sigma_d``, ``sigma_1`` its level),
``b1 = phi1(-h) - phi2(-h) / c2``, ``b2 = phi2(-h) / c2``, ``phi1(t) = expm1(t) / t``, ``phi2(t) = (phi1(t) - 1) / t``;
no noise at ``sigma' = 0``. ComfyUI runs this update in the model's own coordinates whatever they are: for a
variance-exploding model the levels are ``s / (1 - s)`` and ``y = (1 + sigma) x``; for a flow model (``flow=True``)
they are the linear path's own levels and states.

On the linear path (the states the sampler holds, ``x = y / k``) either step is the same Gaussian with every
coefficient divided by ``k'`` and the state's multiplied by ``k``: the mean is ``c_x x + c_x0 D + c_h D1 (+ c_h2 D2)``,
the history the earlier steps' data predictions ``x - sigma v``, and the history's columns 0 where the original has
no earlier step.
"""

from __future__ import annotations

import torch

from .dpmpp import karras_levels
from .kernels import Kernel, positive_option, register_kernel

INTEGRATION_POINTS = 200  # ComfyUI's num_integration_points


def default_noise_scaler(lam: torch.Tensor) -> torch.Tensor:
    """ER-SDE's default noise scaler ``phi(l) = l (exp(l^0.3) + 10)`` (ComfyUI's, from the paper's code)."""
    return lam * (torch.exp(lam**0.3) + 10.0)


class _History(Kernel):
    """Shared by the two kernels: the data-prediction record and the linear path's columns; in a run (``run.py
    kernel=er_sde``) the grid is Karras' (:func:`specsamp.dpmpp.karras_levels`, the keys :attr:`grid_keys`)."""

    stochastic_endpoints = True  # step 0 is a noisy step like every other
    reads_shift = False
    grid_keys = ("sigma_min", "sigma_max", "rho")

    @staticmethod
    def make_grid(steps: int, **keys) -> torch.Tensor:
        return karras_levels(steps, **keys)

    @property
    def init_scale(self) -> float:
        """The first state on the linear path is ``sigma_0 xi`` (``sigma_0 xi`` in variance-exploding coordinates
        over ``1 + sigma_0``)."""
        return float(self.sigmas[0])

    def record(self, x: torch.Tensor, out: torch.Tensor, c: dict) -> torch.Tensor:
        """The data prediction ``x - sigma v`` (ComfyUI's ``denoised``)."""
        return x - c["sigma"] * out

    def linear(self, k: torch.Tensor, A, B, S, history: dict) -> dict:
        """The linear path's columns from the step ``y' = A y + B D + sum_k H_k D_k + S z`` in coordinates
        ``y = k x`` (``k [T + 1]``; ``history``: column name to ``H_k``)."""
        k0, k1 = k[:-1], k[1:]
        cols = {"c_x": A * k0 / k1, "c_x0": B / k1}
        cols.update({name: H / k1 for name, H in history.items()})
        return {**cols, "sigma": self.sigmas.to(k.device)[:-1], "std": S / k1}

    def mean(self, x, out, c, history=None):
        d = self.record(x, out, c)
        back = (d,) * (self.order - 1) if history is None else history  # None (a draft's proposal): its own D
        m = c["c_x"] * x + c["c_x0"] * d + c["c_h"] * back[0]
        return m + c["c_h2"] * back[1] if self.order == 3 else m


@register_kernel("er_sde")
class ERSDE(_History):
    """ComfyUI's ``sample_er_sde`` (module docstring): order 3; ``s_noise > 0``, ``max_stage`` 1, 2 or 3,
    ``noise_scaler`` a function of a float64 tensor of ``lambda`` (None: :func:`default_noise_scaler`); any decreasing
    grid in ``(0, 1)`` ending at 0. The same kernel serves variance-exploding and flow models (their ``u`` is the
    same multiple ``1 + lambda`` of the linear path's state)."""

    columns = ("c_x", "c_x0", "c_h", "c_h2", "sigma", "std", "lsnr")
    order = 3
    run_options = ("s_noise", "max_stage")

    def __init__(self, sigmas, eps, s_noise: float = 1.0, max_stage: int = 3, noise_scaler=None):
        super().__init__(sigmas, eps)
        self.s_noise = positive_option("s_noise", s_noise, "RES multistep")
        if isinstance(max_stage, bool) or max_stage not in (1, 2, 3):
            raise ValueError(f"max_stage={max_stage!r} is invalid: must be 1, 2 or 3")
        if noise_scaler is not None and not callable(noise_scaler):
            raise ValueError(f"noise_scaler={noise_scaler!r} is invalid: must be a function of lambda, or None")
        self.max_stage, self.noise_scaler = int(max_stage), noise_scaler or default_noise_scaler
        if float(self.sigmas[0]) >= 1.0:
            raise ValueError(
                f"the first level {float(self.sigmas[0])!r} is invalid: ER-SDE needs every level below 1 (lambda = "
                "sigma / (1 - sigma) finite); ComfyUI moves a flow model's first level to percent_to_sigma(1e-4)"
            )
        c = self.columns64("cpu")
        inner = c["std"][:-1]
        if not (bool(torch.isfinite(torch.stack(list(c.values()))).all()) and bool((inner > 0).all())):
            raise ValueError(
                "noise_scaler is invalid on this grid: every step but the last needs finite coefficients and "
                "noise (l'^2 > l^2 r^2); a noise-free step (ComfyUI's ODE scaler) is not a stochastic kernel"
            )

    def columns64(self, device) -> dict[str, torch.Tensor]:
        sig = self.sigmas.to(device)
        lam = sig / (1.0 - sig)
        lam[-1] = 0.0
        T = self.steps
        l0, l1 = lam[:-1], lam[1:]
        last = l1 == 0
        phi = self.noise_scaler
        safe1 = torch.where(last, l0 / 2, l1)  # the last step's columns are B = 1 alone
        r = phi(safe1) / phi(l0)
        dt = safe1 - l0
        k = torch.arange(INTEGRATION_POINTS, dtype=torch.float64, device=device)
        width = -dt / INTEGRATION_POINTS  # [T]
        pos = safe1[:, None] + k[None, :] * width[:, None]  # [T, 200] ComfyUI's lambda_pos
        scaled = phi(pos)
        s1 = (1.0 / scaled).sum(1) * width
        s2 = ((pos - l0[:, None]) / scaled).sum(1) * width
        c2 = dt + s1 * phi(safe1)
        c3 = dt * dt / 2 + s2 * phi(safe1)
        step = torch.arange(T, device=device)
        lm1 = torch.cat([l0[:1] + 1.0, l0[:-1]])  # lambda one step back (step 0: unread)
        lm2 = torch.cat([l0[:2] + 2.0, l0[:-2]])  # two steps back (steps 0, 1: unread)
        a1, a2, w = l0 - lm1, lm1 - lm2, 2.0 / (l0 - lm2)
        zero = torch.zeros_like(l0)
        two = (step >= 1) & (self.max_stage >= 2) & ~last
        three = (step >= 2) & (self.max_stage >= 3) & ~last
        c2 = torch.where(two, c2, zero)
        c3 = torch.where(three, c3, zero)
        on_d = c2 / a1 + c3 * w / a1
        on_d1 = -c2 / a1 - c3 * w * (1.0 / a1 + 1.0 / a2)
        on_d2 = c3 * w / a2
        A = torch.where(last, zero, r)
        B = torch.where(last, zero + 1.0, 1.0 - r) + on_d
        var = (l1 * l1 - l0 * l0 * r * r).clamp(min=0.0)  # ComfyUI: sqrt(...).nan_to_num(0)
        S = torch.where(last, zero, self.s_noise * var.sqrt())
        return self.linear(1.0 + lam, A, B, S, {"c_h": on_d1, "c_h2": on_d2})


@register_kernel("res_multistep_ancestral")
class RESMultistepAncestral(_History):
    """ComfyUI's ``sample_res_multistep_ancestral`` (module docstring): order 2; ``eta > 0``, ``s_noise > 0``,
    ``flow`` (the update in a flow model's own coordinates, as ComfyUI runs it there); any decreasing grid ending at
    0 (``flow=False``: below 1)."""

    columns = ("c_x", "c_x0", "c_h", "sigma", "std", "lsnr")
    order = 2
    run_options = ("eta", "s_noise")

    def __init__(self, sigmas, eps, eta: float = 1.0, s_noise: float = 1.0, flow: bool = False):
        super().__init__(sigmas, eps)
        self.eta, self.s_noise = (
            positive_option("eta", eta, "RES multistep"),
            positive_option("s_noise", s_noise, "RES multistep"),
        )
        if not isinstance(flow, bool):
            raise ValueError(f"flow={flow!r} is invalid: must be True or False")
        self.flow = flow
        if not flow and float(self.sigmas[0]) >= 1.0:
            raise ValueError(
                f"the first level {float(self.sigmas[0])!r} is invalid: a variance-exploding model's levels lie below 1"
            )

    def levels(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """float64 ``[T + 1]`` each: the levels the update reads and ``k`` (the model's state over the linear
        path's)."""
        sig = self.sigmas.to(device)
        if self.flow:
            return sig.clone(), torch.ones_like(sig)
        ve = sig / (1.0 - sig)
        ve[-1] = 0.0
        return ve, 1.0 + ve

    def columns64(self, device) -> dict[str, torch.Tensor]:
        lev, k = self.levels(device)
        s0, s1 = lev[:-1], lev[1:]
        up = torch.minimum(s1, self.eta * (s1 * s1 * (s0 * s0 - s1 * s1) / (s0 * s0)).sqrt())
        down = (s1 * s1 - up * up).sqrt()
        step = torch.arange(self.steps, device=device)
        euler = (down == 0) | (step == 0)
        one = torch.ones_like(s0)
        h = torch.log(s0) - torch.log(torch.where(euler, one, down))
        h = torch.where(euler, one, h)
        down1 = torch.cat([down[:1], down[:-1]])  # the step before's sigma_down (step 0: unread)
        sig1 = torch.cat([s0[:1], s0[:-1]])  # the step before's level
        c2 = (torch.log(down1) - torch.log(sig1)) / h  # (t_prev - t_old) / h with t = -log sigma
        phi1 = torch.expm1(-h) / -h
        phi2 = (phi1 - 1.0) / -h
        b1 = torch.nan_to_num(phi1 - phi2 / c2, nan=0.0)
        b2 = torch.nan_to_num(phi2 / c2, nan=0.0)
        ratio = down / s0
        A = torch.where(euler, ratio, torch.exp(-h))
        B = torch.where(euler, 1.0 - ratio, h * b1)
        H = torch.where(euler, torch.zeros_like(s0), h * b2)
        S = torch.where(s1 > 0, self.s_noise * up, torch.zeros_like(s0))
        return self.linear(k, A, B, S, {"c_h": H})
