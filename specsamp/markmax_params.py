"""The parameters of the marked-maximum rule (:mod:`specsamp.listcoupling`): crossing, share and certificate.

For one ``(delta, K)`` per row, all float64 and with fixed step counts: the upper crossing ``c`` of the largest
child's density and the target's (:func:`crossing`), the gap ``R`` to the list bound (:func:`log_bound_gap`), the
marking probability ``kappa`` and GRS's weight ratio ``w`` (:func:`log_kappa`, :func:`log_ratio`), the certificate
that a share ``t`` keeps ``0 <= kappa <= 1`` and ``w`` increasing (:func:`feasible`), the largest certified share
(:func:`share`), and the levels of greedy rejection sampling over the unmarked children
(:func:`grs_on_unmarked`, :func:`acceptance_and_positional`). The proof that these make an exact coupling is in
:mod:`specsamp.listcoupling`'s docstring; that module re-exports the public names.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .coupling import log_sf
from .grs import logaddexp

Y_LO = -40.0  # projections below this have probability < 1e-349; parameter searches start here
Y_SPAN = 40.0  # ... and stop at delta + Y_SPAN (target mass above it < 1e-349)
ROOT_STEPS = 64  # bisection steps for parameter roots (brackets at most ~1e7 wide: 1e-12 precision)
CERT_STEPS = 48  # bisection steps in the certificate (its brackets are taken on the safe side)
SAMPLE_STEPS = 64  # bisection steps for residual inversion (as in grs.sample_grs_residual)
LEVEL_GRID = 24  # grid points locating GRS's level roots before Newton refinement
NEWTON_STEPS = 10  # safeguarded Newton steps per level root
SHARE_STEPS = 12  # bisection steps on the share t (resolution 2^-12), see share
KEY_STEPS = 64  # delta -> bin key round(64 log2 delta): delta-bins about 1% wide
TABLE_DELTA_MAX = 2.0**10  # the share table's last bin (share_table: why this bound)
PIECES = 32  # pieces per monotone stretch in the certificate of feasible()
DGRS_MARGIN = 1e-12  # D-GRS takes a row only when it accepts more by this much (not on rounding noise)
DELTA_MIN = 1e-6  # below this every row goes to D-GRS (both accept 1 - O(delta) there)
_LOG_2PI_HALF = 0.5 * math.log(2.0 * math.pi)


def _log_phi(x: torch.Tensor) -> torch.Tensor:
    return -0.5 * x * x - _LOG_2PI_HALF


def _log_cdf(x: torch.Tensor) -> torch.Tensor:
    return torch.special.log_ndtr(x)


def log1mexp(x: torch.Tensor) -> torch.Tensor:
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
    exact = log1mexp(K * log_cdf)
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


def bisect_midpoint(right_of, lo: torch.Tensor, hi: torch.Tensor, steps: int) -> torch.Tensor:
    """The root of a monotone predicate, elementwise: the midpoint of ``[lo, hi]`` (``[n]`` each) after ``steps``
    bisections (:func:`_bracket`; ``right_of(x)`` True where the root lies above ``x``), with no host synchronisation."""
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
    y_h = bisect_midpoint(lambda y: _log_phi(y) - _log_cdf(y) > log_target, lo, hi, ROOT_STEPS)

    def h(y):
        return log_k + (K - 1) * _log_cdf(y) - delta * y + 0.5 * delta * delta

    top = 0.5 * delta + log_k / delta + 1.0
    _, c = _bracket(lambda y: h(y) > 0, y_h, torch.maximum(top, y_h), ROOT_STEPS)
    return c


def log_bound_gap(delta: torch.Tensor, K: int, c: torch.Tensor) -> torch.Tensor:
    """``log R``, ``R = Phi(c)^K - Phi(c - delta) = Phibar(c - delta) - (1 - Phi(c)^K)``, from the tails."""
    log_t1 = log_sf(c - delta)
    log_t2 = log_one_minus_cdf_pow(c, K)
    return log_t1 + log1mexp(torch.clamp(log_t2 - log_t1, max=0.0))


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
    log_A = logaddexp(torch.log1p(-t) + _log_cdf(c - delta), log_R)
    return MarkMaxParams(delta=delta, K=K, c=c, log_R=log_R, t=t, log_A=log_A)


@dataclass
class RuleAt:
    """The rule's functions at points ``y`` (``[n]`` or ``[n, m]``), from one ``log_ndtr`` call."""

    log_vk: torch.Tensor  # log V(y)^K = log(A + t Q(y))            (y <= c)
    log_kappa: torch.Tensor  # log marking probability (0 above c)
    log_ratio: torch.Tensor  # log((1 - t) rho / (1 - kappa))    (y <= c)
    log_z: torch.Tensor  # log(t q / V^K) = d log V^K / dy          (y <= c)


def rule_at(y: torch.Tensor, p: MarkMaxParams) -> RuleAt:
    """:class:`RuleAt` of the rule with parameters ``p`` (one row per ``p.delta`` entry) at points ``y`` ``[n]`` or ``[n, m]``."""
    shape = p.delta.shape + (1,) * (y.ndim - p.delta.ndim)
    d = p.delta.reshape(shape)
    log_t = torch.log(p.t).reshape(shape)
    log_rho = d * y - 0.5 * d * d
    lvk = logaddexp(p.log_A.reshape(shape), log_t + _log_cdf(y - d))
    below = log_t + log_rho - math.log(p.K) - (p.K - 1) / p.K * lvk
    lk = torch.where(y > p.c.reshape(shape), torch.zeros_like(y), below)
    lr = torch.log1p(-p.t).reshape(shape) + log_rho - log1mexp(lk)
    lz = log_t + _log_phi(y - d) - lvk
    return RuleAt(lvk, lk, lr, lz)


def _log_z(y: torch.Tensor, p: MarkMaxParams) -> torch.Tensor:
    """``log z = log(t q / V^K)`` alone (the certificate's bisections need nothing else)."""
    shape = p.delta.shape + (1,) * (y.ndim - p.delta.ndim)
    d = p.delta.reshape(shape)
    log_t = torch.log(p.t).reshape(shape)
    return log_t + _log_phi(y - d) - logaddexp(p.log_A.reshape(shape), log_t + _log_cdf(y - d))


def log_kappa(y: torch.Tensor, p: MarkMaxParams) -> torch.Tensor:
    """log marking probability at projections ``y`` (``[n]`` or ``[n, m]``): 0 above ``c``, else
    ``log(t rho / (K V^(K-1)))``."""
    return rule_at(y, p).log_kappa


def log_ratio(y: torch.Tensor, p: MarkMaxParams) -> torch.Tensor:
    """``log((1 - t) rho / (1 - kappa))`` at ``y <= c``: GRS's ratio on the unmarked, in ``mu`` units."""
    return rule_at(y, p).log_ratio


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
        return (s < 0) & (torch.log(torch.clamp(-s, min=1e-300)) + logaddexp(log_a, _log_cdf(s)) > _log_phi(s))

    s_lo = torch.minimum(Y_LO - delta, torch.full_like(delta, Y_LO))
    s_m = bisect_midpoint(w_pos, s_lo, torch.zeros_like(delta), CERT_STEPS)
    y_lo = torch.full_like(delta, Y_LO)
    y_m = torch.minimum(torch.clamp(s_m + delta, min=Y_LO), c)
    log_theta = math.log(K / (K - 1)) + torch.log(delta)
    has = _log_z(y_m, q) > log_theta
    # bracket ends outside the interval: z <= theta at y_a (z increasing left of y_m), at y_b (decreasing)
    y_a, _ = _bracket(lambda y: _log_z(y, q) <= log_theta, y_lo, y_m, CERT_STEPS)
    _, y_b = _bracket(lambda y: _log_z(y, q) > log_theta, y_m, c, CERT_STEPS)
    ok_kappa = (rule_at(y_a, q).log_kappa <= 1e-12) & (rule_at(c, q).log_kappa <= 1e-12)
    frac = torch.linspace(0.0, 1.0, PIECES + 1, dtype=torch.float64, device=delta.device)[None]
    left = rule_at(y_a[:, None] + (y_m - y_a)[:, None] * frac, q)
    right = rule_at(y_m[:, None] + (y_b - y_m)[:, None] * frac, q)
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


def owed_above(y: torch.Tensor, p: MarkMaxParams, mu: torch.Tensor) -> torch.Tensor:
    """``int_y^c [(1 - t) q - mu phi (1 - kappa)] = (1 - t)(Q(c) - Q(y)) - mu (V(y) - Phi(y))``."""
    shape = p.delta.shape + (1,) * (y.ndim - p.delta.ndim)
    d, c = p.delta.reshape(shape), p.c.reshape(shape)
    qdiff = (torch.exp(_log_cdf(c - d)) - torch.exp(_log_cdf(y - d))).clamp_min(0.0)
    v = torch.exp(rule_at(y, p).log_vk / p.K)
    vdiff = (v - torch.exp(_log_cdf(y))).clamp_min(0.0)
    return (1.0 - p.t.reshape(shape)) * qdiff - mu.reshape(shape) * vdiff


def _level_root(p: MarkMaxParams, grid_y, grid_lr, log_m, static: bool = False) -> torch.Tensor:
    """``y`` with ``log w(y) = log_m`` (``w`` increasing): grid cell, then safeguarded Newton steps.

    The Newton steps matter only for rows whose level lies inside the grid; the final ``where`` s overwrite the
    others. ``static=False`` skips them when no row needs them (one host synchronisation); ``static=True``
    always runs them (no synchronisation, the same values).
    """
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
    for _ in range(NEWTON_STEPS if static or bool(inner.any()) else 0):
        at = rule_at(y, p)
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


def grs_on_unmarked(p: MarkMaxParams, static: bool = False) -> GRSLevels:
    """Levels and remaining masses of GRS over the unmarked children (module docstring).

    Requires :func:`feasible` parameters (increasing ratio ``w``), so ``H_k = [y_k, c]`` plus the part
    above ``c``: ``mu_k = mu_{k-1} + Gamma_k / A^(1/K)``, ``Gamma_{k+1} = (owed above y_k) + R``.

    Args:
        p: the rows' parameters.
        static: True: every level root is computed for every row and chosen with ``torch.where`` (no host
            synchronisation); False: skipped where every row has ``t = 1`` (one synchronisation). Same values.

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
    grid_lr = rule_at(grid_y, p).log_ratio
    full = p.t >= 1  # nothing owed below c: every H_k is the part above c
    mu, gam, ys = [torch.zeros_like(A)], [A], [torch.full_like(A, Y_LO)]
    for _ in range(K):
        m = mu[-1] + gam[-1] * inv_root
        if not static and bool(full.all()):
            yk = p.c
        else:
            yk = torch.where(full, p.c, _level_root(p, grid_y, grid_lr, torch.log(m), static))
        g = owed_above(yk, p, m) + R
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


KEY_MIN = round(KEY_STEPS * math.log2(DELTA_MIN))  # bin key of DELTA_MIN: every delta the rule serves has one >= it
KEY_MAX = round(KEY_STEPS * math.log2(TABLE_DELTA_MAX))  # the share table's last bin


def bin_shares(keys: torch.Tensor, K: int) -> torch.Tensor:
    """The share of each delta-bin ``k`` (``round(KEY_STEPS log2 delta) = k``) in ``keys``.

    The smallest of :func:`_largest_feasible` (up to ``t = 1``) at the bin's edges ``2^((k -+ 1/2) / KEY_STEPS)``
    and its centre ``2^(k / KEY_STEPS)``, so that nearly every ``delta`` of the bin passes :func:`feasible` at it
    without a search of its own. Each key's value depends on that key alone, whatever the other keys of the
    call (tested: every bin, in batches of 1 to 40 keys, gives the table's value): the three deltas are
    ``2^(j / (2 KEY_STEPS)) 2^q`` with ``j`` and ``q`` the remainder and quotient of ``2k -+ 1`` and ``2k`` by
    ``2 KEY_STEPS``, the 128 fractional powers from one ``exp2`` call of fixed layout and the power of two exact.
    (``torch.exp2`` of a tensor rounds its last elements with its scalar kernel and the others with its
    vectorised one, so ``exp2((k -+ 1/2) / KEY_STEPS)`` would depend on where the key sits in the batch, and at
    a few bins above ``delta = 150`` that flips the certificate; the powers here equal the vectorised
    kernel's on every bin, checked with this build.)

    Args:
        keys: float64 ``[m]``, integer-valued bin keys.
        K: children per parent.

    Returns:
        float64 ``[m]``: multiples of ``2^-SHARE_STEPS`` in ``[0, 1]``.
    """
    steps = 2 * KEY_STEPS
    half = torch.cat([2.0 * keys - 1.0, 2.0 * keys, 2.0 * keys + 1.0])  # 2 KEY_STEPS log2 of the edges and centre
    q = torch.floor(half / steps)
    powers = torch.exp2(torch.arange(steps, dtype=torch.float64, device=keys.device) / steps)
    dk = powers.index_select(0, (half - q * steps).long()) * torch.exp2(q)  # exp2 of an integer is exact
    ck = crossing(dk, K)
    tk = _largest_feasible(dk, K, ck, log_bound_gap(dk, K, ck), torch.ones_like(dk))
    return tk.reshape(3, -1).amin(0)


_SHARE_CACHE: dict[tuple[int, int], float] = {}  # (K, key) -> bin share, filled on demand by share
_SHARE_TABLES: dict[tuple[int, str], torch.Tensor] = {}  # (K, device) -> share_table


def share_table(K: int, device) -> torch.Tensor:
    """The share of every delta-bin from ``KEY_MIN`` (``DELTA_MIN``) to ``KEY_MAX`` (``TABLE_DELTA_MAX``) on ``device``.

    Built once per process and ``(K, device)``, on first use, by one :func:`bin_shares` call over all
    ``KEY_MAX - KEY_MIN + 1 = 1917`` bins (about 5,800 rows of :func:`_largest_feasible`; no host
    synchronisation), then read by a gather (:func:`static_share`). Its values are those :func:`share`
    computes and caches key by key (``tests/core/test_listcoupling.py``: 120 bins per K in the default run,
    every bin in a slow test, K = 2..16).

    Why the table stops at ``TABLE_DELTA_MAX = 2^10``: a row beyond it is not served by the table
    (:func:`static_share` reports it uncertified, and the sampler's dense round hands the round to the checked
    walk, which runs :func:`share`: the same law), so the bound sets cost, not the law. Up to ``2^7`` every bin
    from ``delta = 1`` on has ``t = 1`` for every K <= 16, and no row below ``delta = 100`` fails its own
    certificate (20,000 log-uniform deltas per decade, K = 2, 4, 16). Above, the float64 rounding of the
    log-space ratios (``delta y - delta^2 / 2`` near ``y = delta / 2``: about ``delta^2 eps``, 4e-12 at 128)
    is of the order of the certificate's ``1e-12`` tolerance on ``kappa <= 1``: up to ``2^10``, ``t = 1`` is
    refused in 20-67% of the bins (by K) and 2-4% of the rows fail their own certificate. The sampler does
    reach there (the GMM with the x0 draft and the optimal B = 14 tree: deltas up to 132, 242 of 15,600
    verified rows above 100), so the table goes three octaves beyond ``2^7``; ``2^10`` also covers the law
    tests' deltas (up to 300).

    Args:
        K: children per parent.
        device: a ``torch.device`` or its name.

    Returns:
        float64 ``[KEY_MAX - KEY_MIN + 1]``; entry ``i`` is the share of bin ``KEY_MIN + i``. Never written to.
    """
    dev = torch.device(device)
    slot = (K, str(dev))
    if slot not in _SHARE_TABLES:
        keys = torch.arange(KEY_MIN, KEY_MAX + 1, dtype=torch.float64, device=dev)
        _SHARE_TABLES[slot] = bin_shares(keys, K)
    return _SHARE_TABLES[slot]


def _bin_keys(delta: torch.Tensor) -> torch.Tensor:
    """float64 ``[n]`` bin keys ``round(KEY_STEPS log2 delta)``."""
    return torch.round(KEY_STEPS * torch.log2(delta))


def static_share(delta: torch.Tensor, K: int) -> tuple[MarkMaxParams, torch.Tensor]:
    """:func:`share` without host synchronisation: the table's share of each row's bin, certified at its own ``delta``.

    Static shapes: the share is gathered from :func:`share_table` and certified with :func:`feasible` at the
    row's own ``delta``; no search follows. Where the certificate fails (about 3% of rows above
    ``delta = 100``, none below) or the row's bin lies beyond the table (``delta > TABLE_DELTA_MAX`` up to
    half a bin), the returned share is not certified and must not be used: :func:`share` gives the row's
    parameters (inside :func:`specsamp.coupling.deferred_checks`, :func:`specsamp.listcoupling.markmax`
    flags such rows, and the caller repeats the call outside the context, where :func:`share` serves them).

    Args:
        delta: float64 ``[n]``, finite and ``>= DELTA_MIN``.
        K: children per parent.

    Returns:
        ``(params, certified)``: :class:`MarkMaxParams` with the table's shares, and bool ``[n]``, True where
        they are certified; there ``params`` equals :func:`share`'s.
    """
    c = crossing(delta, K)
    log_R = log_bound_gap(delta, K, c)
    keys = _bin_keys(delta)
    served = (keys >= KEY_MIN) & (keys <= KEY_MAX)
    slot = torch.where(served, keys - KEY_MIN, torch.zeros_like(keys)).long()
    p = make_params(delta, K, share_table(K, delta.device).index_select(0, slot), c, log_R)
    return p, feasible(p) & served


def share(delta: torch.Tensor, K: int) -> MarkMaxParams:
    """Certified parameters per row, with the largest share ``t`` found (acceptance grows with ``t``).

    ``t`` comes from the row's delta-bin (``round(64 log2 delta)``; :func:`bin_shares`, computed once per
    key and cached), is then certified at the row's own ``delta``, and rows where that fails search
    ``[0, t_bin]`` by bisection. A deterministic function of ``(delta, K)``, so the theory functions
    reproduce the sampler, and a row's parameters never depend on the other rows of the batch. Host
    synchronisations: up to three (the keys, the certificate, the search); :func:`static_share` makes none.

    Args:
        delta: float64 ``[n]``, ``>= DELTA_MIN``.
        K: children per parent.

    Returns:
        :class:`MarkMaxParams`, certified by :func:`feasible`.
    """
    c = crossing(delta, K)
    log_R = log_bound_gap(delta, K, c)
    keys = _bin_keys(delta).long().tolist()
    todo = sorted({k for k in keys if (K, k) not in _SHARE_CACHE})
    if todo:
        tk = bin_shares(torch.tensor(todo, dtype=torch.float64, device=delta.device), K)
        _SHARE_CACHE.update({(K, k): t_k for k, t_k in zip(todo, tk.tolist())})
    t = torch.tensor([_SHARE_CACHE[(K, k)] for k in keys], dtype=torch.float64, device=delta.device)
    ok = feasible(make_params(delta, K, t, c, log_R))
    if not bool(ok.all()):
        bad = (~ok).nonzero(as_tuple=True)[0]
        t = t.clone()
        t[bad] = _largest_feasible(delta[bad], K, c[bad], log_R[bad], t[bad])
    return make_params(delta, K, t, c, log_R)
