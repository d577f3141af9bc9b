"""k-diffusion's DPM-Solver++ SDE samplers, 2M and 3M (Lu et al. 2022, arXiv:2211.01095), as kernels with history.

As k-diffusion's ``sample_dpmpp_2m_sde`` and ``sample_dpmpp_3m_sde`` write them (and ComfyUI's, the same for a
variance-exploding model), in the variance-exploding coordinates ``y = x0 + s xi`` of levels ``s`` (``D``: the
denoiser's data prediction at this step, ``D1``, ``D2`` at the one and two before), for a step ``s -> s'`` with
``h = log(s / s')``, ``he = (1 + eta) h``::

    y' = (s' / s) e^{-eta h} y + (1 - e^{-he}) D + correction + s_noise s' sqrt(1 - e^{-2 eta h}) z,

2M, from its second step on, with ``r = h_prev / h``: ``correction = E (D - D1)``, ``E = (1 - e^{-he}) / (2 r)``
(``solver_type="midpoint"``) or ``E = (1 - (1 - e^{-he}) / he) / r`` (``"heun"``); 3M, with ``phi2 = 1 - (1 - e^{-he})
/ he`` and ``phi3 = phi2 / he - 1/2``: at its second step ``phi2 (D - D1) / r``, from its third ``phi2 d1 - phi3 d2``
with ``r0 = h_prev / h``, ``r1 = h_prev2 / h``, ``d1_0 = (D - D1) / r0``, ``d1_1 = (D1 - D2) / r1``,
``d1 = d1_0 + (d1_0 - d1_1) r0 / (r0 + r1)``, ``d2 = (d1_0 - d1_1) / (r0 + r1)``. A step to ``s' = 0`` returns ``D``.
The first steps take the lower-order forms, as the original does.

On the linear path (``x = y / (1 + s)``, level ``s / (1 + s)``, the states the sampler holds) the step is the same
Gaussian with every coefficient divided by ``1 + s'`` and the state's multiplied by ``1 + s``: the mean is
``c_x x + c_x0 D + c_h D1 (+ c_h2 D2)`` with per-step columns, the history the data predictions ``x - sigma v`` of the
earlier steps (:meth:`DPMPP2MSDE.record`), and ``c_h = c_h2 = 0`` where the original has no earlier step to read.
"""

from __future__ import annotations

import torch

from .kernels import Kernel, positive_option, register_kernel

SOLVER_TYPES = ("midpoint", "heun")


def karras_levels(steps: int, sigma_min: float = 0.002, sigma_max: float = 80.0, rho: float = 7.0) -> torch.Tensor:
    """float64 ``[steps + 1]``: Karras et al.'s (2022) variance-exploding levels (k-diffusion's ``get_sigmas_karras``,
    ComfyUI's ``karras`` scheduler) on the linear path, ``s / (1 + s)``, then 0."""
    ramp = torch.linspace(0, 1, steps, dtype=torch.float64)
    lo, hi = sigma_min ** (1 / rho), sigma_max ** (1 / rho)
    ve = (hi + ramp * (lo - hi)) ** rho
    return torch.cat([ve / (1.0 + ve), ve.new_zeros(1)])


class _DPMPPSDE(Kernel):
    """Shared by the 2M and 3M kernels: the step's variance-exploding quantities and the linear path's columns; in a
    run (``run.py kernel=dpmpp_2m_sde``) the grid is Karras' (:func:`karras_levels`, the keys :attr:`grid_keys`)."""

    stochastic_endpoints = True  # step 0 is a noisy step like every other
    grid_keys = ("sigma_min", "sigma_max", "rho")
    run_options = ("eta", "s_noise")
    reads_shift = False

    @staticmethod
    def make_grid(steps: int, **keys) -> torch.Tensor:
        return karras_levels(steps, **keys)

    def __init__(self, sigmas: torch.Tensor, eps: float, eta: float = 1.0, s_noise: float = 1.0):
        super().__init__(sigmas, eps)
        self.eta, self.s_noise = (
            positive_option("eta", eta, "DPM-Solver++"),
            positive_option("s_noise", s_noise, "DPM-Solver++"),
        )

    @property
    def init_scale(self) -> float:
        """The first state is ``s_0 xi`` in variance-exploding coordinates, ``sigma_0 xi`` on the linear path."""
        return float(self.sigmas[0])

    def ve(self, device) -> tuple[torch.Tensor, ...]:
        """float64 ``[T]`` each: ``(s, s', last, h, he, A, B, S)`` in variance-exploding coordinates, ``h`` and ``he``
        1 at the last step (a step to 0, where only ``B = 1`` is read)."""
        sig = self.sigmas.to(device)
        ve = sig / (1.0 - sig)
        ve[-1] = 0.0
        s0, s1 = ve[:-1], ve[1:]
        last = s1 == 0
        one = torch.ones_like(s0)
        h = torch.where(last, one, torch.log(s0) - torch.log(torch.where(last, one, s1)))
        he = (1.0 + self.eta) * h
        A = torch.where(last, 0 * one, s1 / s0 * torch.exp(-self.eta * h))
        B = torch.where(last, one, -torch.expm1(-he))
        S = torch.where(last, 0 * one, self.s_noise * s1 * torch.sqrt(-torch.expm1(-2.0 * self.eta * h)))
        return s0, s1, last, h, he, A, B, S

    def linear(self, s0, s1, A, B, S, history: dict) -> dict:
        """The linear path's columns from the step ``y' = A y + B D + sum_k H_k D_k + S z`` (``history``: column name
        to ``H_k``)."""
        k0, k1 = 1.0 + s0, 1.0 + s1
        cols = {"c_x": A * k0 / k1, "c_x0": B / k1}
        cols.update({name: H / k1 for name, H in history.items()})
        return {**cols, "sigma": self.sigmas.to(s0.device)[:-1], "std": S / k1}

    def record(self, x: torch.Tensor, out: torch.Tensor, c: dict) -> torch.Tensor:
        """The data prediction ``x - sigma v`` (k-diffusion's ``denoised``)."""
        return x - c["sigma"] * out


@register_kernel("dpmpp_2m_sde")
class DPMPP2MSDE(_DPMPPSDE):
    """k-diffusion's ``sample_dpmpp_2m_sde`` (module docstring): order 2, ``eta > 0``, ``s_noise > 0``, ``solver_type``
    ``midpoint`` or ``heun``; on any decreasing grid ending at 0."""

    columns = ("c_x", "c_x0", "c_h", "sigma", "std", "lsnr")
    order = 2
    run_options = ("eta", "s_noise", "solver_type")

    def __init__(self, sigmas, eps, eta: float = 1.0, s_noise: float = 1.0, solver_type: str = "midpoint"):
        super().__init__(sigmas, eps, eta, s_noise)
        if solver_type not in SOLVER_TYPES:
            raise ValueError(f"solver_type={solver_type!r} is invalid: must be one of {', '.join(SOLVER_TYPES)}")
        self.solver_type = solver_type

    def columns64(self, device) -> dict[str, torch.Tensor]:
        s0, s1, last, h, he, A, B, S = self.ve(device)
        r = torch.cat([h[:1], h[:-1]]) / h  # h of the step before over this step's (step 0: unread)
        E = 0.5 * B / r if self.solver_type == "midpoint" else (1.0 - B / he) / r
        later = (torch.arange(h.numel(), device=device) >= 1) & ~last
        E = torch.where(later, E, torch.zeros_like(E))
        return self.linear(s0, s1, A, B + E, S, {"c_h": -E})

    def mean(self, x, out, c, history=None):
        d = self.record(x, out, c)
        d1 = d if history is None else history[0]  # None (a draft's proposal): the first-order form
        return c["c_x"] * x + c["c_x0"] * d + c["c_h"] * d1


@register_kernel("dpmpp_3m_sde")
class DPMPP3MSDE(_DPMPPSDE):
    """k-diffusion's ``sample_dpmpp_3m_sde`` (module docstring): order 3, ``eta > 0``, ``s_noise > 0``; on any decreasing
    grid ending at 0."""

    columns = ("c_x", "c_x0", "c_h", "c_h2", "sigma", "std", "lsnr")
    order = 3

    def columns64(self, device) -> dict[str, torch.Tensor]:
        s0, s1, last, h, he, A, B, S = self.ve(device)
        step = torch.arange(h.numel(), device=device)
        h1 = torch.cat([h[:1], h[:-1]])  # the step before's h (step 0: unread)
        h2 = torch.cat([h[:2], h[:-2]])  # two steps before (steps 0, 1: unread)
        phi2 = 1.0 - B / he
        phi3 = phi2 / he - 0.5
        # second step (one earlier D): phi2 (D - D1) / r
        r = h1 / h
        second = (step == 1) & ~last
        # later steps (two earlier D): phi2 d1 - phi3 d2 = c0 (D - D1) / r0 + c1 (D1 - D2) / r1
        r0, r1 = h1 / h, h2 / h
        c0 = phi2 * (1.0 + r0 / (r0 + r1)) - phi3 / (r0 + r1)
        c1 = -phi2 * r0 / (r0 + r1) + phi3 / (r0 + r1)
        third = (step >= 2) & ~last
        zero = torch.zeros_like(h)
        on_d = torch.where(third, c0 / r0, torch.where(second, phi2 / r, zero))
        on_d1 = torch.where(third, -c0 / r0 + c1 / r1, torch.where(second, -phi2 / r, zero))
        on_d2 = torch.where(third, -c1 / r1, zero)
        return self.linear(s0, s1, A, B + on_d, S, {"c_h": on_d1, "c_h2": on_d2})

    def mean(self, x, out, c, history=None):
        d = self.record(x, out, c)
        d1, d2 = (d, d) if history is None else history
        return c["c_x"] * x + c["c_x0"] * d + c["c_h"] * d1 + c["c_h2"] * d2
