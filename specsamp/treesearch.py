"""Draft-tree search: the tree of at most ``B`` drafted states that maximises expected steps per round.

Model (:func:`specsamp.theory.expected_steps`): a committed node ``u`` at depth ``d`` with ``K``
children accepts its ``j``-th drafted child with probability ``P_d(j | K) = positional(d, K)[j]`` and
continues below it; otherwise the round commits the residual and stops. So
``E[u] = 1 + sum_j P_d(j | K) E[child_j]`` and ``E[leaf] = 0``, and a tree's value is ``E[root]``.

Dynamic program over (depth, budget), Sequoia-style (Chen et al., 2024, "Sequoia: scalable, robust,
and hardware-aware speculative decoding", section 3.1), extended to positional vectors that depend on
the width ``K`` (as markmax's do; D-GRS's do not). With ``F_d(b)`` the best value of a subtree rooted
at depth ``d`` with at most ``b`` drafted descendants:

    F_L(b) = 0,  F_d(0) = 0,
    F_d(b) = max(F_d(b - 1), max_{1 <= K <= min(b, W)} 1 + H_K^{d,K}(b - K)),
    H_0(r) = 0,  H_j^{d,K}(r) = max_{0 <= x <= r} H_{j-1}^{d,K}(r - x) + P_d(j | K) F_{d+1}(x),

(``H_j`` spreads ``r`` drafted states over the subtrees of the first ``j`` children). Subtrees below
different children add independently, so the recursion is exact; ``F_0(B)`` is the optimum over all
trees with at most ``B`` drafted states, depth at most ``L`` and widths at most ``W``. Cost
``O(L W^2 B^2)`` (max-plus convolutions in numpy) plus ``L W`` positional evaluations, memoised.

Also here: :func:`profile_positional` turns a per-depth displacement profile (``delta`` measured in a
calibration run, or fitted by :func:`deltas_from_acceptance` to per-depth acceptance rates) into the
``positional`` callable for ``dgrs``, ``markmax`` or ``rmc``; :func:`tree_for_config` serves the
runner's ``tree=optimal``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import lru_cache

import numpy as np

from . import theory
from .trees import DraftTree

PositionalFn = Callable[[int, int], np.ndarray]
_TIE = 1e-12  # a larger subtree must beat a smaller one by this much (no nodes added on rounding noise)


def _check_int(name: str, value, lo: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < lo:
        raise ValueError(f"{name}={value!r} is invalid: must be an integer >= {lo}")
    return int(value)


class _Positional:
    """Memoised, validated ``positional(depth, K)``."""

    def __init__(self, fn: PositionalFn):
        self.fn = fn
        self.cache: dict[tuple[int, int], np.ndarray] = {}

    def __call__(self, d: int, K: int) -> np.ndarray:
        key = (d, K)
        if key not in self.cache:
            p = np.asarray(self.fn(d, K), dtype=np.float64).reshape(-1)
            if p.shape != (K,) or not np.all(np.isfinite(p)) or np.any(p < -1e-12) or p.sum() > 1 + 1e-9:
                raise ValueError(
                    f"positional({d}, {K}) returned {p!r}: expected {K} probabilities >= 0 summing to <= 1"
                )
            self.cache[key] = np.clip(p, 0.0, 1.0)
        return self.cache[key]


@lru_cache(maxsize=8)
def _conv_index(n: int) -> tuple[np.ndarray, np.ndarray]:
    r = np.arange(n)[:, None]
    x = np.arange(n)[None, :]
    return np.clip(r - x, 0, None), x <= r


def _maxplus(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``c[r] = max_{x <= r} a[r - x] + b[x]`` and its argmax ``x`` (first on ties)."""
    idx, mask = _conv_index(a.size)
    m = np.where(mask, a[idx] + b[None, :], -np.inf)
    arg = m.argmax(1)
    return m[np.arange(a.size), arg], arg


def _children_knapsack(probs: np.ndarray, f_next: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
    """``H_K`` for one (depth, K) and the argmax tables ``x_j(r)``, ``j = 1..K``."""
    h = np.zeros_like(f_next)
    args = []
    for pj in probs:
        h, arg = _maxplus(h, pj * f_next)
        args.append(arg)
    return h, args


def _solve(budget: int, pos: _Positional, max_depth: int, max_width: int):
    n = budget + 1
    F = [None] * (max_depth + 1)
    choice = [None] * (max_depth + 1)
    F[max_depth] = np.zeros(n)
    choice[max_depth] = np.zeros(n, dtype=np.int64)
    for d in range(max_depth - 1, -1, -1):
        best = np.zeros(n)
        width = np.zeros(n, dtype=np.int64)
        for K in range(1, min(budget, max_width) + 1):
            h, _ = _children_knapsack(pos(d, K), F[d + 1])
            val = np.full(n, -np.inf)
            val[K:] = 1.0 + h[: n - K]
            better = val > best + _TIE
            best = np.where(better, val, best)
            width = np.where(better, K, width)
        # ties go to the smaller subtree: carry b - 1's (width 0 marks the carry; F stays nondecreasing)
        for b in range(1, n):
            if best[b] <= best[b - 1] + _TIE:
                best[b], width[b] = best[b - 1], 0
        F[d] = best
        choice[d] = width
    return F, choice


def _build(d: int, b: int, F, choice, pos: _Positional) -> list:
    """Nested children lists of the optimal subtree at depth ``d`` with budget ``b``."""
    while b > 0 and choice[d][b] == 0:
        b -= 1
    if b == 0:
        return []
    K = int(choice[d][b])
    _, args = _children_knapsack(pos(d, K), F[d + 1])
    r = b - K
    alloc = [0] * K
    for j in range(K - 1, -1, -1):
        alloc[j] = int(args[j][r])
        r -= alloc[j]
    return [_build(d + 1, x, F, choice, pos) for x in alloc]


def tree_from_nested(children: list) -> DraftTree:
    """Breadth-first :class:`DraftTree` from nested lists (``[]`` is a leaf; list order = drafting order).

    Args:
        children: the root's children, each itself a list of its children.

    Returns:
        :class:`DraftTree` with nodes by depth, then by parent, siblings in list order.
    """
    parent = [-1]
    queue = [(0, children)]
    head = 0
    while head < len(queue):
        node, kids = queue[head]
        head += 1
        for kid in kids:
            parent.append(node)
            queue.append((len(parent) - 1, kid))
    return DraftTree(np.asarray(parent))


def optimal_tree(budget: int, positional: PositionalFn, max_depth: int, max_width: int | None = None) -> DraftTree:
    """The draft tree with at most ``budget`` drafted states maximising :func:`theory.expected_steps`.

    Exact dynamic program (module docstring). Ties go to the smaller tree, so the result may draft
    fewer than ``budget`` states when more would not help (e.g. beyond a depth where ``delta = 0``).

    Args:
        budget: drafted states ``B >= 1`` (nodes other than the root).
        positional: ``positional(depth, K) -> [K]`` acceptance probability of each child position of a
            parent at ``depth`` (0 = root) with ``K`` children, e.g. from :func:`profile_positional`.
        max_depth: deepest allowed level ``L >= 1`` (a round never uses more than the steps left).
        max_width: widest allowed node (default ``budget``); the cost grows as ``max_width^2``.

    Returns:
        A valid breadth-first :class:`DraftTree`.

    Raises:
        ValueError: a non-integer or out-of-range ``budget``, ``max_depth`` or ``max_width``, or a
            ``positional`` that does not return ``K`` probabilities summing to at most 1.
    """
    budget = _check_int("budget", budget, 1)
    max_depth = _check_int("max_depth", max_depth, 1)
    max_width = budget if max_width is None else _check_int("max_width", max_width, 1)
    pos = _Positional(positional)
    F, choice = _solve(budget, pos, max_depth, max_width)
    return tree_from_nested(_build(0, budget, F, choice, pos))


def optimal_value(budget: int, positional: PositionalFn, max_depth: int, max_width: int | None = None) -> float:
    """``F_0(budget)``: the expected steps of :func:`optimal_tree` (same arguments and errors)."""
    budget = _check_int("budget", budget, 1)
    max_depth = _check_int("max_depth", max_depth, 1)
    max_width = budget if max_width is None else _check_int("max_width", max_width, 1)
    F, _ = _solve(budget, _Positional(positional), max_depth, max_width)
    return float(F[0][budget])


# ----------------------------------------------------------------------------------------------
# positional probabilities from a displacement profile


def _coupling_positional(coupling) -> Callable[[np.ndarray, int], np.ndarray]:
    if callable(coupling):
        return coupling
    if coupling == "dgrs":
        return theory.dgrs_positional
    if coupling == "markmax":
        from .listcoupling import markmax_positional

        return markmax_positional
    if coupling == "rmc":

        def rmc_positional(delta, K):
            if K != 1:
                raise ValueError(f"coupling='rmc' couples one child per parent (K=1), got K={K}")
            return np.asarray(theory.rmc_acceptance(delta))[..., None]

        return rmc_positional
    raise ValueError(f"coupling={coupling!r} has no positional theory here; valid: 'dgrs', 'markmax', 'rmc' or a callable")


def _profile(deltas) -> np.ndarray:
    d = np.asarray(deltas, dtype=np.float64).reshape(-1)
    if d.size == 0 or np.any(~np.isfinite(d)) or np.any(d < 0):
        raise ValueError(f"deltas={deltas!r} is invalid: need a non-empty list of finite values >= 0")
    return d


def profile_positional(deltas: Sequence[float], coupling="dgrs") -> PositionalFn:
    """``positional(depth, K)`` from a per-depth displacement profile.

    Args:
        deltas: ``deltas[d]`` = ``delta = ||mean_q - mean_p|| / sigma`` at parents of depth ``d`` (0 =
            root); deeper parents reuse the last value.
        coupling: ``"dgrs"`` (:func:`theory.dgrs_positional`), ``"markmax"``
            (:func:`specsamp.listcoupling.markmax_positional`), ``"rmc"`` (``K = 1`` only), or a
            callable ``(delta_array, K) -> [..., K]``.

    Returns:
        Callable ``(depth, K) -> [K]`` float64; each ``K`` is evaluated once for the whole profile.

    Raises:
        ValueError: negative, non-finite or empty ``deltas``; unknown ``coupling``.
    """
    d = _profile(deltas)
    fn = _coupling_positional(coupling)
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
    K = _check_int("K", K, 1)
    fn = _coupling_positional(coupling)
    lo, up = np.zeros_like(a), np.full_like(a, float(hi))
    for _ in range(60):
        mid = 0.5 * (lo + up)
        acc = np.asarray(fn(mid, K)).sum(-1)
        right = acc > a  # still accepting more than measured: delta is larger
        lo, up = np.where(right, mid, lo), np.where(right, up, mid)
    return 0.5 * (lo + up)


def tree_for_config(budget: int, v: dict, cfg=None) -> DraftTree:
    """The runner's ``tree=optimal``: optimal tree for the run's coupling and displacement profile.

    Reads from ``cfg``: ``delta_profile`` (required: per-depth ``delta``, e.g. from
    :func:`deltas_from_acceptance` on a calibration run), ``max_depth`` (default: the speculative
    horizon ``steps - 2``), ``max_width`` (default ``min(budget, 32)``).

    Args:
        budget: drafted-state budget ``B``.
        v: validated config (:func:`specsamp.experiment.validate`): ``coupling`` and ``steps`` are used.
        cfg: the raw config.

    Returns:
        :class:`DraftTree`.

    Raises:
        ValueError: no ``delta_profile`` given, or any invalid value (named in the message).
    """
    def get(key):
        if cfg is None:
            return None
        return cfg.get(key) if hasattr(cfg, "get") else getattr(cfg, key, None)

    profile = get("delta_profile")
    if profile is None:
        raise ValueError(
            "tree=optimal needs delta_profile=[d_0, d_1, ...]: the displacement delta per depth, e.g. from "
            "specsamp.treesearch.deltas_from_acceptance on a calibration run's per-depth acceptance"
        )
    try:
        profile = _profile(list(profile))
    except (TypeError, ValueError):
        raise ValueError(f"delta_profile={profile!r} is invalid: need a non-empty list of finite values >= 0") from None
    horizon = max(int(v.get("steps", 3)) - 2, 1)
    max_depth = get("max_depth")
    max_depth = min(budget, horizon) if max_depth is None else max_depth
    max_width = get("max_width")
    max_width = min(budget, 32) if max_width is None else max_width
    return optimal_tree(budget, profile_positional(profile, v["coupling"]), max_depth, max_width)
