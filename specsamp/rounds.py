"""The sparse round of Algorithm 1 (lines 3--24): the path execution, and the checked walk of the dense round.

One round for the live trajectories, one depth at a time: draft (line 7), evaluate, walk down with the
coupling (lines 14--23), record the draft's history, prefetch and commit (line 24). The nodes' view says how a
node's state and velocity are obtained: :class:`_PathNodes` drafts and evaluates only what the walk visits
(the path execution, :class:`SparseLayout`); :class:`specsamp.lean._DenseNodes` reads them from a dense round's
drafted tree (where a deferred check failed). Coefficients come from the kernel's table (:func:`_coefs`), a
round's uniforms from one keyed draw (:func:`_verify_uniforms`): the bits of per-call draws and coefficients.
Round internals (:mod:`specsamp.chains`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from . import rng
from .chains import _Chains, _Context, _root_call, _Tally, commit_round, count_verifications, leaf_prefetch, nearest_sibling, round_masks
from .coupling import NonFiniteError, check_verdict_contract
from .drafts import DraftHistory, DraftRoot, data_prediction, table_means
from .trees import DraftTree


@dataclass
class _Round:
    """The live trajectories of one round (``m`` of them) and what both executions need."""

    rows: torch.Tensor  # [m] positions in the full batch
    x: torch.Tensor  # [m, *e] roots Y_n
    n: torch.Tensor  # [m] root state index
    depth_limit: torch.Tensor  # [m] L_n
    frozen: torch.Tensor  # [m, *e] draft's frozen root quantity
    v_root: torch.Tensor  # [m, *e] root velocity used by the draft
    root_exact: torch.Tensor  # [m] bool: v_root is the root's own exact velocity
    draft_keys: torch.Tensor  # [m] the trajectories' draft keys with the root index folded in: fold(key, n)
    verify_keys: torch.Tensor  # [m] the same for the verification keys
    history: DraftHistory | None = None  # [m, H, ...] the round's own copy of the draft's history; None when H = 0


def _coefs(ctx: _Context, step: torch.Tensor, like: torch.Tensor) -> dict:
    """The kernel coefficients of steps ``step [s]`` (:meth:`specsamp.kernels.Kernel.coefs`), each ``[s, 1, ..., 1]``
    to scale the rows of ``like [s, *e]``, in the states' dtype: one gather of the kernel's table."""
    return ctx.schedule.kernel.coefs(step, like)


def _take(t: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Rows ``rows`` of ``t``, for ascending distinct ``rows`` (a ``nonzero``'s output): ``t`` itself (no copy) where they are
    all of its rows, which is every row of a round at its first depth."""
    return t if rows.numel() == t.shape[0] else t[rows]


class _Nodes:
    """How an execution obtains node states and velocities. Subclasses: tree and path."""

    def __init__(self, tree: DraftTree, tensors: dict, rnd: _Round, ctx: _Context):
        self.tree, self.t, self.r, self.ctx = tree, tensors, rnd, ctx

    def masks(self, u: torch.Tensor, sub: torch.Tensor):
        """:func:`specsamp.chains.round_masks` of nodes ``u`` (one per selected trajectory ``sub``)."""
        return round_masks(self.t["depth"][u], self.t["num_children"][u] > 0, self.r.depth_limit[sub], self.ctx.evaluate_leaves)

    def internal_in_round(self, u: torch.Tensor, sub: torch.Tensor) -> torch.Tensor:
        """Whether node ``u`` (one per selected trajectory ``sub``) is internal in ``T|_{L_n}``."""
        return self.masks(u, sub)[0]

    def evaluated(self, u: torch.Tensor, sub: torch.Tensor) -> torch.Tensor:
        """Whether the round's batched call evaluated node ``u`` (the B=|V| or B=|I| protocol)."""
        return self.masks(u, sub)[1]

    def child_ids(self, u: torch.Tensor, k: int) -> torch.Tensor:
        """Node ids ``[s, k]`` of the ``k`` children of nodes ``u [s]`` (contiguous, drafting order)."""
        return self.t["first_child"][u][:, None] + torch.arange(k, device=u.device)[None]

    def proposal_mean(self, sub: torch.Tensor, x_parents: torch.Tensor, step: torch.Tensor, c: dict) -> torch.Tensor:
        """The draft's proposal means ``[s, P, *e]`` of the children of ``x_parents [s, P, *e]`` at step ``step [s]``.

        ``c``: the steps' kernel coefficients (:func:`_coefs`). A draft with a table form (``Draft.table_mean``)
        computes from them (:func:`specsamp.drafts.table_means`, its one formula); any other calls ``mean``.
        """
        draft = self.ctx.draft
        if draft.table_mean is None:
            return draft.mean(_take(self.r.frozen, sub), x_parents, step, self.ctx.schedule)
        s, p = x_parents.shape[:2]
        flat = {k: v if k == "kernel" else v.reshape(s, 1, 1) for k, v in c.items()}
        return table_means(draft, _take(self.r.frozen, sub), x_parents.reshape(s, p, -1), flat).reshape(x_parents.shape)

    def draft(self, sub: torch.Tensor, x_u: torch.Tensor, step: torch.Tensor, ids: torch.Tensor, c: dict):
        """Draft the children ``ids [s, k]`` of states ``x_u [s, *e]`` at steps ``step [s]`` (rows ``sub [s]`` of the
        round; ``c`` their kernel coefficients, :func:`_coefs`): the proposal means plus keyed kernel noise
        (Algorithm 1, line 7). Returns ``(means [s, *e], children [s, k, *e])``."""
        mean = self.proposal_mean(sub, x_u[:, None], step, c)[:, 0]
        noise = rng.draft_noise(rng.node_keys(_take(self.r.draft_keys, sub)[:, None], ids), x_u.shape[1:], x_u.dtype)
        noise *= c["std"][:, None]  # in place: the noise buffer becomes the children (same numbers as mean + std * noise)
        noise += mean[:, None]
        return mean, noise

    # interface
    def children(self, sub, x_u, u, k, step, c):  # -> (draft mean of u, children states [s, k, *e], ids [s, k])
        raise NotImplementedError

    def velocity(self, sub, u, x_u):  # -> exact velocity of node u [s, *e]
        raise NotImplementedError

    def inner_velocity(self, sub, u, x_u, depth):
        """The exact velocity ``[s, *e]`` of nodes ``u [s]`` below the root, at depth ``depth`` (an int >= 1, or ``[s]``)."""
        return self.velocity(sub, u, x_u)


class _PathNodes(_Nodes):
    """Path execution: only the nodes the walk visits are drafted; velocities computed on demand."""

    def __init__(self, tree, tensors, rnd, ctx):
        super().__init__(tree, tensors, rnd, ctx)
        internal_rows, all_rows = tree.call_rows_by_depth
        table = torch.as_tensor(all_rows if ctx.evaluate_leaves else internal_rows, device=rnd.x.device)
        self.call_rows = table[rnd.depth_limit] - rnd.root_exact.long()

    def children(self, sub, x_u, u, k, step, c):
        ids = self.child_ids(u, k)
        mean, kids = self.draft(sub, x_u, step, ids, c)
        return mean, kids, ids

    def velocity(self, sub, u, x_u):
        root_known = (u == 0) & self.r.root_exact[sub]
        out = _take(self.r.v_root, sub)
        out = out.clone() if out is self.r.v_root else out  # a copy the walk may write
        todo = (~root_known).nonzero(as_tuple=True)[0]
        if todo.numel():  # evaluate only what the round's batched call would have had to compute
            out[todo] = self.ctx.velocity(x_u[todo], self.r.n[sub[todo]] + self.t["depth"][u[todo]], self.r.rows[sub[todo]])
        return out

    def inner_velocity(self, sub, u, x_u, depth):
        return self.ctx.velocity(x_u, _take(self.r.n, sub) + depth, _take(self.r.rows, sub))  # every row's, as velocity would


def _widths(tree: DraftTree) -> list[list[int]]:
    """``[l]``: the distinct widths ``K > 0`` of the nodes at depth ``l - 1``, ascending (``l = 1..L``; entry 0 empty)."""
    nc, depth = np.asarray(tree.num_children), np.asarray(tree.depth)
    return [[]] + [sorted(int(k) for k in np.unique(nc[(depth == l - 1) & (nc > 0)])) for l in range(1, tree.max_depth + 1)]


UNIFORM_TABLE = 1 << 18  # largest m * I * (K_max + 1) for which a round draws every internal node's uniforms at once


def _verify_uniforms(tree: DraftTree, rnd: _Round):
    """``uniforms(sub, u, k)``: the :class:`~specsamp.rng.KeyedRows` of the verification of nodes ``u [s]`` (width ``k``)
    of rows ``sub [s]``, keyed by (trajectory, root, node).

    A round's first two calls of every internal node (``K_max`` and 1 numbers, D-GRS's acceptance and residual
    uniforms) are drawn in one keyed draw for all of its rows (:func:`specsamp.rng.uniform_table`) up to
    :data:`UNIFORM_TABLE` numbers, and gathered per verification; the numbers are those of the keys (any further
    call is drawn from them), so the rule cannot tell.
    """
    nc = np.asarray(tree.num_children)
    internal = np.flatnonzero(nc > 0)
    widths = rng.verify_widths(nc)
    m = rnd.x.shape[0]
    if m * internal.size * sum(widths) > UNIFORM_TABLE:
        def uniforms(sub, u, k):
            keys = rng.node_keys(_take(rnd.verify_keys, sub), u)
            return rng.KeyedRows(keys, rng.verify_uniforms(keys, (k, 1)))  # the same numbers, drawn at once
        return uniforms
    dev = rnd.x.device
    col = np.full(nc.size, -1, dtype=np.int64)
    col[internal] = np.arange(internal.size)
    col = torch.as_tensor(col, device=dev)
    keys = rng.node_keys(rnd.verify_keys[:, None], torch.as_tensor(internal, device=dev)[None])  # [m, I]
    drawn = rng.verify_uniforms(keys, widths)  # [m, I, W_c] per call c

    def uniforms(sub, u, k):
        j = col[u]
        return rng.KeyedRows(lambda: keys[sub, j], [d[sub, j] for d in drawn])
    return uniforms


def _walk(nodes: _Nodes, rnd: _Round, ctx: _Context, tally: _Tally):
    """Phase 3 of Algorithm 1 (lines 14--23) plus root-velocity prefetch for the next round.

    Per depth, the walking rows are verified in one coupling call per node width (ascending); a row's state moves
    to the verdict's sample (the accepted child, or the residual draw where it stops). One host synchronisation per
    width and depth (the rows that walk) and one per depth for the velocities the next depth needs.

    Returns:
        ``(committed_state [m, *e], steps [m], v_next [m, *e], exact_next [m])``.
    """
    m = rnd.x.shape[0]
    dev = rnd.x.device
    t = nodes.t
    all_m = torch.arange(m, device=dev)
    cur = torch.zeros(m, dtype=torch.long, device=dev)
    x_cur = rnd.x.clone()  # the walk's state; where a row stops, its residual draw (the committed state either way)
    v_cur = nodes.velocity(all_m, cur, x_cur)
    _record(ctx, rnd, all_m, x_cur, v_cur, rnd.n)  # the root, verified below
    walking = torch.ones(m, dtype=torch.bool, device=dev)
    rejected = torch.zeros(m, dtype=torch.bool, device=dev)
    steps = torch.zeros(m, dtype=torch.long, device=dev)
    verified = []  # (depth, rows, children ids, children, rejected) of every verification, for the nearest prefetch
    widths = _widths(nodes.tree)
    uniforms = _verify_uniforms(nodes.tree, rnd)
    for l in range(1, nodes.tree.max_depth + 1):  # line 16
        walking &= (l <= rnd.depth_limit) & (t["num_children"][cur] > 0)
        width = t["num_children"][cur]  # fixed before any row of this depth moves down
        groups = []
        for k in widths[l]:
            sub = (walking if len(widths[l]) == 1 else walking & (width == k)).nonzero(as_tuple=True)[0]
            if sub.numel():
                groups.append((k, sub))
        if not groups:
            break
        for k, sub in groups:
            u = _take(cur, sub)
            step = _take(rnd.n, sub) + (l - 1)
            x_u = _take(x_cur, sub)  # x_cur itself at the first depth: read before x_cur moves below
            c = _coefs(ctx, step, x_u)
            mean_p, kids, ids = nodes.children(sub, x_u, u, k, step, c)
            mean_q = ctx.schedule.kernel.mean(x_u, _take(v_cur, sub), c)
            try:
                verdict = ctx.coupling(kids, mean_p, mean_q, c["std"].reshape(-1), uniforms(sub, u, k))  # line 17
            except NonFiniteError as err:
                r0 = err.rows[0]
                raise NonFiniteError(
                    f"non-finite states at trajectory {int(ctx.ids[rnd.rows[sub[r0]]])}, step {int(step[r0])}, "
                    f"children of node {int(u[r0])} (depth {l - 1}) of the round rooted at state {int(rnd.n[sub[r0]])}: "
                    f"the target's velocity or the draft produced NaN or inf there ({len(err.rows)} such parent(s) "
                    "at this depth); no coupling can serve them",
                    [int(ctx.ids[rnd.rows[sub[r]]]) for r in err.rows],
                ) from None
            if ctx.check_contract:
                check_verdict_contract(ctx.coupling, verdict, kids, lambda r: (
                    f"trajectory {int(ctx.ids[rnd.rows[sub[r]]])}, step {int(step[r])}, node {int(u[r])} (depth {l - 1}) "
                    f"of the round rooted at state {int(rnd.n[sub[r]])}"))
            steps[sub] = l
            # lines 18--22: the accepted child (the verdict's sample is that child, bit for bit), or the residual and stop
            x_cur[sub] = verdict.sample
            walking[sub] = verdict.accepted
            rejected[sub] = ~verdict.accepted
            cur[sub] = ids.gather(1, verdict.index.clamp(max=k - 1)[:, None])[:, 0]  # a stopped row's is not read
            if ctx.prefetch == "nearest":
                verified.append((l, sub, ids, kids, ~verdict.accepted))
        # velocities of accepted nodes that are internal in T|_{L_n} are needed one level down
        idx = (walking & nodes.internal_in_round(cur, all_m)).nonzero(as_tuple=True)[0]
        if idx.numel():
            v_cur[idx] = nodes.inner_velocity(idx, _take(cur, idx), _take(x_cur, idx), l)
            if rnd.history is not None:
                _record(ctx, rnd, idx, x_cur[idx], v_cur[idx], rnd.n[idx] + l)
    _count(tally, rnd, steps, rejected, nodes.tree.max_depth)
    finished = ~rejected  # walked to a leaf of T|_{L_n}
    return x_cur, steps, _prefetch(nodes, rnd, ctx, finished, cur, x_cur, v_cur, verified)


def _count(tally: _Tally, rnd: _Round, steps: torch.Tensor, rejected: torch.Tensor, L: int) -> None:
    """The walk's verifications for :func:`specsamp.chains.count_verifications`: row ``r`` was verified at depths
    ``1..steps[r]`` and accepted at all of them but the last where it was ``rejected`` (``steps, rejected [m]``)."""
    depth = torch.arange(L, device=steps.device)[None].expand(steps.shape[0], -1)
    attempts = (depth < steps[:, None]).long()  # [m, L]
    accepts = (depth < (steps - rejected.long())[:, None]).long()
    count_verifications(tally, rnd.n, depth, attempts, accepts, rnd.rows)


def _record(ctx: _Context, rnd: _Round, rows: torch.Tensor, x: torch.Tensor, v: torch.Tensor, n: torch.Tensor) -> None:
    """Push exact data predictions of committed-trajectory states (``x, v [r, *e]`` at state ``n [r]``) to the
    front of rows ``rows`` of the round's draft history; no-op for drafts without history."""
    if rnd.history is not None:
        rnd.history.push(rows, data_prediction(x, v, n, ctx.schedule), n, x)


def _prefetch(nodes: _Nodes, rnd: _Round, ctx: _Context, finished, cur, x_cur, v_cur, verified):
    """Velocity for the next round's draft (the ``prefetch`` key) and whether it is exact.

    ``nearest``: the committed leaf's own if it was evaluated; else the evaluated sibling nearest the
    committed state; else the parent's. ``parent``: the leaf's own if evaluated, else the parent's.
    ``none``: nothing (the next round pays one call for its root). ``x_cur [m, *e]``: the committed states;
    ``verified``: the walk's ``(depth, rows, children ids, children, rejected)`` per verification, in order.
    """
    m = rnd.x.shape[0]
    dev = rnd.x.device
    v_next = v_cur  # the walk's own; for finished rows: the leaf's parent velocity (the last verified node's)
    exact = leaf_prefetch(ctx.prefetch, finished, lambda: nodes.evaluated(cur, torch.arange(m, device=dev)))
    if ctx.prefetch == "none":
        return v_next, exact
    idx = exact.nonzero(as_tuple=True)[0]
    if idx.numel():
        # a finished row accepted at depth 1 at least (every live row's root has children): its leaf is not the root
        v_next[idx] = nodes.inner_velocity(idx, cur[idx], _take(x_cur, idx), nodes.t["depth"][cur[idx]])
    if ctx.prefetch == "nearest":
        for l, sub, ids, kids, stopped in verified:
            at = stopped.nonzero(as_tuple=True)[0]
            if not at.numel():
                continue
            rej, ids, kids = sub[at], ids[at], kids[at]
            has, best = nearest_sibling(nodes.evaluated(ids, rej[:, None].expand_as(ids)), kids, x_cur[rej], float("inf"))
            has = has.nonzero(as_tuple=True)[0]
            if has.numel():
                r2 = rej[has]
                v_next[r2] = nodes.inner_velocity(r2, ids[has, best[has]], kids[has, best[has]], l)
    return v_next, exact


def _round(ctx: _Context, tree: DraftTree, tensors: dict, nodes_cls, st: _Chains, live: torch.Tensor, tally: _Tally,
           batch: bool = True) -> None:
    """One round (Algorithm 1, lines 3--24) for the ``live`` trajectories; updates ``st`` and ``tally``.

    ``nodes_cls(tree, tensors, rnd, ctx)``: how the walk obtains node states and velocities (:class:`_PathNodes`, or
    the dense round's drafted tree, :class:`specsamp.lean._DenseNodes`); ``batch``: count the calls in ``batch_nfe``
    here (the dense layout counts them itself)."""
    # line 3: L_n = min(L, N - n) and T_n = T|_{L_n}, with N the end of speculation
    hist = None if st.history is None else st.history.take(live)
    x, n = st.x[live], st.n[live]  # copies: read by the round, never written
    root = DraftRoot(x=x, v=st.v_root[live], n=n, exact=st.root_exact[live], history=hist)
    rnd = _Round(
        rows=live,
        x=x,
        n=n,
        depth_limit=(ctx.schedule.end_speculative - n).clamp(max=tree.max_depth),
        frozen=ctx.draft.freeze(root, ctx.schedule),
        v_root=root.v,
        root_exact=root.exact,
        draft_keys=rng.round_keys(st.draft_keys[live], n),  # (trajectory, root): the nodes fold in per draw
        verify_keys=rng.round_keys(st.verify_keys[live], n),
        history=None if hist is None else hist.clone(),  # the walk records into its own copy
    )
    nodes = nodes_cls(tree, tensors, rnd, ctx)  # lines 4--13: drafting and (tree execution) the batched call
    new_x, steps, (v_next, exact_next) = _walk(nodes, rnd, ctx, tally)  # lines 14--23
    for rows in getattr(nodes, "sweep_rows", ()):  # Picard sweeps (refine): one batched call each
        tally.charge(live, rows, batch)
    tally.charge(live, nodes.call_rows, batch)  # a round with nothing to evaluate costs no call
    commit_round(st, tally, live, new_x, n + steps, steps, v_next, exact_next, rnd.history)  # line 24


class SparseLayout:
    """The sparse round's layout for :func:`specsamp.chains.run_rounds`: the live rows as device indices (one host
    synchronisation to find them), each round on those rows alone. ``tree``: a fixed tree, or ``{n: T_n}`` with one
    round per root index in the batch, whose rows would share one batched call (charged once)."""

    def __init__(self, ctx: _Context, st: _Chains, tally: _Tally, tree: DraftTree | dict):
        self.ctx, self.st, self.tally = ctx, st, tally
        with_tensors = lambda t: (t, t.index_tensors(st.x.device))  # noqa: E731
        self.trees = with_tensors(tree) if isinstance(tree, DraftTree) else {n: with_tensors(t) for n, t in tree.items()}

    def live(self):
        live = (self.st.n < self.ctx.schedule.end_speculative).nonzero(as_tuple=True)[0]
        return live if live.numel() else None

    def root_call(self, live):
        _root_call(self.ctx, self.st, live, self.tally)

    def round(self, live):
        ctx, st, tally = self.ctx, self.st, self.tally
        if isinstance(self.trees, tuple):
            return _round(ctx, *self.trees, _PathNodes, st, live, tally)
        calls, most, roots = tally.batch_nfe, 0, st.n[live]
        for n in torch.unique(roots).tolist():
            before = tally.batch_nfe
            _round(ctx, *self.trees[n], _PathNodes, st, live[roots == n], tally)
            most = max(most, tally.batch_nfe - before)  # 1, or 1 + refine with Picard sweeps
        tally.batch_nfe = calls + most
    def progress(self, r: int, live) -> dict:
        first = self.ctx.schedule.first_speculative
        return {"round": r, "live": int(live.numel()), "batch_nfe": self.tally.batch_nfe,
                "steps_done": int((self.st.n - first).clamp(min=0).sum()), "n": self.st.n, "x": self.st.x, "v": self.st.v_root}

    def need_rows(self):
        return None
