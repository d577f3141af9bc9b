"""Closed-form acceptance probabilities and expected progress of speculative rounds.

All functions take ``delta = ||mean_q - mean_p|| / sigma`` (array-like, >= 0) and return numpy float64.

- :func:`rmc_acceptance`: eq. 20, ``2 Phibar(delta / 2)``.
- :func:`dgrs_acceptance`: eqs. 19/25, ``1 - G_{K+1}``.
- :func:`dgrs_positional`: ``P(J = k) = G_k - G_{k+1}`` for D-GRS (Lemma III.1 of Flamich and Theis).
- :func:`list_coupling_bound`: ``alpha*_K = 1 - max_c [Phi(c)^K - Phi(c - delta)]``, an upper bound on
  the acceptance of *any* exact coupling of ``K`` i.i.d. ``N(0, 1)`` children with an ``N(delta, 1)``
  target: for the event ``A = {s <= c}``, ``P(Y in A) <= P(all children in A) + P(Y not a child)``.
- :func:`expected_steps`: expected committed steps of one round of Algorithm 1 on any tree, given
  positional acceptance probabilities per depth.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from scipy import special  # optimize and stats are imported where used: they cost ~1 s at start-up

from .grs import grs_levels
from .trees import DraftTree, check_int


def check_delta(delta) -> np.ndarray:
    """``delta`` (any shape) as a float64 array; ``ValueError`` unless every entry is finite and >= 0."""
    d = np.asarray(delta, dtype=np.float64)
    if np.any(~np.isfinite(d)) or np.any(d < 0):
        raise ValueError(f"delta must be finite and >= 0, got {delta!r}")
    return d


def _k(K) -> int:
    return check_int("K", K)


def rmc_acceptance(delta) -> np.ndarray:
    """Acceptance of reflection maximal coupling, ``2 Phibar(delta / 2)`` (eq. 20).

    Raises:
        ValueError: negative or non-finite ``delta``.
    """
    return 2.0 * special.ndtr(-check_delta(delta) / 2.0)


def rmc_positional(delta, K: int) -> np.ndarray:
    """``P(J = 1)`` of reflection maximal coupling as a positional vector: ``[*delta, 1]``, eq. 20.

    Raises:
        ValueError: ``K != 1`` (the rule couples one child per parent), or a bad ``delta``.
    """
    if K != 1:
        raise ValueError(f"coupling='rmc' couples one child per parent (K=1), got K={K}")
    return np.asarray(rmc_acceptance(delta))[..., None]


def dgrs_levels(delta, K: int) -> tuple[np.ndarray, np.ndarray]:
    """Levels ``lambda_0..K`` and remaining masses ``G_1..G_{K+1}`` of Algorithm 3.

    Returns:
        ``(lam [*delta, K+1], G [*delta, K+1])``.

    Raises:
        ValueError: bad ``delta`` or ``K``.
    """
    d = torch.tensor(check_delta(delta))  # a copy: the caller's array may be read-only
    lam, g = grs_levels(d, _k(K))
    return lam.numpy(), g.numpy()


def dgrs_acceptance(delta, K: int) -> np.ndarray:
    """Probability that D-GRS accepts one of ``K`` children, ``1 - G_{K+1}`` (eqs. 18--19).

    Raises:
        ValueError: bad ``delta`` or ``K``.
    """
    _, g = dgrs_levels(delta, K)
    return 1.0 - g[..., -1]


def dgrs_positional(delta, K: int) -> np.ndarray:
    """``P(J = k)`` for ``k = 1..K``: the probability that D-GRS accepts child ``k``.

    Returns:
        ``[*delta, K]``; the rows sum to :func:`dgrs_acceptance`.

    Raises:
        ValueError: bad ``delta`` or ``K``.
    """
    _, g = dgrs_levels(delta, K)
    return g[..., :-1] - g[..., 1:]


def list_coupling_bound(delta, K: int) -> np.ndarray:
    """``alpha*_K(delta) = 1 - max_c [Phi(c)^K - Phi(c - delta)]``.

    No exact coupling of ``K`` i.i.d. ``N(0, 1)`` children with an ``N(delta, 1)`` target accepts a child
    more often. Equals :func:`rmc_acceptance` at ``K = 1``. The maximum over ``c`` is found on a grid
    and refined with a bounded scalar search.

    Raises:
        ValueError: bad ``delta`` or ``K``.
    """
    from scipy import optimize

    d = check_delta(delta)
    K = _k(K)
    out = np.empty(d.shape, dtype=np.float64)
    for i, di in np.ndenumerate(d):

        def neg(c, di=di):
            return -(np.exp(K * special.log_ndtr(c)) - special.ndtr(c - di))

        grid = np.linspace(-12.0, di + 12.0, 4001)
        j = int(np.argmin(neg(grid)))
        lo, hi = grid[max(j - 1, 0)], grid[min(j + 1, grid.size - 1)]
        res = optimize.minimize_scalar(neg, bounds=(lo, hi), method="bounded", options={"xatol": 1e-12})
        best = max(-res.fun, -neg(grid[j]), 0.0)
        out[i] = 1.0 - best
    return out


PositionalFn = Callable[[int, int], np.ndarray]


def expected_steps(tree: DraftTree, positional: PositionalFn) -> float:
    """Expected steps one round of Algorithm 1 commits on ``tree``.

    A committed node ``u`` with children commits one more step for sure (an accepted child or the
    residual) and continues below child ``j`` with probability ``P(J = j)``:
    ``E[u] = 1 + sum_j P(J = j) E[child_j]``, and ``E[leaf] = 0``.

    Args:
        tree: the round's (restricted) draft tree.
        positional: ``positional(depth, K) -> [K]`` acceptance probability of each child position
            at a parent of the given depth (0 for the root) with ``K`` children; e.g.
            ``lambda l, K: dgrs_positional(delta[l], K)``.

    Returns:
        Expected committed steps per round (per target call).
    """
    steps = np.zeros(len(tree), dtype=np.float64)
    parent = tree.parent
    for l in range(tree.max_depth, 0, -1):
        layer = tree.layer(l)
        par = parent[layer]
        pos = layer - tree.first_child[par]
        w = np.empty(layer.size)
        # group by parent width to call ``positional`` once per (depth, K)
        widths = tree.num_children[par]
        for k in np.unique(widths):
            sel = widths == k
            probs = np.asarray(positional(l - 1, int(k)), dtype=np.float64)
            w[sel] = probs[pos[sel]]
        prev = tree.layer(l - 1)
        contrib = np.bincount(par - prev[0], weights=w * steps[layer], minlength=prev.size)
        internal = tree.num_children[prev] > 0
        steps[prev] = np.where(internal, 1.0 + contrib, 0.0)
    return float(steps[0])


def chain_steps(alpha: float, L: int) -> float:
    """Expected committed steps of a chain of ``L`` with constant acceptance ``alpha``: ``sum_{i<L} alpha^i``.

    (Accepted prefix ``sum_{i=1}^{L} alpha^i`` plus one residual step unless all ``L`` were accepted;
    appendix C.2.) Tends to ``1 / (1 - alpha)``.
    """
    return float(sum(alpha**i for i in range(L)))
