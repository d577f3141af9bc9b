"""What a dense round is built from: a tree's static index tensors and buffers (:class:`_LeanTree`), per-run tables.

The constants bound the caches (tests set 0: fallbacks draw the same numbers). Round internals (:mod:`specsamp.chains`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from . import rng
from .chains import round_masks
from .trees import DraftTree

if TYPE_CHECKING:
    from .chains import _Context


HISTORY_SLOTS = 16  # most records a draft's history may keep in the lean round (Draft.history)
RESIDUAL_CACHE = 1 << 20  # largest I * M * D for which a round keeps every internal node's verdict sample
KEY_CACHE = 1 << 21  # largest M * T * N for which a run keeps every (row, root, node) key in a table
NOISE_CACHE = 1 << 20  # largest M * T * (N - 1) * D for which a run draws every (row, root, node) draft noise once
UNIFORM_CACHE = 1 << 20  # largest M * T * N * (Kmax + 1) for which a run draws every node's coupling uniforms once
VERIFY_MEMORY = 0.1  # a verification chunk's temporaries, as a fraction of the states block ...
VERIFY_FLOOR = 1 << 20  # ... or this many elements, whichever is larger


class _LeanTree:
    """Static index tensors of one fixed :class:`DraftTree` (``N`` nodes, depth ``L``), built once per run: ``depth``,
    ``parent``, ``first_child``, ``num_children`` ``[N]`` long; ``anc [N, N]``, ``anc[v, w] = 1`` where ``w`` is ``v``
    or its ancestor (states' dtype); ``layer_sizes``, ``layer_parents`` per depth; ``groups_np``, ``(K, internal nodes
    [g], children [g, K])`` per width; ``child_pad``, ``child_ok`` ``[N, Kmax]``: children (clamped), which exist."""

    def __init__(self, tree: DraftTree, dev, dtype):
        N, L = len(tree), tree.max_depth
        self.N, self.L = N, L
        t = lambda a: torch.as_tensor(a, dtype=torch.long, device=dev)  # noqa: E731
        self.tree, self.tensors = tree, tree.index_tensors(dev)
        self.depth, self.parent, self.first_child, self.num_children = (self.tensors[k] for k in ("depth", "parent", "first_child", "num_children"))
        anc = np.eye(N)
        for v in range(1, N):  # breadth-first: the parent's row is complete before the child's
            anc[v] += anc[int(tree.parent[v])]
        self.anc = torch.as_tensor(anc, dtype=dtype, device=dev)
        self.anc_t = self.anc[:, 1:].T.contiguous()  # [N-1, N]: which nodes each non-root edge lies above
        self.depth1_row = (self.depth + 1)[None]
        self.dm1 = self.depth[1:] - 1
        self.dcol = self.depth.clamp(max=max(L - 1, 0))[None]  # the depth column of a node's verification
        self.parent1, self.parent_c = self.parent[1:], self.parent.clamp(min=0)
        self.one = torch.ones((), dtype=dtype, device=dev)
        self.num_children_np = np.asarray(tree.num_children)
        self.depth_np = np.asarray(tree.depth)
        self.layer_sizes = [1] + [int(tree.layer_end[l] - tree.layer_end[l - 1]) for l in range(1, L + 1)]
        self.layer_parents = [t(tree.parent[tree.layer(l)]) for l in range(1, L + 1)]
        self.layer_bounds = np.concatenate([[0], np.cumsum(self.layer_sizes)]).tolist()  # layer l: nodes [b[l], b[l+1])
        self.ids = torch.arange(1, N, device=dev)
        self.key_cache = self.noise_cache = self.uniform_cache = None
        self.noise_scaled = False
        self.nodes = torch.arange(N, device=dev)
        self.groups_np = []  # (K, internal nodes, their children) per distinct width
        for k in sorted({int(c) for c in tree.num_children if c > 0}):
            u = [v for v in range(N) if int(tree.num_children[v]) == k]
            self.groups_np.append((k, u, [[int(tree.first_child[v]) + j for j in range(k)] for v in u]))
        kmax = int(tree.num_children.max())
        j = torch.arange(kmax, device=dev)
        self.child_ok = j[None] < self.num_children[:, None]
        self.child_pad = (self.first_child[:, None] + j[None]).clamp(max=N - 1)
        depth, internal = np.asarray(tree.depth), np.asarray(tree.num_children) > 0
        d = np.arange(L + 1)[:, None]
        self.evaluated_by_limit = {  # [L+1, N]: nodes the call evaluates when L_n = row index, per protocol
            leaves: round_masks(depth[None], internal[None], d, leaves)[1] for leaves in (False, True)}
        self.edge_slot = (self.ids - self.first_child[self.parent[1:]])[None]  # each child's place among its siblings
        up = np.tile(np.arange(N)[:, None], (1, L + 1))  # [N, L+1]: the ancestor of v at depth j (v itself below it)
        for v in range(N):
            u = v
            while u >= 0:
                up[v, : int(tree.depth[u]) + 1] = u
                u = int(tree.parent[u])
        self.anc_at_depth = t(up)
        self.vrest_row = (self.nodes - 1).clamp(min=0)  # node v's row of the non-root velocities (0 for the root)
        self.is_root_col = (self.nodes == 0)[:, None]
        self.slots = torch.arange(HISTORY_SLOTS, device=dev)[None]

    def plan(self, n: np.ndarray, exact: np.ndarray, end: int, evaluate_leaves: bool, rows: np.ndarray | None = None) -> np.ndarray:
        """Flat indices ``node * M + row`` of the states a round's call evaluates, from host copies of ``n [M]`` and
        ``exact [M]``: the protocol's nodes of ``T|_{L_n}`` (:meth:`specsamp.rounds._Nodes.evaluated`), known roots
        out, live rows only (and only ``rows``, bool ``[M]``, where given)."""
        dl = np.clip(end - n, 0, self.L)
        mask = self.evaluated_by_limit[bool(evaluate_leaves)][dl]
        mask[:, 0] &= ~exact
        mask &= (n < end)[:, None]
        if rows is not None:
            mask &= rows[:, None]
        return np.flatnonzero(mask.T)

    def bind(self, M: int, D: int, pool: dict | None = None, event: tuple | None = None) -> None:
        """Allocate :class:`_LeanBuffers` (``self.buffers``) for ``M`` rows of ``D`` coordinates, event shape ``event``
        (default ``(D,)``). ``pool``: optional ``{"states", "residual"}`` flat storage shared by a run's trees (their
        rounds run one after another and keep nothing in the buffers), each at least this tree's size."""
        dev = self.anc.device
        N = self.N
        event = tuple(event) if event is not None else (D,)
        if pool is None:
            states = torch.empty(N, M, D, dtype=self.anc.dtype, device=dev)
        else:
            states = pool["states"][: N * M * D].view(N, M, D)
        bounds = np.concatenate([[0], np.cumsum(self.layer_sizes)])
        layers = []
        for l in range(1, self.L + 1):
            a, b, pa, pb = int(bounds[l]), int(bounds[l + 1]), int(bounds[l - 1]), int(bounds[l])
            kids = self.num_children_np[pa:pb]
            if (kids == kids[0]).all() and kids[0] > 0:
                k = int(kids[0])
                out = states[a:b] if k == 1 else states[a:b].view(pb - pa, k, M, D)
                parent_view = states[pa:pb] if k == 1 else states[pa:pb].view(pb - pa, 1, M, D)
                layers.append((None, parent_view, None if k == 1 else k, out))
            else:
                layers.append((self.layer_parents[l - 1], None, None, states[a:b]))
        t = lambda a: torch.as_tensor(a, dtype=torch.long, device=dev)  # noqa: E731
        chunks, pos, node_pos = [], 0, np.zeros(N, dtype=np.int64)
        budget = max(VERIFY_MEMORY * N * M * D, VERIFY_FLOOR)
        for k, u_np, ch_np in self.groups_np:
            per_node = (k + 8) * M * D  # children copy, parents, means and the coupling's work rows
            step = max(1, int(budget // per_node))
            for i in range(0, len(u_np), step):
                uc, cc = u_np[i : i + step], ch_np[i : i + step]
                flat_ch = [c for row in cc for c in row]
                node_pos[uc] = np.arange(pos, pos + len(uc))
                chunks.append((k, t(uc), _as_slice(uc), t(cc), _as_slice(flat_ch), t(self.depth_np[uc]), bool(uc[0] == 0),
                               slice(pos, pos + len(uc))))
                pos += len(uc)
        # internal nodes' verdict samples, kept where small; else redrawn (same keys) for the walk's one node per row
        if pos * M * D > RESIDUAL_CACHE:
            residual = None
        elif pool is None:
            residual = torch.empty(pos, M, D, dtype=states.dtype, device=dev)
        else:
            residual = pool["residual"][: pos * M * D].view(pos, M, D)
        self.width_groups = [(k, t(u_np[0]), torch.as_tensor(self.num_children_np == k, device=dev)) for k, u_np, _ in self.groups_np]
        self.pos_c = t(node_pos)
        self.rows = torch.arange(M, device=dev).repeat(N)  # the batch row of every node-major state
        self.rows_rest = self.rows[M:]
        self.ar = torch.arange(M, device=dev)
        self.ar_col = self.ar[:, None]
        self.dcol_m = self.dcol.expand(M, N)
        self.root_state = states[0].view(M, *event)  # node 0's states as the batch's, and the others as the call's input
        self.rest_states = states[1:].view((N - 1) * M, *event)
        self.buffers = _LeanBuffers(states, residual, layers, chunks, torch.zeros(M, N, dtype=torch.bool, device=dev),
                                    torch.zeros(M, N, dtype=torch.long, device=dev))


@dataclass
class _LeanBuffers:
    """The lean round's node-major buffers: ``states [N, M, D]``; ``residual [I, M, D]``, the internal nodes' verdict
    samples; ``layers``, per depth ``(parents, parent_view, K, out_view)``: where the parents are the whole previous
    layer with ``K`` children each, ``parents`` None and views ``[P, 1, M, D]``, ``[P, K, M, D]`` (both ``[P, M, D]``
    and ``K`` None for one child), else the parents' ids, ``out_view [C, M, D]`` and the rest None; ``chunks``, the
    verification calls ``(K, nodes [c], slice, children [c, K], slice, depths [c], has node 0, rows of residual)``
    (slices None unless contiguous), each at most :data:`VERIFY_MEMORY` of the states in temporaries (one node at
    least); ``acc``, ``idx`` ``[M, N]``: the internal nodes' verdicts (accepted, index), every round; 0 elsewhere."""

    states: torch.Tensor
    residual: torch.Tensor
    layers: list
    chunks: list
    acc: torch.Tensor
    idx: torch.Tensor


def _as_slice(ids: list[int]) -> slice | None:
    return slice(ids[0], ids[-1] + 1) if ids == list(range(ids[0], ids[-1] + 1)) else None


def _upload(a: np.ndarray, dev) -> torch.Tensor:
    """Host indices to the device without waiting for it (pinned, non-blocking copy on CUDA)."""
    t = torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64))
    if torch.device(dev).type == "cuda":
        return t.pin_memory().to(dev, non_blocking=True)
    return t.to(dev)


def _root_tables(lt: _LeanTree, ctx: _Context) -> None:
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
    lt.zero_long = torch.zeros((), dtype=torch.long, device=dev)
    lt.false = torch.zeros((), dtype=torch.bool, device=dev)
    lt.inf = torch.full((), float("inf"), dtype=lt.one.dtype, device=dev)
    lt.sigma_by_root = [torch.where(lt.internal_by_root[:, u].T, lt.coefs_by_root[du, lt.std_col, :, 0], lt.one)
                        for _, u, _, _, _, du, _, _ in lt.buffers.chunks]


def _draw_tables(lt: _LeanTree, e: tuple, dtype, M: int, T: int, D: int, shared: dict | None = None) -> None:
    """Draw every (row, root, node)'s numbers once where small (:data:`NOISE_CACHE`, :data:`UNIFORM_CACHE`):
    ``lt.noise_cache [N-1, M, T, D]``, each non-root node's draft noise (:func:`specsamp.rng.normal` of its key, the
    states' dtype), times its parent step's ``std`` where ``lt.noise_scaled`` (one tree per run); ``lt.uniform_cache``,
    per coupling call ``c`` ``[N, M, T, W_c]``, a node's first two :class:`specsamp.rng.KeyedRows` draws (widths
    ``Kmax`` and 1: D-GRS's acceptance and residual uniforms, the reflection coupling's one). Same keys, so the same
    numbers as per-round draws. ``shared``: the run's other trees' tables, reused where nodes (and widths) match."""
    N = lt.N
    if N > 1 and M * T * (N - 1) * D <= NOISE_CACHE:
        if shared is None:
            z = rng.draft_noise(lt.key_cache[0], e, dtype).reshape(M, T, N - 1, D).permute(2, 0, 1, 3)
            std = lt.coefs_by_root[lt.dm1, lt.std_col]  # [N-1, T, 1]: each node's parent step, per root
            lt.noise_cache, lt.noise_scaled = (z * std[:, None]).contiguous(), True  # std z, as _Nodes.draft scales it
        else:
            if ("noise", N) not in shared:
                z = rng.draft_noise(lt.key_cache[0], e, dtype).reshape(M, T, N - 1, D)
                shared["noise", N] = z.permute(2, 0, 1, 3).contiguous()
            lt.noise_cache = shared["noise", N]
    widths = rng.verify_widths(lt.num_children_np)
    if M * T * N * sum(widths) <= UNIFORM_CACHE:
        if shared is None or ("uniform", N, widths) not in shared:
            tabs = [u.permute(2, 0, 1, 3).contiguous() for u in rng.verify_uniforms(lt.key_cache[1], widths)]
            if shared is None:
                lt.uniform_cache = tabs
                return
            shared["uniform", N, widths] = tabs
        lt.uniform_cache = shared["uniform", N, widths]
