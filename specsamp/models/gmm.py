"""Isotropic Gaussian mixture target with its exact velocity (paper section 5.1).

Data law ``x0 ~ sum_i w_i N(mu_i, s_i^2 I_d)``. On the linear path ``x = (1 - sigma) x0 + sigma xi`` the
marginal is ``sum_i w_i N((1 - sigma) mu_i, v_i I)`` with ``v_i = (1 - sigma)^2 s_i^2 + sigma^2``, so

    E[x0 | x] = sum_i r_i(x) (mu_i + (1 - sigma) s_i^2 / v_i (x - (1 - sigma) mu_i)),
    v(x, sigma) = (x - E[x0 | x]) / sigma,

with posterior weights ``r_i`` computed in log space.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import ConfigError
from .base import Target, TargetConfig


class GaussianMixture:
    """Section 5.1 mixture: means ``U([-2, 2]^d)``, stds ``U([0.10, 0.25])``, equal weights.

    Args:
        dim: ``d >= 1``.
        components: number of components ``>= 1``.
        layout_seed: seed of the layout (means and stds), fixed across runs.
        mean_range: half-width ``a`` of ``U([-a, a]^d)``.
        std_range: ``(lo, hi)`` of the component stds.
        dtype: dtype of states and velocities.
        device: torch device.

    Raises:
        ValueError: ``dim`` or ``components`` below 1, or an empty std range.
    """

    def __init__(
        self,
        dim: int = 500,
        components: int = 5,
        layout_seed: int = 0,
        mean_range: float = 2.0,
        std_range: tuple[float, float] = (0.10, 0.25),
        dtype: torch.dtype = torch.float64,
        device: str | torch.device = "cpu",
    ):
        if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
            raise ValueError(f"model.dim={dim!r} is invalid: must be an integer >= 1")
        if isinstance(components, bool) or not isinstance(components, int) or components < 1:
            raise ValueError(f"model.components={components!r} is invalid: must be an integer >= 1")
        lo, hi = map(float, std_range)
        if not 0 < lo <= hi:
            raise ValueError(f"model.std_range={std_range!r} is invalid: need 0 < lo <= hi")
        g = torch.Generator().manual_seed(int(layout_seed))
        means = (torch.rand(components, dim, generator=g, dtype=torch.float64) * 2 - 1) * mean_range
        stds = lo + (hi - lo) * torch.rand(components, generator=g, dtype=torch.float64)
        self.event_shape = (dim,)
        self.dtype = dtype
        self.device = torch.device(device)
        self.means = means.to(device=self.device, dtype=dtype)
        self.stds = stds.to(device=self.device, dtype=dtype)
        self.log_weights = torch.full((components,), -math.log(components), dtype=dtype, device=self.device)
        # per-call constants, computed once (the same operations, so the same bits): s_i^2 [1, C], ||mu_i||^2 [1, C]
        self._var0 = self.stds[None, :] ** 2
        self._msq = (self.means**2).sum(1)[None]

    def _posterior(self, x: torch.Tensor, sigma: torch.Tensor):
        """Posterior weights ``r [b, C]``, marginal variances ``v [b, C]`` and ``alpha = 1 - sigma``."""
        x = x.reshape(x.shape[0], -1)
        sigma = sigma.to(x.dtype).reshape(-1, 1)
        alpha = 1.0 - sigma
        alpha2 = alpha**2
        var = alpha2 * self._var0 + sigma**2  # [b, C]
        # ||x - alpha mu_i||^2 = ||x||^2 - 2 alpha x.mu_i + alpha^2 ||mu_i||^2
        sq = (x * x).sum(1, keepdim=True) - 2 * alpha * (x @ self.means.T) + alpha2 * self._msq
        d = x.shape[1]
        logp = self.log_weights[None] - 0.5 * d * torch.log(2 * math.pi * var) - 0.5 * sq.clamp_min(0) / var
        return torch.softmax(logp, dim=1), var, alpha, x

    def denoise(self, x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        """Posterior mean ``E[x0 | x_sigma = x]``.

        Args:
            x: ``[b, d]``.
            sigma: ``[b]`` noise levels in ``[0, 1]``.

        Returns:
            ``[b, d]``.
        """
        r, var, alpha, xf = self._posterior(x, sigma)
        gain = alpha * self._var0 / var  # [b, C]
        # sum_i r_i (mu_i + gain_i (x - alpha mu_i)) = (r (1 - alpha gain)) @ mu + (r . gain) x
        coef = r * (1.0 - alpha * gain)
        out = coef @ self.means + (r * gain).sum(1, keepdim=True) * xf
        return out.reshape(x.shape)

    def __call__(self, x: torch.Tensor, sigma: torch.Tensor, **cond) -> torch.Tensor:
        """Exact velocity ``(x - E[x0 | x]) / sigma``.

        Args:
            x: ``[b, d]`` states.
            sigma: ``[b]`` noise levels in ``(0, 1]``.
            **cond: ignored (the mixture is unconditional).

        Returns:
            ``[b, d]`` velocities in ``x``'s dtype.
        """
        s = sigma.to(x.dtype).reshape((-1,) + (1,) * (x.ndim - 1))
        return (x - self.denoise(x, sigma)) / s

    def component(self, x0: torch.Tensor) -> torch.Tensor:
        """Index of the component with the highest posterior weight for a clean sample ``x0 [b, d]``."""
        sigma = torch.zeros(x0.shape[0], dtype=x0.dtype, device=x0.device)
        r, *_ = self._posterior(x0, sigma)
        return r.argmax(1)

    def sample(self, n: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """Exact draws from the data law ``[n, d]`` (for reference statistics)."""
        c = torch.multinomial(torch.exp(self.log_weights).cpu(), n, replacement=True, generator=generator)
        z = torch.randn(n, self.event_shape[0], generator=generator, dtype=torch.float64).to(self.device, self.dtype)
        c = c.to(self.device)
        return self.means[c] + self.stds[c, None] * z


@dataclass
class GMMConfig(TargetConfig):
    """``conf/model/gmm.yaml``: the section 5.1 mixture (keys as :class:`GaussianMixture`'s arguments)."""

    _target_: str = "specsamp.models.gmm.GMMConfig"
    dim: int = 500
    components: int = 5
    layout_seed: int = 0
    dtype: str = "float64"

    def size_from_config(self) -> tuple[str, float] | None:
        """The mixture's means and their construction: about four float64 ``[components, dim]`` arrays."""
        if isinstance(self.dim, int) and isinstance(self.components, int) and self.dim > 0 and self.components > 0:
            return (
                f"model.dim={self.dim}, model.components={self.components} (the mixture's means)",
                4.0 * 8 * self.dim * self.components,
            )
        return None

    def build(self, device: str) -> Target:
        """The mixture on ``device``; ConfigError for a bad ``dim``, ``components`` or ``dtype``."""
        try:
            return Target(
                GaussianMixture(self.dim, self.components, self.layout_seed, dtype=self.torch_dtype(), device=device)
            )
        except ValueError as e:
            raise ConfigError(str(e)) from None
