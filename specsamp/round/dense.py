"""The dense round: the tree execution (a fixed tree or a tree per root step, any draft, Picard sweeps).

Every row of the batch in every round (finished rows padded), so a round is a fixed sequence of tensor operations
over shapes static per tree (:mod:`specsamp.round.tables`): the noise and uniforms gathered from per-run tables or
drawn in one keyed draw (:mod:`specsamp.round.draws`), drafting layer by layer, the Picard sweeps, one batched target
call, one coupling call per node width, the walk by gathers, and one host synchronisation, where the loop's layout
(:class:`specsamp.round.layouts.DenseLayout`) reads the outcome. :class:`DenseRound` holds a round's state by name
and runs its phases as methods. The policy is the sparse round's (:mod:`specsamp.round.sparse`; equal counts and
drafted bits, tested). Where a deferred check fails, the round is drafted again and walked by the sparse walk
(:class:`DenseNodes`), which raises each check where it fails.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..coupling import contract_violation, deferred_checks
from ..drafts import DraftHistory, DraftRoot
from .context import Chains, Commit, Context, Tally, commit_round, count_verifications, leaf_prefetch, nearest_sibling
from .draws import dense_noise, dense_uniforms, keyed_rows, outside
from .sparse import Nodes
from .split import closed_draft, output_split
from .tables import DenseTables


def dense_round(
    ctx: Context, lt: DenseTables, st: Chains, sel: torch.Tensor | None, plans: list, stages=None
) -> DenseRound:
    """One round of Algorithm 1 for every row of the batch (finished rows padded), without host syncs: a
    :class:`DenseRound` of ``lt``'s tree run through its phases (:meth:`DenseRound.run`) and returned.

    Args:
        sel: optional bool ``[M]``: the rows whose round uses this tree (one dense round per distinct tree of the
            live rows); the others are padded like finished rows.
        plans: ``(plan, kind)`` of each batched call (:meth:`DenseRound.call`): the Picard sweeps' (``refine``), then
            the round's own.
        stages: the compiled round's pieces (:class:`specsamp.round.compiled.Stages`); None: eager.
    """
    r = DenseRound(ctx, lt, st, sel)
    r.run(plans, stages)
    return r


def drafted_round(ctx: Context, lt: DenseTables, st: Chains, sel: torch.Tensor | None, plans: list) -> DenseRound:
    """A :class:`DenseRound` drafted and called (eagerly) as :func:`dense_round` drafts and calls it, not verified:
    the tree the checked walk (:class:`DenseNodes`) serves again where a deferred check failed."""
    r = DenseRound(ctx, lt, st, sel)
    r.draft(len(plans) > 1)
    r.call(plans)
    return r


class DenseRound:
    """One dense round of the rows ``live`` (line 3), its state named once and its phases methods over it.

    Set at construction: ``ctx``, ``lt`` (the tree's :class:`DenseTables`), ``st``, ``n [M]``, ``live [M]`` (the rows
    served: unfinished, and of this tree where ``sel`` is given), ``n_lim [M]`` (the root index that sets ``L_n``,
    with ``L_n = 0`` for rows not served), ``v_root``, ``root_exact``. Then, phase by phase:

    - :meth:`draft` (line 7): ``states [N, M, D]`` (node-major, node 0 the roots), the round's kernel coefficients
      ``coefs [L, C, M, 1]`` and ``per_depth`` (``[M, 1]`` per (depth, column)), the draft's ``frozen`` quantity and
      its per-depth columns ``frozen_col`` (:meth:`proposal_mean`), the drafts' noise ``innov`` (``std z``) where
      Picard sweeps follow;
    - :meth:`call` (lines 10--13, with the sweeps, :meth:`picard`): ``v0 [M, D]``, ``vrest [N-1, M, D]``, the
      sweeps' last velocities ``refined [N, M, D]`` (None without sweeps), ``calls`` (rows each call evaluated per
      batch row);
    - :meth:`verify` (lines 14--17, every internal node at once, :meth:`verify_chunk`): the verdicts in
      ``lt.buffers``, ``bad`` (a 0-dim flag of a failed deferred or contract check);
    - :meth:`walk` (lines 18--23, by gathers): ``on_path [M, N]``, the last node reached ``ustar`` and whether it was
      rejected ``[M]``, the committed states ``out [M, D]`` (:meth:`residual_again` where no verdict sample is kept);
    - :meth:`accept` (line 24): ``n_new``, ``exact_new [M]`` and what :meth:`commit` writes, the draft's history
      (:meth:`history`) among it.

    The target's kernel mean is computed in one method, :meth:`kernel_mean`, handed the nodes it is taken at.
    """

    def __init__(self, ctx: Context, lt: DenseTables, st: Chains, sel: torch.Tensor | None = None):
        self.ctx, self.lt, self.st, self.n = ctx, lt, st, st.n
        end = ctx.schedule.end_speculative
        live = self.n < end
        if sel is not None:
            live = live & sel
        self.live = live
        # the root index that sets L_n, with L_n = 0 (a root that is not served) for the rows the round does not serve
        self.n_lim = self.n if sel is None else torch.where(live, self.n, end)
        self.v_root, self.root_exact, self.refined, self.calls = st.v_root, st.root_exact, None, []
        self.recs = self.refined_recs = None  # a multistep kernel's records tables (records), exact and refined

    def run(self, plans: list, stages=None) -> None:
        """The phases in order; ``stages``: the compiled pieces (:class:`specsamp.round.compiled.Stages`), else eager.
        Value checks are deferred (:func:`specsamp.coupling.deferred_checks`) into ``bad``."""
        (DenseRound.draft if stages is None else stages.draft)(self, len(plans) > 1)
        self.call(plans)
        if stages is not None:
            stages.verify(self)
            return
        with deferred_checks() as checks:
            self.verify()
            self.walk()
        if checks.bad is not None:
            self.bad = self.bad | checks.bad
        self.accept()

    def draft(self, keep_innov: bool) -> None:
        """Line 7 for every node of every row, into ``lt.buffers.states``: the keyed noise
        (:func:`specsamp.round.draws.dense_noise`) times its parent step's std, then layer by layer the proposal mean
        added (:meth:`proposal_mean`): the sparse round's operations, so the same bits. ``keep_innov``: keep the
        noise for the Picard sweeps."""
        ctx, lt, st = self.ctx, self.lt, self.st
        sch, draft, kern = ctx.schedule, ctx.draft, ctx.schedule.kernel
        x, n, NC = st.x, self.n, len(kern.columns)
        M, L = x.shape[0], lt.L
        self.frozen = frozen = draft.freeze(
            DraftRoot(x=x, v=st.v_root, n=n, exact=st.root_exact, history=st.history), sch
        )
        self.coefs = coefs = lt.coefs_by_root.index_select(2, n)  # [L, NC, M, 1]: one gather of the per-root table
        self.per_depth = per_depth = coefs.reshape(L * NC, M, 1).unbind(0)
        self.states = states = lt.buffers.states
        dense_noise(ctx, lt, n, coefs, states[1:])  # line 7's keyed noise, std z
        lt.root_state.copy_(x)  # node 0 of the states, seen as [M, *event]
        self.innov = states[1:].clone() if keep_innov else None
        D = states.shape[2]
        if draft.table_mean is None:  # a draft given by its mean alone: Draft.mean per depth (plain_mean)
            self.frozen_col = None
        elif draft.table_frozen is None:
            self.frozen_col = frozen.reshape(1, M, D)
        else:  # components on a leading axis, combined once for every depth as the draft's mean combines them: [L, M, D]
            self.frozen_col = draft.table_frozen(
                frozen.reshape(M, -1, D).permute(1, 0, 2)[:, None], kern.named(coefs.unbind(1))
            )
        # the velocity draft's output term for every depth in one operation, each depth then the rest of the kernel
        # mean (specsamp.round.split: the same operations, so the same bits); other drafts their table form per depth
        if ctx.draft_form == "closed":
            closed_draft(self, states[1:])
            return
        split = output_split(kern, draft) if self.frozen_col is not None else None
        terms = None if split is None else split[0](self.frozen_col, kern.named(coefs.unbind(1))).unbind(0)
        # a layer whose parents all have K children adds the mean of the parent layer (no gather); others gather parents
        for l, (parents, parent_view, out_view) in enumerate(lt.buffers.layers, start=1):
            x_par = parent_view if parents is None else states[parents]
            c = kern.named(per_depth[NC * (l - 1) : NC * l])
            out_view += self.proposal_mean(x_par, c, l - 1) if split is None else split[1](x_par, terms[l - 1], c)

    def call(self, plans: list) -> None:
        """The batched target calls over the planned rows (what the sparse round evaluates; :func:`target_call`): each
        Picard sweep's, its tree rebuilt after it (:meth:`picard`), then the round's own. Where the rows are all
        non-root nodes or all nodes, the call reads the states in place and its output is kept as is."""
        ctx, lt, live, n_lim = self.ctx, self.lt, self.live, self.n_lim
        node_step = lt.node_step_by_root.index_select(1, self.n)  # [N, M]
        network = network_outside() if ctx.compiled else target_call
        M = self.n.shape[0]
        for plan, kind in plans[:-1]:
            self.calls.append(
                torch.where(live, lt.internal_count.index_select(0, n_lim) - self.root_exact.long(), lt.zero_long)
            )
            v0, vrest = network(self, node_step, plan, kind)
            self.v_root, self.root_exact = (
                torch.where(live[:, None], v0, self.v_root.reshape(M, -1)),
                self.root_exact | live,
            )
            self.picard(torch.cat([self.v_root[None], vrest]))
        self.v0, self.vrest = network(self, node_step, *plans[-1])
        if self.st.past is not None:
            self.recs = self.records(torch.cat([self.v0[None], self.vrest]))
        self.calls.append(
            torch.where(live, lt.evaluated_count.index_select(0, n_lim) - self.root_exact.long(), lt.zero_long)
        )

    def kernel_mean(
        self, x: torch.Tensor, out: torch.Tensor, c: dict, nodes, recs: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The target's kernel mean at states ``x`` (node-major ``[c, M, D]``, or ``[M, D]``) of the nodes ``nodes``
        (their indices ``[c]`` or a slice of them, or ``(nodes [M], rows [M])``: one per row), ``out`` their network
        outputs, ``c`` their steps' coefficients: the one place the dense round computes it. A multistep kernel
        reads the records of the states before ``nodes`` (their ancestry, ``lt.back``) from the records table ``recs``
        (:meth:`records`; None: the round's exact one, ``self.recs``)."""
        kern = self.ctx.schedule.kernel
        if kern.order == 1:
            return kern.mean(x, out, c)
        return kern.mean(x, out, c, self.history_of(nodes, self.recs if recs is None else recs))

    def history_of(self, nodes, recs: torch.Tensor) -> tuple:
        """A multistep kernel's ``history`` at ``nodes`` (as :meth:`kernel_mean` takes them): the records of the
        ``order - 1`` states before each (its parent, grandparent, ...; beyond the round's root, the committed path's)
        gathered from the records table ``recs [H + N, M, D]``, shaped like the nodes' states."""
        back = self.lt.back
        if isinstance(nodes, tuple):  # one node per row
            u, rows = nodes
            return tuple(recs[back[u, j], rows] for j in range(1, back.shape[1]))
        if isinstance(nodes, slice):
            nodes = self.lt.nodes[nodes]
        return tuple(recs[back[nodes, j]] for j in range(1, back.shape[1]))

    def records(self, vel: torch.Tensor) -> torch.Tensor:
        """A multistep kernel's records table ``[H + N, M, D]`` (``H = order - 1``): the root's ``H`` earlier records
        (``st.past``, oldest first), then every node's record (:meth:`specsamp.kernels.Kernel.record`) at its state,
        its output in ``vel [N, M, D]`` and its depth's coefficients (leaves at depth ``L``, never read: the last
        depth's). Rows ``lt.back`` index it."""
        kern, lt, st, M = self.ctx.schedule.kernel, self.lt, self.st, self.n.shape[0]
        c = kern.named(self.coefs[lt.dcol_m[0]].unbind(1))  # [N, M, 1] each
        rec = kern.record(self.states, vel, c)
        return torch.cat([torch.stack([p.reshape(M, -1) for p in reversed(st.past)]), rec])

    def picard(self, vel: torch.Tensor) -> None:
        """One Picard sweep's rebuild of the drafted tree, in place on ``states [N, M, D]``; ``refined = vel``.

        ``vel [N, M, D]``: the sweep's velocities at the current snapshot of every internal node (its batched call:
        the internal nodes of ``T|_{L_n}``, the root only where its velocity was not exact). Breadth-first, a child
        ``c`` of ``u`` at step ``s`` becomes ``mean(x_u, v_u, s) + std(s) xi_c`` with ``x_u`` the parent's rebuilt
        state and ``innov`` the drafts' own ``std(s) xi_c``. This is the Picard iteration of ParaDiGMS (Shih et al.,
        2023) on a tree: after ``j`` sweeps the first ``j`` levels equal the target tree's, so at ``J >= L_n`` every
        child's proposal mean is the target kernel mean at its parent.

        Exactness: the snapshot of ``u`` is a function of ``u``'s ancestors' and ``u``'s own innovations (and the
        round's root), never of ``u``'s children's, so given the path walked to ``u`` each child of ``u`` is
        ``N(mean(x_u, v_u, s), std(s)^2 I)`` with ``v_u`` already fixed; the coupling is handed that mean (the refined
        proposal mean), which is all an exact coupling needs."""
        lt, states, kern = self.lt, self.states, self.ctx.schedule.kernel
        NC, H = len(kern.columns), kern.order - 1
        recs = None
        if H:  # a multistep kernel's records at the rebuilt states, layer by layer (records' layout)
            recs = states.new_zeros(H + states.shape[0], *states.shape[1:])
            recs[:H] = torch.stack([p.reshape(states.shape[1], -1) for p in reversed(self.st.past)])
        for l, par in enumerate(lt.layer_parents, start=1):
            a, b = lt.layer_bounds[l], lt.layer_bounds[l + 1]
            c = kern.named(self.per_depth[NC * (l - 1) : NC * l])
            if recs is not None:  # the parents' layer is rebuilt: its records, before its children read them
                p0 = lt.layer_bounds[l - 1]
                recs[H + p0 : H + a] = kern.record(states[p0:a], vel[p0:a], c)
            states[a:b] = self.kernel_mean(states[par], vel[par], c, par, recs) + self.innov[a - 1 : b - 1]
        self.refined, self.refined_recs = vel, recs

    def proposal_mean(self, x: torch.Tensor, c: dict, at, nodes=None) -> torch.Tensor:
        """The proposal means of parents ``x`` (node-major, ``[..., M, D]``, or ``[M, D]``: one per row) with kernel
        coefficients ``c``. ``at`` indexes the depth axis of per-depth tables: a depth, depths ``[c]``, or ``(depths
        [M], rows)`` for one node per row; ``nodes`` the node axis of ``refined`` alike. After Picard sweeps the
        target's kernel mean at the last sweep's velocity (:meth:`picard`); else the draft's table form on its frozen
        columns (``frozen_col``: ``[1, M, D]``, or per depth ``[L, M, D]`` or a tuple of them,
        ``Draft.table_frozen``); else ``Draft.mean`` (:meth:`plain_mean`)."""
        if self.refined is not None:
            return self.kernel_mean(x, self.refined[nodes], c, nodes, self.refined_recs)
        frozen_col = self.frozen_col
        if frozen_col is None:
            return self.plain_mean(x, at)
        if self.ctx.draft.table_frozen is not None:
            frozen_col = tuple(f[at] for f in frozen_col) if isinstance(frozen_col, tuple) else frozen_col[at]
        return self.ctx.draft.table_mean(frozen_col, x, c, self.ctx.schedule.kernel)

    def plain_mean(self, x: torch.Tensor, at) -> torch.Tensor:
        """The proposal means of a draft without a table form: ``Draft.mean`` called on ``[M, P, *event]`` with each
        depth's step, as the sparse round calls it: of parents ``x [P, M, D]`` (or ``[P, 1, M, D]``) at depth ``at``
        (an int) or ``at[p]`` per parent, or of ``x [M, D]`` at depths ``at[0] [M]`` (``at`` a tuple)."""
        ctx, n, frozen = self.ctx, self.n, self.frozen
        M, D, last = n.shape[0], x.shape[-1], ctx.schedule.steps - 1
        if isinstance(at, tuple):
            return ctx.draft.mean(frozen, x.reshape(M, 1, *ctx.x_event), (n + at[0]).clamp(max=last), ctx.schedule)[
                :, 0
            ].reshape(M, -1)
        depths = [at] if isinstance(at, int) else at.tolist()
        xp = x.reshape(-1, M, D)
        if len(depths) > 1:
            return torch.stack([self.plain_mean(xp[p], d) for p, d in enumerate(depths)]).reshape(x.shape)
        out = ctx.draft.mean(
            frozen, xp.transpose(0, 1).reshape(M, -1, *ctx.x_event), (n + depths[0]).clamp(max=last), ctx.schedule
        )
        return out.reshape(M, -1, D).transpose(0, 1).reshape(x.shape)

    def verify_inputs(self) -> None:
        """What every verification chunk reads: the nodes' verification keys ``vkeys_all [N, M]`` and the run's uniform
        table's rows ``drawn_all`` (:func:`specsamp.round.draws.dense_uniforms`), whether each node is verified if
        visited ``internal_r [M, N]`` (never for finished rows), and the ``rule`` the chunks call."""
        self.vkeys_all, self.drawn_all = dense_uniforms(self.ctx, self.lt, self.n)
        self.internal_r = self.lt.internal_by_root.index_select(0, self.n_lim)  # [M, N]: verified if visited
        # where no verdict sample is kept, the chunks decide (a rule's choice alone, where it has one) and the
        # walk's one residual per row is drawn after the walk (residual_again)
        ctx = self.ctx
        self.rule = ctx.coupling.choice if self.lt.buffers.residual is None and not ctx.check_contract else ctx.coupling
        self.bad = self.lt.false

    def verify(self) -> None:
        """Lines 14--17 for every internal node of every row: one coupling call per verification chunk
        (:meth:`verify_chunk`; the chunks of ``lt.buffers``, each at most a memory bound of temporaries, node-sliced
        where contiguous), the verdicts written into ``lt.buffers`` (``acc``, ``idx``, the verdict samples)."""
        self.verify_inputs()
        lt = self.lt
        acc, idx = (
            lt.buffers.acc,
            lt.buffers.idx,
        )  # [M, N]: the chunks write every internal node's column, the others stay 0
        res = lt.buffers.residual  # [I, M, D]: each internal node's verdict sample
        for chunk, sig_tab in zip(lt.buffers.chunks, lt.sigma_by_root):
            accepted, index, sample, bad_c = self.verify_chunk(chunk[:7], sig_tab)
            acc[:, chunk[1]] = accepted
            idx[:, chunk[1]] = index
            if res is not None:
                res[chunk[7]] = sample
            if bad_c is not None:
                self.bad = self.bad | bad_c
            del accepted, index, sample

    def verify_chunk(self, chunk: tuple, sig_tab: torch.Tensor, own_checks: bool = False) -> tuple:
        """Line 17 for the ``c`` internal nodes of one verification chunk, every row at once: one call of ``rule``.

        ``chunk``: ``(K, nodes [c], slice, children [c, K], slice, depths [c], has node 0)`` of ``lt.buffers.chunks``;
        the compiled round passes None for the slices and the flag (gathers instead of views, node 0's velocity picked
        by ``torch.where``: the same numbers), so that one graph serves every chunk of a shape. ``sig_tab [c, T]``: the
        chunk's kernel scales per root. ``own_checks``: collect the deferred value checks here and return their flag
        (a compiled piece), else they go to the caller's context.

        Returns:
            ``(accepted, index, sample, bad)``: ``[M, c]`` each of the first two, the verdict samples ``[c, M, D]``
            (None unless the round keeps them), a 0-dim flag of a failed check (None where none ran).
        """
        k, u, u_sl, ch, ch_sl, du, has_root = chunk
        ctx, lt, states, v0, vrest = self.ctx, self.lt, self.states, self.v0, self.vrest
        kern, e, ar, n, M = ctx.schedule.kernel, ctx.x_event, lt.ar, self.n, self.n.shape[0]
        c, at_u = u.numel(), u if u_sl is None else u_sl
        xu = states[at_u]  # [c, M, D]
        if has_root is None:
            vu = torch.where((u == 0)[:, None, None], v0[None], vrest[lt.vrest_row[u]])
        elif has_root:
            vu = torch.cat([v0[None], vrest[lt.vrest_row[u[1:]]]]) if c > 1 else v0[None]
        else:
            vu = vrest[u_sl.start - 1 : u_sl.stop - 1] if u_sl is not None else vrest[u - 1]
        cu = kern.named(self.coefs[du].unbind(1))  # [c, M, 1] each
        mean_p = self.proposal_mean(xu, cu, du, at_u)
        mean_q = self.kernel_mean(xu, vu, cu, u)
        sigma = sig_tab.index_select(1, self.n_lim)  # [c, M]: the kernel scale where verified, else 1
        if k == 1 and ch_sl is not None:
            kids = states[ch_sl].reshape(c * M, 1, *e)  # a view: a chain's children are one block
        else:
            kids = states[ch].permute(0, 2, 1, 3).reshape(c * M, k, *e)
        rows = keyed_rows(
            self.vkeys_all,
            self.drawn_all,
            lambda t: t[at_u].reshape(c * M, *t.shape[2:]),
            lambda: lt.key_cache[1][ar, n].T[u].reshape(-1),
        )
        args = (kids, mean_p.reshape(c * M, *e), mean_q.reshape(c * M, *e), sigma.reshape(-1), rows)
        if own_checks:
            with deferred_checks() as checks:
                verdict = self.rule(*args)  # line 17, every node of the chunk at once
            bad = checks.bad
        else:
            verdict, bad = self.rule(*args), None
        if ctx.check_contract:
            flag = (contract_violation(verdict, kids).reshape(c, M) & self.internal_r[:, u].T).any()
            bad = flag if bad is None else bad | flag
        if own_checks and bad is None:
            bad = lt.false
        sample = verdict.sample.reshape(c, M, -1) if lt.buffers.residual is not None else None
        return verdict.accepted.reshape(c, M).T, verdict.index.reshape(c, M).T, sample, bad

    def walk(self) -> None:
        """Lines 18--23 by gathers over the verdicts in ``lt.buffers`` (a node is on the accepted path iff every edge
        above it was the accepted one): ``on_path``, ``ustar``, ``rejected``, ``out``."""
        lt, states = self.lt, self.states
        acc, idx, res, ar, internal_r = lt.buffers.acc, lt.buffers.idx, lt.buffers.residual, lt.ar, self.internal_r
        p = lt.parent1
        taken = acc[:, p] & (idx[:, p] == lt.edge_slot) & internal_r[:, p]  # [M, N-1]
        self.on_path = ((~taken).to(states.dtype) @ lt.anc_t) == 0  # [M, N]
        self.ustar = ustar = torch.argmax(self.on_path * lt.depth1_row, 1)  # the last node the walk reached
        self.rejected = rejected = internal_r[ar, ustar]  # it was verified and rejected (lines 18--20)
        if res is not None:
            self.out = torch.where(rejected[:, None], res[lt.pos_c[ustar], ar], states[ustar, ar])
        else:  # its checks deferred too: no host synchronisation
            self.out = self.residual_again()

    def residual_again(self) -> torch.Tensor:
        """The committed states ``[M, D]`` of a round that kept no verdict samples: where a row's walk stopped at a
        rejection, the verification of that node drawn again (one coupling call per node width, over every row: the
        node's own keys or its rows of the run's uniform table, so the same numbers as the first call); elsewhere the
        reached leaf."""
        ctx, lt, states, v0, vrest = self.ctx, self.lt, self.states, self.v0, self.vrest
        ustar, rejected, n = self.ustar, self.rejected, self.n
        M, e, ar, kern = states.shape[1], ctx.x_event, lt.ar, ctx.schedule.kernel
        out = states[ustar, ar]
        for k, rep, of_width in lt.width_groups:
            mine = of_width[ustar]
            w = torch.where(mine, ustar, rep)  # rows whose node has another width verify a stand-in
            xw, dw = states[w, ar], lt.depth[w]
            vw = torch.where((w == 0)[:, None], v0, vrest[(w - 1).clamp(min=0), ar])
            cw = kern.named(self.coefs[dw, :, ar].unbind(1))  # [M, 1] each
            mean_p = self.proposal_mean(xw, cw, (dw, ar), (w, ar))
            mean_q = self.kernel_mean(xw, vw, cw, (w, ar))
            kids = states[lt.first_child[w][:, None] + torch.arange(k, device=w.device)[None], ar[:, None]]  # [M, k, D]
            sigma = torch.where(mine & rejected, cw["std"][:, 0], lt.one)
            verdict = ctx.coupling(
                kids.reshape(M, k, *e),
                mean_p.reshape(M, *e),
                mean_q.reshape(M, *e),
                sigma,
                keyed_rows(
                    self.vkeys_all, self.drawn_all, lambda t, w=w: t[w, ar], lambda w=w: lt.key_cache[1][ar, n, w]
                ),
            )
            out = torch.where((mine & rejected)[:, None], verdict.sample.reshape(M, -1), out)
        return out

    def accept(self) -> None:
        """Line 24 for every row: the prefetch (the rules of :func:`specsamp.round.context.leaf_prefetch` and
        :func:`~specsamp.round.context.nearest_sibling`), the draft's history (:meth:`history`), and what
        :meth:`commit` writes: ``n_new``, ``exact_new [M]``, the next root velocities ``v_next``, ``steps``."""
        ctx, lt, st, live, states, v0, vrest = self.ctx, self.lt, self.st, self.live, self.states, self.v0, self.vrest
        ustar, rejected, n, ar = self.ustar, self.rejected, self.n, lt.ar
        finished = live & ~rejected  # walked to a leaf of T|_{L_n}
        self.steps = torch.where(live, lt.depth[ustar] + rejected, lt.zero_long)
        last = torch.where(rejected, ustar, lt.parent_c[ustar])  # the last node the walk verified
        v_cur = torch.where(lt.is_root_col[last], v0, vrest[lt.vrest_row[last], ar])
        v_leaf = vrest[lt.vrest_row[ustar], ar]  # where finished, u* is a leaf of depth >= 1
        evaluated = lt.evaluated_by_root.index_select(0, self.n_lim)  # [M, N]: what the batched call evaluated
        v_next, exact = v_cur, leaf_prefetch(ctx.prefetch, finished, lambda: evaluated[ar, ustar])
        if ctx.prefetch != "none":
            v_next = torch.where(exact[:, None], v_leaf, v_next)
            if ctx.prefetch == "nearest":
                ch = lt.child_pad[ustar]  # [M, Kmax]: the siblings of the committed state
                has, best = nearest_sibling(
                    lt.child_ok[ustar] & evaluated.gather(1, ch) & rejected[:, None],
                    states[ch, lt.ar_col],
                    self.out,
                    lt.inf,
                )
                v_next = torch.where(has[:, None], vrest[ch[ar, best] - 1, ar], v_next)  # children are never the root
        self.v_next, self.verified = v_next, self.on_path & self.internal_r
        self.past = None  # a multistep kernel's past of the committed states: the records of the H states before them
        if st.past is not None:
            self.past = tuple(self.recs[lt.back[last, j], ar].reshape(st.x.shape) for j in range(lt.back.shape[1] - 1))
        self.hist = None if st.history is None else self.history()
        self.n_new, self.exact_new = n + self.steps, torch.where(live, exact, self.root_exact)

    def history(self) -> DraftHistory:
        """The draft history after the round, by gathers: the exact data predictions the sparse walk records
        (:func:`specsamp.round.sparse.record`: the root and every accepted internal node, the nodes ``verified`` on the
        path, in depth order) pushed in front of ``st``'s records, most recent first; rows without a verified node
        keep theirs. Written apart from the sparse walk's record: the data prediction here reads the run's
        coefficient table (``sigma`` column, by gathers over every row), where the sparse walk computes it per visited
        node (:func:`specsamp.drafts.data_prediction`); the same operations, so the same bits."""
        ctx, lt, st, n, verified = self.ctx, self.lt, self.st, self.n, self.verified
        M, H = st.history.n.shape
        ar = torch.arange(M, device=n.device)[:, None]
        nv = verified.sum(1, keepdim=True)  # [M, 1] records of this round
        slot = lt.slots[:, :H]
        j = nv - 1 - slot  # [M, H]: depth of the path node slot s records, where >= 0
        node = lt.anc_at_depth[self.ustar].gather(1, j.clamp(min=0))  # [M, H]
        xs = self.states[node, ar]  # [M, H, D]
        vs = torch.where((node == 0)[..., None], self.v0[:, None], self.vrest[(node - 1).clamp(min=0), ar])
        nn = n[:, None] + lt.depth[node]
        sigma = ctx.coef_table[nn.clamp(max=ctx.schedule.steps - 1), ctx.schedule.kernel.col("sigma")]
        x0 = xs - sigma[..., None] * vs  # data_prediction's operations
        return st.history.prepend(DraftHistory(x0, nn, xs), nv, slot=slot, rows=ar)

    def commit(self, tally: Tally) -> None:
        """Write the round's rows into ``st`` and ``tally``, leaving the other rows as they are then (so the rounds of
        several trees commit one after the other); the layout counts the calls' batches from its host plan."""
        lt, verified = self.lt, self.verified
        count_verifications(tally, self.n, lt.dcol_m, verified.long(), (verified & lt.buffers.acc).long())
        for rows in self.calls:
            tally.charge(None, rows, batch=False)
        shape = self.st.x.shape
        new = Commit(
            self.out.reshape(shape),
            self.n_new,
            self.steps,
            self.v_next.reshape(shape),
            self.exact_new,
            self.hist,
            self.past,
        )
        commit_round(self.st, tally, self.live, new)


class DenseNodes(Nodes):
    """The checked walk over a dense round (:func:`specsamp.round.sparse.sparse_round` with this view of a drafted
    :class:`DenseRound` ``d``): the drafted states and the batched call's velocities, verified one depth at a time
    with every check raised where it fails, naming trajectory, step and node. Serves the rounds whose deferred checks
    failed (or whose markmax rows the share table could not certify): same keys, same states, so the same numbers."""

    def __init__(self, d: DenseRound, live: torch.Tensor):
        super().__init__(d.ctx, (d.lt.tree, d.lt.tensors), d.st, live)
        self.d, self.e = d, self.x.shape[1:]

    def calls(self):
        return [r[self.rows] for r in self.d.calls]

    def draft(self, v, ids):
        b = self.rows[v.sub]
        kids = self.d.states[ids, b[:, None]].view(-1, ids.shape[1], *self.e)
        if self.d.refined is None:
            return self.proposal_mean(v), kids
        return self.kernel_mean(v, self.d.refined[v.u, b].view_as(v.x), refined=True), kids

    def history_of(self, v, refined=False):
        if not refined:  # the walk's own records, as the sparse round keeps them
            return super().history_of(v)
        b, back, recs = self.rows[v.sub], self.d.lt.back, self.d.refined_recs  # the last Picard sweep's records
        return tuple(recs[back[v.u, j], b].view_as(v.x) for j in range(1, back.shape[1]))

    def velocity(self, sub, u, x_u, depth):
        b = self.rows[sub]
        return torch.where((u == 0)[:, None], self.d.v0[b], self.d.vrest[(u - 1).clamp(min=0), b]).view_as(x_u)


def target_call(
    r: DenseRound, node_step: torch.Tensor, plan: torch.Tensor | None, kind: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """The dense round's batched target call over the planned rows (what the sparse round evaluates).

    ``rest`` (every non-root node; the roots' velocities known) and ``all`` (every node) read the states ``[N, M, D]``
    in place; ``some`` evaluates their flat rows ``plan`` (long ``[P]``, ``node * M + row``), the others' velocities
    left 0 (never read). ``node_step [N, M]``: each node's step. Returns the roots' velocities ``v0 [M, D]``
    (``r.v_root`` where ``r.root_exact``) and the others' ``vrest [N-1, M, D]``. Under ``compile`` it runs outside
    the compiled graphs (:func:`network_outside`): a model need not compile, and the plan's size varies by round.
    """
    ctx, lt, states = r.ctx, r.lt, r.states
    N, M, e = states.shape[0], states.shape[1], ctx.x_event
    if isinstance(plan, Hidden):
        plan = plan.value
    flat = states.reshape(N * M, -1)
    if kind == "rest":
        v0 = r.v_root.reshape(M, -1)
        vrest = ctx.velocity(lt.rest_states, node_step.view(-1)[M:], lt.rows_rest).reshape(N - 1, M, -1)
    elif kind == "all":
        out_all = ctx.velocity(flat.reshape(-1, *e), node_step.reshape(-1), lt.rows).reshape(N, M, -1)
        v0, vrest = out_all[0], out_all[1:]
    else:
        full = torch.zeros_like(flat)
        if plan.numel():
            full[plan] = ctx.velocity(flat[plan].reshape(-1, *e), node_step.reshape(-1)[plan], plan % M).reshape(
                plan.numel(), -1
            )
        v0 = torch.where(r.root_exact[:, None], r.v_root.reshape(M, -1), full[:M])
        vrest = full[M:].view(N - 1, M, -1)
    return v0, vrest


class Hidden:
    """A value the compiled round hands to :func:`target_call` without reading it (the plan: its size varies from
    round to round, so a compiled graph that read it would be specialised to each size)."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value


def network_outside() -> Callable:
    """:func:`target_call` excluded from ``torch.compile``'s tracing (:func:`specsamp.round.draws.outside`)."""
    return outside(target_call)
