"""The scalar machinery of greedy rejection sampling for ``N(0, 1)`` proposals and an ``N(delta, 1)`` target.

Everything D-GRS (:func:`specsamp.coupling.dgrs`) and markmax (:mod:`specsamp.listcoupling`) need once a
verification is reduced to one dimension (eqs. 12--14): the super-level threshold (proof of Thm. 4), the levels
``lambda_j`` and remaining masses ``G_j`` of Algorithm 3 (eqs. 19 and 25), the fixed-cost inversion of the
residual's survival function (eq. 17) and the scalar acceptance step of Algorithm 3. All float64, torch only.
:mod:`specsamp.coupling` re-exports the public names.
"""

from __future__ import annotations

import math

import torch


def logaddexp(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``log(exp(a) + exp(b))`` elementwise, each element rounded the same wherever it sits in its tensor.

    ``max(a, b) + log1p(exp(-|a - b|))`` (``-inf`` and ``+inf`` pairs give themselves, NaN stays NaN), the
    formula of ``torch.logaddexp``, whose CPU kernel rounds the elements of its vectorised body and of its
    scalar tail differently, so that a row's value would depend on the batch it is in. Its parts (``exp``,
    ``log1p``, and exact ones) round an element by its value alone; within 2 ulps of ``torch.logaddexp``.
    """
    gap = torch.sub(a, b).abs_().nan_to_num_(nan=math.inf, posinf=math.inf)  # equal infinities: no gap, the pair itself
    return torch.maximum(a, b).add_(gap.neg_().exp_().log1p_())


def log_sf(x: torch.Tensor) -> torch.Tensor:
    """log of the standard normal survival function, stable in both tails (float64)."""
    return torch.special.log_ndtr(-x)


def grs_threshold(lam: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """The super-level set ``{s : rho(s) >= lam}`` is ``{s >= c}``; return ``c`` (proof of Thm. 4).

    ``rho(s) = exp(delta s - delta^2 / 2)``, so ``c = ln(lam) / delta + delta / 2``. For
    ``delta == 0`` and ``lam == 1`` (the only level reached then) returns 0.
    """
    return torch.log(lam) / delta.clamp_min(1e-300) + 0.5 * delta


def _remaining_mass(log_lam: torch.Tensor, delta: torch.Tensor, safe: torch.Tensor, half: torch.Tensor) -> torch.Tensor:
    """:func:`grs_remaining_mass` from ``log(lam)``, with ``delta``'s derived tensors computed once.

    No mask is needed for ``delta == 0``: there ``lam == 1`` and the formula gives exactly 0; the
    product of ``exp(a) <= 1`` and ``-expm1(x) in [0, 1]`` needs no clamp.
    """
    c = torch.addcdiv(half, log_lam, safe)
    a = torch.special.log_ndtr(delta - c)  # log Phibar(c - delta)
    b = log_lam + torch.special.log_ndtr(-c)
    return torch.exp(a) * -torch.expm1(torch.clamp(b - a, max=0.0))


def grs_remaining_mass(lam: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """``G = Q(H) - lam P(H)`` with ``H = {rho >= lam}`` (eqs. 19 and 25), for ``lam >= 1``.

    Computed as ``Phibar(c - delta) * (1 - lam Phibar(c) / Phibar(c - delta))`` in log space.

    Args:
        lam: float64 levels (``>= 1``).
        delta: float64 ``delta >= 0``, broadcastable with ``lam``.

    Returns:
        float64 masses in ``[0, 1]``.
    """
    return _remaining_mass(torch.log(lam), delta, delta.clamp_min(1e-300), 0.5 * delta)


def grs_levels(delta: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Levels ``lambda_0..lambda_K`` and remaining masses ``G_1..G_{K+1}`` of Algorithm 3.

    ``lambda_j = lambda_{j-1} + G_j`` and ``G_{j+1} = G(lambda_j)`` (:func:`grs_remaining_mass`), with
    ``lambda_0 = 0``, ``G_1 = 1``; ``lambda_1 = 1`` whatever ``delta``, so its mass needs no ``log``
    (``G_2 = Phibar(-delta / 2) - Phibar(delta / 2)``, both terms from one ``log_ndtr``).

    Args:
        delta: float64 ``[*b]``.
        k: number of proposals ``K >= 0``.

    Returns:
        ``(lam [*b, K+1], G [*b, K+1])`` with ``lam[..., j] = lambda_j`` and ``G[..., j] = G_{j+1}``.
    """
    lam, g = _levels(delta, k)
    return torch.stack(lam, -1), torch.stack(g, -1)


def _levels(delta: torch.Tensor, k: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """:func:`grs_levels` as two lists of ``K + 1`` tensors shaped like ``delta`` (unstacked)."""
    zero = torch.zeros_like(delta)
    one = torch.ones_like(delta)
    lam, g = [zero], [one]
    if k == 0:
        return lam, g
    half = 0.5 * delta
    ab = torch.special.log_ndtr(torch.stack([half, -half]))  # c = delta / 2 at lambda_1 = 1
    a, b = ab.unbind(0)
    lam.append(one)
    g.append(torch.exp(a) * -torch.expm1(torch.clamp(b - a, max=0.0)))
    if k > 1:
        safe = delta.clamp_min(1e-300)
        for _ in range(k - 1):
            lam.append(lam[-1] + g[-1])
            g.append(_remaining_mass(torch.log(lam[-1]), delta, safe, half))
    return lam, g


RESIDUAL_STEPS = 1  # Newton steps of sample_grs_residual after its grid (see its docstring for the bound)
GRID = 64  # sample_grs_residual's grid search: points per level
GRID_LEVELS = 4  # ... and levels
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_WIDEN = 4e-5  # sample_grs_residual's ndtri bounds are widened by this: 1e-6 (1 + |ndtri|), |ndtri| <= 38.5


_GRID_CONSTANTS: dict = {}


def _grid_constants(device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights [2, GRID + 1] float64, pair [2] long)`` of :func:`sample_grs_residual`'s grid, made once per device:
    ``weights = [1 - f; f]`` with ``f = linspace(0, 1, GRID + 1)``, ``pair = [0, 1]``. Never written to."""
    key = str(device)
    if key not in _GRID_CONSTANTS:
        f = torch.linspace(0.0, 1.0, GRID + 1, dtype=torch.float64, device=device)
        _GRID_CONSTANTS[key] = (torch.stack([1.0 - f, f]), torch.arange(2, device=device))
    return _GRID_CONSTANTS[key]


_grid_constants("cpu")  # made at import, so that no counted or compiled call on the CPU makes them


def sample_grs_residual(
    delta, lam, mass, u, iterations: int = RESIDUAL_STEPS, grid_levels: int = GRID_LEVELS
) -> torch.Tensor:
    """Draw ``S`` from the normalised residual of eq. 17 by inverting its survival function at ``u``.

    The residual density is ``r(s) / G`` with ``r(s) = (phi(s - delta) - lam phi(s))_+ =
    phi(s - delta) (1 - exp(-delta (s - c)))`` on ``s >= c`` (:func:`grs_threshold`), and its survival
    is ``S(s) = (Phibar(s - delta) - lam Phibar(s)) / G``, evaluated in log space. ``S(s) = u`` is
    solved with a fixed number of tensor operations whatever the inputs (no data-dependent loop, no
    host synchronisation), in three stages:

    - *Bracket.* ``Phibar(s - delta) >= G S(s)`` gives ``root <= delta + Phibar^-1(u G)`` (tight when
      ``delta`` is large), intersected with ``max(c, delta) + sqrt(-2 log(u G)) + 2`` (from
      ``Phibar(x) <= exp(-x^2 / 2)``). Below: ``root >= c``, and ``Phi(root - delta) >= G (1 - u)``,
      also written on the survival side, where it stays informative when ``G (1 - u)`` rounds to 1:
      ``Phibar(root - delta) <= 1 - G (1 - u) <= 2 K Phibar(delta / 2) + u G`` (a coupling accepts
      each child with probability at most ``1 - TV(P, Q) = 2 Phibar(delta / 2)``), with ``K <= 1 +
      (lambda_K - 1) / G_{K+1}`` (the masses decrease). The ``ndtri`` bounds are widened by ``4e-5``
      (``1e-6 (1 + |ndtri|)`` for its rounding: ``|ndtri| <= 38.5`` in float64).
    - *Grid.* ``GRID_LEVELS = 4`` times, the survival at ``GRID - 1 = 63`` interior points of the
      bracket, in one evaluation, narrows it to the cell where it crosses ``u`` (the same test as a
      bisection, 6 bisection steps per level): the bracket shrinks ``2^24``-fold.
    - *Newton.* ``RESIDUAL_STEPS = 1`` Newton step on ``log(G S(s)) = log(G u)`` from the cell's
      midpoint, clamped into the cell (``fmax``/``fmin``: a NaN step goes to the cell's lower end), so
      where rounding noise dominates the survival the result stays in the grid's cell around the
      crossing, as a bisection's would. ``log S`` is concave (``r`` is log-concave: ``log r`` is a
      sum of concave terms), so Newton converges quadratically from a cell this small; near ``u =
      1``, where ``log S`` is flat, the step is the one of Newton on ``S`` itself (``log S - log u ~
      u - S``), whose quadratic constant there equals that of Newton on ``log(1 - S)``.

    Bound: the result differs from the root of the computed survival (a 64-step bisection of
    it) by at most ``8 eps max(1, |s|) + 32 nu(s)``, where ``nu(s) = eps max(1,
    -log Phibar(s - delta)) (Phibar(s - delta) + lam Phibar(s)) / r(s)`` is the survival's own rounding
    carried to ``s`` (the cancellation of its two terms and of their logs): every root finder of this
    survival is uncertain by about ``nu``. ``tests/core/test_residual.py`` checks the bound for ``delta`` in
    ``[1e-8, 300]``, ``lambda_K`` and ``G_{K+1}`` of ``K = 1..32`` and ``u`` from ``1e-300`` to
    ``1 - 2^-53``; measured on such grids (six seeds): at most ``3.6 eps max(1, |s|)`` where ``nu <= eps
    max(1, |s|)``, and ``2.2 nu`` beyond ``8 eps max(1, |s|)`` elsewhere. (Three grid levels with one
    step, or two with two, miss the bound by orders of magnitude at small ``delta`` and tiny ``u``.)
    Every row is computed from its own inputs, rounded the same in a batch of any size (``tests/core/
    test_rowwise.py``): the grid elementwise and :func:`logaddexp`, never a matrix product or a kernel whose
    vectorised body and scalar tail round differently.
    Cost: about 160 ATen operations whatever ``n`` (a 64-step bisection takes about 1110), but ``2 (GRID_LEVELS
    (GRID - 1) + RESIDUAL_STEPS) = 506`` ``log_ndtr`` evaluations per row (a bisection 128): fewer
    launches, four times the arithmetic. ``nu`` is large only at small ``delta`` (``G ~ delta``) and
    for ``u`` within ``1e-10`` of 1 (``r`` vanishes at ``c``).

    Args:
        delta: float64 ``[n]``, > 0 where used.
        lam: float64 ``[n]``, ``lambda_K >= 1``.
        mass: float64 ``[n]``, ``G_{K+1}``.
        u: float64 ``[n]`` uniforms in (0, 1).
        iterations: Newton steps (the bound above is for the defaults).
        grid_levels: grid levels.

    Returns:
        float64 ``[n]``; rows with ``delta == 0`` or ``mass == 0`` (never rejected) hold finite filler.
    """
    delta = delta.clamp_min(1e-300)
    log_lam = torch.log(lam)
    c = torch.addcdiv(0.5 * delta, log_lam, delta)  # grs_threshold
    log_mass = torch.log(mass.clamp_min(1e-300))
    log_u = torch.log(u)
    log_t = log_u + log_mass
    t_lin = torch.exp(log_t)
    # bracket: Phibar(s - delta) >= G S(s) and Phi(s - delta) >= G (1 - S(s)), widened for ndtri's error
    hi = torch.maximum(c, delta).add_(torch.sqrt(log_t * -2.0)).add_(2.0)  # Phibar(x) <= exp(-x^2 / 2), x >= 0
    q = torch.special.ndtri(t_lin)  # ndtri(0) = -inf leaves hi as it is
    hi = torch.minimum(hi, torch.sub(delta + _WIDEN, q).clamp_(min=c))
    # ndtri(1) = inf (G (1 - u) rounded to 1) bounds nothing: it becomes -inf, so lo = c ...
    q = torch.special.ndtri((1.0 - u) * mass).nan_to_num_(posinf=-math.inf)
    # ... but the survival side stays informative there: Phibar(root - delta) = 1 - G (1 - u) <=
    # 2 K Phibar(delta / 2) + u G (a child is accepted with probability at most 1 - TV(P, Q) each),
    # and K <= 1 + (lambda_K - 1) / G_{K+1} (the masses decrease)
    p_up = torch.addcmul(
        t_lin, (lam - 1.0).div_(mass.clamp_min(1e-300)).add_(1.0), torch.special.erfc(delta * (0.5 * math.sqrt(0.5)))
    )
    q = torch.maximum(q, torch.special.ndtri(p_up.clamp_(max=1.0)).neg_())
    z_lo = torch.add(delta - _WIDEN, q)
    lo = torch.minimum(torch.maximum(z_lo, c), hi)
    # grid levels: the survival at GRID - 1 interior points of the bracket in one evaluation; the
    # bracket becomes the cell where it crosses u (a static-shape GRID-ary bisection). The cell's
    # ends and the points are lo (1 - f) + hi f with f = 0, 1/GRID, ..., 1, two products and a sum,
    # each rounded once: elementwise, never a matrix product, whose rounding of a row depends on the
    # batch's size and the BLAS's kernel (a row alone and inside a batch would differ in the last bit)
    ends = torch.stack([lo, hi], 1)
    if grid_levels:
        weights, pair = _grid_constants(u.device)
        w_lo, w_hi = weights.unbind(0)
        d2, lam2, t2 = delta[:, None], log_lam[:, None], log_t[:, None]
        for _ in range(grid_levels):
            grid = torch.mul(ends[:, :1], w_lo).add_(torch.mul(ends[:, 1:], w_hi))  # [n, GRID + 1]: lo, the points, hi
            pts = grid[:, 1:GRID]
            # S(s) > u, i.e. Phibar(s - delta) > lam Phibar(s) + u G, in log space: the root lies above
            above = torch.special.log_ndtr(d2 - pts) > logaddexp(torch.special.log_ndtr(-pts) + lam2, t2)
            ends = grid.gather(1, above.sum(1, keepdim=True) + pair)
    lo, hi = ends.unbind(1)
    s = torch.lerp(lo, hi, 0.5)
    if iterations:
        # Newton on log(G S(s)) towards log(G u): d/ds log(G S) = -r / (G S), so the step is
        # (log(G S) - log(G u)) G S / r, all in log space
        for _ in range(iterations):
            nz = delta - s
            a = torch.special.log_ndtr(nz)  # log Phibar(s - delta)
            e = torch.special.log_ndtr(-s) + log_lam - a
            log_gs = a + torch.log(-torch.expm1(e.clamp_(max=-1e-300)))  # log(G S(s)), as the grid
            # log r(s) = log phi(s - delta) + log(1 - exp(-delta (s - c)))
            log_r = torch.addcmul(torch.log(torch.expm1(delta * (c - s)) * -_INV_SQRT_2PI), nz, nz, value=-0.5)
            step = torch.addcmul(s, log_gs - log_t, torch.exp(log_gs - log_r))
            s = torch.fmin(torch.fmax(step, lo), hi)  # never leaves the grid's cell; a NaN step goes to lo
    return s


def grs_select(
    delta: torch.Tensor, s_hat: torch.Tensor, rows, residual: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scalar part of Algorithm 3: which child to accept, and the residual projection.

    Child ``j`` is accepted with probability ``beta_j = min(1, (rho_j - lambda_{j-1})_+ / G_j)``, that
    is where ``u_j G_j <= rho_j - lambda_{j-1}``, tested for every child at once as ``log rho_j >=
    log(lambda_{j-1} + u_j G_j)`` (no division, so ``G_j = 0`` needs no guard); the first accepted in
    drafting order is taken. The residual is drawn for every row (static shapes, no host
    synchronisation) and kept where all were rejected.

    Args:
        delta: float64 ``[n]``.
        s_hat: float64 ``[n, K]`` projections, examined in column order.
        rows: per-row uniform source (``uniform(m) -> [n, m]``); draws ``K`` then 1 per row.
        residual: False: the choice alone (``s_res`` is None and the residual's uniform is not drawn; the
            index is the same, from the same ``K`` uniforms).

    Returns:
        ``(index [n] long, s_res [n] float64)``; ``index == K`` where every child was rejected,
        and then ``s_res`` is the residual draw (elsewhere finite filler, which
        :func:`specsamp.coupling.reconstruct` ignores).
    """
    n, k = s_hat.shape
    u = rows.uniform(k)
    lam, g = _levels(delta, k)
    d = delta[:, None]
    log_rho = torch.addcmul(d * s_hat, d, d, value=-0.5)  # log rho = delta s - delta^2 / 2
    if k == 1:  # lambda_0 + u G_1 = 0 + u 1 = u exactly
        accept = log_rho >= torch.log(u)
    else:
        accept = log_rho >= torch.log(torch.addcmul(torch.stack(lam[:k], 1), u, torch.stack(g[:k], 1)))
    index = accept.logical_not().cumprod(1).sum(1)  # leading rejections: the first accepted, or K
    if not residual:
        return index, None
    u_res = rows.uniform(1)[:, 0]
    s_res = sample_grs_residual(delta, lam[k], g[k], u_res)
    return index, s_res
