"""The dense round: the tree execution (a fixed tree or a tree per root step, any draft, Picard sweeps).

Every row of the batch in every round (finished rows padded), so a round is a fixed sequence of tensor operations
over shapes static per tree (:mod:`specsamp.round.tables`): the noise and uniforms gathered from per-run tables or
drawn in one keyed draw, drafting layer by layer, the Picard sweeps (:func:`picard`), one batched target call,
one coupling call per node width, the walk by gathers (:func:`dense_round`), and one host synchronisation, where
the loop's layout (:class:`DenseLayout`) reads the outcome. The policy is the sparse round's
(:mod:`specsamp.round.sparse`; equal counts and drafted bits, tested). Where a deferred check fails, the round is
drafted again and walked by the sparse walk (:class:`DenseNodes`), which raises each check where it fails.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from ..coupling import contract_violation, deferred_checks
from ..drafts import DraftHistory, DraftRoot
from ..trees import DraftTree
from .draws import dense_noise, dense_uniforms, keyed_rows, outside
from .context import Chains, Context, Tally, commit_round, count_verifications, leaf_prefetch, nearest_sibling
from .loop import root_call
from .sparse import Nodes, sparse_round
from .tables import DenseTables, upload


def dense_round(ctx: Context, lt: DenseTables, st: Chains, plan: torch.Tensor, plan_kind: str = "some",
                sel: torch.Tensor | None = None, sweeps: tuple = (), drafted_only: bool = False,
                stages=None):
    """One round of Algorithm 1 for every row of the batch (finished rows padded), without host syncs, in phases:
    :func:`draft_nodes` (line 7), the Picard sweeps (:func:`picard`) and the batched call (lines 10--13),
    :func:`verify_nodes` (every internal node at once, then the walk by gathers: lines 14--23) and :func:`accept`
    (prefetch, history, commit: line 24). Value checks are deferred (:func:`specsamp.coupling.deferred_checks`).

    Args:
        plan, plan_kind: the states the batched call evaluates (:func:`target_call`; :meth:`DenseTables.plan`).
        sel: optional bool ``[M]``: the rows whose round uses this tree (one dense round per distinct tree of the
            live rows); the others are padded like finished rows.
        sweeps: ``(plan, plan_kind)`` of each Picard sweep's call (``refine``), before the round's own.
        drafted_only: return the drafted tree after the call (:class:`Drafted`), for the checked walk.
        stages: the compiled round's pieces (:class:`specsamp.round.compiled.Stages`); None: this function's own, eager.

    Returns:
        ``(commit, n_new, exact_new, flags, live)``: ``commit(tally)`` writes the round's rows into ``st`` and
        ``tally`` (leaving the other rows as they are then, so the rounds of several trees commit one after the
        other); the state indices and root flags ``[M]`` it would write; a 0-dim bool, True where a deferred value
        check or the contract check failed (the caller then serves the round by the checked walk); the rows served.
    """
    n, end, kern = st.n, ctx.schedule.end_speculative, ctx.schedule.kernel
    live = n < end
    if sel is not None:
        live = live & sel
    # the root index that sets L_n, with L_n = 0 (a root that is not served) for the rows the round does not serve
    n_lim = n if sel is None else torch.where(live, n, end)
    states, coefs, per_depth, frozen, frozen_col, innov = (draft_nodes if stages is None else stages.draft)(ctx, lt, st, bool(sweeps))
    # the batched target call over the planned rows (what the sparse round evaluates); where they are
    # all non-root nodes or all nodes, the call reads the states in place and its output is kept as is
    node_step = lt.node_step_by_root.index_select(1, n)  # [N, M]
    network = network_outside() if ctx.compiled else target_call
    v_root, root_exact, M = st.v_root, st.root_exact, n.shape[0]
    calls, refined = [], None  # the rows each call evaluates, per batch row: the Picard sweeps', then the round's own
    for sweep_plan, sweep_kind in sweeps:
        calls.append(torch.where(live, lt.internal_count.index_select(0, n_lim) - root_exact.long(), lt.zero_long))
        v0, vrest = network(ctx, lt, states, node_step, v_root, root_exact, sweep_plan, sweep_kind)
        v_root, root_exact = torch.where(live[:, None], v0, v_root.reshape(M, -1)), root_exact | live
        refined = picard(lt, states, torch.cat([v_root[None], vrest]), innov, kern, per_depth, len(kern.columns))
    v0, vrest = network(ctx, lt, states, node_step, v_root, root_exact, plan, plan_kind)
    calls.append(torch.where(live, lt.evaluated_count.index_select(0, n_lim) - root_exact.long(), lt.zero_long))
    if drafted_only:
        return Drafted(states, v0, vrest, refined, calls)
    if stages is not None:
        return (*stages.verify(ctx, lt, st, live, n_lim, root_exact, states, v0, vrest, coefs, frozen, frozen_col,
                               refined, calls), live)
    with deferred_checks() as checks:
        walk = verify_nodes(ctx, lt, n, n_lim, states, v0, vrest, coefs, frozen, frozen_col, refined)
    bad = walk[-1] if checks.bad is None else walk[-1] | checks.bad
    commit, n_new, exact_new = accept(ctx, lt, st, live, n_lim, root_exact, states, v0, vrest, *walk[:-1], calls)
    return commit, n_new, exact_new, bad, live


def draft_nodes(ctx: Context, lt: DenseTables, st: Chains, keep_innov: bool):
    """Line 7 for every node of every row, into ``lt.buffers.states [N, M, D]`` (node-major; node 0: the roots): the
    keyed noise (node ``v`` of the round rooted at ``n``: ``fold(fold(k, n), v)``, as :meth:`specsamp.round.sparse.Nodes.draft`
    draws it) gathered from the run's table or drawn in one draw, times its parent step's std, then layer by layer
    the proposal mean added (:func:`proposal_mean`): the sparse round's operations, so the same bits.

    Returns:
        ``(states, coefs, per_depth, frozen, frozen_col, innov)``: every kernel coefficient of every depth ``[L, C, M,
        1]`` (and as ``[M, 1]`` per (depth, coefficient)), the draft's frozen root quantity and its per-depth columns
        (:func:`proposal_mean`), and the noise ``std z`` kept for the Picard sweeps where ``keep_innov``.
    """
    sch, draft, kern = ctx.schedule, ctx.draft, ctx.schedule.kernel
    x, n, NC = st.x, st.n, len(kern.columns)
    M, L = x.shape[0], lt.L
    frozen = draft.freeze(DraftRoot(x=x, v=st.v_root, n=n, exact=st.root_exact, history=st.history), sch)
    coefs = lt.coefs_by_root.index_select(2, n)  # [L, NC, M, 1]: one gather of the per-root table, node-major
    per_depth = coefs.reshape(L * NC, M, 1).unbind(0)
    states = lt.buffers.states
    dense_noise(ctx, lt, n, coefs, states[1:])  # line 7's keyed noise, std z
    lt.root_state.copy_(x)  # node 0 of the states, seen as [M, *event]
    innov = states[1:].clone() if keep_innov else None
    D = states.shape[2]
    if draft.table_mean is None:  # a draft given by its mean alone: Draft.mean per depth (plain_mean)
        frozen_col = None
    elif draft.table_frozen is None:
        frozen_col = frozen.reshape(1, M, D)
    else:  # components on a leading axis, combined once for every depth as the draft's mean combines them: [L, M, D]
        frozen_col = draft.table_frozen(frozen.reshape(M, -1, D).permute(1, 0, 2)[:, None], kern.named(coefs.unbind(1)))
    # a layer whose parents all have K children adds the mean of the parent layer (no gather); others gather parents
    for l, (parents, parent_view, out_view) in enumerate(lt.buffers.layers, start=1):
        x_par = parent_view if parents is None else states[parents]
        out_view += proposal_mean(ctx, frozen, frozen_col, None, x_par, kern.named(per_depth[NC * (l - 1) : NC * l]), n, l - 1)
    return states, coefs, per_depth, frozen, frozen_col, innov


def proposal_mean(ctx: Context, frozen, frozen_col, refined, x: torch.Tensor, c: dict, n: torch.Tensor, at, nodes=None):
    """The proposal means of parents ``x`` (node-major, ``[..., M, D]``, or ``[M, D]``: one per row) with kernel
    coefficients ``c``, in the dense round. ``at`` indexes the depth axis of per-depth tables: a depth, depths ``[c]``,
    or ``(depths [M], rows)`` for one node per row; ``nodes`` the node axis of ``refined`` alike. After Picard sweeps
    (``refined [N, M, D]``) the target's kernel mean at the last sweep's velocity (:func:`picard`); else the draft's
    table form on its frozen columns (``frozen_col``: ``[1, M, D]``, or per depth ``[L, M, D]`` or a tuple of them,
    ``Draft.table_frozen``); else ``Draft.mean`` (:func:`plain_mean`)."""
    if refined is not None:
        return ctx.schedule.kernel.mean(x, refined[nodes], c)
    if frozen_col is None:
        return plain_mean(ctx, frozen, x, n, at)
    if ctx.draft.table_frozen is not None:
        frozen_col = tuple(f[at] for f in frozen_col) if isinstance(frozen_col, tuple) else frozen_col[at]
    return ctx.draft.table_mean(frozen_col, x, c)


def verify_nodes(ctx: Context, lt: DenseTables, n, n_lim, states, v0, vrest, coefs, frozen, frozen_col, refined):
    """Lines 14--23 for every row: the verdicts of every internal node, one coupling call per width (in chunks of nodes
    sized to the states' memory, :func:`verify_chunk`; each node's keys are its own, so the numbers are those the
    sparse walk draws), then the walk by gathers (:func:`gather_walk`).

    Returns:
        ``(acc, internal_r, on_path, ustar, rejected, out, bad)``: each node's acceptance and whether it is verified
        if visited, ``[M, N]``; the walked path ``[M, N]``; the last node reached and whether it was rejected ``[M]``;
        the committed states ``[M, D]``; a 0-dim flag of a failed contract check.
    """
    vkeys_all, drawn_all, internal_r, verify = verify_inputs(ctx, lt, n, n_lim)
    acc, idx = lt.buffers.acc, lt.buffers.idx  # [M, N]: the chunks write every internal node's column, the others stay 0
    res = lt.buffers.residual  # [I, M, D]: each internal node's verdict sample
    bad = lt.false
    for (k, u, u_sl, ch, ch_sl, du, has_root, pos), sig_tab in zip(lt.buffers.chunks, lt.sigma_by_root):
        accepted, index, sample, bad_c = verify_chunk(ctx, lt, (k, u, u_sl, ch, ch_sl, du, has_root), sig_tab, n, n_lim,
                                                       states, v0, vrest, coefs, frozen, frozen_col, refined, vkeys_all,
                                                       drawn_all, internal_r, verify, res is not None)
        acc[:, u] = accepted
        idx[:, u] = index
        if res is not None:
            res[pos] = sample
        if bad_c is not None:
            bad = bad | bad_c
        del accepted, index, sample
    return (acc, internal_r, *gather_walk(ctx, lt, n, states, v0, vrest, coefs, frozen, frozen_col, refined, vkeys_all, drawn_all,
                                    internal_r), bad)


def verify_inputs(ctx: Context, lt: DenseTables, n, n_lim):
    """What every verification chunk reads: ``(vkeys_all, drawn_all, internal_r, verify)``, the nodes' verification
    keys ``[N, M]`` (None where the run's uniform table ``drawn_all``, ``[N, M, W_c]`` per call, holds their numbers),
    whether each node is verified if visited ``[M, N]`` (never for finished rows), and the rule the chunks call."""
    vkeys_all, drawn_all = dense_uniforms(ctx, lt, n)
    internal_r = lt.internal_by_root.index_select(0, n_lim)  # [M, N]: verified if visited (never for finished rows)
    # where no verdict sample is kept, the chunks decide (a rule's choice alone, where it has one) and the
    # walk's one residual per row is drawn after the walk (residual_again)
    verify = ctx.coupling.choice if lt.buffers.residual is None and not ctx.check_contract else ctx.coupling
    return vkeys_all, drawn_all, internal_r, verify


def verify_chunk(ctx: Context, lt: DenseTables, chunk: tuple, sig_tab, n, n_lim, states, v0, vrest, coefs, frozen,
                  frozen_col, refined, vkeys_all, drawn_all, internal_r, verify, keep: bool, own_checks: bool = False):
    """Line 17 for the ``c`` internal nodes of one verification chunk, every row at once: one call of ``verify``.

    ``chunk``: ``(K, nodes [c], slice, children [c, K], slice, depths [c], has node 0)`` of ``lt.buffers.chunks``; the
    compiled round passes None for the slices and the flag (gathers instead of views, node 0's velocity picked by
    ``torch.where``: the same numbers), so that one graph serves every chunk of a shape. ``sig_tab [c, T]``: the
    chunk's kernel scales per root. ``keep``: return the verdict samples. ``own_checks``: collect the deferred value
    checks here and return their flag (a compiled piece), else they go to the caller's context.

    Returns:
        ``(accepted, index, sample, bad)``: ``[M, c]`` each of the first two, the verdict samples ``[c, M, D]`` (None
        unless ``keep``), a 0-dim flag of a failed check (None where none ran).
    """
    k, u, u_sl, ch, ch_sl, du, has_root = chunk
    kern, e, ar, M = ctx.schedule.kernel, ctx.x_event, lt.ar, n.shape[0]
    c, at_u = u.numel(), u if u_sl is None else u_sl
    xu = states[at_u]  # [c, M, D]
    if has_root is None:
        vu = torch.where((u == 0)[:, None, None], v0[None], vrest[lt.vrest_row[u]])
    elif has_root:
        vu = torch.cat([v0[None], vrest[lt.vrest_row[u[1:]]]]) if c > 1 else v0[None]
    else:
        vu = vrest[u_sl.start - 1 : u_sl.stop - 1] if u_sl is not None else vrest[u - 1]
    cu = kern.named(coefs[du].unbind(1))  # [c, M, 1] each
    mean_p = proposal_mean(ctx, frozen, frozen_col, refined, xu, cu, n, du, at_u)
    mean_q = kern.mean(xu, vu, cu)
    sigma = sig_tab.index_select(1, n_lim)  # [c, M]: the kernel scale where verified, else 1
    if k == 1 and ch_sl is not None:
        kids = states[ch_sl].reshape(c * M, 1, *e)  # a view: a chain's children are one block
    else:
        kids = states[ch].permute(0, 2, 1, 3).reshape(c * M, k, *e)
    rows = keyed_rows(vkeys_all, drawn_all, lambda t: t[at_u].reshape(c * M, *t.shape[2:]),
                        lambda: lt.key_cache[1][ar, n].T[u].reshape(-1))
    args = (kids, mean_p.reshape(c * M, *e), mean_q.reshape(c * M, *e), sigma.reshape(-1), rows)
    if own_checks:
        with deferred_checks() as checks:
            verdict = verify(*args)  # line 17, every node of the chunk at once
        bad = checks.bad
    else:
        verdict, bad = verify(*args), None
    if ctx.check_contract:
        flag = (contract_violation(verdict, kids).reshape(c, M) & internal_r[:, u].T).any()
        bad = flag if bad is None else bad | flag
    if own_checks and bad is None:
        bad = lt.false
    sample = verdict.sample.reshape(c, M, -1) if keep else None
    return verdict.accepted.reshape(c, M).T, verdict.index.reshape(c, M).T, sample, bad


def gather_walk(ctx: Context, lt: DenseTables, n, states, v0, vrest, coefs, frozen, frozen_col, refined, vkeys_all, drawn_all,
          internal_r):
    """The walk by gathers over the verdicts in ``lt.buffers`` (a node is on the accepted path iff every edge above it
    was the accepted one). Returns ``(on_path, ustar, rejected, out)`` as :func:`verify_nodes` does."""
    acc, idx, res, ar = lt.buffers.acc, lt.buffers.idx, lt.buffers.residual, lt.ar
    p = lt.parent1
    taken = acc[:, p] & (idx[:, p] == lt.edge_slot) & internal_r[:, p]  # [M, N-1]
    on_path = ((~taken).to(states.dtype) @ lt.anc_t) == 0  # [M, N]
    ustar = torch.argmax(on_path * lt.depth1_row, 1)  # the last node the walk reached
    rejected = internal_r[ar, ustar]  # it was verified and rejected (lines 18--20)
    if res is not None:
        out = torch.where(rejected[:, None], res[lt.pos_c[ustar], ar], states[ustar, ar])
    else:  # its checks deferred too: no host synchronisation
        out = residual_again(ctx, lt, states, v0, vrest, coefs, frozen, frozen_col, refined, vkeys_all, drawn_all, n, ustar,
                              rejected)
    return on_path, ustar, rejected, out


def accept(ctx: Context, lt: DenseTables, st: Chains, live, n_lim, root_exact, states, v0, vrest, acc, internal_r, on_path, ustar,
            rejected, out, calls: list):
    """Line 24 for every row: the prefetch (the rules of :func:`specsamp.round.context.leaf_prefetch` and
    :func:`~specsamp.round.context.nearest_sibling`), the draft's history (:func:`dense_history`) and the commit.
    Returns ``(commit, n_new, exact_new)`` as :func:`dense_round` does; ``calls``: as :class:`Drafted`'s."""
    n, ar = st.n, lt.ar
    finished = live & ~rejected  # walked to a leaf of T|_{L_n}
    steps = torch.where(live, lt.depth[ustar] + rejected, lt.zero_long)
    last = torch.where(rejected, ustar, lt.parent_c[ustar])  # the last node the walk verified
    v_cur = torch.where(lt.is_root_col[last], v0, vrest[lt.vrest_row[last], ar])
    v_leaf = vrest[lt.vrest_row[ustar], ar]  # where finished, u* is a leaf of depth >= 1
    evaluated = lt.evaluated_by_root.index_select(0, n_lim)  # [M, N]: what the batched call evaluated
    v_next, exact = v_cur, leaf_prefetch(ctx.prefetch, finished, lambda: evaluated[ar, ustar])
    if ctx.prefetch != "none":
        v_next = torch.where(exact[:, None], v_leaf, v_next)
        if ctx.prefetch == "nearest":
            ch = lt.child_pad[ustar]  # [M, Kmax]: the siblings of the committed state
            has, best = nearest_sibling(lt.child_ok[ustar] & evaluated.gather(1, ch) & rejected[:, None], states[ch, lt.ar_col],
                                        out, lt.inf)
            v_next = torch.where(has[:, None], vrest[ch[ar, best] - 1, ar], v_next)  # children are never the root
    verified = on_path & internal_r
    hist = None if st.history is None else dense_history(ctx, lt, st, states, v0, vrest, verified, ustar, n)
    n_new, exact_new, shape = n + steps, torch.where(live, exact, root_exact), st.x.shape

    def commit(tally: Tally):
        count_verifications(tally, n, lt.dcol_m, verified.long(), (verified & acc).long())
        for rows in calls:  # the layout counts the calls themselves, from its host plan
            tally.charge(None, rows, batch=False)
        commit_round(st, tally, live, out.reshape(shape), n_new, steps, v_next.reshape(shape), exact_new, hist)

    return commit, n_new, exact_new


def plain_mean(ctx: Context, frozen, x: torch.Tensor, n: torch.Tensor, at) -> torch.Tensor:
    """The proposal means of a draft without a table form: ``Draft.mean`` called on ``[M, P, *event]`` with each depth's
    step, as the sparse round calls it, of rounds rooted at ``n [M]``: of parents ``x [P, M, D]`` (or ``[P, 1, M, D]``)
    at depth ``at`` (an int) or ``at[p]`` per parent, or of ``x [M, D]`` at depths ``at[0] [M]`` (``at`` a tuple)."""
    M, D, last = n.shape[0], x.shape[-1], ctx.schedule.steps - 1
    if isinstance(at, tuple):
        return ctx.draft.mean(frozen, x.reshape(M, 1, *ctx.x_event), (n + at[0]).clamp(max=last), ctx.schedule)[:, 0].reshape(M, -1)
    depths = [at] if isinstance(at, int) else at.tolist()
    xp = x.reshape(-1, M, D)
    if len(depths) > 1:
        return torch.stack([plain_mean(ctx, frozen, xp[p], n, d) for p, d in enumerate(depths)]).reshape(x.shape)
    out = ctx.draft.mean(frozen, xp.transpose(0, 1).reshape(M, -1, *ctx.x_event), (n + depths[0]).clamp(max=last), ctx.schedule)
    return out.reshape(M, -1, D).transpose(0, 1).reshape(x.shape)


def picard(lt: DenseTables, states: torch.Tensor, vel: torch.Tensor, innov: torch.Tensor, kern, per_depth, NC: int) -> torch.Tensor:
    """One Picard sweep's rebuild of the drafted tree, in place on ``states [N, M, D]``; returns ``vel``.

    ``vel [N, M, D]``: the sweep's velocities at the current snapshot of every internal node (its batched call: the
    internal nodes of ``T|_{L_n}``, the root only where its velocity was not exact). Breadth-first, a child ``c`` of
    ``u`` at step ``s`` becomes ``mean(x_u, v_u, s) + std(s) xi_c`` with ``x_u`` the parent's rebuilt state and
    ``innov [N-1, M, D]`` the drafts' own ``std(s) xi_c``. This is the Picard iteration of ParaDiGMS (Shih et al.,
    2023) on a tree: after ``j`` sweeps the first ``j`` levels equal the target tree's, so at ``J >= L_n`` every
    child's proposal mean is the target kernel mean at its parent.

    Exactness: the snapshot of ``u`` is a function of ``u``'s ancestors' and ``u``'s own innovations (and the
    round's root), never of ``u``'s children's, so given the path walked to ``u`` each child of ``u`` is
    ``N(mean(x_u, v_u, s), std(s)^2 I)`` with ``v_u`` already fixed; the coupling is handed that mean (the refined
    proposal mean), which is all an exact coupling needs."""
    for l, par in enumerate(lt.layer_parents, start=1):
        a, b = lt.layer_bounds[l], lt.layer_bounds[l + 1]
        states[a:b] = kern.mean(states[par], vel[par], kern.named(per_depth[NC * (l - 1) : NC * l])) + innov[a - 1 : b - 1]
    return vel


@dataclass
class Drafted:
    """A dense round's tree after its batched call, for the checked walk (:class:`DenseNodes`): ``states [N, M, D]``,
    the roots' and the other nodes' velocities ``v0 [M, D]`` and ``vrest [N-1, M, D]``, the last Picard sweep's
    velocities ``refined [N, M, D]`` (None without sweeps), and the rows each call evaluated per batch row (``[M]``
    each: the sweeps', then the round's own)."""

    states: torch.Tensor
    v0: torch.Tensor
    vrest: torch.Tensor
    refined: torch.Tensor | None
    calls: list


class DenseNodes(Nodes):
    """The checked walk over a dense round (:func:`specsamp.round.sparse.sparse_round` with this view of a :class:`Drafted`):
    the drafted states and the batched call's velocities, verified one depth at a time with every check raised
    where it fails, naming trajectory, step and node. Serves the rounds whose deferred checks failed (or whose
    markmax rows the share table could not certify): same keys, same states, so the same numbers."""

    def __init__(self, ctx, tree, tensors, st, live, d: Drafted):
        super().__init__(ctx, tree, tensors, st, live)
        self.d, self.e = d, self.x.shape[1:]

    def calls(self):
        return [r[self.rows] for r in self.d.calls]

    def draft(self, sub, u, x_u, ids, step, c):
        b = self.rows[sub]
        kids = self.d.states[ids, b[:, None]].view(-1, ids.shape[1], *self.e)
        if self.d.refined is None:
            return self.proposal_mean(sub, x_u, step, c), kids
        return self.ctx.schedule.kernel.mean(x_u, self.d.refined[u, b].view_as(x_u), c), kids

    def velocity(self, sub, u, x_u, depth):
        b = self.rows[sub]
        return torch.where((u == 0)[:, None], self.d.v0[b], self.d.vrest[(u - 1).clamp(min=0), b]).view_as(x_u)


def target_call(ctx: Context, lt: DenseTables, states: torch.Tensor, node_step: torch.Tensor, v_root: torch.Tensor,
             root_exact: torch.Tensor, plan: torch.Tensor | None, plan_kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The dense round's batched target call over the planned rows (what the sparse round evaluates).

    ``rest`` (every non-root node; the roots' velocities known) and ``all`` (every node) read the states ``[N, M, D]``
    in place; ``some`` evaluates their flat rows ``plan`` (long ``[P]``, ``node * M + row``), the others' velocities
    left 0 (never read). ``node_step [N, M]``: each node's step. Returns the roots' velocities ``v0 [M, D]``
    (``v_root`` where ``root_exact``) and the others' ``vrest [N-1, M, D]``. Under ``compile`` it runs outside the
    compiled graphs (:func:`network_outside`): a model need not compile, and the plan's size varies by round.
    """
    N, M, e = states.shape[0], states.shape[1], ctx.x_event
    if isinstance(plan, Hidden):
        plan = plan.value
    flat = states.reshape(N * M, -1)
    if plan_kind == "rest":
        v0 = v_root.reshape(M, -1)
        vrest = ctx.velocity(lt.rest_states, node_step.view(-1)[M:], lt.rows_rest).reshape(N - 1, M, -1)
    elif plan_kind == "all":
        out_all = ctx.velocity(flat.reshape(-1, *e), node_step.reshape(-1), lt.rows).reshape(N, M, -1)
        v0, vrest = out_all[0], out_all[1:]
    else:
        full = torch.zeros_like(flat)
        if plan.numel():
            full[plan] = ctx.velocity(flat[plan].reshape(-1, *e), node_step.reshape(-1)[plan], plan % M).reshape(plan.numel(), -1)
        v0 = torch.where(root_exact[:, None], v_root.reshape(M, -1), full[:M])
        vrest = full[M:].view(N - 1, M, -1)
    return v0, vrest


class Hidden:
    """A value the compiled round hands to :func:`target_call` without reading it (the plan: its size varies from
    round to round, so a compiled graph that read it would be specialised to each size)."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value


def network_outside() -> Callable:
    """:func:`target_call` excluded from ``torch.compile``'s tracing (:func:`outside`)."""
    return outside(target_call)


def dense_history(ctx, lt, st, states, v0, vrest, verified, ustar, n):
    """The draft history after a dense round, by gathers: the exact data predictions the sparse walk records
    (:func:`specsamp.round.sparse.record`: the root and every accepted internal node, the nodes ``verified`` on the path, in depth
    order) pushed in front of ``st``'s records, most recent first. Returns the :class:`DraftHistory` of every
    row (rows without a verified node keep their records)."""
    M, H = st.history.n.shape
    ar = torch.arange(M, device=n.device)[:, None]
    nv = verified.sum(1, keepdim=True)  # [M, 1] records of this round
    slot = lt.slots[:, :H]
    j = nv - 1 - slot  # [M, H]: depth of the path node slot s records, where >= 0
    node = lt.anc_at_depth[ustar].gather(1, j.clamp(min=0))  # [M, H]
    xs = states[node, ar]  # [M, H, D]
    vs = torch.where((node == 0)[..., None], v0[:, None], vrest[(node - 1).clamp(min=0), ar])
    nn = n[:, None] + lt.depth[node]
    sigma = ctx.coef_table[nn.clamp(max=ctx.schedule.steps - 1), ctx.schedule.kernel.col("sigma")]
    x0 = xs - sigma[..., None] * vs  # data_prediction's operations
    return st.history.prepend(DraftHistory(x0, nn, xs), nv, slot=slot, rows=ar)


def residual_again(ctx, lt, states, v0, vrest, coefs, frozen, frozen_col, refined, vkeys_all, drawn_all, n, ustar,
                    rejected) -> torch.Tensor:
    """The committed states ``[M, D]`` of a dense round that kept no verdict samples: where a row's walk stopped
    at a rejection, the verification of that node drawn again (one coupling call per node width, over every
    row: the node's own keys or its rows of the run's uniform table ``drawn_all``, so the same numbers as the
    first call); elsewhere the reached leaf."""
    M, e, ar, kern = states.shape[1], ctx.x_event, lt.ar, ctx.schedule.kernel
    out = states[ustar, ar]
    for k, rep, of_width in lt.width_groups:
        mine = of_width[ustar]
        w = torch.where(mine, ustar, rep)  # rows whose node has another width verify a stand-in
        xw, dw = states[w, ar], lt.depth[w]
        vw = torch.where((w == 0)[:, None], v0, vrest[(w - 1).clamp(min=0), ar])
        cw = kern.named(coefs[dw, :, ar].unbind(1))  # [M, 1] each
        mean_p = proposal_mean(ctx, frozen, frozen_col, refined, xw, cw, n, (dw, ar), (w, ar))
        mean_q = kern.mean(xw, vw, cw)
        kids = states[lt.first_child[w][:, None] + torch.arange(k, device=w.device)[None], ar[:, None]]  # [M, k, D]
        sigma = torch.where(mine & rejected, cw["std"][:, 0], lt.one)
        verdict = ctx.coupling(kids.reshape(M, k, *e), mean_p.reshape(M, *e), mean_q.reshape(M, *e), sigma,
                               keyed_rows(vkeys_all, drawn_all, lambda t: t[w, ar], lambda: lt.key_cache[1][ar, n, w]))
        out = torch.where((mine & rejected)[:, None], verdict.sample.reshape(M, -1), out)
    return out


class DenseLayout:
    """The dense round's layout for :func:`specsamp.round.loop.run_rounds` (the tree execution); fills ``ctx``'s dense fields.

    ``tree``: a fixed tree, or ``{n: T_n}``: one :class:`DenseTables` per distinct ``T_n`` (built on first use, sharing
    one set of buffers), one dense round per distinct tree of the live rows, committed one after the other and
    charged as one batched call per call. ``dense_round_fn``: :func:`dense_round`, or its compiled form.

    One host synchronisation per round reads whether a deferred check failed and the rows' new state indices and
    root flags: from those host copies the next round's live rows, trees and call plans follow (:meth:`_calls`).
    Where a check failed, the checked walk (:class:`DenseNodes`) serves the round again on the same keys: it raises
    the precise error, or commits the same round (bad nodes off the path; markmax rows its table could not certify).
    """

    def __init__(self, ctx: Context, st: Chains, tally: Tally, tree: DraftTree | dict, dense_round_fn: Callable | None = None):
        self.ctx, self.st, self.tally, self.dense_round_fn = ctx, st, tally, dense_round_fn or dense_round
        schedule, M, T = ctx.schedule, st.x.shape[0], ctx.schedule.steps
        self.end = schedule.end_speculative
        self.n_host = np.full(M, schedule.first_speculative, dtype=np.int64)  # what first_step wrote
        self.exact_host = np.zeros(M, dtype=bool)
        D = st.x[0].numel()
        if isinstance(tree, DraftTree):
            self.trees, self.lt_of_root, self.pool = [tree], np.zeros(T, dtype=np.int64), None
        else:
            self.trees, self.lt_of_root, seen = [], np.full(T, -1, dtype=np.int64), {}
            for n_root, t_n in tree.items():
                key = tuple(int(p) for p in t_n.parent)
                if key not in seen:
                    seen[key] = len(self.trees)
                    self.trees.append(t_n)
                self.lt_of_root[n_root] = seen[key]
            internal = max(int((np.asarray(t.num_children) > 0).sum()) for t in self.trees)
            self.pool = {"states": st.x.new_empty(max(len(t) for t in self.trees) * M * D),
                         "residual": st.x.new_empty(internal * M * D)}
        self.lts, self.shared = {}, {}  # shared: the key and random tables of a node count, the same for every tree of that size

    def dense_tables(self, g: int) -> DenseTables:
        """The run's :class:`DenseTables` number ``g``, built, bound and given its tables on first use."""
        if g not in self.lts:
            self.lts[g] = DenseTables(self.trees[g], self.ctx, self.st.x.shape[0], self.shared, self.pool)
        return self.lts[g]

    def live(self):
        live_host = self.n_host < self.end
        return live_host if live_host.any() else None

    def root_call(self, live_host):
        root_call(self.ctx, self.st, upload(np.flatnonzero(live_host), self.st.x.device), self.tally)
        self.exact_host = self.exact_host | live_host

    def _calls(self, lt: DenseTables, rows: np.ndarray | None) -> list:
        """``(plan, kind)`` of each batched call of a round of ``lt`` over rows ``rows`` (None: every row): the Picard
        sweeps' (the internal nodes; after the first, every live root's velocity is exact), then the round's own
        (the protocol's nodes). ``kind``: ``all``, ``rest`` (read in place, no plan) or ``some``."""
        out, exact, M = [], self.exact_host, self.st.x.shape[0]
        for j in range(self.ctx.refine + 1):
            plan = lt.plan(self.n_host, exact, self.end, self.ctx.evaluate_leaves and j == self.ctx.refine, rows)
            kind = "all" if plan.size == lt.N * M else "rest" if plan.size == (lt.N - 1) * M and plan[0] == M else "some"
            plan_t = upload(plan, self.st.x.device) if kind == "some" else None
            out.append((Hidden(plan_t) if self.ctx.compiled else plan_t, kind, plan.size > 0))
            exact = exact | (self.n_host < self.end)
        return out

    def round(self, live_host):
        ctx, st, tally = self.ctx, self.st, self.tally
        n_host, dev, M = self.n_host, st.x.device, st.x.shape[0]
        which = np.where(live_host, self.lt_of_root[np.minimum(n_host, len(self.lt_of_root) - 1)], -1)
        groups = np.unique(which[live_host])
        rounds, called = [], [False] * (ctx.refine + 1)
        n_new, exact_new = st.n, st.root_exact
        for g in groups:
            lt = self.dense_tables(int(g))
            mine = None if len(groups) == 1 else which == g
            calls = self._calls(lt, mine)
            called = [a or c[2] for a, c in zip(called, calls)]
            sel = None if mine is None else torch.from_numpy(mine).to(dev)
            args = (*calls[-1][:2], sel, tuple(c[:2] for c in calls[:-1]))  # the round's own call, its rows, the sweeps
            commit, n_g, exact_g, bad_g, live_g = self.dense_round_fn(ctx, lt, st, *args)
            rounds.append((commit, bad_g, lt, args, live_host if mine is None else mine))
            if mine is None:
                n_new, exact_new, bad = n_g, exact_g, bad_g
            else:
                n_new, exact_new = torch.where(live_g, n_g, n_new), torch.where(live_g, exact_g, exact_new)
        if len(groups) > 1:
            bad = torch.stack([r[1] for r in rounds]).any()
        payload = torch.cat([bad.long().reshape(1), n_new, exact_new.long()]).tolist()  # the one sync of the round
        if payload[0]:  # the checked walk serves the round again, tree by tree, on the same keys and calls
            for _, _, lt, args, rows in rounds:
                d = dense_round(ctx, lt, st, *args, drafted_only=True)
                sparse_round(ctx, lt.tree, lt.tensors, lambda *a, d=d: DenseNodes(*a, d), st, upload(np.flatnonzero(rows), dev), tally,
                       batch=False)
            self.n_host, self.exact_host = st.n.cpu().numpy(), st.root_exact.cpu().numpy()
        else:
            for commit, *_ in rounds:
                commit(tally)
            self.n_host = np.asarray(payload[1 : M + 1], dtype=np.int64)
            self.exact_host = np.asarray(payload[M + 1 :], dtype=bool)
        tally.batch_nfe += sum(called)  # a call with nothing to evaluate is not made

    def progress(self, r: int, live_host) -> dict:
        return {"round": r, "live": int((self.n_host < self.end).sum()), "batch_nfe": self.tally.batch_nfe,
                "steps_done": int((self.n_host - self.ctx.schedule.first_speculative).clip(min=0).sum()),
                "n": self.st.n, "x": self.st.x, "v": self.st.v_root}

    def need_rows(self):
        return upload(np.flatnonzero(~self.exact_host), self.st.x.device)
