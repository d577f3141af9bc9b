"""The sparse round of Algorithm 1 (lines 3--24): the path execution, and the checked walk of the dense round.

One round for the live trajectories, one depth at a time: draft (line 7), evaluate, walk down with the
coupling (lines 14--23), record the draft's history, prefetch and commit (line 24). The nodes' view says how a
node's state and velocity are obtained: :class:`Nodes` drafts and evaluates only what the walk visits (the path
execution, :class:`SparseLayout`); :class:`specsamp.round.dense.DenseNodes` reads them from a dense round's drafted
tree (where a deferred check failed). A round's uniforms come from one keyed draw (:func:`specsamp.round.draws.sparse_uniforms`).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from .. import rng
from ..coupling import NonFiniteError, check_verdict_contract
from ..drafts import DraftRoot, data_prediction, table_means
from .context import (
    Chains,
    Commit,
    Context,
    Tally,
    commit_round,
    count_verifications,
    leaf_prefetch,
    nearest_sibling,
    round_masks,
)
from .draws import sparse_noise, sparse_uniforms


def take_rows(t: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Rows ``rows`` (ascending, distinct) of ``t``: ``t`` itself, no copy, where they are all of its rows."""
    return t if rows.numel() == t.shape[0] else t[rows]


class Visit(NamedTuple):
    """Nodes ``u [s]`` of rows ``sub [s]`` of a sparse round, at states ``x [s, *e]`` and steps ``step [s]``, with
    their steps' kernel coefficients ``c`` (:meth:`specsamp.kernels.Kernel.coefs`)."""

    sub: torch.Tensor
    u: torch.Tensor
    x: torch.Tensor
    step: torch.Tensor
    c: dict


class Nodes:
    """The round of the live trajectories ``rows [m]`` (line 3: roots ``x``, ``n``, ``L_n = depth_limit``; the draft's
    frozen quantity; the keys with the root folded in), and the path execution's view of its nodes: drafted and
    evaluated only where the walk visits them. ``trees``: ``(tree, its index tensors)``; ``sub [s]`` selects rows of
    the round."""

    def __init__(self, ctx: Context, trees: tuple, st: Chains, live: torch.Tensor):
        (tree, tensors), self.st = trees, st
        self.ctx, self.tree, self.t, self.rows = ctx, tree, tensors, live
        hist = None if st.history is None else st.history.take(live)
        self.x, self.n = st.x[live], st.n[live]  # copies: read by the round, never written
        root = DraftRoot(x=self.x, v=st.v_root[live], n=self.n, exact=st.root_exact[live], history=hist)
        self.v_root, self.root_exact = root.v, root.exact
        self.depth_limit = (ctx.schedule.end_speculative - self.n).clamp(max=tree.max_depth)
        self.frozen = ctx.draft.freeze(root, ctx.schedule)
        self.draft_keys, self.verify_keys = (rng.round_keys(k[live], self.n) for k in (ctx.draft_keys, ctx.verify_keys))
        self.history = None if hist is None else hist.clone()  # the walk records into its own copy
        # a multistep kernel's records of the H = order - 1 states before each row's current node (the walk's own
        # copies, pushed as it walks down: walked)
        self.past = None if st.past is None else tuple(p[live] for p in st.past)

    def calls(self) -> list:
        """The rows ``[m]`` each batched call of the round evaluated per trajectory (Picard sweeps first)."""
        internal_rows, all_rows = self.tree.call_rows_by_depth
        table = torch.as_tensor(all_rows if self.ctx.evaluate_leaves else internal_rows, device=self.x.device)
        return [table[self.depth_limit] - self.root_exact.long()]

    def evaluated(self, u: torch.Tensor, sub: torch.Tensor) -> torch.Tensor:
        """Whether the round's call evaluated nodes ``u`` of rows ``sub`` (:func:`specsamp.round.context.round_masks`)."""
        return round_masks(
            self.t["depth"][u], self.t["num_children"][u] > 0, self.depth_limit[sub], self.ctx.evaluate_leaves
        )[1]

    def proposal_mean(self, v: Visit) -> torch.Tensor:
        """The draft's means ``[s, *e]`` of the children of the visited nodes ``v``, by the draft's table form where it
        has one (:func:`specsamp.drafts.table_means`)."""
        sub, x_u, step, c = v.sub, v.x, v.step, v.c
        draft, frozen, s = self.ctx.draft, take_rows(self.frozen, sub), x_u.shape[0]
        if draft.table_mean is None:
            return draft.mean(frozen, x_u[:, None], step, self.ctx.schedule)[:, 0]
        flat = {k: v.reshape(s, 1, 1) for k, v in c.items()}
        return table_means(draft, frozen, x_u.reshape(s, 1, -1), flat, self.ctx.schedule.kernel).reshape(x_u.shape)

    def draft(self, v: Visit, ids: torch.Tensor):
        """Line 7: the children ``ids [s, k]`` of the visited nodes ``v``, the proposal means plus keyed kernel noise.
        Returns ``(means [s, *e], children [s, k, *e])``."""
        mean = self.proposal_mean(v)
        return mean, sparse_noise(take_rows(self.draft_keys, v.sub), ids, mean, v.c["std"])

    def kernel_mean(self, v: Visit, out: torch.Tensor, refined: bool = False) -> torch.Tensor:
        """The target's kernel mean ``[s, *e]`` at the visited nodes ``v`` (``v.u`` of rows ``v.sub``: a node's
        ancestry is the walk's path to it), ``out [s, *e]`` their network outputs: the one place the sparse round and
        the checked walk compute it. A multistep kernel reads the records of the states before ``v.u``
        (:meth:`history_of`; ``refined``: the checked walk's Picard-refined proposal,
        :class:`specsamp.round.dense.DenseNodes`)."""
        kern = self.ctx.schedule.kernel
        if kern.order == 1:
            return kern.mean(v.x, out, v.c)
        return kern.mean(v.x, out, v.c, self.history_of(v, refined))

    def history_of(self, v: Visit, refined: bool = False) -> tuple:
        """A multistep kernel's ``history`` at the visited nodes ``v``: the records of the ``order - 1`` states before
        each on the walk's path (beyond the round's root, the committed path's), ``[s, *e]`` each."""
        return tuple(p[v.sub] for p in self.past)

    def walked(self, v: Visit, out: torch.Tensor) -> None:
        """A multistep kernel's past one step on for the rows ``v.sub`` verified at nodes ``v.u`` (their next state, the
        accepted child or the residual draw, is a child of ``v.u``): the record of ``v.u``'s step (state ``v.x``,
        output ``out``) pushed in front of those rows' records, in place."""
        rec = self.ctx.schedule.kernel.record(v.x, out, v.c)
        for j in range(len(self.past) - 1, 0, -1):
            self.past[j][v.sub] = self.past[j - 1][v.sub]
        self.past[0][v.sub] = rec

    def velocity(self, sub, u, x_u, depth):
        """The exact velocities ``[s, *e]`` of nodes ``u`` at states ``x_u`` and depth ``depth`` (an int or ``[s]``), or of
        the roots where ``depth`` is None (every row: ``v_root`` where exact, else evaluated)."""
        if depth is not None:
            return self.ctx.velocity(x_u, take_rows(self.n, sub) + depth, take_rows(self.rows, sub))
        out, todo = self.v_root.clone(), (~self.root_exact).nonzero(as_tuple=True)[0]
        if todo.numel():
            out[todo] = self.ctx.velocity(x_u[todo], self.n[todo], self.rows[todo])
        return out


def record(nodes: Nodes, rows, x, v, n) -> None:
    """Push the exact data predictions of committed-path states ``x, v [r, *e]`` at state ``n [r]`` to the front of
    rows ``rows`` of the round's draft history."""
    nodes.history.push(rows, data_prediction(x, v, n, nodes.ctx.schedule), n, x)


def verify_checked(nodes: Nodes, v: Visit, l: int, kids: torch.Tensor, means: tuple, uniforms):
    """Line 17 for the visited nodes ``v`` (depth ``l - 1``): the coupling's verdict on ``kids [s, k, *e]`` with the
    proposal and target means ``means`` (``[s, *e]`` each), each check raised where it fails, naming the trajectory,
    the step and the node."""
    ctx, sub, u, step = nodes.ctx, v.sub, v.u, v.step

    def traj(r):
        return int(ctx.ids[nodes.rows[sub[r]]])

    def at(r, what="node"):
        return (
            f"trajectory {traj(r)}, step {int(step[r])}, {what} {int(u[r])} (depth {l - 1}) "
            f"of the round rooted at state {int(nodes.n[sub[r]])}"
        )

    try:
        verdict = ctx.coupling(kids, *means, v.c["std"].reshape(-1), uniforms)
    except NonFiniteError as err:
        raise NonFiniteError(
            f"non-finite states at {at(err.rows[0], 'children of node')}: the target's velocity or the draft produced "
            f"NaN or inf there ({len(err.rows)} such parent(s) at this depth); no coupling can serve them",
            [traj(r) for r in err.rows],
        ) from None
    if ctx.check_contract:
        check_verdict_contract(ctx.coupling, verdict, kids, at)
    return verdict


def sparse_round(nodes: Nodes, tally: Tally, batch: bool = True) -> None:
    """One round for the trajectories ``nodes.rows [m]``; updates ``nodes.st`` and ``tally``. ``nodes``: the round and
    the view of its nodes (:class:`Nodes`, :class:`specsamp.round.dense.DenseNodes`); ``batch``: count the calls in
    ``batch_nfe`` here.

    Per depth, the walking rows are verified in one coupling call per node width (ascending); a row's state moves
    to the verdict's sample (the accepted child, or the residual draw where it stops). One host synchronisation per
    width and depth where a depth has several (the rows verified), and one per depth (the rows that walk on)."""
    ctx, tree, t, st, live = nodes.ctx, nodes.tree, nodes.t, nodes.st, nodes.rows
    m, dev = live.shape[0], st.x.device
    every = torch.arange(m, device=dev)
    cur = torch.zeros(m, dtype=torch.long, device=dev)
    x_cur = nodes.x.clone()  # the walk's state; where a row stops, its residual draw (the committed state either way)
    v_cur = nodes.velocity(every, cur, x_cur, None)  # the velocity at each row's node; after the walk, the next root's
    if nodes.history is not None:
        record(nodes, every, x_cur, v_cur, nodes.n)  # the root, verified below
    walking = torch.ones(m, dtype=torch.bool, device=dev)
    walk = every  # the rows verified at the next depth: at the first, every row (L_n >= 1, and the root has children)
    rejected = torch.zeros(m, dtype=torch.bool, device=dev)
    steps = torch.zeros(m, dtype=torch.long, device=dev)
    uniforms = sparse_uniforms(nodes.verify_keys, tree.num_children)
    nc, depth = np.asarray(tree.num_children), np.asarray(tree.depth)
    for l in range(1, tree.max_depth + 1):  # line 16
        widths = np.unique(nc[(depth == l - 1) & (nc > 0)]).tolist()
        width = t["num_children"][cur] if len(widths) > 1 else None  # fixed before any row of this depth moves down
        for k in widths:
            sub = walk if width is None else (walking & (width == k)).nonzero(as_tuple=True)[0]
            if not sub.numel():
                continue
            u, step, x_u = take_rows(cur, sub), take_rows(nodes.n, sub) + (l - 1), take_rows(x_cur, sub)
            visit = Visit(sub, u, x_u, step, ctx.schedule.kernel.coefs(step, x_u))
            ids = t["first_child"][u][:, None] + torch.arange(k, device=dev)[None]  # contiguous, in drafting order
            mean_p, kids = nodes.draft(visit, ids)
            v_u = take_rows(v_cur, sub)
            mean_q = nodes.kernel_mean(visit, v_u)
            verdict = verify_checked(nodes, visit, l, kids, (mean_p, mean_q), uniforms(sub, u, k))
            if nodes.past is not None:
                nodes.walked(visit, v_u)  # before the nearest prefetch writes v_cur
            # lines 18--22: the accepted child (the verdict's sample is that child, bit for bit), or the residual and stop
            stopped = ~verdict.accepted
            steps[sub], x_cur[sub], walking[sub], rejected[sub] = l, verdict.sample, verdict.accepted, stopped
            cur[sub] = ids.gather(1, verdict.index.clamp(max=k - 1)[:, None])[:, 0]  # a stopped row's is not read
            if ctx.prefetch == "nearest" and (at := stopped.nonzero(as_tuple=True)[0]).numel():
                rej, sibs, x_sibs = (
                    sub[at],
                    ids[at],
                    kids[at],
                )  # the next root's velocity: the evaluated child nearest it
                has, best = nearest_sibling(nodes.evaluated(sibs, rej[:, None]), x_sibs, x_cur[rej], float("inf"))
                if (has := has.nonzero(as_tuple=True)[0]).numel():
                    r2 = rej[has]
                    v_cur[r2] = nodes.velocity(r2, sibs[has, best[has]], x_sibs[has, best[has]], l)
        walking &= (l < nodes.depth_limit) & (t["num_children"][cur] > 0)  # accepted into a node internal in T|_{L_n}
        if not (walk := walking.nonzero(as_tuple=True)[0]).numel():
            break
        v_cur[walk] = nodes.velocity(walk, take_rows(cur, walk), take_rows(x_cur, walk), l)  # needed one level down
        if nodes.history is not None:
            record(nodes, walk, x_cur[walk], v_cur[walk], nodes.n[walk] + l)
    cols = torch.arange(tree.max_depth, device=dev)[None].expand(m, -1)  # row r was verified at depths 1..steps[r]
    tried, accepted = (cols < steps[:, None]).long(), (cols < (steps - rejected.long())[:, None]).long()
    count_verifications(tally, nodes.n, cols, tried, accepted, live)
    exact = leaf_prefetch(ctx.prefetch, ~rejected, lambda: nodes.evaluated(cur, every))  # finished at an evaluated leaf
    if ctx.prefetch != "none" and (done := exact.nonzero(as_tuple=True)[0]).numel():
        u = cur[done]
        v_cur[done] = nodes.velocity(done, u, take_rows(x_cur, done), t["depth"][u])  # depth >= 1
    for rows in nodes.calls():  # a call with nothing to evaluate costs none
        tally.charge(live, rows, batch)
    new = Commit(x_cur, nodes.n + steps, steps, v_cur, exact, nodes.history, nodes.past)
    commit_round(st, tally, live, new)  # line 24
