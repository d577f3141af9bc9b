"""Draft trees (section 3.1, eqs. 9--11): budgets, layers, internal nodes, restriction, validation.

All checks are deterministic (no randomness).
"""

import re

import numpy as np
import pytest

from specsamp import trees
from specsamp.trees import DraftTree


def brute_depth(parent):
    depth = []
    for p in parent:
        depth.append(0 if p < 0 else depth[p] + 1)
    return np.asarray(depth)


# --- budgets ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "K,L,B",
    [(2, 3, 14), (5, 3, 155), (1, 1, 1), (1, 7, 7), (3, 2, 12), (6, 6, 55986), (7, 6, 137256), (7, 2, 56)],
)
def test_budget_uniform(K, L, B):
    assert trees.budget(K, L) == B
    assert trees.budget(K, L) == sum(K**l for l in range(1, L + 1))
    if B < 1000:
        t = DraftTree.uniform(K, L)
        assert t.budget == B and len(t) == B + 1
        assert t.max_depth == L


def test_paper_budgets():
    # the paper: B = 14 for (2, 3) and 155 for (5, 3); the matched RMC chain has the same budget
    assert DraftTree.uniform(2, 3).budget == 14
    assert DraftTree.uniform(5, 3).budget == 155
    assert DraftTree.chain(155).budget == 155 == trees.budget(5, 3)


def test_chain():
    t = DraftTree.chain(4)
    assert t.parent.tolist() == [-1, 0, 1, 2, 3]
    assert t.depth.tolist() == [0, 1, 2, 3, 4]
    assert t.budget == 4 and t.max_depth == 4
    assert t.widths == [1, 1, 1, 1]
    assert t.describe() == "chain(4)"
    assert t.internal.tolist() == [0, 1, 2, 3]
    assert DraftTree.chain(1).parent.tolist() == [-1, 0]


def test_from_widths_non_uniform():
    t = DraftTree.from_widths([3, 1, 2])
    # |V_l| = 1, 3, 3, 6
    assert len(t) == 13 and t.budget == 12
    assert [t.layer(l).size for l in range(4)] == [1, 3, 3, 6]
    assert t.widths == [3, 1, 2]
    assert t.describe() == "widths(3,1,2)"
    assert t.children(0).tolist() == [1, 2, 3]
    assert t.children(1).tolist() == [4]
    assert t.children(4).tolist() == [7, 8]
    assert t.children(6).tolist() == [11, 12]
    assert t.internal.tolist() == list(range(7))
    assert t.call_rows(True) == 13
    assert t.call_rows(False) == 7
    np.testing.assert_array_equal(t.depth, brute_depth(t.parent))


def test_uniform_structure_eq10():
    K, L = 2, 3
    t = DraftTree.uniform(K, L)
    assert t.describe() == "uniform(2,3)"
    assert repr(t) == "DraftTree<uniform(2,3), budget=14>"
    # eq. 10: |V_l| = K^l, |I| = sum_{l<L} K^l, |V| = sum_{l<=L} K^l
    for l in range(L + 1):
        assert t.layer(l).size == K**l
        assert np.all(t.depth[t.layer(l)] == l)
    assert t.layer(0).tolist() == [0]
    assert t.layer(1).tolist() == [1, 2]
    assert t.layer(2).tolist() == [3, 4, 5, 6]
    assert t.layer(3).tolist() == list(range(7, 15))
    assert t.layer(4).size == 0 and t.layer(-1).size == 0
    assert t.internal.tolist() == list(range(7))
    assert t.call_rows() == 15 == sum(K**l for l in range(L + 1))
    assert t.call_rows(evaluate_leaves=False) == 7 == sum(K**l for l in range(L))
    np.testing.assert_array_equal(t.depth, brute_depth(t.parent))


def test_children_order_and_parents():
    t = DraftTree.uniform(3, 3)
    seen = []
    for u in range(len(t)):
        kids = t.children(u)
        # children are contiguous, in drafting (array) order, and point back to u
        assert np.all(np.diff(kids) == 1)
        assert np.all(t.parent[kids] == u)
        assert kids.size == (3 if t.depth[u] < 3 else 0)
        seen.extend(kids.tolist())
    assert seen == list(range(1, len(t)))  # every non-root node is exactly one node's child


def test_internal_nodes_irregular():
    # root with 3 children; node 1 has 2 children (4, 5), node 2 has 1 (6); node 4 has 2 (7, 8)
    parent = [-1, 0, 0, 0, 1, 1, 2, 4, 4]
    t = DraftTree(parent)
    assert t.depth.tolist() == [0, 1, 1, 1, 2, 2, 2, 3, 3]
    assert t.internal.tolist() == [0, 1, 2, 4]
    assert t.num_children.tolist() == [3, 2, 1, 0, 2, 0, 0, 0, 0]
    assert t.children(3).size == 0 and t.children(5).size == 0
    assert t.children(2).tolist() == [6]
    assert t.widths is None
    assert t.describe() == "tree(|V|=9, L=3)"
    assert t.call_rows(False) == 4 and t.call_rows(True) == 9


# --- restriction (eq. 11) -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "tree",
    [
        DraftTree.uniform(2, 3),
        DraftTree.from_widths([3, 1, 2]),
        DraftTree.chain(5),
        DraftTree([-1, 0, 0, 0, 1, 1, 2, 4, 4]),
    ],
    ids=lambda t: t.describe(),
)
def test_restrict_eq11(tree):
    for m in range(tree.max_depth + 2):
        sub = tree.restrict(m)
        keep = np.flatnonzero(tree.depth <= m)
        # T|_m is the subtree induced by V_{<=m}: same parent map on those nodes
        assert len(sub) == keep.size
        np.testing.assert_array_equal(sub.parent, tree.parent[keep])
        assert sub.max_depth == min(m, tree.max_depth)
        # internal nodes of T|_m: depth < m and a child in T
        want_internal = [u for u in keep if tree.depth[u] < m and tree.num_children[u] > 0]
        assert sub.internal.tolist() == want_internal
    assert tree.restrict(tree.max_depth) is tree
    assert tree.restrict(tree.max_depth + 3) is tree
    root = tree.restrict(0)
    assert len(root) == 1 and root.budget == 0 and root.internal.size == 0


def test_restrict_uniform_is_shallower_uniform():
    t = DraftTree.uniform(3, 4)
    for m in range(1, 5):
        np.testing.assert_array_equal(t.restrict(m).parent, DraftTree.uniform(3, m).parent)


def test_restrict_negative_raises():
    with pytest.raises(ValueError, match="m=-1"):
        DraftTree.uniform(2, 2).restrict(-1)


@pytest.mark.parametrize(
    "tree",
    [
        DraftTree.uniform(2, 3),
        DraftTree.uniform(5, 3),
        DraftTree.from_widths([3, 1, 2]),
        DraftTree.chain(6),
        DraftTree([-1, 0, 0, 0, 1, 1, 2, 4, 4]),
    ],
    ids=lambda t: t.describe(),
)
def test_call_rows_by_depth(tree):
    internal_rows, all_rows = tree.call_rows_by_depth
    assert internal_rows.shape == all_rows.shape == (tree.max_depth + 1,)
    for m in range(tree.max_depth + 1):
        sub = tree.restrict(m)
        assert all_rows[m] == sub.call_rows(True) == len(sub)
        assert internal_rows[m] == sub.call_rows(False)


def test_call_rows_by_depth_uniform_values():
    internal_rows, all_rows = DraftTree.uniform(2, 3).call_rows_by_depth
    assert internal_rows.tolist() == [0, 1, 3, 7]
    assert all_rows.tolist() == [1, 3, 7, 15]


# --- validation ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "parent",
    [
        [],  # empty
        [0, 0],  # root not marked with -1
        [[-1, 0]],  # not 1-D
        [-1, 1],  # parent[v] >= v
        [-1, 0, 3, 1],  # parent[v] >= v
        [-1, -1],  # second root
        [-1, 0, 1, 0],  # siblings not contiguous / not breadth-first
        [-1, 0, 0, 1, 2, 1],  # children of node 1 split around node 2's
    ],
)
def test_invalid_parent_arrays(parent):
    with pytest.raises(ValueError, match="parent|breadth-first"):
        DraftTree(parent)


@pytest.mark.parametrize(
    "K,L,bad", [(0, 3, "K=0"), (-2, 3, "K=-2"), (2, 0, "L=0"), (3, -1, "L=-1"), (1.5, 2, "K=1.5"), (True, 2, "K=True")]
)
def test_uniform_bad_K_L(K, L, bad):
    with pytest.raises(ValueError, match=bad):
        DraftTree.uniform(K, L)
    with pytest.raises(ValueError, match=bad):
        trees.budget(K, L)


def test_chain_and_widths_bad():
    with pytest.raises(ValueError, match="L=0"):
        DraftTree.chain(0)
    with pytest.raises(ValueError, match=r"widths\[1\]=0"):
        DraftTree.from_widths([2, 0, 1])
    # error messages state the valid range
    with pytest.raises(ValueError, match=">= 1"):
        DraftTree.uniform(0, 2)


def test_numpy_integers_accepted():
    t = DraftTree.uniform(np.int64(2), np.int32(2))
    assert t.budget == 6
    assert trees.budget(np.int64(5), 3) == 155


def test_a_huge_tree_is_refused_before_it_is_allocated():
    import time

    from specsamp.errors import ConfigError
    from specsamp.trees import MAX_NODES, check_size

    t0 = time.perf_counter()
    for make, named in (
        (lambda: DraftTree.uniform(8, 64), "K=8, L=64"),
        (lambda: DraftTree.uniform(2, 22), "K=2, L=22"),
        (lambda: DraftTree.from_widths([16] * 8), "widths=[16, 16"),
        (lambda: DraftTree.chain(10**12), "L=1000000000000"),
    ):
        with pytest.raises(ConfigError, match=f"{re.escape(named)}.*more than {MAX_NODES:,} nodes"):
            make()
    assert time.perf_counter() - t0 < 30  # counted, not allocated (the largest would need exabytes)
    assert check_size([2] * 21) == 2**22 - 1 and len(DraftTree.uniform(2, 3)) == check_size([2] * 3) == 15
