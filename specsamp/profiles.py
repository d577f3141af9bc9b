"""Positional acceptance from a displacement profile: what the tree search (:mod:`specsamp.treesearch`) optimises.

A profile is ``delta = ||mean_q - mean_p|| / sigma`` per depth of a round (section 3.1), measured in a calibration
run or fitted to measured per-depth acceptance (:func:`deltas_from_acceptance`, :func:`deltas_by_root`).
:func:`profile_positional` turns it into ``positional(depth, K)``, the probabilities that a node of that depth with
``K`` drafted children accepts its ``j``-th child, from the coupling's own theory (``Coupling.positional``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from .trees import check_int

PositionalFn = Callable[[int, int], np.ndarray]


def coupling_positional(coupling) -> Callable[[np.ndarray, int], np.ndarray]:
    """The positional theory of ``coupling``: a :class:`~specsamp.coupling.Coupling`'s ``positional``
    attribute, that of the coupling registered under a name, or a callable itself."""
    from .coupling import COUPLINGS, Coupling

    if isinstance(coupling, str) and coupling in COUPLINGS:
        coupling = COUPLINGS.get(coupling)
    if isinstance(coupling, Coupling):
        if coupling.positional is None:
            raise ValueError(
                f"coupling={coupling.name!r} has no positional theory (its Coupling.positional is None); "
                "tree=optimal needs one: register_coupling(..., positional=fn)"
            )
        return coupling.positional
    if callable(coupling):
        return coupling
    with_theory = [n for n in COUPLINGS.names() if COUPLINGS.get(n).positional is not None]
    raise ValueError(f"coupling={coupling!r} has no positional theory here; valid: {with_theory} or a callable")


def check_profile(deltas) -> np.ndarray:
    """``deltas`` as float64 ``[L]``; ``ValueError`` unless it is a non-empty list of finite values ``>= 0``."""
    d = np.asarray(deltas, dtype=np.float64).reshape(-1)
    if d.size == 0 or np.any(~np.isfinite(d)) or np.any(d < 0):
        raise ValueError(f"deltas={deltas!r} is invalid: need a non-empty list of finite values >= 0")
    return d


def profile_positional(deltas: Sequence[float], coupling="dgrs") -> PositionalFn:
    """``positional(depth, K)`` from a per-depth displacement profile.

    Args:
        deltas: ``deltas[d]`` = ``delta = ||mean_q - mean_p|| / sigma`` at parents of depth ``d`` (0 =
            root); deeper parents reuse the last value.
        coupling: a :class:`~specsamp.coupling.Coupling` or a registered coupling's name, whose
            ``positional`` theory is used (``dgrs``: :func:`theory.dgrs_positional`; ``markmax``:
            :func:`specsamp.listcoupling.markmax_positional`; ``rmc``: ``K = 1`` only), or a callable
            ``(delta_array, K) -> [..., K]`` itself.

    Returns:
        Callable ``(depth, K) -> [K]`` float64; each ``K`` is evaluated once for the whole profile.

    Raises:
        ValueError: negative, non-finite or empty ``deltas``; unknown ``coupling``, or one without theory.
    """
    d = check_profile(deltas)
    fn = coupling_positional(coupling)
    table: dict[int, np.ndarray] = {}

    def positional(depth: int, K: int) -> np.ndarray:
        if K not in table:
            table[K] = np.asarray(fn(d, K), dtype=np.float64).reshape(d.size, K)
        return table[K][min(int(depth), d.size - 1)]

    return positional


def deltas_from_acceptance(acceptance: Sequence[float], K: int, coupling="dgrs", hi: float = 40.0) -> np.ndarray:
    """Per-depth ``delta`` whose theoretical acceptance matches measured per-depth acceptance rates.

    Acceptance decreases in ``delta`` for every rule here, so each value is found by bisection
    (60 steps on ``[0, hi]``); rates at or above the rule's acceptance at ``delta = 0`` give 0.

    Args:
        acceptance: measured rate per depth, e.g. ``accepts.sum(0) / attempts.sum(0)`` of a
            :class:`specsamp.sampler.SampleResult`, in ``[0, 1]``.
        K: width the rates were measured at.
        coupling: as in :func:`profile_positional`.
        hi: upper end of the search.

    Returns:
        float64 ``[len(acceptance)]``.

    Raises:
        ValueError: rates outside ``[0, 1]`` or non-finite; bad ``K`` or ``coupling``.
    """
    a = np.asarray(acceptance, dtype=np.float64).reshape(-1)
    if a.size == 0 or np.any(~np.isfinite(a)) or np.any((a < 0) | (a > 1)):
        raise ValueError(f"acceptance={acceptance!r} is invalid: need rates in [0, 1]")
    K = check_int("K", K, 1)
    fn = coupling_positional(coupling)
    lo, up = np.zeros_like(a), np.full_like(a, float(hi))
    for _ in range(60):
        mid = 0.5 * (lo + up)
        acc = np.asarray(fn(mid, K)).sum(-1)
        right = acc > a  # still accepting more than measured: delta is larger
        lo, up = np.where(right, mid, lo), np.where(right, up, mid)
    return 0.5 * (lo + up)


def deltas_by_root(attempts, accepts, K: int, coupling="dgrs", min_attempts: int = 24) -> np.ndarray:
    """Per-(root state index, depth) ``delta`` table from a calibration run's per-root acceptance counts.

    Rounds rooted at one state index are few (a 64-trajectory run has about 10-40 per index at depth 1,
    fewer deeper), so each cell pools the counts of the root indices ``n - h .. n + h`` at the same
    depth, with the smallest ``h`` that gives at least ``min_attempts`` attempts (a kernel estimate
    with an adaptive window; the rate's standard error is then at most ``0.5 / sqrt(min_attempts)``).
    A depth never attempted at all takes the next shallower depth's value, as
    :func:`profile_positional` does beyond the profile.

    Args:
        attempts, accepts: ``[T, L]`` counts, e.g. ``SampleResult.attempts_by_root`` and
            ``accepts_by_root`` (row ``n``: rounds rooted at state index ``n``; column ``d``: depth ``d + 1``).
        K: width of the calibration tree's nodes.
        coupling: as in :func:`profile_positional`.
        min_attempts: attempts each cell pools at least (when the run has that many at its depth).

    Returns:
        float64 ``[T, L]``: row ``n`` is the profile of rounds rooted at ``n``.

    Raises:
        ValueError: counts of different shapes, negative, or accepts above attempts; bad ``K``.
    """
    att = np.asarray(attempts, dtype=np.float64)
    acc = np.asarray(accepts, dtype=np.float64)
    if att.ndim != 2 or att.shape != acc.shape or np.any(acc < 0) or np.any(acc > att):
        raise ValueError(
            f"attempts {att.shape} and accepts {acc.shape} must be [T, L] counts with 0 <= accepts <= attempts"
        )
    min_attempts = check_int("min_attempts", min_attempts, 1)
    T, L = att.shape
    # cumulative sums over root indices: window sums in O(1)
    ca = np.concatenate([np.zeros((1, L)), np.cumsum(att, 0)])
    cc = np.concatenate([np.zeros((1, L)), np.cumsum(acc, 0)])
    rates = np.full((T, L), np.nan)
    n = np.arange(T)
    for d in range(L):
        if ca[-1, d] == 0:
            continue
        # the smallest half-width h per root, by bisection over all roots at once (the window's attempts grow with h,
        # and h = T - 1 spans every root)
        below, h = np.zeros(T, dtype=np.int64), np.full(T, T - 1, dtype=np.int64)
        while np.any(below < h):
            mid = (below + h) // 2
            lo, hi = np.maximum(0, n - mid), np.minimum(T, n + mid + 1)
            ok = (ca[hi, d] - ca[lo, d] >= min_attempts) | ((lo == 0) & (hi == T))
            h, below = np.where(ok, mid, h), np.where(ok, below, mid + 1)
        lo, hi = np.maximum(0, n - h), np.minimum(T, n + h + 1)
        rates[:, d] = (cc[hi, d] - cc[lo, d]) / (ca[hi, d] - ca[lo, d])
    out = np.zeros((T, L))
    for d in range(L):
        if np.isnan(rates[0, d]):
            out[:, d] = out[:, d - 1] if d > 0 else 0.0
        else:
            out[:, d] = deltas_from_acceptance(rates[:, d], K, coupling)
    return out
