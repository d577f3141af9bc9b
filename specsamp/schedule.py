"""Time grid of the linear path and its transition kernel (paper appendix C.3, eqs. 36--38).

Forward noise levels ``sigma`` live in ``[0, 1]`` with ``x_sigma = (1 - sigma) x0 + sigma xi``. Reverse
step ``n`` goes ``sigma_n -> sigma_{n+1}``. The grid is ``linspace(1, sigma_min, T)`` followed by 0
(``T + 1`` levels, ``T`` steps; diffusers' FlowMatchEuler layout), optionally shifted by eq. 38 before
the final 0 is appended.

The kernel (:mod:`specsamp.kernels`; :attr:`Schedule.kernel`, by default the Euler--Maruyama kernel) of step
``n`` (paper appendix C.3, eqs. 36--37)::

    mean = x + (sigma_{n+1} - sigma_n) (v - eps^2 g^2 s / 2),   s = -(x + (1 - sigma) v) / sigma,
    g^2  = 2 sigma / (1 - sigma),   std = eps g sqrt(sigma_n - sigma_{n+1}),   sigma = sigma_n.

The first step (from ``sigma = 1``, where ``g`` is infinite) and the last (to ``sigma = 0``) are plain
Euler steps with no noise: no coupling exists there, so they lie outside speculation, which covers
steps ``1 .. T-2``. The schedulers' kernels (``ddpm``, ``euler_ancestral``, ``flow_stochastic``: a
grid from :mod:`specsamp.integrations.schedulers`) keep that split; their step 0 is an ancestral step with
noise (:attr:`Schedule.stochastic_endpoints`), and their first state is the scheduler's initial noise
(:meth:`Schedule.initial_scale`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from .kernels import Kernel, get_kernel, per_row  # noqa: F401  (per_row: public here)


def check_churn(eps: float) -> float:
    """Validate the churn ``eps`` in (0, 1].

    Raises:
        ValueError: ``eps`` outside (0, 1].
    """
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not (0.0 < float(eps) <= 1.0):
        raise ValueError(
            f"eps={eps!r} is invalid: the churn must lie in (0, 1] (eps=0 is the ODE, where speculation is vacuous)"
        )
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
        kernel_name: the registered transition kernel (:mod:`specsamp.kernels`).
        kernel_options: keyword arguments of the kernel's constructor (a scheduler's options: DDPM's
            ``variance_type``, Euler ancestral's ``eta``, ``clip``, ...); empty for Euler--Maruyama.
    """

    sigmas: torch.Tensor
    eps: float
    kernel_name: str = "euler_maruyama"
    kernel_options: dict = field(default_factory=dict)

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
            raise ValueError(
                f"steps={steps!r} is invalid: need an integer >= 3 (two deterministic endpoints and at least one stochastic step)"
            )
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

    @functools.cached_property
    def kernel(self) -> Kernel:
        """The run's transition kernel (:mod:`specsamp.kernels`, registered as :attr:`kernel_name`) on this grid:
        it owns every step's coefficients (mean and std)."""
        return get_kernel(self.kernel_name)(self.sigmas, self.eps, **self.kernel_options)

    @property
    def stochastic_endpoints(self) -> bool:
        """Whether the kernel may add noise at the two steps outside speculation (step 0 and ``T - 1``): the
        schedulers' kernels do (their first step is an ancestral step), Euler--Maruyama's endpoints are Euler steps."""
        return bool(getattr(self.kernel, "stochastic_endpoints", False))

    def initial_scale(self) -> float | None:
        """The initial state is ``scale * xi`` on the linear path (a scheduler's start, e.g. DDPM's
        ``xi / (alpha + sigma_vp)``); None: ``xi`` itself (Euler--Maruyama from ``sigma = 1``)."""
        return getattr(self.kernel, "init_scale", None)

    def std(self, n: torch.Tensor) -> torch.Tensor:
        """Kernel std of step ``n`` (eq. 37): ``eps g(sigma_n) sqrt(sigma_n - sigma_{n+1})``; 0 at the endpoints.

        Args:
            n: long tensor of step indices in ``[0, T-1]``.

        Returns:
            float64 tensor like ``n``.
        """
        return self.kernel.table(n.device, torch.float64)[n, self.kernel.col("std")]

    def tables(self, device) -> dict[str, torch.Tensor]:
        """Per-step coefficient columns of the kernel, float64 ``[T]`` on ``device``, indexed by step n
        (:meth:`specsamp.kernels.Kernel.columns64`; for Euler--Maruyama ``sigma``, ``dt``, ``a``, ``b``, ``std``)."""
        return self.kernel.columns64(device)

    def mean(self, x: torch.Tensor, v: torch.Tensor, n: torch.Tensor, history: tuple | None = None) -> torch.Tensor:
        """Kernel mean of step ``n`` at state ``x`` with velocity ``v`` (eq. 36); Euler at the endpoints.

        Args:
            x: ``[b, *event]`` states at noise level ``sigma_n``.
            v: ``[b, *event]`` velocities at ``x``.
            n: long ``[b]`` step indices.
            history: a multistep kernel's earlier records (:meth:`specsamp.kernels.Kernel.mean`: ``order - 1``
                tensors ``[b, *event]``, most recent first; None: none known); not passed to an order-1 kernel.

        Returns:
            ``[b, *event]`` in ``x``'s dtype.
        """
        c = self.kernel.coefs(n, x)
        if self.kernel.order == 1:
            return self.kernel.mean(x, v, c)
        return self.kernel.mean(x, v, c, history)

    def record(self, x: torch.Tensor, v: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        """What later steps of a multistep kernel read of step ``n`` at ``x [b, *event]`` with velocity ``v``
        (:meth:`specsamp.kernels.Kernel.record`), ``[b, *event]``."""
        return self.kernel.record(x, v, self.kernel.coefs(n, x))
