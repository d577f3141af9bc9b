"""Marked-maximum list coupling ("markmax"): an exact K-child coupling close to the list bound.

Setting (after the rank-1 projection of section 3.1): the children's projections ``s_1..s_K`` are
i.i.d. ``N(0, 1)`` with density ``phi``, the target projection is ``N(delta, 1)`` with density
``q(y) = phi(y - delta)``, and ``rho = q / phi = exp(delta y - delta^2 / 2)``. Write ``Phi`` for the
normal CDF, ``Q(y) = Phi(y - delta)`` and ``f_M = K phi Phi^(K-1)`` for the density of the largest child.

Why not D-GRS. No exact coupling accepts more often than ``alpha*_K = 1 - R`` with
``R = max_c [Phi(c)^K - Phi(c - delta)]`` (:func:`specsamp.theory.list_coupling_bound`). The bound is
attained only by a rule that (i) accepts the *largest* child whenever it lies above the maximiser
``c`` and (ii) serves the whole target mass below ``c``. D-GRS looks at the children in drafting
order and does neither, so it sits well below the bound (delta = 1, K = 4: 0.798 vs 0.924).

The rule. ``c`` is the upper crossing of ``f_M`` and ``q`` (the maximiser above; found by bisection,
the log-ratio ``log K + (K - 1) log Phi(y) - delta y + delta^2 / 2`` being concave). Fix a share
``t in [0, 1]`` and put ``A = Phi(c)^K - t Q(c)`` (``= R + (1 - t) Q(c)``).

1. *Marking.* Each child is marked independently with probability
   ``kappa(y) = 1`` for ``y > c`` and ``kappa(y) = t rho(y) / (K V(y)^(K-1))`` for ``y <= c``, where
   ``V(y)^K = A + t Q(y)``. If any child is marked, accept the marked child with the largest
   projection.
2. *GRS on the unmarked.* If none is marked, run greedy rejection sampling (Algorithm 3 / Flamich
   and Theis, 2023) over the children in drafting order, with their conditional law and the
   remaining target as below; if it rejects all of them, draw from its residual.

Proof of exactness.

* Highest marked child. A child at ``y`` is returned in step 1 iff it is marked and no other child
  is marked above ``y``; the children and their marks are independent, so the returned density is
  ``K phi(y) kappa(y) V(y)^(K-1)`` with ``V(y) = 1 - int_y^inf kappa phi = P(a child is not marked
  above y)``. Above ``c`` every child is marked, so ``V = Phi`` and the density is ``f_M``. Below
  ``c``, ``d V^K / dy = K V^(K-1) kappa phi = t q`` and ``V(c)^K = Phi(c)^K = A + t Q(c)``, which gives
  the stated ``V^K = A + t Q`` and a returned density of exactly ``t q``.
* No mark. This event has probability ``V(-inf)^K = A``; given it, the children are still i.i.d.
  (marks are independent per child), with density ``p~ = phi (1 - kappa) / A^(1/K)``, supported on
  ``y <= c``. The mass still owed to the target is ``r = (1 - t) q`` on ``y <= c`` plus ``q - f_M``
  on ``y > c``; the latter is ``>= 0`` because ``log(f_M / q)`` has a decreasing derivative
  ``(K - 1) phi / Phi - delta``, so ``f_M / q`` is unimodal and ``f_M < q`` beyond its upper crossing
  ``c``. Its total is ``(1 - t) Q(c) + R = A``, so ``r / A`` is a probability law and GRS with
  proposal ``p~`` and target ``r / A`` returns an exact draw from it (its part above ``c``, where
  ``p~ = 0``, only through the residual).
* Sum: ``t q 1{y <= c} + f_M 1{y > c} + A (r / A) = q``.
* Orthogonal parts (eqs. 13--15) are i.i.d. and independent of every projection; the choices use
  only projections and independent uniforms, so the returned child keeps an ``N(0, I - e e^T)``
  orthogonal part, and the residual uses child 0's, which is independent of all the choices.

The proof needs ``0 <= kappa <= 1`` and, for GRS's level sets ``{w >= lam}`` to be the intervals
``[y_lam, c]`` used below, an increasing ratio ``w = (1 - t) rho / (1 - kappa)`` on ``y <= c``
(``d log w / dy = delta - (K - 1) / K kappa z`` with ``z = t q / V^K``). ``t = 0`` (plain GRS below
``c``, the largest child above it) always qualifies. :func:`feasible` certifies a given ``t`` with
monotonicity bounds only (no grid): ``z = phi(s) / (A / t + Phi(s))`` is unimodal in ``s = y - delta``,
so ``kappa`` increases, decreases on the interval where ``z > K delta / (K - 1)``, then increases,
and on that interval ``kappa z`` is bounded piecewise by its values at the piece ends.
:func:`share` takes the largest certified ``t`` (acceptance grows with ``t``; bisection on ``t``,
cached per delta-bin and re-certified at each row's own ``delta``); where D-GRS would still accept more
(and for ``delta < 1e-6``), :func:`markmax` hands the row to D-GRS. Both choices depend on ``delta``
and ``K`` only, so the mixture is exact.

Acceptance. ``1 - Gamma_{K+1}`` where ``Gamma_1 = A`` and GRS's remaining masses, in unconditional
units (``Gamma_k = A G_k``, ``mu_k = lambda_k A^((K-1)/K)``), follow
``mu_k = mu_{k-1} + Gamma_k / A^(1/K)`` and
``Gamma_{k+1} = (1 - t)(Q(c) - Q(y_k)) + R - mu_k (V(y_k) - Phi(y_k))`` with ``w(y_k) = mu_k``. At
``t = 1`` the acceptance is ``1 - R = alpha*_K``: the bound is attained whenever ``t = 1`` is feasible,
which holds for moderate and large ``delta`` (e.g. ``delta >= 1`` for ``K <= 16``). Acceptance by
drafting index: the highest marked child is exchangeable and GRS is not, so
``P(J = k) = (1 - A) / K + Gamma_k - Gamma_{k+1}``.

Numerics: every scalar is float64 and kept in log space where it can underflow (``R``, tails of
``Phi^K``); no loop is unbounded: roots are found by bisection or by bracket-safeguarded Newton steps
with fixed step counts. GRS's masses are stationary in the level roots ``y_k`` (the integrand
``(1 - t) q - mu phi (1 - kappa)`` vanishes there), so root errors enter only to second order. The
parameter searches work on ``[-40, min(c, delta + 40)]``: outside it both laws have mass below 1e-300.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from .coupling import Verdict, grs_levels, grs_select, log_sf, project, reconstruct, register_coupling, uniform_rows

Y_LO = -40.0  # projections below this have probability < 1e-349; parameter searches start here
Y_SPAN = 40.0  # ... and stop at delta + Y_SPAN (target mass above it < 1e-349)
ROOT_STEPS = 64  # bisection steps for parameter roots (brackets at most ~1e7 wide: 1e-12 precision)
CERT_STEPS = 48  # bisection steps in the certificate (its brackets are taken on the safe side)
SAMPLE_STEPS = 64  # bisection steps for residual inversion (as in coupling.sample_grs_residual)
LEVEL_GRID = 24  # grid points locating GRS's level roots before Newton refinement
NEWTON_STEPS = 10  # safeguarded Newton steps per level root
SHARE_STEPS = 12  # bisection steps on the share t (resolution 2^-12), see share
KEY_STEPS = 64  # delta -> cache key round(64 log2 delta): delta-bins about 1% wide
PIECES = 32  # pieces per monotone stretch in the certificate of feasible()
DGRS_MARGIN = 1e-12  # D-GRS takes a row only when it accepts more by this much (not on rounding noise)
DELTA_MIN = 1e-6  # below this every row goes to D-GRS (both accept 1 - O(delta) there)
_LOG_2PI_HALF = 0.5 * math.log(2.0 * math.pi)


def _log_phi(x: torch.Tensor) -> torch.Tensor:
    return -0.5 * x * x - _LOG_2PI_HALF


def _log_cdf(x: torch.Tensor) -> torch.Tensor:
    return torch.special.log_ndtr(x)


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """``log(1 - exp(x))`` for ``x <= 0`` (``-inf`` at 0), accurate in both regimes."""
    x = x.clamp(max=0.0)
    return torch.where(x > -0.6931471805599453, torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def log_one_minus_cdf_pow(y: torch.Tensor, K: int) -> torch.Tensor:
    """``log(1 - Phi(y)^K)``, accurate for every ``y`` (float64).

    For ``y < 0`` it uses ``log Phi``; for ``y >= 0`` it works from ``log Phibar(y)``, and where
    ``K Phibar(y) < 1e-10`` it uses ``log K + log Phibar(y) + log1p(-(K - 1) Phibar(y) / 2)`` (the
    first terms of ``1 - (1 - x)^K``), which stays finite after ``Phibar`` underflows.
    """
    x = log_sf(y)  # log Phibar(y)
    log_cdf = torch.where(y < 0, _log_cdf(y), torch.log1p(-torch.exp(x)))
    exact = _log1mexp(K * log_cdf)
    small = (x + math.log(K) < -23.0) & (y > 0)
    approx = math.log(K) + x + torch.log1p(-0.5 * (K - 1) * torch.exp(x))
    return torch.where(small, approx, exact)


def _bracket(right_of, lo: torch.Tensor, hi: torch.Tensor, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Shrink ``[lo, hi]`` around the switch of a monotone predicate by ``steps`` bisections.

    ``right_of(x)`` is True where the root lies above ``x``. Returns the final ``(lo, hi)``.
    """
    for _ in range(steps):
        mid = 0.5 * (lo + hi)
        r = right_of(mid)
        lo = torch.where(r, mid, lo)
        hi = torch.where(r, hi, mid)
    return lo, hi


def _bisect(right_of, lo: torch.Tensor, hi: torch.Tensor, steps: int) -> torch.Tensor:
    """Midpoint of :func:`_bracket`."""
    lo, hi = _bracket(right_of, lo, hi, steps)
    return 0.5 * (lo + hi)


def crossing(delta: torch.Tensor, K: int) -> torch.Tensor:
    """Upper crossing ``c`` of ``f_M = K phi Phi^(K-1)`` and ``q = phi(. - delta)``; it maximises
    ``Phi(c)^K - Phi(c - delta)``.

    ``h(y) = log K + (K - 1) log Phi(y) - delta y + delta^2 / 2 = log(f_M / q)`` is concave (its
    derivative ``(K - 1) phi / Phi - delta`` decreases), positive at its maximiser ``y_h`` (two
    different densities must cross) and negative beyond ``delta / 2 + log K / delta``; ``c`` is its root
    right of ``y_h``, returned as the upper end of the final bisection bracket so that ``h(c) <= 0``
    holds exactly. ``K = 1``: ``c = delta / 2``.

    Args:
        delta: float64 ``[n]``, ``>= DELTA_MIN``.
        K: children per parent.

    Returns:
        float64 ``[n]``.
    """
    if K == 1:
        return 0.5 * delta
    log_k = math.log(K)
    # maximiser of h: (K - 1) phi(y) / Phi(y) = delta; phi/Phi >= -y for y < 0 and <= 2 phi(y) for y >= 0
    lo = -delta / (K - 1) - 1.0
    hi = torch.sqrt(2.0 * torch.log((2.0 * (K - 1) / (delta * math.sqrt(2.0 * math.pi))).clamp_min(1.0))) + 1.0
    log_target = torch.log(delta / (K - 1))
    y_h = _bisect(lambda y: _log_phi(y) - _log_cdf(y) > log_target, lo, hi, ROOT_STEPS)

    def h(y):
        return log_k + (K - 1) * _log_cdf(y) - delta * y + 0.5 * delta * delta

    top = 0.5 * delta + log_k / delta + 1.0
    _, c = _bracket(lambda y: h(y) > 0, y_h, torch.maximum(top, y_h), ROOT_STEPS)
    return c


def log_bound_gap(delta: torch.Tensor, K: int, c: torch.Tensor) -> torch.Tensor:
    """``log R``, ``R = Phi(c)^K - Phi(c - delta) = Phibar(c - delta) - (1 - Phi(c)^K)``, from the tails."""
    log_t1 = log_sf(c - delta)
    log_t2 = log_one_minus_cdf_pow(c, K)
    return log_t1 + _log1mexp(torch.clamp(log_t2 - log_t1, max=0.0))


@dataclass
class MarkMaxParams:
    """Per-row parameters of the marked-maximum rule (float64 ``[n]`` tensors, ``K`` an int).

    Attributes:
        delta: standardised displacement.
        K: children per parent.
        c: upper crossing of ``f_M`` and ``q`` (:func:`crossing`).
        log_R: ``log(Phi(c)^K - Phi(c - delta))``; ``1 - R`` is the list bound ``alpha*_K``.
        t: share of the target below ``c`` served by the highest marked child.
        log_A: ``log(R + (1 - t) Phi(c - delta))``, log-probability that no child is marked.
    """

    delta: torch.Tensor
    K: int
    c: torch.Tensor
    log_R: torch.Tensor
    t: torch.Tensor
    log_A: torch.Tensor

    def rows(self, idx: torch.Tensor) -> MarkMaxParams:
        """The parameters of rows ``idx``."""
        return MarkMaxParams(self.delta[idx], self.K, self.c[idx], self.log_R[idx], self.t[idx], self.log_A[idx])


def make_params(delta: torch.Tensor, K: int, t: torch.Tensor, c=None, log_R=None) -> MarkMaxParams:
    """Assemble :class:`MarkMaxParams` for displacements ``delta`` and shares ``t`` (float64 ``[n]``)."""
    if c is None:
        c = crossing(delta, K)
    if log_R is None:
        log_R = log_bound_gap(delta, K, c)
    log_A = torch.logaddexp(torch.log1p(-t) + _log_cdf(c - delta), log_R)
    return MarkMaxParams(delta=delta, K=K, c=c, log_R=log_R, t=t, log_A=log_A)


@dataclass
class _At:
    """The rule's functions at points ``y`` (``[n]`` or ``[n, m]``), from one ``log_ndtr`` call."""

    log_vk: torch.Tensor  # log V(y)^K = log(A + t Q(y))            (y <= c)
    log_kappa: torch.Tensor  # log marking probability (0 above c)
    log_ratio: torch.Tensor  # log((1 - t) rho / (1 - kappa))    (y <= c)
    log_z: torch.Tensor  # log(t q / V^K) = d log V^K / dy          (y <= c)


def _at(y: torch.Tensor, p: MarkMaxParams) -> _At:
    shape = p.delta.shape + (1,) * (y.ndim - p.delta.ndim)
    d = p.delta.reshape(shape)
    log_t = torch.log(p.t).reshape(shape)
    log_rho = d * y - 0.5 * d * d
    lvk = torch.logaddexp(p.log_A.reshape(shape), log_t + _log_cdf(y - d))
    below = log_t + log_rho - math.log(p.K) - (p.K - 1) / p.K * lvk
    lk = torch.where(y > p.c.reshape(shape), torch.zeros_like(y), below)
    lr = torch.log1p(-p.t).reshape(shape) + log_rho - _log1mexp(lk)
    lz = log_t + _log_phi(y - d) - lvk
    return _At(lvk, lk, lr, lz)


def _log_z(y: torch.Tensor, p: MarkMaxParams) -> torch.Tensor:
    """``log z = log(t q / V^K)`` alone (the certificate's bisections need nothing else)."""
    shape = p.delta.shape + (1,) * (y.ndim - p.delta.ndim)
    d = p.delta.reshape(shape)
    log_t = torch.log(p.t).reshape(shape)
    return log_t + _log_phi(y - d) - torch.logaddexp(p.log_A.reshape(shape), log_t + _log_cdf(y - d))


def log_kappa(y: torch.Tensor, p: MarkMaxParams) -> torch.Tensor:
    """log marking probability at projections ``y`` (``[n]`` or ``[n, m]``): 0 above ``c``, else
    ``log(t rho / (K V^(K-1)))``."""
    return _at(y, p).log_kappa


def log_ratio(y: torch.Tensor, p: MarkMaxParams) -> torch.Tensor:
    """``log((1 - t) rho / (1 - kappa))`` at ``y <= c``: GRS's ratio on the unmarked, in ``mu`` units."""
    return _at(y, p).log_ratio


def feasible(p: MarkMaxParams) -> torch.Tensor:
    """Certify ``0 <= kappa <= 1`` and an increasing GRS ratio on ``[Y_LO, c]`` (bool ``[n]``).

    ``d log kappa / dy = delta - (K - 1) / K z`` and ``d log w / dy = delta - (K - 1) / K kappa z``.
    ``z(y) = phi(s) / (a + Phi(s))`` (``s = y - delta``, ``a = A / t``) is unimodal: the sign of its
    derivative is that of ``-s (a + Phi(s)) - phi(s)``, whose own derivative is ``-(a + Phi(s)) < 0``.
    So ``{z > theta}`` with ``theta = K delta / (K - 1)`` is an interval ``(y_a, y_b)`` around the mode
    ``y_m`` (bracketed outwards); outside it ``kappa`` increases and ``(K - 1) / K kappa z <= kappa
    delta``, so ``kappa(y_a) <= 1`` and ``kappa(c) <= 1`` suffice there. Inside, ``kappa`` decreases;
    on ``[y_a, y_m]`` ``z`` increases, so on a piece ``[l, r]``, ``kappa z <= kappa(l) z(r)``; on
    ``[y_m, y_b]`` both decrease and ``kappa z <= kappa(l) z(l)``. The certificate asks
    ``(K - 1) / K max(bounds) <= delta``. Sufficient, not necessary: a rejected ``t`` is just not used.

    Args:
        p: parameters; ``t == 0`` is always feasible, ``t == 1`` needs only ``kappa <= 1``.

    Returns:
        bool ``[n]``.
    """
    K, t, delta, c = p.K, p.t, p.delta, p.c
    if K == 1:  # kappa = t rho <= t rho(c) = t: increasing, and the ratio's slope is delta
        return torch.ones_like(t, dtype=torch.bool)
    pos = t > 0
    q = MarkMaxParams(delta, K, c, p.log_R, torch.where(pos, t, torch.ones_like(t)), p.log_A)
    log_a = p.log_A - torch.log(q.t)

    def w_pos(s):  # sign of -s (a + Phi(s)) - phi(s), in logs (a may underflow)
        return (s < 0) & (torch.log(torch.clamp(-s, min=1e-300)) + torch.logaddexp(log_a, _log_cdf(s)) > _log_phi(s))

    s_lo = torch.minimum(Y_LO - delta, torch.full_like(delta, Y_LO))
    s_m = _bisect(w_pos, s_lo, torch.zeros_like(delta), CERT_STEPS)
    y_lo = torch.full_like(delta, Y_LO)
    y_m = torch.minimum(torch.clamp(s_m + delta, min=Y_LO), c)
    log_theta = math.log(K / (K - 1)) + torch.log(delta)
    has = _log_z(y_m, q) > log_theta
    # bracket ends outside the interval: z <= theta at y_a (z increasing left of y_m), at y_b (decreasing)
    y_a, _ = _bracket(lambda y: _log_z(y, q) <= log_theta, y_lo, y_m, CERT_STEPS)
    _, y_b = _bracket(lambda y: _log_z(y, q) > log_theta, y_m, c, CERT_STEPS)
    ok_kappa = (_at(y_a, q).log_kappa <= 1e-12) & (_at(c, q).log_kappa <= 1e-12)
    frac = torch.linspace(0.0, 1.0, PIECES + 1, dtype=torch.float64, device=delta.device)[None]
    left = _at(y_a[:, None] + (y_m - y_a)[:, None] * frac, q)
    right = _at(y_m[:, None] + (y_b - y_m)[:, None] * frac, q)
    b1 = (left.log_kappa[:, :-1] + left.log_z[:, 1:]).amax(1)
    b2 = (right.log_kappa[:, :-1] + right.log_z[:, :-1]).amax(1)
    bound = torch.maximum(b1, b2) + math.log((K - 1) / K)
    ok_ratio = ~has | (bound <= torch.log(delta)) | (t >= 1)
    return (ok_kappa & ok_ratio & torch.isfinite(p.log_A)) | ~pos


@dataclass
class GRSLevels:
    """GRS over the unmarked children, in unconditional units (float64).

    Attributes:
        mu: ``[n, K + 1]``: ``mu_0 = 0 .. mu_K`` (``lambda_k A^((K-1)/K)``).
        gamma: ``[n, K + 1]``: ``Gamma_1 = A .. Gamma_{K+1}`` (``A G_k``, remaining target mass).
        y: ``[n, K + 1]``: ``y_k``, the lower end of ``H_k = {w >= mu_k} = [y_k, c]`` (``y_0 = Y_LO``).
    """

    mu: torch.Tensor
    gamma: torch.Tensor
    y: torch.Tensor


def _owed_above(y: torch.Tensor, p: MarkMaxParams, mu: torch.Tensor) -> torch.Tensor:
    """``int_y^c [(1 - t) q - mu phi (1 - kappa)] = (1 - t)(Q(c) - Q(y)) - mu (V(y) - Phi(y))``."""
    shape = p.delta.shape + (1,) * (y.ndim - p.delta.ndim)
    d, c = p.delta.reshape(shape), p.c.reshape(shape)
    qdiff = (torch.exp(_log_cdf(c - d)) - torch.exp(_log_cdf(y - d))).clamp_min(0.0)
    v = torch.exp(_at(y, p).log_vk / p.K)
    vdiff = (v - torch.exp(_log_cdf(y))).clamp_min(0.0)
    return (1.0 - p.t.reshape(shape)) * qdiff - mu.reshape(shape) * vdiff


def _level_root(p: MarkMaxParams, grid_y, grid_lr, log_m) -> torch.Tensor:
    """``y`` with ``log w(y) = log_m`` (``w`` increasing): grid cell, then safeguarded Newton steps."""
    G = grid_y.shape[1]
    cnt = (grid_lr < log_m[:, None]).sum(1)
    i_hi = cnt.clamp(1, G - 1)
    lo = grid_y.gather(1, (i_hi - 1)[:, None])[:, 0]
    hi = grid_y.gather(1, i_hi[:, None])[:, 0]
    f_lo = grid_lr.gather(1, (i_hi - 1)[:, None])[:, 0] - log_m
    f_hi = grid_lr.gather(1, i_hi[:, None])[:, 0] - log_m
    frac = (-f_lo / (f_hi - f_lo)).nan_to_num(0.5).clamp(0.0, 1.0)
    y = lo + frac * (hi - lo)
    K = p.K
    inner = (cnt > 0) & (cnt < G)
    for _ in range(NEWTON_STEPS if bool(inner.any()) else 0):
        at = _at(y, p)
        f = at.log_ratio - log_m
        lo = torch.where(f < 0, y, lo)
        hi = torch.where(f > 0, y, hi)
        kap = torch.exp(at.log_kappa.clamp(max=0.0))
        slope = p.delta + kap / (1.0 - kap).clamp_min(1e-300) * (p.delta - (K - 1) / K * torch.exp(at.log_z))
        step = torch.where(f == 0, y, y - f / slope)
        inside = torch.isfinite(step) & (step >= lo) & (step <= hi)
        y = torch.where(inside, step, 0.5 * (lo + hi))
    y = torch.where(cnt == 0, grid_y[:, 0], y)  # ratio >= mu on the whole grid
    return torch.where(cnt == G, p.c, y)  # ratio < mu on the grid: H_k holds no mass below c


def grs_on_unmarked(p: MarkMaxParams) -> GRSLevels:
    """Levels and remaining masses of GRS over the unmarked children (module docstring).

    Requires :func:`feasible` parameters (increasing ratio ``w``), so ``H_k = [y_k, c]`` plus the part
    above ``c``: ``mu_k = mu_{k-1} + Gamma_k / A^(1/K)``, ``Gamma_{k+1} = (owed above y_k) + R``.

    Returns:
        :class:`GRSLevels`.
    """
    K = p.K
    A = torch.exp(p.log_A)
    R = torch.exp(p.log_R)
    inv_root = torch.exp(-p.log_A / K).nan_to_num(0.0, posinf=0.0)  # A^(-1/K); A = 0 never reaches GRS
    top = torch.clamp(torch.minimum(p.c, p.delta + Y_SPAN), min=Y_LO)
    frac = torch.linspace(0.0, 1.0, LEVEL_GRID, dtype=torch.float64, device=A.device)[None]
    grid_y = torch.minimum(Y_LO + (top - Y_LO)[:, None] * frac, top[:, None])
    grid_lr = _at(grid_y, p).log_ratio
    full = p.t >= 1  # nothing owed below c: every H_k is the part above c
    mu, gam, ys = [torch.zeros_like(A)], [A], [torch.full_like(A, Y_LO)]
    for _ in range(K):
        m = mu[-1] + gam[-1] * inv_root
        yk = p.c if bool(full.all()) else torch.where(full, p.c, _level_root(p, grid_y, grid_lr, torch.log(m)))
        g = _owed_above(yk, p, m) + R
        g = torch.minimum(torch.maximum(g, R), gam[-1])
        mu.append(m)
        gam.append(g)
        ys.append(yk)
    return GRSLevels(mu=torch.stack(mu, -1), gamma=torch.stack(gam, -1), y=torch.stack(ys, -1))


def acceptance_and_positional(p: MarkMaxParams, lev: GRSLevels | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Acceptance ``1 - Gamma_{K+1}`` and ``P(J = k) = (1 - A) / K + Gamma_k - Gamma_{k+1}``.

    Args:
        p: certified parameters (:func:`feasible`).
        lev: their :func:`grs_on_unmarked` levels, if already computed.

    Returns:
        ``(acceptance [n], positional [n, K])``, float64; positional rows sum to the acceptance.
    """
    if lev is None:
        lev = grs_on_unmarked(p)
    A = torch.exp(p.log_A)
    acc = 1.0 - lev.gamma[:, -1]
    pos = (1.0 - A)[:, None] / p.K + (lev.gamma[:, :-1] - lev.gamma[:, 1:])
    return acc, pos


def _largest_feasible(delta, K, c, log_R, t_hi) -> torch.Tensor:
    """Largest share in ``[0, t_hi]`` certified by :func:`feasible`, to ``2^-SHARE_STEPS`` (bisection).

    The bracket's lower end is certified at every step (it starts at 0, always feasible), so the
    result is feasible even where feasibility were not monotone in ``t``.
    """
    ok_hi = feasible(make_params(delta, K, t_hi, c, log_R))
    lo, hi = torch.zeros_like(delta), t_hi.clone()
    for _ in range(SHARE_STEPS):
        mid = 0.5 * (lo + hi)
        ok = feasible(make_params(delta, K, mid, c, log_R))
        lo = torch.where(ok, mid, lo)
        hi = torch.where(ok, hi, mid)
    return torch.where(ok_hi, t_hi, lo)


_SHARE_CACHE: dict[tuple[int, int], float] = {}


def share(delta: torch.Tensor, K: int) -> MarkMaxParams:
    """Certified parameters per row, with the largest share ``t`` found (acceptance grows with ``t``).

    ``t`` comes from the row's delta-bin (``round(64 log2 delta)``; the smallest of
    :func:`_largest_feasible` at the bin's edges and centre, computed once and cached), is then
    certified at the row's own ``delta``, and rows where that fails search ``[0, t_bin]`` by
    bisection. A deterministic function of ``(delta, K)``, so the theory functions reproduce the
    sampler, and a row's parameters never depend on the other rows of the batch.

    Args:
        delta: float64 ``[n]``, ``>= DELTA_MIN``.
        K: children per parent.

    Returns:
        :class:`MarkMaxParams`, certified by :func:`feasible`.
    """
    c = crossing(delta, K)
    log_R = log_bound_gap(delta, K, c)
    keys = torch.round(KEY_STEPS * torch.log2(delta)).long().tolist()
    todo = sorted({k for k in keys if (K, k) not in _SHARE_CACHE})
    if todo:
        # the bin's value: the smallest of the largest certified shares at its two edges and centre, so
        # that nearly every delta of the bin passes the certificate below without a search of its own
        kk = torch.tensor(todo, dtype=torch.float64, device=delta.device)
        dk = torch.exp2(torch.cat([kk - 0.5, kk, kk + 0.5]) / KEY_STEPS)
        ck = crossing(dk, K)
        tk = _largest_feasible(dk, K, ck, log_bound_gap(dk, K, ck), torch.ones_like(dk))
        tk = tk.reshape(3, -1).amin(0)
        _SHARE_CACHE.update({(K, k): t_k for k, t_k in zip(todo, tk.tolist())})
    t = torch.tensor([_SHARE_CACHE[(K, k)] for k in keys], dtype=torch.float64, device=delta.device)
    ok = feasible(make_params(delta, K, t, c, log_R))
    if not bool(ok.all()):
        bad = (~ok).nonzero(as_tuple=True)[0]
        t = t.clone()
        t[bad] = _largest_feasible(delta[bad], K, c[bad], log_R[bad], t[bad])
    return make_params(delta, K, t, c, log_R)


@dataclass
class Plan:
    """Which rows use the marked-maximum rule, with its parameters, GRS levels and acceptance.

    Attributes:
        use: bool ``[n]``; the other rows use D-GRS.
        params: :class:`MarkMaxParams` of the ``use`` rows (``None`` if there are none).
        levels: their :class:`GRSLevels`.
        acceptance: float64 ``[use.sum()]``.
    """

    use: torch.Tensor
    params: MarkMaxParams | None
    levels: GRSLevels | None
    acceptance: torch.Tensor


def plan(delta: torch.Tensor, K: int) -> Plan:
    """Split rows between the marked-maximum rule and D-GRS; compute the former's parameters.

    A row uses D-GRS when ``delta < DELTA_MIN`` or when D-GRS's acceptance (eq. 19) exceeds the rule's
    by more than ``DGRS_MARGIN``;
    both are functions of ``(delta, K)`` alone, so the mixture stays exact.

    Args:
        delta: float64 ``[n]``, ``>= 0``.
        K: children per parent.

    Returns:
        :class:`Plan`.
    """
    uniq, inv = torch.unique(delta, return_inverse=True)
    if uniq.numel() < delta.numel():  # repeated deltas: plan each value once
        pu = plan(uniq, K)
        use = pu.use[inv]
        if pu.params is None:
            return Plan(use, None, None, pu.acceptance)
        slot = (torch.cumsum(pu.use.long(), 0) - 1)[inv[use]]
        lev = GRSLevels(pu.levels.mu[slot], pu.levels.gamma[slot], pu.levels.y[slot])
        return Plan(use, pu.params.rows(slot), lev, pu.acceptance[slot])
    use = delta >= DELTA_MIN
    idx = use.nonzero(as_tuple=True)[0]
    if idx.numel() == 0:
        return Plan(use, None, None, torch.zeros(0, dtype=torch.float64, device=delta.device))
    p = share(delta[idx], K)
    lev = grs_on_unmarked(p)
    acc, _ = acceptance_and_positional(p, lev)
    keep = acc + DGRS_MARGIN >= 1.0 - grs_levels(p.delta, K)[1][:, -1]
    if not bool(keep.all()):
        use = use.clone()
        use[idx[~keep]] = False
        sel = keep.nonzero(as_tuple=True)[0]
        p, acc = p.rows(sel), acc[sel]
        lev = GRSLevels(lev.mu[sel], lev.gamma[sel], lev.y[sel])
    return Plan(use, p, lev, acc)


class _Fixed:
    """Hands pre-drawn uniform columns to :func:`specsamp.coupling.grs_select` (rows already chosen)."""

    def __init__(self, *cols: torch.Tensor):
        self.cols = list(cols)

    def uniform(self, m: int) -> torch.Tensor:
        return self.cols.pop(0)[:, :m]


def _log_upper_survival(y: torch.Tensor, delta: torch.Tensor, K: int) -> torch.Tensor:
    """``log(Phibar(y - delta) - (1 - Phi(y)^K))``, the unnormalised survival of ``q - f_M`` on ``y >= c``."""
    a = log_sf(y - delta)
    return a + _log1mexp(torch.clamp(log_one_minus_cdf_pow(y, K) - a, max=0.0))


def _sample_upper(p: MarkMaxParams, u: torch.Tensor) -> torch.Tensor:
    """Invert the survival of ``(q - f_M) 1{y > c} / R`` at ``u`` (log space, fixed bisection).

    The bracket's upper end uses ``Phibar(x) <= exp(-x^2 / 2)`` for ``x >= 0``.
    """
    log_target = torch.log(u) + p.log_R
    hi = torch.maximum(p.c, p.delta) + torch.sqrt(-2.0 * torch.clamp(log_target, max=-1e-300)) + 2.0
    return _bisect(lambda y: _log_upper_survival(y, p.delta, p.K) > log_target, p.c.clone(), hi, SAMPLE_STEPS)


def _sample_lower(p: MarkMaxParams, mu_k, y_k, mass, u) -> torch.Tensor:
    """Invert the survival of ``[(1 - t) q - mu_K phi (1 - kappa)]_+ / mass`` on ``[y_K, c]`` at ``u``."""
    target = u * mass
    return _bisect(lambda y: _owed_above(y, p, mu_k) > target, y_k.clone(), p.c.clone(), SAMPLE_STEPS)


def select(p: MarkMaxParams, lev: GRSLevels, s_hat: torch.Tensor, u_mark, u_grs, u_res):
    """Scalar part of the rule: accepted index per row, and the residual projection where none is.

    Args:
        p: parameters of the ``m`` rows; ``lev`` their :func:`grs_on_unmarked` levels.
        lev: see ``p``.
        s_hat: float64 ``[m, K]`` projections in drafting order.
        u_mark: ``[m, K]`` uniforms in (0, 1) for the marks.
        u_grs: ``[m, K]`` uniforms for GRS over the unmarked children.
        u_res: ``[m, 2]`` uniforms for the residual (branch, inversion).

    Returns:
        ``(index [m] long, s_res [m] float64)``; ``index == K`` where the residual was drawn.
    """
    m, K = s_hat.shape
    at = _at(s_hat, p)
    marked = torch.log(u_mark) <= at.log_kappa
    any_mark = marked.any(1)
    top = torch.where(marked, s_hat, torch.full_like(s_hat, -torch.inf)).argmax(1)
    # GRS over the unmarked children, drafting order: beta_k = min(1, (w - mu_{k-1})_+ / g_k)
    log_g = torch.log(lev.gamma[:, :K].clamp_min(1e-300)) - (p.log_A / K)[:, None]
    g, mu = torch.exp(log_g), lev.mu[:, :K]
    ceiling = torch.log(mu + g)
    w = torch.exp(torch.minimum(at.log_ratio, ceiling))
    part = ((w - mu).clamp_min(0.0) / g.clamp_min(1e-300)).clamp(0.0, 1.0)
    beta = torch.where(at.log_ratio >= ceiling, torch.ones_like(w), part)
    pos = torch.arange(K, device=s_hat.device).expand(m, K)
    first = torch.where(u_grs <= beta, pos, torch.full_like(pos, K)).amin(1)
    index = torch.where(any_mark, top, first)
    s_res = torch.zeros(m, dtype=torch.float64, device=s_hat.device)
    rej = (index == K).nonzero(as_tuple=True)[0]
    if rej.numel():
        sub = p.rows(rej)
        total = lev.gamma[rej, K]
        lower = (total - torch.exp(sub.log_R)).clamp_min(0.0)
        go_low = u_res[rej, 0] * total < lower
        lo_i, up_i = go_low.nonzero(as_tuple=True)[0], (~go_low).nonzero(as_tuple=True)[0]
        if up_i.numel():
            s_res[rej[up_i]] = _sample_upper(sub.rows(up_i), u_res[rej[up_i], 1])
        if lo_i.numel():
            r = rej[lo_i]
            s_res[r] = _sample_lower(sub.rows(lo_i), lev.mu[r, K], lev.y[r, K], lower[lo_i], u_res[r, 1])
    return index, s_res


@register_coupling("markmax", positional=lambda delta, K: markmax_positional(delta, K))
def markmax(children, mean_p, mean_q, sigma, generator=None) -> Verdict:
    """Marked-maximum list coupling: mark children independently, accept the highest marked, else GRS.

    Any ``K >= 1``. Exact for every ``delta >= 0`` (proof in the module docstring). Its acceptance
    equals the list bound ``alpha*_K`` wherever the full share ``t = 1`` is certified (moderate and large
    ``delta``); elsewhere (small ``delta``) it stays within 0.009 (K = 2), 0.005 (K = 4), 0.002 (K = 8)
    and 0.0007 (K = 16) of it, where D-GRS is up to 0.13 below. Never below D-GRS: rows where D-GRS
    accepts more (and ``delta < 1e-6``) are handed to D-GRS. The accepted
    index is not in drafting order; see :func:`markmax_positional`. Contract:
    :class:`specsamp.coupling.Coupling`.
    """
    proj = project(children, mean_p, mean_q, sigma)
    n, K = proj.s_hat.shape
    rows = uniform_rows(generator, n, children.device)
    u_mark, u_grs, u_res = rows.uniform(K), rows.uniform(K), rows.uniform(2)
    pl = plan(proj.delta, K)
    index = torch.full((n,), K, dtype=torch.long, device=children.device)
    s_res = torch.zeros(n, dtype=torch.float64, device=children.device)
    mm = pl.use.nonzero(as_tuple=True)[0]
    dg = (~pl.use).nonzero(as_tuple=True)[0]
    if mm.numel():
        index[mm], s_res[mm] = select(pl.params, pl.levels, proj.s_hat[mm], u_mark[mm], u_grs[mm], u_res[mm])
    if dg.numel():
        index[dg], s_res[dg] = grs_select(proj.delta[dg], proj.s_hat[dg], _Fixed(u_grs[dg], u_res[dg]))
    accepted = index < K
    return Verdict(reconstruct(children, proj, s_res, accepted, index), accepted, index)


# ----------------------------------------------------------------------------------------------
# Theory: numpy in, numpy out, like specsamp.theory.


def _theory(delta, K) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    from .theory import _delta, _k, dgrs_positional  # theory imports coupling; keep this one-way

    d = _delta(delta)
    K = _k(K)
    flat = torch.as_tensor(d.reshape(-1), dtype=torch.float64)
    acc = np.empty(flat.shape[0])
    pos = np.empty((flat.shape[0], K))
    t = np.full(flat.shape[0], np.nan)
    pl = plan(flat, K)
    if pl.params is not None:
        a, ps = acceptance_and_positional(pl.params, pl.levels)
        idx = pl.use.nonzero(as_tuple=True)[0].numpy()
        acc[idx], pos[idx], t[idx] = a.numpy(), ps.numpy(), pl.params.t.numpy()
    rest = (~pl.use).nonzero(as_tuple=True)[0].numpy()
    if rest.size:
        pos[rest] = dgrs_positional(flat.numpy()[rest], K)
        acc[rest] = pos[rest].sum(-1)
    return acc.reshape(d.shape), pos.reshape(*d.shape, K), t.reshape(d.shape)


def markmax_acceptance(delta, K: int) -> np.ndarray:
    """Probability that :func:`markmax` accepts one of ``K`` children at displacement ``delta``.

    ``1 - Gamma_{K+1}`` (module docstring; closed form up to root finding), or eq. 19 on rows handed
    to D-GRS. Lies between :func:`specsamp.theory.dgrs_acceptance` and
    :func:`specsamp.theory.list_coupling_bound`.

    Args:
        delta: array-like, finite, ``>= 0``.
        K: integer ``>= 1``.

    Returns:
        float64 array of ``delta``'s shape.

    Raises:
        ValueError: negative or non-finite ``delta``, or ``K < 1``.
    """
    return _theory(delta, K)[0]


def markmax_positional(delta, K: int) -> np.ndarray:
    """``P(J = k)``, ``k = 1..K``: probability that :func:`markmax` accepts the ``k``-th drafted child.

    ``(1 - A) / K + Gamma_k - Gamma_{k+1}``: the highest marked child is exchangeable in the drafting
    index (``(1 - A) / K`` each), GRS over the unmarked favours early children. Plug into
    :func:`specsamp.theory.expected_steps`.

    Args:
        delta: array-like, finite, ``>= 0``.
        K: integer ``>= 1``.

    Returns:
        float64 ``[*delta.shape, K]``; rows sum to :func:`markmax_acceptance`.

    Raises:
        ValueError: negative or non-finite ``delta``, or ``K < 1``.
    """
    return _theory(delta, K)[1]


def markmax_share(delta, K: int) -> np.ndarray:
    """The share ``t`` the rule uses per ``delta`` (NaN where the row goes to D-GRS); ``t = 1`` attains
    the list bound.

    Raises:
        ValueError: negative or non-finite ``delta``, or ``K < 1``.
    """
    return _theory(delta, K)[2]
