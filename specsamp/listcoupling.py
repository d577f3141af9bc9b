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
and ``K`` only, so the mixture is exact. Inside :func:`specsamp.coupling.deferred_checks` the bin's
share is gathered from :func:`specsamp.markmax_params.share_table` (every bin from ``DELTA_MIN`` to
``TABLE_DELTA_MAX``, built once per process and ``(K, device)``) and re-certified, with no search: a
row it cannot certify sets the context's flag, and the caller repeats the call outside it.

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

from dataclasses import dataclass

import numpy as np
import torch

from .coupling import (
    Verdict,
    active_checks,
    grs_levels,
    grs_select,
    log_sf,
    project,
    reconstruct,
    register_coupling,
    uniform_rows,
)
from .markmax_params import (  # noqa: F401  (the rule's parameters; their public names are re-exported here)
    CERT_STEPS,
    DELTA_MIN,
    DGRS_MARGIN,
    KEY_MAX,
    KEY_MIN,
    KEY_STEPS,
    LEVEL_GRID,
    NEWTON_STEPS,
    PIECES,
    ROOT_STEPS,
    SAMPLE_STEPS,
    SHARE_STEPS,
    TABLE_DELTA_MAX,
    Y_LO,
    Y_SPAN,
    GRSLevels,
    MarkMaxParams,
    acceptance_and_positional,
    bin_shares,
    bisect_midpoint,
    crossing,
    feasible,
    grs_on_unmarked,
    log1mexp,
    log_bound_gap,
    log_kappa,
    log_one_minus_cdf_pow,
    log_ratio,
    make_params,
    owed_above,
    rule_at,
    share,
    share_table,
    static_share,
)
from .trees import check_int


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


def static_plan(delta: torch.Tensor, K: int) -> tuple[Plan, torch.Tensor]:
    """:func:`plan` with static shapes and no host synchronisation: every row's parameters, split by ``torch.where``.

    Every row gets marked-maximum parameters (:func:`specsamp.markmax_params.static_share`; rows below
    ``DELTA_MIN`` those of ``delta = 1``, never used), GRS levels and acceptance, and ``use`` is :func:`plan`'s
    test on them. Where a row's share is certified, all of it equals :func:`plan`'s.

    Args:
        delta: float64 ``[n]``, ``>= 0`` (NaN rows go to D-GRS; the caller refuses them).
        K: children per parent.

    Returns:
        ``(plan, uncertified)``: a :class:`Plan` whose ``params``, ``levels`` and ``acceptance`` cover all ``n``
        rows (not only the ``use`` rows), and bool ``[n]``, True where a row would use the rule but its share
        is not certified (:func:`specsamp.markmax_params.static_share`): such rows must be served by :func:`plan`.
    """
    wanted = delta >= DELTA_MIN
    p, certified = static_share(torch.where(wanted, delta, torch.ones_like(delta)), K)
    lev = grs_on_unmarked(p, static=True)
    acc, _ = acceptance_and_positional(p, lev)
    keep = acc + DGRS_MARGIN >= 1.0 - grs_levels(p.delta, K)[1][:, -1]
    return Plan(wanted & keep, p, lev, acc), wanted & ~certified


class _Fixed:
    """Hands pre-drawn uniform columns to :func:`specsamp.coupling.grs_select` (rows already chosen)."""

    def __init__(self, *cols: torch.Tensor):
        self.cols = list(cols)

    def uniform(self, m: int) -> torch.Tensor:
        return self.cols.pop(0)[:, :m]


def _log_upper_survival(y: torch.Tensor, delta: torch.Tensor, K: int) -> torch.Tensor:
    """``log(Phibar(y - delta) - (1 - Phi(y)^K))``, the unnormalised survival of ``q - f_M`` on ``y >= c``."""
    a = log_sf(y - delta)
    return a + log1mexp(torch.clamp(log_one_minus_cdf_pow(y, K) - a, max=0.0))


def _sample_upper(p: MarkMaxParams, u: torch.Tensor) -> torch.Tensor:
    """Invert the survival of ``(q - f_M) 1{y > c} / R`` at ``u`` (log space, fixed bisection).

    The bracket's upper end uses ``Phibar(x) <= exp(-x^2 / 2)`` for ``x >= 0``.
    """
    log_target = torch.log(u) + p.log_R
    hi = torch.maximum(p.c, p.delta) + torch.sqrt(-2.0 * torch.clamp(log_target, max=-1e-300)) + 2.0
    return bisect_midpoint(lambda y: _log_upper_survival(y, p.delta, p.K) > log_target, p.c.clone(), hi, SAMPLE_STEPS)


def _sample_lower(p: MarkMaxParams, mu_k, y_k, mass, u) -> torch.Tensor:
    """Invert the survival of ``[(1 - t) q - mu_K phi (1 - kappa)]_+ / mass`` on ``[y_K, c]`` at ``u``."""
    target = u * mass
    return bisect_midpoint(lambda y: owed_above(y, p, mu_k) > target, y_k.clone(), p.c.clone(), SAMPLE_STEPS)


def select(p: MarkMaxParams, lev: GRSLevels, s_hat: torch.Tensor, u_mark, u_grs, u_res, static: bool = False):
    """Scalar part of the rule: accepted index per row, and the residual projection where none is.

    Args:
        p: parameters of the ``m`` rows; ``lev`` their :func:`grs_on_unmarked` levels.
        lev: see ``p``.
        s_hat: float64 ``[m, K]`` projections in drafting order.
        u_mark: ``[m, K]`` uniforms in (0, 1) for the marks.
        u_grs: ``[m, K]`` uniforms for GRS over the unmarked children.
        u_res: ``[m, 2]`` uniforms for the residual (branch, inversion), or None: the choice alone.
        static: True: both branches of the residual are drawn for every row and chosen with ``torch.where``
            (no host synchronisation); False: each only for the rows that need it. The same values (to the
            last bit of a row that torch's vectorised kernels round in another lane: :func:`markmax`).

    Returns:
        ``(index [m] long, s_res [m] float64)``; ``index == K`` where the residual was drawn (``s_res`` is 0
        elsewhere, and None where ``u_res`` is None).
    """
    m, K = s_hat.shape
    at = rule_at(s_hat, p)
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
    if u_res is None:
        return index, None
    if static:  # the residual's two branches for every row: the ones below, without choosing the rows first
        total = lev.gamma[:, K].contiguous()
        lower = (total - torch.exp(p.log_R)).clamp_min(0.0)
        go_low = u_res[:, 0] * total < lower
        u = u_res[:, 1].contiguous()
        s_up = _sample_upper(p, u)
        s_low = _sample_lower(p, lev.mu[:, K].contiguous(), lev.y[:, K].contiguous(), lower, u)
        return index, torch.where(index == K, torch.where(go_low, s_low, s_up), torch.zeros_like(s_up))
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


def _choose(proj, u_mark, u_grs, u_res) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(index [n], s_res [n] or None)`` of :func:`markmax` from the projection and its uniforms (``u_res`` None:
    the choice alone). Inside :func:`specsamp.coupling.deferred_checks`: static shapes, both rules for every row,
    no host synchronisation, rows whose share is not certified flagged; elsewhere each rule on its own rows."""
    n, K = proj.s_hat.shape
    residual = u_res is not None
    checks = active_checks()
    if checks is not None:
        pl, uncertified = static_plan(proj.delta, K)
        checks.flag(uncertified)  # the caller repeats the call outside the context, where plan serves them
        i_mm, s_mm = select(pl.params, pl.levels, proj.s_hat, u_mark, u_grs, u_res, static=True)
        i_dg, s_dg = grs_select(proj.delta, proj.s_hat, _Fixed(u_grs, u_res), residual=residual)
        index = torch.where(pl.use, i_mm, i_dg)
        return index, (torch.where(pl.use, s_mm, s_dg) if residual else None)
    pl = plan(proj.delta, K)
    index = torch.full((n,), K, dtype=torch.long, device=proj.delta.device)
    s_res = torch.zeros(n, dtype=torch.float64, device=proj.delta.device) if residual else None
    mm = pl.use.nonzero(as_tuple=True)[0]
    dg = (~pl.use).nonzero(as_tuple=True)[0]
    if mm.numel():
        index[mm], s = select(
            pl.params, pl.levels, proj.s_hat[mm], u_mark[mm], u_grs[mm], u_res[mm] if residual else None
        )
        if residual:
            s_res[mm] = s
    if dg.numel():
        index[dg], s = grs_select(
            proj.delta[dg], proj.s_hat[dg], _Fixed(u_grs[dg], u_res[dg] if residual else None), residual=residual
        )
        if residual:
            s_res[dg] = s
    return index, s_res


def _markmax_decide(children, mean_p, mean_q, sigma, generator=None) -> Verdict:
    """:func:`markmax`'s choice alone (``sample=None``): the same projection, marks and GRS uniforms, no residual
    (its two uniforms are not drawn)."""
    proj = project(children, mean_p, mean_q, sigma)
    n, K = proj.s_hat.shape
    rows = uniform_rows(generator, n, children.device)
    u_mark, u_grs = rows.uniform(K), rows.uniform(K)
    index, _ = _choose(proj, u_mark, u_grs, None)
    return Verdict(None, index < K, index)


@register_coupling("markmax", positional=lambda delta, K: markmax_positional(delta, K), decide=_markmax_decide)
def markmax(children, mean_p, mean_q, sigma, generator=None) -> Verdict:
    """Marked-maximum list coupling: mark children independently, accept the highest marked, else GRS.

    Any ``K >= 1``. Exact for every ``delta >= 0`` (proof in the module docstring). Its acceptance
    equals the list bound ``alpha*_K`` wherever the full share ``t = 1`` is certified (moderate and large
    ``delta``); elsewhere (small ``delta``) it stays within 0.009 (K = 2), 0.005 (K = 4), 0.002 (K = 8)
    and 0.0007 (K = 16) of it, where D-GRS is up to 0.13 below. Never below D-GRS: rows where D-GRS
    accepts more (and ``delta < 1e-6``) are handed to D-GRS. The accepted
    index is not in drafting order; see :func:`markmax_positional`. Contract:
    :class:`specsamp.coupling.Coupling`.

    Host synchronisations: none inside :func:`specsamp.coupling.deferred_checks` on valid inputs (static shapes:
    both rules and both residual branches for every row, chosen with ``torch.where``; shares from
    :func:`specsamp.markmax_params.share_table`), where a row whose share the table cannot certify sets the
    context's flag instead (:func:`static_plan`), so that the caller repeats the call outside it; outside it
    about a dozen (:func:`plan`, the rows of each branch). Both give the same ``index``, ``accepted`` and
    ``sample`` bits: every row is computed from its own inputs with operations that round it the same in any
    batch (``tests/core/test_rowwise.py``).
    """
    proj = project(children, mean_p, mean_q, sigma)
    n, K = proj.s_hat.shape
    rows = uniform_rows(generator, n, children.device)
    u_mark, u_grs, u_res = rows.uniform(K), rows.uniform(K), rows.uniform(2)
    index, s_res = _choose(proj, u_mark, u_grs, u_res)
    accepted = index < K
    return Verdict(reconstruct(children, proj, s_res, accepted, index), accepted, index)


# ----------------------------------------------------------------------------------------------
# Theory: numpy in, numpy out, like specsamp.theory.


def _theory(delta, K) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    from .theory import check_delta, dgrs_positional  # theory imports coupling; keep this one-way

    d = check_delta(delta)
    K = check_int("K", K)
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
