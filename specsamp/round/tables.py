"""What a dense round is built from: a tree's static index tensors and buffers (:class:`DenseTables`), per-run tables.

The constants bound the caches (tests set 0: fallbacks draw the same numbers).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from .. import rng
from ..trees import DraftTree
from .context import round_masks

if TYPE_CHECKING:
    from .context import Context


HISTORY_SLOTS = 16  # most records a draft's history may keep in the dense round (Draft.history)
RESIDUAL_CACHE = 1 << 20  # largest I * M * D for which a round keeps every internal node's verdict sample
KEY_CACHE = 1 << 21  # largest M * T * N for which a run keeps every (row, root, node) key in a table
NOISE_CACHE = 1 << 20  # largest M * T * (N - 1) * D for which a run draws every (row, root, node) draft noise once
UNIFORM_CACHE = 1 << 20  # largest M * T * N * (Kmax + 1) for which a run draws every node's coupling uniforms once
VERIFY_MEMORY = 0.1  # a verification chunk's temporaries, as a fraction of the states block ...
VERIFY_FLOOR = 1 << 20  # ... or this many elements, whichever is larger


class DenseTables:
    """Static index tensors of one fixed :class:`DraftTree` (``N`` nodes, depth ``L``), built once per run: ``depth``,
    ``parent``, ``first_child``, ``num_children`` ``[N]`` long; ``anc_at_depth [N, L+1]``, ``v``'s ancestor at depth
    ``j`` (``v`` below it); ``anc_t [N-1, N]``, 1 where the edge into ``e`` lies above ``v`` (states' dtype); per depth
    ``layer_bounds`` (nodes ``[b[l], b[l+1])``), ``layer_parents``; ``child_pad``, ``child_ok`` ``[N, Kmax]``."""

    def __init__(self, tree: DraftTree, dev, dtype):
        N, L = self.N, self.L = len(tree), tree.max_depth
        self.tree, self.tensors = tree, tree.index_tensors(dev)
        self.depth, self.parent, self.first_child, self.num_children = (self.tensors[k] for k in ("depth", "parent", "first_child", "num_children"))
        up = np.tile(np.arange(N)[:, None], (1, L + 1))
        for v in range(1, N):  # breadth-first: the parent's row is complete before the child's
            up[v, : tree.depth[v]] = up[tree.parent[v], : tree.depth[v]]
        self.anc_at_depth = long_tensor(up, dev)
        self.anc_t = torch.as_tensor(np.ascontiguousarray(up.T[tree.depth[1:]] == np.arange(1, N)[:, None]), dtype=dtype, device=dev)
        self.depth1_row, self.dm1 = (self.depth + 1)[None], self.depth[1:] - 1
        self.parent1, self.parent_c = self.parent[1:], self.parent.clamp(min=0)
        self.one = torch.ones((), dtype=dtype, device=dev)
        self.layer_bounds = [0, *tree.layer_end.tolist()]
        self.layer_parents = [long_tensor(tree.parent[a:b], dev) for a, b in zip(self.layer_bounds[1:], self.layer_bounds[2:])]
        self.ids, self.nodes = torch.arange(1, N, device=dev), torch.arange(N, device=dev)
        self.key_cache = self.noise_cache = self.uniform_cache = None  # per-run tables (dense.DenseLayout, draw_tables)
        self.noise_scaled = False
        j = torch.arange(int(tree.num_children.max()), device=dev)
        self.child_ok = j[None] < self.num_children[:, None]
        self.child_pad = (self.first_child[:, None] + j[None]).clamp(max=N - 1)
        self.evaluated_by_limit = {  # [L+1, N]: nodes the call evaluates when L_n = row index, per protocol
            leaves: round_masks(tree.depth[None], tree.num_children[None] > 0, np.arange(L + 1)[:, None], leaves)[1]
            for leaves in (False, True)}
        self.edge_slot = (self.ids - self.first_child[self.parent1])[None]  # each child's place among its siblings
        self.vrest_row = (self.nodes - 1).clamp(min=0)  # node v's row of the non-root velocities (0 for the root)
        self.is_root_col = (self.nodes == 0)[:, None]
        self.slots = torch.arange(HISTORY_SLOTS, device=dev)[None]

    def plan(self, n: np.ndarray, exact: np.ndarray, end: int, evaluate_leaves: bool, rows: np.ndarray | None = None) -> np.ndarray:
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

    def bind(self, M: int, D: int, pool: dict | None = None, event: tuple | None = None) -> None:
        """Allocate :class:`DenseBuffers` (``self.buffers``) for ``M`` rows of ``D`` coordinates, event shape ``event``
        (default ``(D,)``). ``pool``: optional ``{"states", "residual"}`` flat storage shared by a run's trees (their
        rounds run one after another and keep nothing in the buffers), each at least this tree's size."""
        N, b, nc, dev = self.N, self.layer_bounds, self.tree.num_children, self.one.device

        def block(name: str, size: int) -> torch.Tensor:  # [size, M, D], the pool's storage where given
            if pool is None:
                return torch.empty(size, M, D, dtype=self.one.dtype, device=dev)
            return pool[name][: size * M * D].view(size, M, D)

        states, layers = block("states", N), []
        for l in range(1, self.L + 1):
            kids, out = nc[b[l - 1] : b[l]], states[b[l] : b[l + 1]]
            k, P = int(kids[0]), b[l] - b[l - 1]
            if k == 0 or (kids != k).any():
                layers.append((self.layer_parents[l - 1], None, out))
            else:
                par = states[b[l - 1] : b[l]]
                layers.append((None, par, out) if k == 1 else (None, par.view(P, 1, M, D), out.view(P, k, M, D)))
        chunks, pos, node_pos, self.width_groups = [], 0, np.zeros(N, dtype=np.int64), []
        budget = max(VERIFY_MEMORY * N * M * D, VERIFY_FLOOR)
        for k in np.unique(nc[nc > 0]).tolist():
            u_k = np.flatnonzero(nc == k)
            ch_k = self.tree.first_child[u_k, None] + np.arange(k)
            step = max(1, int(budget // ((k + 8) * M * D)))  # per node: children copy, parents, means, the coupling's rows
            for i in range(0, len(u_k), step):
                u, ch = u_k[i : i + step], ch_k[i : i + step]
                node_pos[u] = np.arange(pos, pos + len(u))
                chunks.append((k, long_tensor(u, dev), as_slice(u), long_tensor(ch, dev), as_slice(ch.ravel()), long_tensor(self.tree.depth[u], dev),
                               bool(u[0] == 0), slice(pos, pos + len(u))))
                pos += len(u)
            self.width_groups.append((k, long_tensor(u_k[0], dev), torch.as_tensor(nc == k, device=dev)))
        # internal nodes' verdict samples, kept where small; else redrawn (same keys) for the walk's one node per row
        residual = block("residual", pos) if pos * M * D <= RESIDUAL_CACHE else None
        self.pos_c = long_tensor(node_pos, dev)
        self.ar = torch.arange(M, device=dev)
        self.rows = self.ar.repeat(N)  # the batch row of every node-major state
        self.rows_rest, self.ar_col = self.rows[M:], self.ar[:, None]
        self.dcol_m = self.depth.clamp(max=max(self.L - 1, 0))[None].expand(M, N)  # the depth column of a verification
        event = (D,) if event is None else tuple(event)
        self.root_state = states[0].view(M, *event)  # node 0's states as the batch's, and the others as the call's input
        self.rest_states = states[1:].view((N - 1) * M, *event)
        self.buffers = DenseBuffers(states, residual, layers, chunks, torch.zeros(M, N, dtype=torch.bool, device=dev),
                                    torch.zeros(M, N, dtype=torch.long, device=dev))


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


def root_tables(lt: DenseTables, ctx: Context) -> None:
    """Per-root tables, once per run (rows gathered by root ``n``; ``L_n = clip(end - n, 0, L)``): ``coefs_by_root
    [L, C, T, 1]``, each depth's parent-step coefficients (:meth:`specsamp.kernels.Kernel.table`); ``node_step_by_root
    [N, T]``, each node's step; ``internal_by_root``, ``evaluated_by_root [T, N]`` (verified if visited; evaluated by
    the protocol, root in), ``evaluated_count [T]``; ``sigma_by_root [c, T]`` per chunk: std where verified, else 1."""
    T, L, dev = ctx.schedule.steps, lt.L, lt.depth.device
    roots = torch.arange(T, device=dev)
    step = (roots[:, None] + torch.arange(L + 1, device=dev)[None]).clamp(max=T - 1)  # [T, L+1]: step of depth-l nodes
    lt.std_col = ctx.schedule.kernel.col("std")
    lt.coefs_by_root = ctx.coef_table[step[:, :L]].permute(1, 2, 0)[..., None].contiguous()
    lt.node_step_by_root = step[:, lt.depth].T.contiguous()
    dl = (ctx.schedule.end_speculative - roots).clamp(min=0, max=L)[:, None]  # L_n (0 for finished rows)
    lt.internal_by_root, lt.evaluated_by_root = round_masks(lt.depth[None], lt.num_children[None] > 0, dl, ctx.evaluate_leaves)
    lt.evaluated_count, lt.internal_count = lt.evaluated_by_root.sum(1), lt.internal_by_root.sum(1)
    lt.zero_long, lt.false = torch.zeros((), dtype=torch.long, device=dev), torch.zeros((), dtype=torch.bool, device=dev)
    lt.inf = torch.full((), float("inf"), dtype=lt.one.dtype, device=dev)
    lt.sigma_by_root = [torch.where(lt.internal_by_root[:, u].T, lt.coefs_by_root[du, lt.std_col, :, 0], lt.one)
                        for _, u, _, _, _, du, _, _ in lt.buffers.chunks]


def draw_tables(lt: DenseTables, e: tuple, dtype, M: int, T: int, D: int, shared: dict | None = None) -> None:
    """Draw every (row, root, node)'s numbers once where small (:data:`NOISE_CACHE`, :data:`UNIFORM_CACHE`):
    ``lt.noise_cache [N-1, M, T, D]``, each non-root node's draft noise (:func:`specsamp.rng.normal` of its key, the
    states' dtype), times its parent step's ``std`` where ``lt.noise_scaled`` (one tree per run); ``lt.uniform_cache``,
    per coupling call ``c`` ``[N, M, T, W_c]``, a node's first two :class:`specsamp.rng.KeyedRows` draws (widths
    ``Kmax`` and 1: D-GRS's acceptance and residual uniforms, the reflection coupling's one). Same keys, so the same
    numbers as per-round draws. ``shared``: the run's other trees' tables, reused where nodes (and widths) match."""
    N = lt.N

    def once(key, make):  # the run's table under key, made by its first tree; the tree's own without shared
        if shared is not None and key not in shared:
            shared[key] = make()
        return make() if shared is None else shared[key]

    noise = lambda: rng.draft_noise(lt.key_cache[0], e, dtype).reshape(M, T, N - 1, D).permute(2, 0, 1, 3)  # noqa: E731
    if N > 1 and M * T * (N - 1) * D <= NOISE_CACHE:
        if shared is None:
            std = lt.coefs_by_root[lt.dm1, lt.std_col]  # [N-1, T, 1]: each node's parent step, per root
            lt.noise_cache, lt.noise_scaled = (noise() * std[:, None]).contiguous(), True  # std z, as Nodes.draft scales it
        else:
            lt.noise_cache = once(("noise", N), lambda: noise().contiguous())
    widths = rng.verify_widths(lt.tree.num_children)
    if M * T * N * sum(widths) <= UNIFORM_CACHE:
        lt.uniform_cache = once(("uniform", N, widths),
                                lambda: [u.permute(2, 0, 1, 3).contiguous() for u in rng.verify_uniforms(lt.key_cache[1], widths)])
