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
trees with at most ``B`` drafted states, depth at most ``L`` and widths at most ``W``. Tables at depth
``d`` stop at ``cap_d = min(B, W (1 + cap_{d+1}))``, the most states such a subtree can hold. Cost
``O(L W cap^2)`` pair updates when the positional vectors of narrower nodes are prefixes of wider ones
(D-GRS: one chain of products serves every width), ``O(L W^2 cap^2)`` otherwise (markmax), in blocked
numpy max-plus products with ``O(L cap)`` memory; :func:`search_cost` estimates it before any work.

In :mod:`specsamp.profiles`: :func:`profile_positional` turns a per-depth displacement profile (``delta`` measured in a
calibration run, or fitted by :func:`deltas_from_acceptance` to per-depth acceptance rates) into the
``positional`` callable for ``dgrs``, ``markmax`` or ``rmc``. The runner's ``tree=optimal``
(:mod:`specsamp.runner.build`) calibrates a profile, checks the search's cost, then calls :func:`optimal_tree`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from .profiles import (  # noqa: F401  (re-exported: the profiles the search reads are public here too)
    PositionalFn,
    coupling_positional,
    deltas_by_root,
    deltas_from_acceptance,
    profile_positional,
)
from .trees import DraftTree, check_int

_TIE = 1e-12  # a larger subtree must beat a smaller one by this much (no nodes added on rounding noise)


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


_BLOCK = 1 << 21  # elements of one max-plus block (16 MiB of float64): the search's working memory
# measured: the blocked max-plus below does about this many (r, x) pair updates per second on one core
PAIRS_PER_SECOND = 4e8
# refusal threshold of :func:`optimal_tree` (and the runner): about two minutes at the rate above
MAX_PAIRS = 5e10


def _maxplus(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``c[r] = max_{0 <= x <= min(r, len(b) - 1)} a[r - x] + b[x]`` and its argmax ``x`` (first on ties).

    Rows are done in blocks of at most ``_BLOCK`` pairs over a strided view, so the memory is
    ``O(len(a) + _BLOCK)``, never ``len(a) x len(b)``.
    """
    na, nb = a.size, b.size
    pad = np.concatenate([np.full(nb - 1, -np.inf), a])
    win = np.lib.stride_tricks.sliding_window_view(pad, nb)[:, ::-1]  # win[r, x] = a[r - x] (-inf for x > r)
    c = np.empty(na)
    arg = np.empty(na, dtype=np.int64)
    rows = max(1, _BLOCK // nb)
    for r0 in range(0, na, rows):
        m = win[r0 : r0 + rows] + b[None, :]
        i = m.argmax(1)
        arg[r0 : r0 + rows] = i
        c[r0 : r0 + rows] = m[np.arange(i.size), i]
    return c, arg


def _children_knapsack(probs: np.ndarray, f_next: np.ndarray, n: int) -> tuple[np.ndarray, list[np.ndarray]]:
    """``H_K(r)``, ``r < n``, for one (depth, K) and the argmax tables ``x_j(r)``, ``j = 1..K``."""
    h = np.zeros(n)
    args = []
    for pj in probs:
        h, arg = _maxplus(h, pj * f_next)
        args.append(arg)
    return h, args


def _caps(budget: int, max_depth: int, max_width: int) -> list[int]:
    """``cap[d]``: most drafted states a subtree rooted at depth ``d`` can hold (depth and width limits)."""
    cap = [0] * (max_depth + 1)
    for d in range(max_depth - 1, -1, -1):
        cap[d] = min(budget, max_width * (1 + cap[d + 1]))
    return cap


def _shared_prefix(pos: _Positional, d: int, width: int) -> bool:
    """True when ``positional(d, K) == positional(d, width)[:K]`` for every ``K`` (D-GRS): then one chain of
    ``width`` max-plus products serves every ``K`` and the cost is linear, not quadratic, in the width."""
    first = pos(d, 1)  # validated from the narrowest up, so a bad positional is reported at K = 1
    full = pos(d, width)
    return np.array_equal(first, full[:1]) and all(np.array_equal(pos(d, K), full[:K]) for K in range(2, width))


def search_cost(budget: int, max_depth: int, max_width: int, shared_prefix: bool = True) -> dict:
    """Up-front cost of :func:`optimal_tree` (no positional evaluated, nothing allocated).

    Args:
        budget, max_depth, max_width: as in :func:`optimal_tree`.
        shared_prefix: whether the rule's positional vectors are prefixes of each other (D-GRS: yes;
            markmax: no, every width is a separate knapsack).

    Returns:
        ``{"budget": B actually usable (at most sum_{l <= L} W^l), "pairs": max-plus pair updates,
        "seconds": pairs / PAIRS_PER_SECOND, "bytes": peak memory}``.
    """
    cap = _caps(budget, max_depth, max_width)
    pairs = 0.0
    for d in range(max_depth):
        w = min(max_width, cap[d])
        convs = w if shared_prefix else w * (w + 1) / 2
        pairs += convs * (cap[d] + 1) * (cap[d + 1] + 1)
    # the tree's reconstruction reuses subtrees of equal budget: at most one more root knapsack
    pairs += min(max_width, cap[0]) * (cap[0] + 1) * (cap[min(1, max_depth)] + 1)
    nbytes = 16 * sum(c + 1 for c in cap) + 8 * 4 * _BLOCK + 8 * max_width * (cap[0] + 1) + 400 * (cap[0] + 1)
    return {"budget": cap[0], "pairs": pairs, "seconds": pairs / PAIRS_PER_SECOND, "bytes": nbytes}


def check_search(
    budget: int,
    max_depth: int,
    max_width: int,
    shared_prefix: bool = True,
    max_pairs: float = MAX_PAIRS,
    free_bytes: int | None = None,
) -> dict:
    """Refuse, before any work, a search that would take too long or not fit in memory.

    Returns:
        :func:`search_cost`'s estimate.

    Raises:
        ValueError: ``pairs > max_pairs`` or ``bytes > 0.8 * free_bytes``; the message gives the estimate
            and the largest budget that fits with the same depth and width.
    """
    cost = search_cost(budget, max_depth, max_width, shared_prefix)
    slow = cost["pairs"] > max_pairs
    big = free_bytes is not None and cost["bytes"] > 0.8 * free_bytes
    if not (slow or big):
        return cost
    lo, hi = 0, budget  # largest budget within both limits (the cost is monotone in the budget)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        c = search_cost(mid, max_depth, max_width, shared_prefix)
        if c["pairs"] <= max_pairs and (free_bytes is None or c["bytes"] <= 0.8 * free_bytes):
            lo = mid
        else:
            hi = mid - 1
    what = (
        f"about {cost['pairs']:.2g} max-plus updates (~{_duration(cost['seconds'])} at {PAIRS_PER_SECOND:.2g}/s; "
        f"the limit is {max_pairs:.2g})"
        if slow
        else ""
    )
    if big:
        what += (" and " if what else "") + (
            f"about {cost['bytes'] / 2**30:.1f} GiB of memory ({free_bytes / 2**30:.1f} GiB free)"
        )
    raise ValueError(
        f"tree=optimal with budget={budget}, max_depth={max_depth}, max_width={max_width} is too large to search: it "
        f"needs {what}. "
        + (f"budget={lo} or less fits with this depth and width; " if lo >= 1 else "")
        + "or lower max_width or max_depth, or give the tree yourself (tree=widths widths=[...])."
    )


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    if seconds < 3 * 86400:
        return f"{seconds / 3600:.0f} h"
    return f"{seconds / 86400:.2g} days"


def _solve(budget: int, pos: _Positional, max_depth: int, max_width: int, callback=None, gains=None):
    cap = _caps(budget, max_depth, max_width)
    F = [None] * (max_depth + 1)
    choice = [None] * (max_depth + 1)
    F[max_depth] = np.zeros(1)
    choice[max_depth] = np.zeros(1, dtype=np.int64)
    for d in range(max_depth - 1, -1, -1):
        n = cap[d] + 1
        best = np.zeros(n)
        width = np.zeros(n, dtype=np.int64)
        w = min(max_width, cap[d])
        shared = _shared_prefix(pos, d, w)
        probs, h = pos(d, w), np.zeros(n)
        for K in range(1, w + 1):
            if shared:  # H_K = H_{K-1} (+) P(K) F_{d+1}: one product per width
                h, _ = _maxplus(h, probs[K - 1] * F[d + 1])
            else:
                h, _ = _children_knapsack(pos(d, K), F[d + 1], n)
            val = np.full(n, -np.inf)
            val[K:] = (1.0 if gains is None else gains[d]) + h[: n - K]
            better = val > best + _TIE
            best = np.where(better, val, best)
            width = np.where(better, K, width)
        # ties go to the smaller subtree: carry b - 1's (width 0 marks the carry; F stays nondecreasing)
        for b in range(1, n):
            if best[b] <= best[b - 1] + _TIE:
                best[b], width[b] = best[b - 1], 0
        F[d] = best
        choice[d] = width
        if callback is not None:
            callback(max_depth - d, max_depth)
    return F, choice


def _build_parent(budget: int, F, choice, pos: _Positional) -> np.ndarray:
    """Breadth-first parent array of the optimal tree (subtrees of equal (depth, budget) solved once)."""
    memo: dict[tuple[int, int], list[int]] = {}

    def alloc(d: int, b: int) -> list[int]:
        key = (d, b)
        if key not in memo:
            while b > 0 and choice[d][b] == 0:
                b -= 1
            if b == 0:
                memo[key] = []
            else:
                K = int(choice[d][b])
                r = b - K
                _, args = _children_knapsack(pos(d, K), F[d + 1][: r + 1], r + 1)
                out = [0] * K
                for j in range(K - 1, -1, -1):
                    out[j] = int(args[j][r])
                    r -= out[j]
                memo[key] = out
        return memo[key]

    parent = [-1]
    queue = [(0, 0, min(budget, F[0].size - 1))]
    head = 0
    while head < len(queue):
        node, d, b = queue[head]
        head += 1
        for x in alloc(d, b):
            parent.append(node)
            queue.append((len(parent) - 1, d + 1, x))
    return np.asarray(parent, dtype=np.int64)


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


def _prepare(budget, positional, max_depth, max_width, max_pairs):
    budget = check_int("budget", budget, 1)
    max_depth = check_int("max_depth", max_depth, 1)
    max_width = budget if max_width is None else check_int("max_width", max_width, 1)
    max_width = min(max_width, budget)
    if max_pairs is not None:
        check_search(budget, max_depth, max_width, True, max_pairs)  # optimistic: refuses the hopeless at once
    pos = _Positional(positional)
    if max_pairs is not None:
        check_search(budget, max_depth, max_width, _shared_prefix(pos, 0, min(max_width, budget)), max_pairs)
    return budget, pos, max_depth, max_width


def optimal_tree(
    budget: int,
    positional: PositionalFn,
    max_depth: int,
    max_width: int | None = None,
    *,
    max_pairs: float | None = MAX_PAIRS,
    callback: Callable[[int, int], None] | None = None,
    gains: Sequence[float] | None = None,
) -> DraftTree:
    """The draft tree with at most ``budget`` drafted states maximising :func:`theory.expected_steps`.

    Exact dynamic program (module docstring). Ties go to the smaller tree, so the result may draft
    fewer than ``budget`` states when more would not help (e.g. beyond a depth where ``delta = 0``).
    Tables are sized by what a tree of depth ``max_depth`` and width ``max_width`` can hold (at most
    ``W + W^2 + ... + W^L`` states), and the cost (:func:`search_cost`) is checked before any work.

    Args:
        budget: drafted states ``B >= 1`` (nodes other than the root).
        positional: ``positional(depth, K) -> [K]`` acceptance probability of each child position of a
            parent at ``depth`` (0 = root) with ``K`` children, e.g. from :func:`profile_positional`.
        max_depth: deepest allowed level ``L >= 1`` (a round never uses more than the steps left).
        max_width: widest allowed node (default ``budget``); the cost grows as ``max_width`` for
            prefix-consistent rules (D-GRS) and as ``max_width^2`` otherwise.
        max_pairs: refuse searches estimated above this many max-plus updates (None: no limit).
        callback: ``callback(depths_done, max_depth)`` after each depth of the program (progress).
        gains: ``gains[d]`` = worth of reaching an internal node of depth ``d`` (default 1 for every
            depth: the expected committed steps). A round that commits ``c`` steps is then worth
            ``gains[0] + ... + gains[c - 1]``; :func:`optimal_trees_by_root` sets them to the drop in
            the expected rounds left, so each tree minimises the rounds to the end, not the next round's length.

    Returns:
        A valid breadth-first :class:`DraftTree`.

    Raises:
        ValueError: a non-integer or out-of-range ``budget``, ``max_depth`` or ``max_width``, a
            ``positional`` that does not return ``K`` probabilities summing to at most 1, or a search
            estimated above ``max_pairs`` (the message gives the estimate and a budget that fits).
    """
    budget, pos, max_depth, max_width = _prepare(budget, positional, max_depth, max_width, max_pairs)
    F, choice = _solve(budget, pos, max_depth, max_width, callback, _gains(gains, max_depth))
    return DraftTree(_build_parent(budget, F, choice, pos))


def _gains(gains, max_depth: int):
    if gains is None:
        return None
    g = np.asarray(gains, dtype=np.float64).reshape(-1)
    if g.size < max_depth or not np.all(np.isfinite(g)):
        raise ValueError(f"gains={gains!r} is invalid: need {max_depth} finite values (one per depth 0..max_depth-1)")
    return g


def optimal_value(
    budget: int,
    positional: PositionalFn,
    max_depth: int,
    max_width: int | None = None,
    *,
    max_pairs: float | None = MAX_PAIRS,
    gains: Sequence[float] | None = None,
) -> float:
    """``F_0(budget)``: the expected steps (or worth, with ``gains``) of :func:`optimal_tree` (same arguments and errors)."""
    budget, pos, max_depth, max_width = _prepare(budget, positional, max_depth, max_width, max_pairs)
    F, _ = _solve(budget, pos, max_depth, max_width, gains=_gains(gains, max_depth))
    return float(F[0][-1])


# ----------------------------------------------------------------------------------------------
# positional probabilities from a displacement profile: specsamp.profiles; the search over them per root step


def shared_prefix(coupling, width: int) -> bool:
    """Whether ``coupling``'s positional vectors are prefixes of each other for widths ``1..width``
    (D-GRS: yes; markmax: no), checked at ``delta = 1`` (:func:`search_cost`'s ``shared_prefix``).

    Raises:
        ValueError: as :func:`profile_positional`.
    """
    return _shared_prefix(_Positional(profile_positional([1.0], coupling)), 0, max(int(width), 1))


def optimal_trees_by_root(
    budget: int,
    table,
    first: int,
    end: int,
    max_depth: int,
    max_width: int | None = None,
    coupling="dgrs",
    *,
    max_pairs: float | None = MAX_PAIRS,
    callback: Callable[[int, int], None] | None = None,
) -> dict[int, DraftTree]:
    """Step-dependent optimal trees: for each root state index ``n``, :func:`optimal_tree` at the same
    ``budget`` for row ``n`` of ``table`` and depth ``min(max_depth, end - n)`` (the steps left).

    Equal (profile row, depth) pairs are searched once.

    Args:
        budget, max_width, max_pairs: as in :func:`optimal_tree` (each tree has at most ``budget`` drafted states).
        table: ``[T, L']`` per-root profile (:func:`deltas_by_root`), or one profile ``[L']`` for every root
            (then the trees differ only through the steps left).
        first, end: root state indices ``first <= n < end`` (``Schedule.first_speculative``, ``end_speculative``).
        max_depth: deepest level of any tree.
        coupling: as in :func:`profile_positional`.
        callback: ``callback(roots_done, roots)`` after each root's search.

    Returns:
        ``{n: DraftTree}``.

    Raises:
        ValueError: as :func:`optimal_tree` and :func:`profile_positional`; a table without a row for some ``n``.
    """
    tab = np.asarray(table, dtype=np.float64)
    if tab.ndim == 1:
        tab = np.broadcast_to(tab, (end, tab.size))
    if tab.ndim != 2 or tab.shape[0] < end:
        raise ValueError(f"table of shape {tab.shape} is invalid: need one profile row per root index 0..{end - 1}")
    rounds_left = np.zeros(end + 1)  # V(n): expected rounds from root n to the end (V(end) = 0)
    out = {}
    for i, n in enumerate(range(end - 1, first - 1, -1)):
        depth = max(1, min(max_depth, end - n))
        pos = profile_positional(tab[n], coupling)
        # a round from n that commits c steps leaves V(n + c) rounds: worth of passing depth d >= 1 is
        # V(n + d) - V(n + d + 1); depth 0 is always passed (worth 1, so the value is 1 + V(n + 1) - E V(n + C))
        gains = np.concatenate([[1.0], rounds_left[n + 1 : n + depth] - rounds_left[n + 2 : n + depth + 1]])
        out[n] = optimal_tree(budget, pos, depth, max_width, max_pairs=max_pairs, gains=gains)
        value = optimal_value(budget, pos, depth, max_width, max_pairs=max_pairs, gains=gains)
        rounds_left[n] = 2.0 + rounds_left[n + 1] - value
        if callback is not None:
            callback(i + 1, end - first)
    return dict(sorted(out.items()))


class TreesByRoot:
    """Step-dependent trees: ``self(n)`` is the tree of rounds rooted at state index ``n``.

    What :func:`specsamp.sampler.sample_speculative` accepts as ``tree`` for step-dependent trees, plus
    what a record needs (a description, the largest tree for memory checks, the parent arrays).

    Args:
        trees: ``{n: DraftTree}`` for every root index of the run (:func:`optimal_trees_by_root`).
    """

    def __init__(self, trees: dict[int, DraftTree]):
        if not trees:
            raise ValueError("TreesByRoot needs at least one tree")
        self.trees = dict(sorted(trees.items()))

    def __call__(self, n: int) -> DraftTree:
        return self.trees[int(n)]

    @property
    def largest(self) -> DraftTree:
        """The tree with the most nodes (memory checks size a round by it)."""
        return max(self.trees.values(), key=len)

    @property
    def max_depth(self) -> int:
        return max(t.max_depth for t in self.trees.values())

    def call_rows(self, evaluate_leaves: bool = True) -> int:
        """The most target rows any round's call evaluates (:meth:`DraftTree.call_rows` of each tree)."""
        return max(t.call_rows(evaluate_leaves) for t in self.trees.values())

    def describe(self) -> str:
        sizes = [len(t) - 1 for t in self.trees.values()]
        return f"per-root({len(sizes)} trees, B<={max(sizes)}, L<={self.max_depth})"

    def parents(self) -> dict[int, list[int]]:
        """``{n: parent array}`` of each root index's tree."""
        return {n: t.parent.tolist() for n, t in self.trees.items()}
