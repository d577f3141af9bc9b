"""Transition kernels: a reverse step's Gaussian ``N(mean, std^2 I)`` from per-step coefficients.

A kernel owns one step's coefficients on the run's noise grid: the mean as an affine map of the state ``x`` and
the network's output ``out`` (:meth:`Kernel.mean`), and the standard deviation (the ``std`` column). Everything
that writes a step (the standard sampler, the endpoint steps, the drafts, the speculative rounds' target means
and draft noise, the Picard sweeps) reads both from here: the coefficients as one table per device and dtype
(:meth:`Kernel.table`, ``[T, C]``, one row per step, one column per name in :attr:`Kernel.columns`), gathered by
step where a round needs them, so a round never recomputes a coefficient. Every kernel's columns include
``sigma`` (``sigma_n``, which the drafts read), ``lsnr`` (the half log-SNR ``log((1 - sigma) / sigma)`` in the
table's dtype, for the extrapolating drafts) and ``std``.

Adding a kernel is one subclass and a registration (``docs/extending.md``)::

    @register_kernel("mine")
    class Mine(Kernel):
        columns = ("c_x", "c_out", "sigma", "std", "lsnr")
        def columns64(self, device): ...      # float64 [T] per column, from self.sigmas and self.eps
        def mean(self, x, out, c): return c["c_x"] * x + c["c_out"] * out

:meth:`Kernel.mean` fixes its floating-point operations: the tables hold bit for bit what a per-step computation
would, and each kernel's ``mean`` is the one formula every caller runs, so the executions agree bitwise.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from .registry import Registry


def per_row(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """View ``t [m]`` as ``[m, 1, ..., 1]`` with ``like.ndim`` dimensions, to scale the rows of ``like``."""
    return t.reshape((-1,) + (1,) * (like.ndim - 1))


def lsnr(sigma: torch.Tensor) -> torch.Tensor:
    """Half log-SNR ``log((1 - sigma) / sigma)`` of the linear path; ``-inf`` at ``sigma = 1``."""
    return torch.log1p(-sigma) - torch.log(sigma)


class Kernel:
    """One step's Gaussian kernel on a noise grid ``sigmas [T + 1]`` with churn ``eps``.

    Subclasses set :attr:`columns` and implement :meth:`columns64` and :meth:`mean`; :meth:`table`, :meth:`coefs`
    and :meth:`named` follow from them.
    """

    name: ClassVar[str] = ""
    columns: ClassVar[tuple[str, ...]] = ()

    def __init__(self, sigmas: torch.Tensor, eps: float):
        self.sigmas, self.eps = sigmas, eps
        self.steps = sigmas.numel() - 1
        self._tables: dict = {}

    def col(self, name: str) -> int:
        """The column index of coefficient ``name`` in :meth:`table`."""
        return self.columns.index(name)

    def columns64(self, device) -> dict[str, torch.Tensor]:
        """Every coefficient but ``lsnr`` as float64 ``[T]`` on ``device``, indexed by step."""
        raise NotImplementedError

    def mean(self, x: torch.Tensor, out: torch.Tensor, c: dict) -> torch.Tensor:
        """The kernel mean at states ``x`` with the network's outputs ``out``; ``c`` maps each column to a tensor that
        broadcasts against ``x`` (the steps' coefficients, in ``x``'s dtype)."""
        raise NotImplementedError

    def table(self, device, dtype) -> torch.Tensor:
        """``[T, C]`` the :attr:`columns` in ``dtype`` on ``device`` (``lsnr`` computed in ``dtype`` from ``sigma``);
        built once per device and dtype."""
        key = (str(torch.device(device)), dtype)
        if key not in self._tables:
            f64 = self.columns64(device)
            cols = {k: v.to(dtype) for k, v in f64.items()}
            cols["lsnr"] = lsnr(cols["sigma"])
            self._tables[key] = torch.stack([cols[k] for k in self.columns], 1)
        return self._tables[key]

    def named(self, cols) -> dict:
        """``{column: tensor}`` from one tensor per column, in :attr:`columns` order, with ``kernel``: this kernel
        (what a draft's ``table_mean`` and :meth:`mean` are handed)."""
        out = dict(zip(self.columns, cols))
        out["kernel"] = self
        return out

    def coefs(self, n: torch.Tensor, like: torch.Tensor) -> dict:
        """The coefficients of steps ``n [s]`` for the rows of ``like [s, ...]``: one gather of :meth:`table`, each
        ``[s, 1, ..., 1]`` in ``like``'s dtype."""
        c = self.table(like.device, like.dtype)[n]  # [s, C]
        return self.named(c.reshape(c.shape[0], len(self.columns), *(1,) * (like.ndim - 1)).unbind(1))


KERNELS: Registry[type] = Registry("kernel")


def register_kernel(name: str):
    """Class decorator: register a :class:`Kernel` subclass as ``name``."""

    def deco(cls: type) -> type:
        cls.name = name
        return KERNELS.register(name, cls)

    return deco


def get_kernel(name: str) -> type:
    """A kernel class by registered name (or ``pkg.module:name``)."""
    return KERNELS.get(name)


@register_kernel("euler_maruyama")
class EulerMaruyama(Kernel):
    """The paper's Euler--Maruyama kernel on the linear path (appendix C.3, eqs. 36--37)::

        mean = x + dt (a v + b x),   dt = sigma_{n+1} - sigma_n,   a = 1 + eps^2,   b = eps^2 / (1 - sigma_n),
        std  = eps g sqrt(sigma_n - sigma_{n+1}),   g^2 = 2 sigma_n / (1 - sigma_n),

    the network's output ``v`` a velocity. ``a v + b x = v - eps^2 g^2 s / 2`` with the score
    ``s = -(x + (1 - sigma) v) / sigma``. Steps ``0`` and ``T - 1`` are plain Euler steps with no noise (``a = 1``,
    ``b = 0``, ``std = 0``).
    """

    columns = ("dt", "a", "b", "sigma", "std", "lsnr")

    def columns64(self, device) -> dict[str, torch.Tensor]:
        n = torch.arange(self.steps, device=device)
        sig = self.sigmas.to(device)
        s0, s1 = sig[n], sig[n + 1]
        stochastic = (n >= 1) & (n <= self.steps - 2)
        safe = torch.where(stochastic, 1.0 - s0, torch.ones_like(s0))
        a = torch.where(stochastic, torch.full_like(s0, 1.0 + self.eps**2), torch.ones_like(s0))
        b = torch.where(stochastic, self.eps**2 / safe, torch.zeros_like(s0))
        std = self.eps * torch.sqrt(2.0 * s0 / safe * (s0 - s1))
        std = torch.where(stochastic, std, torch.zeros_like(std))
        return {"dt": s1 - s0, "a": a, "b": b, "sigma": s0, "std": std}

    def mean(self, x: torch.Tensor, out: torch.Tensor, c: dict) -> torch.Tensor:
        return x + c["dt"] * (c["a"] * out + c["b"] * x)
