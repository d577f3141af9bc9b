"""The layouts of the loop over rounds (:func:`specsamp.round.loop.run_rounds`): which rows a round serves, how
its roots get their own call, the round itself (:class:`DenseLayout`: the dense round, :class:`SparseLayout`: the
sparse one), what a callback is shown and which rows the last step must evaluate.

Trees per root step (``tree(n)``) are served in both, and grouped differently for a reason: the dense layout runs one
dense round per distinct tree of the live rows (its tables and buffers are per tree, and rows of one tree share
them), the sparse layout one round per root index (a sparse round is built for its rows alone, so there is nothing to
share by tree).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from ..trees import DraftTree
from .context import Chains, Context, Tally
from .dense import DenseNodes, Hidden, dense_round, drafted_round
from .loop import root_call
from .sparse import Nodes, sparse_round
from .tables import DenseTables, upload


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

    def __init__(
        self, ctx: Context, st: Chains, tally: Tally, tree: DraftTree | dict, dense_round_fn: Callable | None = None
    ):
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
            self.pool = {
                "states": st.x.new_empty(max(len(t) for t in self.trees) * M * D),
                "residual": st.x.new_empty(internal * M * D),
            }
        self.lts, self.shared = (
            {},
            {},
        )  # shared: the key and random tables of a node count, the same for every tree of that size

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
            kind = (
                "all" if plan.size == lt.N * M else "rest" if plan.size == (lt.N - 1) * M and plan[0] == M else "some"
            )
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
            plans = [c[:2] for c in calls]  # the sweeps' calls, then the round's own
            r = self.dense_round_fn(ctx, lt, st, sel, plans)
            rounds.append((r, sel, plans, live_host if mine is None else mine))
            if mine is None:
                n_new, exact_new, bad = r.n_new, r.exact_new, r.bad
            else:
                n_new, exact_new = torch.where(r.live, r.n_new, n_new), torch.where(r.live, r.exact_new, exact_new)
        if len(groups) > 1:
            bad = torch.stack([r[0].bad for r in rounds]).any()
        payload = torch.cat([bad.long().reshape(1), n_new, exact_new.long()]).tolist()  # the one sync of the round
        if payload[0]:  # the checked walk serves the round again, tree by tree, on the same keys and calls
            for r, sel, plans, rows in rounds:
                d = drafted_round(ctx, r.lt, st, sel, plans)
                sparse_round(DenseNodes(d, upload(np.flatnonzero(rows), dev)), tally, batch=False)
            self.n_host, self.exact_host = st.n.cpu().numpy(), st.root_exact.cpu().numpy()
        else:
            for r, *_ in rounds:
                r.commit(tally)
            self.n_host = np.asarray(payload[1 : M + 1], dtype=np.int64)
            self.exact_host = np.asarray(payload[M + 1 :], dtype=bool)
        tally.batch_nfe += sum(called)  # a call with nothing to evaluate is not made

    def progress(self, r: int, live_host) -> dict:
        return {
            "round": r,
            "live": int((self.n_host < self.end).sum()),
            "batch_nfe": self.tally.batch_nfe,
            "steps_done": int((self.n_host - self.ctx.schedule.first_speculative).clip(min=0).sum()),
            "n": self.st.n,
            "x": self.st.x,
            "v": self.st.v_root,
        }

    def need_rows(self):
        return upload(np.flatnonzero(~self.exact_host), self.st.x.device)


class SparseLayout:
    """The sparse round's layout for :func:`specsamp.round.loop.run_rounds`: the live rows as device indices (one host
    synchronisation to find them), each round on those rows alone. ``tree``: a fixed tree, or ``{n: T_n}`` with one
    round per root index in the batch, whose rows would share one batched call (charged once)."""

    def __init__(self, ctx: Context, st: Chains, tally: Tally, tree: DraftTree | dict):
        self.ctx, self.st, self.tally = ctx, st, tally
        with_tensors = lambda t: (t, t.index_tensors(st.x.device))  # noqa: E731
        self.trees = (
            with_tensors(tree) if isinstance(tree, DraftTree) else {n: with_tensors(t) for n, t in tree.items()}
        )

    def live(self):
        live = (self.st.n < self.ctx.schedule.end_speculative).nonzero(as_tuple=True)[0]
        return live if live.numel() else None

    def root_call(self, live):
        root_call(self.ctx, self.st, live, self.tally)

    def round(self, live):
        ctx, st, tally = self.ctx, self.st, self.tally
        if isinstance(self.trees, tuple):
            return sparse_round(Nodes(ctx, self.trees, st, live), tally)
        calls, most, roots = tally.batch_nfe, 0, st.n[live]
        for n in torch.unique(roots).tolist():
            before = tally.batch_nfe
            sparse_round(Nodes(ctx, self.trees[n], st, live[roots == n]), tally)
            most = max(most, tally.batch_nfe - before)  # 0 or 1: the rounds of the batch share one call
        tally.batch_nfe = calls + most

    def progress(self, r: int, live) -> dict:
        first = self.ctx.schedule.first_speculative
        return {
            "round": r,
            "live": int(live.numel()),
            "batch_nfe": self.tally.batch_nfe,
            "steps_done": int((self.st.n - first).clamp(min=0).sum()),
            "n": self.st.n,
            "x": self.st.x,
            "v": self.st.v_root,
        }

    def need_rows(self):
        return None
