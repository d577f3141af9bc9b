"""What a dense round is built from: a tree's static index tensors and buffers (:class:`DenseTables`), per-run tables.

The constants bound the caches (tests set 0: fallbacks draw the same numbers).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..trees import DraftTree
from .context import round_masks
from .draws import run_tables
from .split import closed_tables

if TYPE_CHECKING:
    from .context import Context


HISTORY_SLOTS = 16  # most records a draft's history may keep in the dense round (Draft.history)
RESIDUAL_CACHE = 1 << 20  # largest I * M * D for which a round keeps every internal node's verdict sample
VERIFY_MEMORY = 0.1  # a verification chunk's temporaries, as a fraction of the states block ...
VERIFY_FLOOR = 1 << 20  # ... or this many elements, whichever is larger


class DenseTables:
    """Everything a dense round of one fixed :class:`DraftTree` (``N`` nodes, depth ``L``) reads but the batch's state,
    built once per run by this one constructor (nothing is set on it afterwards), for ``M`` rows of the run ``ctx``
    (its event, dtype, device, kernel table and keys, :func:`specsamp.round.context.build_context`).

    Index tensors: ``depth``, ``parent``, ``first_child``, ``num_children`` ``[N]`` long; ``anc_at_depth [N, L+1]``,
    ``v``'s ancestor at depth ``j`` (``v`` below it); ``back [N, H+1]`` (a kernel of order ``H + 1 > 1``; else None):
    where the records of each node and its ``H`` earlier states lie (:func:`back_table`); ``anc_t [N-1, N]``, 1 where
    the edge into ``e`` lies above ``v`` (states' dtype); per depth ``layer_bounds`` (nodes ``[b[l], b[l+1])``),
    ``layer_parents``; ``child_pad``, ``child_ok`` ``[N, Kmax]``. Buffers (:class:`DenseBuffers`, ``buffers``) and the
    verification chunks (:func:`plan_chunks`; ``even_chunks``, their compiled form, where the run compiles). Per-root
    tables (rows gathered by root ``n``; ``L_n = clip(end - n, 0, L)``): ``coefs_by_root [L, C, T, 1]``, each depth's
    parent-step coefficients (:meth:`specsamp.kernels.Kernel.table`); ``node_step_by_root [N, T]``, each node's step;
    ``internal_by_root``, ``evaluated_by_root [T, N]`` (verified if visited; evaluated by the protocol, root in),
    ``evaluated_count``, ``internal_count [T]``; ``sigma_by_root [c, T]`` per chunk: std where verified, else 1.
    The run's keyed tables (:func:`specsamp.round.draws.run_tables`): ``key_cache``, ``noise_cache``,
    ``noise_scaled``, ``uniform_cache``.

    ``shared``: the run's dict of tables of a node count (keys, noise, uniforms), the same for each of its trees of
    that size. ``pool``: ``{"states", "residual"}`` flat storage shared by a run's several trees (their rounds run one
    after another and keep nothing in the buffers), each at least this tree's size; None: the run's one tree.
    """

    def __init__(self, tree: DraftTree, ctx: Context, M: int, shared: dict, pool: dict | None = None):
        dev, dtype, event = ctx.coef_table.device, ctx.coef_table.dtype, tuple(ctx.x_event)
        D, T = int(np.prod(event, dtype=np.int64)), ctx.schedule.steps
        N, L = self.N, self.L = len(tree), tree.max_depth
        self.tree, self.tensors = tree, tree.index_tensors(dev)
        self.depth, self.parent, self.first_child, self.num_children = (
            self.tensors[k] for k in ("depth", "parent", "first_child", "num_children")
        )
        up = np.tile(np.arange(N)[:, None], (1, L + 1))
        for v in range(1, N):  # breadth-first: the parent's row is complete before the child's
            up[v, : tree.depth[v]] = up[tree.parent[v], : tree.depth[v]]
        self.anc_at_depth = long_tensor(up, dev)
        self.back = back_table(tree, up, ctx.schedule.kernel.order - 1, dev)
        self.anc_t = torch.as_tensor(
            np.ascontiguousarray(up.T[tree.depth[1:]] == np.arange(1, N)[:, None]), dtype=dtype, device=dev
        )
        self.depth1_row, self.dm1 = (self.depth + 1)[None], self.depth[1:] - 1
        self.parent1, self.parent_c = self.parent[1:], self.parent.clamp(min=0)
        self.one = torch.ones((), dtype=dtype, device=dev)
        self.layer_bounds = [0, *tree.layer_end.tolist()]
        self.layer_parents = [
            long_tensor(tree.parent[a:b], dev) for a, b in zip(self.layer_bounds[1:], self.layer_bounds[2:])
        ]
        self.ids, self.nodes = torch.arange(1, N, device=dev), torch.arange(N, device=dev)
        j = torch.arange(int(tree.num_children.max()), device=dev)
        self.child_ok = j[None] < self.num_children[:, None]
        self.child_pad = (self.first_child[:, None] + j[None]).clamp(max=N - 1)
        self.evaluated_by_limit = {  # [L+1, N]: nodes the call evaluates when L_n = row index, per protocol
            leaves: round_masks(tree.depth[None], tree.num_children[None] > 0, np.arange(L + 1)[:, None], leaves)[1]
            for leaves in (False, True)
        }
        self.edge_slot = (self.ids - self.first_child[self.parent1])[None]  # each child's place among its siblings
        self.vrest_row = (self.nodes - 1).clamp(min=0)  # node v's row of the non-root velocities (0 for the root)
        self.is_root_col = (self.nodes == 0)[:, None]
        self.slots = torch.arange(HISTORY_SLOTS, device=dev)[None]
        # the buffers and the verification chunks of M rows of D coordinates
        chunks, self.pos_c, self.width_groups, internal = plan_chunks(tree, M, D, dev)
        self.ar = torch.arange(M, device=dev)
        self.rows = self.ar.repeat(N)  # the batch row of every node-major state
        self.rows_rest, self.ar_col = self.rows[M:], self.ar[:, None]
        self.dcol_m = self.depth.clamp(max=max(L - 1, 0))[None].expand(M, N)  # the depth column of a verification
        self.buffers = dense_buffers(self, chunks, (M, D, internal), pool)
        self.root_state = self.buffers.states[0].view(
            M, *event
        )  # node 0's states as the batch's, the others the call's
        self.rest_states = self.buffers.states[1:].view((N - 1) * M, *event)
        # the per-root tables
        roots = torch.arange(T, device=dev)
        step = (roots[:, None] + torch.arange(L + 1, device=dev)[None]).clamp(
            max=T - 1
        )  # [T, L+1]: step of depth-l nodes
        self.std_col = ctx.schedule.kernel.col("std")
        self.coefs_by_root = ctx.coef_table[step[:, :L]].permute(1, 2, 0)[..., None].contiguous()
        self.node_step_by_root = step[:, self.depth].T.contiguous()
        dl = (ctx.schedule.end_speculative - roots).clamp(min=0, max=L)[:, None]  # L_n (0 for finished rows)
        self.internal_by_root, self.evaluated_by_root = round_masks(
            self.depth[None], self.num_children[None] > 0, dl, ctx.evaluate_leaves
        )
        self.evaluated_count, self.internal_count = self.evaluated_by_root.sum(1), self.internal_by_root.sum(1)
        self.zero_long, self.false = (
            torch.zeros((), dtype=torch.long, device=dev),
            torch.zeros((), dtype=torch.bool, device=dev),
        )
        self.inf = torch.full((), float("inf"), dtype=dtype, device=dev)
        self.sigma_by_root = [
            torch.where(self.internal_by_root[:, u].T, self.coefs_by_root[du, self.std_col, :, 0], self.one)
            for _, u, _, _, _, du, _, _ in chunks
        ]
        self.even_chunks = even_chunks(chunks, self.sigma_by_root) if ctx.compiled else None
        self.closed = closed_tables(self, ctx) if ctx.draft_form == "closed" else None  # (A, B, mix)
        # the run's keyed tables (keys, draft noise, verification uniforms), where small
        self.key_cache, self.noise_cache, self.noise_scaled, self.uniform_cache = run_tables(
            self, ctx, M, shared, pool is not None
        )

    def plan(
        self, n: np.ndarray, exact: np.ndarray, end: int, evaluate_leaves: bool, rows: np.ndarray | None = None
    ) -> np.ndarray:
        """Flat indices ``node * M + row`` of the states a round's call evaluates, from host copies of ``n [M]`` and
        ``exact [M]``: the protocol's nodes of ``T|_{L_n}`` (:meth:`specsamp.round.sparse.Nodes.evaluated`), known roots
        out, live rows only (and only ``rows``, bool ``[M]``, where given)."""
        dl = np.clip(end - n, 0, self.L)
        mask = self.evaluated_by_limit[bool(evaluate_leaves)][dl]
        mask[:, 0] &= ~exact
        mask &= (n < end)[:, None]
        if rows is not None:
            mask &= rows[:, None]
        return np.flatnonzero(mask.T)


def back_table(tree: DraftTree, up: np.ndarray, H: int, dev) -> torch.Tensor | None:
    """Where a multistep kernel's records of the states ``j = 0..H`` steps back of each node (``j = 0``: the node's
    own) lie in a round's records table (:meth:`specsamp.round.dense.DenseRound.records`: the root's ``H`` earlier
    records, oldest first, then one row per node): ``[N, H + 1]`` long, ``H + a`` for the ancestor ``a`` at depth
    ``depth - j`` (``up``: :attr:`DenseTables.anc_at_depth`), ``H - j + depth`` beyond the root. None where
    ``H = 0``."""
    if H == 0:
        return None
    depth = np.asarray(tree.depth)
    out = np.empty((len(tree), H + 1), dtype=np.int64)
    for j in range(H + 1):
        inside = depth >= j
        out[:, j] = np.where(inside, H + up[np.arange(len(tree)), np.maximum(depth - j, 0)], H - j + depth)
    return long_tensor(out, dev)


def plan_chunks(tree: DraftTree, M: int, D: int, dev) -> tuple:
    """The verification chunks of ``tree``'s internal nodes for ``M`` rows of ``D`` coordinates, each at most
    :data:`VERIFY_MEMORY` of the states block in temporaries (or :data:`VERIFY_FLOOR` elements; one node at least):
    ``(chunks, pos_c, width_groups, I)``: the chunks as :class:`DenseBuffers` lists them, each node's row of the
    residual ``[N]``, per width ``(K, a node of it, whether each node has it [N])``, the internal nodes' count."""
    N, nc = len(tree), tree.num_children
    chunks, pos, node_pos, width_groups = [], 0, np.zeros(N, dtype=np.int64), []
    budget = max(VERIFY_MEMORY * N * M * D, VERIFY_FLOOR)
    for k in np.unique(nc[nc > 0]).tolist():
        u_k = np.flatnonzero(nc == k)
        ch_k = tree.first_child[u_k, None] + np.arange(k)
        step = max(1, int(budget // ((k + 8) * M * D)))  # per node: children copy, parents, means, the coupling's rows
        for i in range(0, len(u_k), step):
            u, ch = u_k[i : i + step], ch_k[i : i + step]
            node_pos[u] = np.arange(pos, pos + len(u))
            chunks.append(
                (
                    k,
                    long_tensor(u, dev),
                    as_slice(u),
                    long_tensor(ch, dev),
                    as_slice(ch.ravel()),
                    long_tensor(tree.depth[u], dev),
                    bool(u[0] == 0),
                    slice(pos, pos + len(u)),
                )
            )
            pos += len(u)
        width_groups.append((k, long_tensor(u_k[0], dev), torch.as_tensor(nc == k, device=dev)))
    return chunks, long_tensor(node_pos, dev), width_groups, pos


def dense_buffers(lt: DenseTables, chunks: list, size: tuple, pool: dict | None) -> DenseBuffers:
    """The :class:`DenseBuffers` of ``lt``'s tree for ``size = (M, D, I)`` (rows, coordinates, internal nodes), in
    ``pool``'s storage where given; the verdict samples kept only where small (:data:`RESIDUAL_CACHE`), else drawn
    again (same keys) for the walk's one node per row."""
    (M, D, internal), N, b, nc, dev = size, lt.N, lt.layer_bounds, lt.tree.num_children, lt.one.device

    def block(name: str, rows: int) -> torch.Tensor:  # [rows, M, D], the pool's storage where given
        if pool is None:
            return torch.empty(rows, M, D, dtype=lt.one.dtype, device=dev)
        return pool[name][: rows * M * D].view(rows, M, D)

    states, layers = block("states", N), []
    for l in range(1, lt.L + 1):
        kids, out = nc[b[l - 1] : b[l]], states[b[l] : b[l + 1]]
        k, P = int(kids[0]), b[l] - b[l - 1]
        if k == 0 or (kids != k).any():
            layers.append((lt.layer_parents[l - 1], None, out))
        else:
            par = states[b[l - 1] : b[l]]
            layers.append((None, par, out) if k == 1 else (None, par.view(P, 1, M, D), out.view(P, k, M, D)))
    residual = block("residual", internal) if internal * M * D <= RESIDUAL_CACHE else None
    return DenseBuffers(
        states,
        residual,
        layers,
        chunks,
        torch.zeros(M, N, dtype=torch.bool, device=dev),
        torch.zeros(M, N, dtype=torch.long, device=dev),
    )


def even_chunks(chunks: list, sigma_by_root: list) -> list:
    """``chunks`` as the compiled round verifies them: ``(K, nodes [c], children [c, K], depths [c], rows of the
    residual, sigma_by_root [c, T])``, the internal nodes of a width in chunks of one size, the largest divisor of
    their number within the memory rule's chunk (:func:`plan_chunks`), so that one graph serves every chunk of the
    width (seven nodes in chunks of 5 and 2 would compile two)."""
    widths: dict = {}
    for (k, u, _, ch, _, du, _, pos), sig in zip(chunks, sigma_by_root):
        widths.setdefault(k, []).append((u, ch, du, sig, pos))
    out = []
    for k, parts in widths.items():
        u, ch, du, sig = (torch.cat([p[i] for p in parts]) for i in range(4))
        first, count, most = parts[0][4].start, u.numel(), max(p[0].numel() for p in parts)
        size = max(d for d in range(1, most + 1) if count % d == 0)
        for a in range(0, count, size):  # a width's verdict samples are consecutive rows of the residual
            out.append(
                (
                    k,
                    *(t[a : a + size].clone() for t in (u, ch, du)),
                    slice(first + a, first + a + size),
                    sig[a : a + size].clone(),
                )
            )
    return out


@dataclass
class DenseBuffers:
    """The dense round's node-major buffers: ``states [N, M, D]``; ``residual [I, M, D]``, the internal nodes' verdict
    samples; ``layers``, per depth ``(parents, parent_view, out_view)``: where the parents are the whole previous
    layer with ``K`` children each, ``parents`` None and views ``[P, 1, M, D]``, ``[P, K, M, D]`` (both ``[P, M, D]``
    for one child), else the parents' ids, ``parent_view`` None and ``out_view [C, M, D]``; ``chunks``, the
    verification calls ``(K, nodes [c], slice, children [c, K], slice, depths [c], has node 0, rows of residual)``
    (slices None unless contiguous), each at most :data:`VERIFY_MEMORY` of the states in temporaries (one node at
    least); ``acc``, ``idx`` ``[M, N]``: the internal nodes' verdicts (accepted, index), every round; 0 elsewhere."""

    states: torch.Tensor
    residual: torch.Tensor
    layers: list
    chunks: list
    acc: torch.Tensor
    idx: torch.Tensor


def long_tensor(a, dev) -> torch.Tensor:
    """Host indices as a long tensor, through a list (under inference mode, an array's dtype cast is an operation)."""
    return torch.as_tensor(np.asarray(a).tolist(), dtype=torch.long, device=dev)


def as_slice(ids: np.ndarray) -> slice | None:
    return slice(int(ids[0]), int(ids[-1]) + 1) if np.array_equal(ids, np.arange(ids[0], ids[-1] + 1)) else None


def upload(a: np.ndarray, dev) -> torch.Tensor:
    """Host indices to the device without waiting for it (pinned, non-blocking copy on CUDA)."""
    t = torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64))
    if torch.device(dev).type == "cuda":
        return t.pin_memory().to(dev, non_blocking=True)
    return t.to(dev)
