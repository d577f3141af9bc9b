"""Time grid and Euler--Maruyama kernel of the linear path (paper appendix C.3, eqs. 36--38).

Forward noise levels ``sigma`` live in ``[0, 1]`` with ``x_sigma = (1 - sigma) x0 + sigma xi``. Reverse
step ``n`` goes ``sigma_n -> sigma_{n+1}``. The grid is ``linspace(1, sigma_min, T)`` followed by 0
(``T + 1`` levels, ``T`` steps; diffusers' FlowMatchEuler layout), optionally shifted by eq. 38 before
the final 0 is appended.

The kernel of step ``n`` (paper appendix C.3, eqs. 36--37)::

    mean = x + (sigma_{n+1} - sigma_n) (v - eps^2 g^2 s / 2),   s = -(x + (1 - sigma) v) / sigma,
    g^2  = 2 sigma / (1 - sigma),   std = eps g sqrt(sigma_n - sigma_{n+1}),   sigma = sigma_n.

The first step (from ``sigma = 1``, where ``g`` is infinite) and the last (to ``sigma = 0``) are plain
Euler steps with no noise: no coupling exists there, so they lie outside speculation, which covers
steps ``1 .. T-2``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def per_row(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """View ``t [m]`` as ``[m, 1, ..., 1]`` with ``like.ndim`` dimensions, to scale the rows of ``like``."""
    return t.reshape((-1,) + (1,) * (like.ndim - 1))


def check_churn(eps: float) -> float:
    """Validate the churn ``eps`` in (0, 1].

    Raises:
        ValueError: ``eps`` outside (0, 1].
    """
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not (0.0 < float(eps) <= 1.0):
        raise ValueError(f"eps={eps!r} is invalid: the churn must lie in (0, 1] (eps=0 is the ODE, where speculation is vacuous)")
    return float(eps)


def shift_sigmas(sigma: torch.Tensor, shift: float) -> torch.Tensor:
    """Timestep shift of eq. 38: ``sigma -> kappa sigma / (1 + (kappa - 1) sigma)``.

    Raises:
        ValueError: ``shift <= 0``.
    """
    if not shift > 0:
        raise ValueError(f"shift={shift!r} is invalid: must be > 0 (1 means no shift)")
    return shift * sigma / (1.0 + (shift - 1.0) * sigma)


@dataclass(frozen=True)
class Schedule:
    """Noise grid and kernel of the Euler--Maruyama sampler.

    Attributes:
        sigmas: float64 ``[T + 1]``, decreasing from 1 to 0.
        eps: churn in (0, 1].
    """

    sigmas: torch.Tensor
    eps: float

    @classmethod
    def make(cls, steps: int, eps: float, shift: float = 1.0, sigma_min: float = 1e-3) -> Schedule:
        """Build the paper's grid: ``linspace(1, sigma_min, steps)``, shifted, then 0.

        Args:
            steps: ``T >= 3`` (the two deterministic endpoints plus at least one speculative step).
            eps: churn in (0, 1].
            shift: ``kappa`` of eq. 38 (1 = none; SD3 uses 3).
            sigma_min: last positive noise level.

        Raises:
            ValueError: ``steps < 3``, ``eps`` outside (0, 1], ``shift <= 0``, ``sigma_min`` not in (0, 1).
        """
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 3:
            raise ValueError(f"steps={steps!r} is invalid: need an integer >= 3 (two deterministic endpoints and at least one stochastic step)")
        eps = check_churn(eps)
        if not 0.0 < sigma_min < 1.0:
            raise ValueError(f"sigma_min={sigma_min!r} is invalid: must lie in (0, 1)")
        grid = torch.linspace(1.0, sigma_min, steps, dtype=torch.float64)
        grid = shift_sigmas(grid, shift)
        return cls(torch.cat([grid, grid.new_zeros(1)]), eps)

    @property
    def steps(self) -> int:
        """Number of steps ``T``."""
        return self.sigmas.numel() - 1

    @property
    def first_speculative(self) -> int:
        """First stochastic step index (1)."""
        return 1

    @property
    def end_speculative(self) -> int:
        """State index where speculation ends: ``T - 1`` (steps ``1 .. T-2`` are stochastic)."""
        return self.steps - 1

    def std(self, n: torch.Tensor) -> torch.Tensor:
        """Kernel std of step ``n`` (eq. 37): ``eps g(sigma_n) sqrt(sigma_n - sigma_{n+1})``; 0 at the endpoints.

        Args:
            n: long tensor of step indices in ``[0, T-1]``.

        Returns:
            float64 tensor like ``n``.
        """
        s0 = self.sigmas.to(n.device)[n]
        s1 = self.sigmas.to(n.device)[n + 1]
        stochastic = (n >= 1) & (n <= self.steps - 2)
        g2 = 2.0 * s0 / torch.where(stochastic, 1.0 - s0, torch.ones_like(s0))
        out = self.eps * torch.sqrt(g2 * (s0 - s1))
        return torch.where(stochastic, out, torch.zeros_like(out))

    def tables(self, device) -> dict[str, torch.Tensor]:
        """Per-step coefficient tables of the kernel, float64 ``[T]`` on ``device``, indexed by step ``n``.

        Keys: ``sigma`` (``sigma_n``), ``dt`` (``sigma_{n+1} - sigma_n``), ``a`` and ``b`` (the mean is
        ``x + dt (a v + b x)``, eq. 36), ``std`` (eq. 37). Each entry equals, bit for bit, what
        :meth:`mean` and :meth:`std` compute for that step, so a sampler can gather a round's
        coefficients once instead of recomputing them per call.
        """
        n = torch.arange(self.steps, device=device)
        sig = self.sigmas.to(device)
        s0, s1 = sig[n], sig[n + 1]
        stochastic = (n >= 1) & (n <= self.steps - 2)
        a = torch.where(stochastic, torch.full_like(s0, 1.0 + self.eps**2), torch.ones_like(s0))
        b = torch.where(stochastic, self.eps**2 / torch.where(stochastic, 1.0 - s0, torch.ones_like(s0)), torch.zeros_like(s0))
        return {"sigma": s0, "dt": s1 - s0, "a": a, "b": b, "std": self.std(n)}

    def mean(self, x: torch.Tensor, v: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        """Kernel mean of step ``n`` at state ``x`` with velocity ``v`` (eq. 36); Euler at the endpoints.

        Args:
            x: ``[b, *event]`` states at noise level ``sigma_n``.
            v: ``[b, *event]`` velocities at ``x``.
            n: long ``[b]`` step indices.

        Returns:
            ``[b, *event]`` in ``x``'s dtype.
        """
        sig = self.sigmas.to(x.device)
        s0 = sig[n]
        s1 = sig[n + 1]
        stochastic = (n >= 1) & (n <= self.steps - 2)
        # v - eps^2 g^2 s / 2 = v + eps^2 (x + (1 - sigma) v) / (1 - sigma) = (1 + eps^2) v + eps^2 x / (1 - sigma)
        a = torch.where(stochastic, torch.full_like(s0, 1.0 + self.eps**2), torch.ones_like(s0))
        b = torch.where(stochastic, self.eps**2 / torch.where(stochastic, 1.0 - s0, torch.ones_like(s0)), torch.zeros_like(s0))
        dt, a, b = (per_row(t.to(x.dtype), x) for t in (s1 - s0, a, b))
        return x + dt * (a * v + b * x)
