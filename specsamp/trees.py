"""Draft trees (section 3.1, "Draft Topology"; eqs. 9--11).

A :class:`DraftTree` is a rooted tree stored as a parent array in breadth-first order: node 0 is
the root, depths never decrease along the array, and the children of every node are contiguous and
listed in drafting order. Those two facts make everything cheap: the restriction ``T|_m`` of eq. 11
is a prefix of the array, and a node's children are one slice.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from functools import cached_property

import numpy as np
import torch

from .errors import ConfigError

MAX_NODES = 1 << 22
"""The most nodes a tree may have (4,194,304: one round's batched call would evaluate that many states per image,
and the tree's own index arrays take about 40 bytes a node). A constructor refuses more before it allocates."""


def check_int(name: str, value, lo: int = 1) -> int:
    """``value`` as an ``int`` if it is an integer ``>= lo`` (bools refused); else ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < lo:
        raise ValueError(f"{name}={value!r} is invalid: must be an integer >= {lo}")
    return int(value)


def check_size(widths: Iterable[int], named: str = "the tree's widths") -> int:
    """The node count of the tree whose depth-``l`` nodes have ``widths[l - 1]`` children each; a
    :class:`~specsamp.errors.ConfigError` naming ``named`` as soon as the count passes :data:`MAX_NODES`.
    Counts layer by layer in Python integers and stops there, so a huge tree (``widths`` may be a lazy iterable,
    ``itertools.repeat(K, L)``) is refused without allocating it."""
    total, layer = 1, 1
    for w in widths:
        layer *= int(w)
        total += layer
        if total > MAX_NODES:
            raise ConfigError(
                f"{named} is invalid: the draft tree would have more than {MAX_NODES:,} nodes (DraftTree's MAX_NODES; "
                "one round's batched call evaluates every node per image); lower K or L."
            )
    return total


class DraftTree:
    """A rooted draft tree ``T = (V, pa)`` in breadth-first order.

    Args:
        parent: ``[|V|]`` ints, ``parent[0] == -1`` and ``parent[v] < v``; nodes must be in
            breadth-first order with each node's children contiguous.

    Raises:
        ValueError: the array is not a breadth-first parent array.
    """

    def __init__(self, parent: Sequence[int] | np.ndarray):
        p = np.asarray(parent, dtype=np.int64)
        if p.ndim != 1 or p.size == 0 or p[0] != -1:
            raise ValueError("parent must be a 1-D array with parent[0] == -1 (the root)")
        if p.size > 1:
            rest = p[1:]
            if np.any(rest < 0) or np.any(rest >= np.arange(1, p.size)):
                raise ValueError("parent[v] must satisfy 0 <= parent[v] < v for every non-root v")
            if np.any(np.diff(rest) < 0):
                raise ValueError("nodes must be in breadth-first order with contiguous siblings")
        self.parent = p
        # depth by pointer jumping: O(|V| log L) without a Python loop over nodes
        anc = p.copy()
        anc[0] = 0
        depth = (p >= 0).astype(np.int64)
        while True:
            nxt = anc[anc]
            if np.array_equal(nxt, anc):
                break
            depth = depth + depth[anc] * (anc != nxt)
            anc = nxt
        if np.any(np.diff(depth) < 0):
            raise ValueError("nodes must be listed by non-decreasing depth (breadth-first)")
        self.depth = depth
        counts = np.bincount(p[1:], minlength=p.size) if p.size > 1 else np.zeros(1, np.int64)
        self.num_children = counts.astype(np.int64)
        first = np.zeros(p.size, dtype=np.int64)
        if p.size > 1:
            starts = np.searchsorted(p[1:], np.arange(p.size), side="left") + 1
            first = starts.astype(np.int64)
        self.first_child = first

    # --- constructors ------------------------------------------------------------------------
    @classmethod
    def from_widths(cls, widths: Sequence[int]) -> DraftTree:
        """Every node at depth ``l - 1`` has ``widths[l - 1]`` children (depth-dependent ``K_l``).

        Raises:
            ValueError: a width below 1.
            ConfigError: more than :data:`MAX_NODES` nodes (checked before anything is allocated).
        """
        widths = [check_int(f"widths[{i}]", w) for i, w in enumerate(widths)]
        check_size(widths, f"widths={widths[:8]}{' ...' if len(widths) > 8 else ''}")
        parts = [np.array([-1], dtype=np.int64)]
        start, size = 0, 1  # current layer: nodes start .. start + size - 1
        for w in widths:
            parts.append(np.repeat(np.arange(start, start + size, dtype=np.int64), w))
            start, size = start + size, size * w
        return cls(np.concatenate(parts))

    @classmethod
    def uniform(cls, K: int, L: int) -> DraftTree:
        """The uniform ``(K, L)`` tree of the paper: ``|V_l| = K^l`` for ``l <= L`` (eq. 10).

        Raises:
            ValueError: ``K < 1`` or ``L < 1``.
            ConfigError: more than :data:`MAX_NODES` nodes (checked before anything is allocated).
        """
        K = check_int("K", K)
        L = check_int("L", L)
        check_size(itertools.repeat(K, L), f"K={K}, L={L}")
        return cls.from_widths([K] * L)

    @classmethod
    def chain(cls, L: int) -> DraftTree:
        """A chain of ``L`` drafted states (RMC's topology, ``K = 1``).

        Raises:
            ValueError: ``L < 1``.
        """
        L = check_int("L", L)
        check_size(itertools.repeat(1, L), f"L={L}")
        return cls(np.arange(-1, L))

    # --- structure ---------------------------------------------------------------------------
    def __len__(self) -> int:
        return int(self.parent.size)

    @property
    def max_depth(self) -> int:
        """Depth ``L`` of the deepest node."""
        return int(self.depth[-1])

    @cached_property
    def layer_end(self) -> np.ndarray:
        """``layer_end[l]`` = number of nodes of depth ``<= l`` (so ``V_l`` is a slice)."""
        return np.searchsorted(self.depth, np.arange(self.max_depth + 1), side="right")

    def layer(self, l: int) -> np.ndarray:
        """Node indices of ``V_l`` (eq. 9)."""
        if l < 0 or l > self.max_depth:
            return np.zeros(0, dtype=np.int64)
        start = 0 if l == 0 else self.layer_end[l - 1]
        return np.arange(start, self.layer_end[l])

    def children(self, u: int) -> np.ndarray:
        """Children ``C(u)`` of node ``u``, in drafting order."""
        return np.arange(self.first_child[u], self.first_child[u] + self.num_children[u])

    @property
    def internal(self) -> np.ndarray:
        """Internal nodes ``I(T)`` (eq. 9): nodes with at least one child."""
        return np.flatnonzero(self.num_children > 0)

    @property
    def budget(self) -> int:
        """Drafted states ``|V| - 1`` (``K + K^2 + ... + K^L`` for the uniform tree)."""
        return len(self) - 1

    def call_rows(self, evaluate_leaves: bool = True) -> int:
        """States the target evaluates in one round's batched call: ``|V|`` with leaves, ``|I(T)|``
        without (section 3.1, eq. 16; the warm-up and prefetch savings aside)."""
        return len(self) if evaluate_leaves else int(self.internal.size)

    def index_tensors(self, device) -> dict[str, torch.Tensor]:
        """``parent``, ``depth``, ``num_children`` and ``first_child`` as long tensors ``[N]`` on ``device`` (the
        rounds' indices)."""
        return {
            k: torch.as_tensor(getattr(self, k), dtype=torch.long, device=device)
            for k in ("parent", "depth", "num_children", "first_child")
        }

    def restrict(self, m: int) -> DraftTree:
        """The subtree ``T|_m`` induced by the nodes of depth at most ``m`` (eq. 11).

        Raises:
            ValueError: ``m < 0``.
        """
        if m < 0:
            raise ValueError(f"m={m} is invalid: depth must be >= 0")
        if m >= self.max_depth:
            return self
        return DraftTree(self.parent[: self.layer_end[m]])

    @cached_property
    def call_rows_by_depth(self) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`call_rows` of ``T|_m`` for every ``m = 0..L``, without and with leaves.

        Returns:
            ``(internal_rows [L+1], all_rows [L+1])``: ``internal_rows[m] = |I(T|_m)|`` and
            ``all_rows[m] = |V(T|_m)|``.
        """
        all_rows = self.layer_end.copy()
        has_child = self.num_children > 0
        internal_rows = np.zeros(self.max_depth + 1, dtype=np.int64)
        for m in range(self.max_depth + 1):
            # internal in T|_m: depth < m and has a child (children all have depth <= m then)
            internal_rows[m] = int(
                np.count_nonzero(has_child[: self.layer_end[m]] & (self.depth[: self.layer_end[m]] < m))
            )
        return internal_rows, all_rows

    @cached_property
    def widths(self) -> list[int] | None:
        """``[K_1, ..., K_L]`` when every node of a depth has the same number of children, else None."""
        out = []
        for l in range(self.max_depth):
            k = np.unique(self.num_children[self.layer(l)])
            if k.size != 1:
                return None
            out.append(int(k[0]))
        return out

    def describe(self) -> str:
        """Short human-readable name, e.g. ``uniform(2,3)``, ``chain(14)`` or ``widths(3,2,2)``."""
        w = self.widths
        if w is None:
            return f"tree(|V|={len(self)}, L={self.max_depth})"
        if all(k == 1 for k in w):
            return f"chain({len(w)})"
        if len(set(w)) == 1:
            return f"uniform({w[0]},{len(w)})"
        return "widths(" + ",".join(map(str, w)) + ")"

    def __repr__(self) -> str:
        return f"DraftTree<{self.describe()}, budget={self.budget}>"


def budget(K: int, L: int) -> int:
    """``B = K + K^2 + ... + K^L`` drafted states of the uniform ``(K, L)`` tree."""
    K = check_int("K", K)
    L = check_int("L", L)
    return L if K == 1 else (K ** (L + 1) - K) // (K - 1)
