"""Samplers: the standard Euler--Maruyama chain and speculative sampling on draft trees (Algorithm 1).

Both are plain functions of ``(model, schedule, ...)`` in the k-diffusion style. Trajectories are
batched: one batched target call serves every live trajectory of a round. All randomness is keyed by
``(seed, trajectory index, step, node)`` (:mod:`specsamp.rng`), so the random numbers of a trajectory do
not depend on the batch it ran in, and the two executions of the speculative sampler draw identical
numbers. A trajectory's counts are then equal bitwise across executions, ``max_batch``, batches and index
subsets; its sample is equal to the rounding of the model's batched evaluation (a row's output may
differ in the last bits with its batch), not bitwise (``tests/test_reproducibility.py``):

- ``tree``: draft every node of ``T|_{L_n}``, evaluate all of them in one batched target call, then walk
  (what runs on a GPU);
- ``path``: draft and evaluate only what the acceptance walk visits (cheap sweeps on analytic targets).

The reference round (:func:`_round`) serves both, differing only in how a node's state and velocity are
obtained (:class:`_TreeNodes` and :class:`_PathNodes`). The tree execution (a fixed tree or a tree per root
step, a draft with a table form) runs the lean round instead (:func:`_lean_round`): the same policy (drafts, keys, verifications, walk, prefetch,
accounting) as a fixed sequence of tensor operations over every row of the batch, with one host
synchronisation per round; tests hold it to identical counts and the same drafted bits as ``path``.

Accounting (the paper's protocol, section 5; ``docs/protocol.md``): ``nfe`` counts batched target
calls on the speculative steps ``1..T-2``, the warm-up call at the first root included;
``speedup = (T - 2) / nfe``. ``nfe_total`` adds the two deterministic endpoint steps. ``target_rows``
counts the states the speculative calls evaluated. Picard sweeps (``refine``) are batched calls of their own,
charged to both.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from . import rng
from .coupling import Coupling, NonFiniteError, Verdict, deferred_checks, get_coupling
from .drafts import Draft, DraftHistory, DraftRoot, _lsnr_feature, data_prediction, get_draft
from .errors import ConfigError
from .result import SampleResult
from .batching import batched
from .schedule import Schedule, per_row
from .trees import DraftTree

PREFETCH = ("nearest", "parent", "none")
EXECUTIONS = ("tree", "path")
WARMUPS = ("call", "step0")


def _check_choice(name: str, value, valid) -> str:
    if value not in valid:
        raise ConfigError(f"{name}={value!r} is invalid; valid: {list(valid)}")
    return value


def _trajectory_ids(n_samples: int | None, indices, device) -> torch.Tensor:
    if indices is None:
        if isinstance(n_samples, bool) or not isinstance(n_samples, int) or n_samples < 1:
            raise ValueError(f"n_samples={n_samples!r} is invalid: must be an integer >= 1")
        return torch.arange(n_samples, device=device)
    ids = torch.as_tensor(indices, dtype=torch.long, device=device)
    if ids.ndim != 1 or ids.numel() == 0:
        raise ValueError("indices must be a non-empty 1-D sequence of trajectory ids")
    return ids


def _model_device(model) -> torch.device:
    return torch.device(getattr(model, "device", "cpu"))


class _Velocity:
    """Target evaluations ``v(x, sigma_n)`` for rows of given trajectories, with their conditioning."""

    def __init__(self, model, schedule: Schedule, cond: dict | None, max_batch: int | None):
        self.model, self.schedule, self.cond, self.max_batch = model, schedule, cond or {}, max_batch

    def __call__(self, x: torch.Tensor, n: torch.Tensor, traj: torch.Tensor) -> torch.Tensor:
        sigma = self.schedule.sigmas.to(x.device)[n]
        cond = {k: c[traj] for k, c in self.cond.items()}
        return batched(self.model, x, sigma, self.max_batch, **cond).to(x.dtype)


def initial_noise(seed: int, ids: torch.Tensor, event_shape, dtype) -> torch.Tensor:
    """Initial states ``x ~ N(0, I)`` at ``sigma = 1``, keyed by ``(seed, trajectory)``.

    Speculative and standard samplers with the same seed start from the same noise (paired runs).
    """
    keys = rng.base_key(seed, ids, "init", device=ids.device)
    return rng.normal(keys, event_shape, dtype=dtype)


def sample_standard(
    model,
    schedule: Schedule,
    n_samples: int | None = None,
    *,
    seed: int = 0,
    indices=None,
    cond: dict | None = None,
    max_batch: int | None = None,
    callback: Callable[[dict], None] | None = None,
) -> SampleResult:
    """The standard Euler--Maruyama sampler: one target call per step (eqs. 4--5, 36--37).

    Args:
        model: velocity model (:class:`specsamp.models.VelocityModel`).
        schedule: time grid and kernel.
        n_samples: number of trajectories (ids ``0..n-1``) when ``indices`` is None.
        seed: run seed.
        indices: explicit trajectory ids ``[M]`` (their randomness is keyed by these).
        cond: per-trajectory conditioning tensors ``[M, ...]``.
        max_batch: rows per forward pass.
        callback: called after each step with ``{"step", "steps_done"}`` (``steps_done``: steps of the
            speculative range ``1..T-2`` done, summed over trajectories; for progress bars).

    Returns:
        :class:`SampleResult` with ``nfe = T - 2`` for every trajectory.

    Raises:
        ValueError: ``n_samples < 1`` or bad indices.
    """
    dev = _model_device(model)
    ids = _trajectory_ids(n_samples, indices, dev)
    m = ids.numel()
    velocity = _Velocity(model, schedule, cond, max_batch)
    x = initial_noise(seed, ids, model.event_shape, model.dtype)
    step_keys = rng.base_key(seed, ids, "step", device=dev)
    traj = torch.arange(m, device=dev)
    for n in range(schedule.steps):
        nn = torch.full((m,), n, dtype=torch.long, device=dev)
        mean = schedule.mean(x, velocity(x, nn, traj), nn)
        std = per_row(schedule.std(nn).to(x.dtype), x)
        noise = rng.normal(rng.fold(step_keys, n), model.event_shape, dtype=x.dtype)
        x = mean + std * noise
        if callback is not None:
            callback({"step": n + 1, "steps_done": m * min(n, schedule.steps - 2)})
    T = schedule.steps
    z = torch.zeros(m, dtype=torch.long, device=dev)
    return SampleResult(
        samples=x,
        nfe=z + (T - 2),
        nfe_total=z + T,
        target_rows=z + (T - 2),
        rounds=z + (T - 2),
        committed=torch.ones(m, T - 2, dtype=torch.long, device=dev),
        attempts=torch.zeros(m, 0, dtype=torch.long, device=dev),
        accepts=torch.zeros(m, 0, dtype=torch.long, device=dev),
        speculative_steps=T - 2,
        batch_nfe=T - 2,
    )


# ----------------------------------------------------------------------------------------------
# One round of Algorithm 1, shared by both executions.


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
    draft_keys: torch.Tensor  # [m]
    verify_keys: torch.Tensor  # [m]
    history: DraftHistory | None = None  # [m, H, ...] the round's own copy of the draft's history; None when H = 0


class _Nodes:
    """How an execution obtains node states and velocities. Subclasses: tree and path."""

    def __init__(self, tree: DraftTree, tensors: dict, rnd: _Round, ctx: _Context):
        self.tree, self.t, self.r, self.ctx = tree, tensors, rnd, ctx

    def internal_in_round(self, u: torch.Tensor, sub: torch.Tensor) -> torch.Tensor:
        """Whether node ``u`` (one per selected trajectory ``sub``) is internal in ``T|_{L_n}``."""
        return (self.t["depth"][u] < self.r.depth_limit[sub]) & (self.t["num_children"][u] > 0)

    def evaluated(self, u: torch.Tensor, sub: torch.Tensor) -> torch.Tensor:
        """Whether the round's batched call evaluated node ``u`` (the B=|V| or B=|I| protocol)."""
        inside = self.t["depth"][u] <= self.r.depth_limit[sub]
        return inside & (self.internal_in_round(u, sub) | self.ctx.evaluate_leaves)

    def child_ids(self, u: torch.Tensor, k: int) -> torch.Tensor:
        """Node ids ``[s, k]`` of the ``k`` children of nodes ``u [s]`` (contiguous, drafting order)."""
        return self.t["first_child"][u][:, None] + torch.arange(k, device=u.device)[None]

    def draft(self, sub: torch.Tensor, x_parents: torch.Tensor, step: torch.Tensor, ids: torch.Tensor, pos: torch.Tensor, out=None):
        """Draft children: their parents' proposal means plus keyed kernel noise (Algorithm 1, line 7).

        Args:
            sub: ``[s]`` rows of the round.
            x_parents: ``[s, P, *e]`` parent states, all at step ``step [s]``.
            step: ``[s]`` the parents' step index.
            ids: ``[s or 1, C]`` node ids of the children (they key the noise).
            pos: ``[C]`` or ``[s, C]`` position of each child's parent among the ``P``.
            out: optional node-major buffer ``[C, s, *e]`` to draft into (then ``ids`` is ``[1, C]`` and
                ``pos`` is ``[C]``, non-decreasing: children of one parent are contiguous).

        Returns:
            ``(means [s, P, *e], children [s, C, *e])``; the children are ``out.transpose(0, 1)`` when
            ``out`` is given. The numbers are the same either way.
        """
        mean = self.ctx.draft.mean(self.r.frozen[sub], x_parents, step, self.ctx.schedule)
        e = x_parents.shape[2:]
        std = per_row(self.ctx.schedule.std(step).to(x_parents.dtype), x_parents)
        if out is not None:  # node-major, in place: no gather of parent means, no copy of the children
            keys = rng.fold(self.r.draft_keys[sub][None], self.r.n[sub][None], ids.reshape(-1, 1))  # [C, s]
            rng.normal(keys, e, out=out)
            out *= std.transpose(0, 1)
            bounds = torch.searchsorted(pos, torch.arange(mean.shape[1] + 1, device=pos.device)).tolist()
            for p in range(mean.shape[1]):
                if bounds[p + 1] > bounds[p]:
                    out[bounds[p] : bounds[p + 1]] += mean[:, p][None]
            return mean, out.transpose(0, 1)
        keys = rng.fold(self.r.draft_keys[sub][:, None], self.r.n[sub][:, None], ids)
        noise = rng.normal(keys, e, dtype=x_parents.dtype)
        rows = torch.arange(mean.shape[0], device=mean.device)[:, None]
        noise *= std  # in place: the noise buffer becomes the children (same numbers as mean + std * noise)
        noise += mean[rows, pos]
        return mean, noise

    # interface
    def children(self, sub, x_u, u, k, step):  # -> (draft mean of u, children states [s, k, *e], ids [s, k])
        raise NotImplementedError

    def velocity(self, sub, u, x_u):  # -> exact velocity of node u [s, *e]
        raise NotImplementedError


class _TreeNodes(_Nodes):
    """Tree execution: every node of ``T|_{L_n}`` drafted, one batched call over all of them.

    States and velocities are stored node-major (``[nodes, m, *e]``), so the rows of every non-root
    node form one contiguous block that goes to the network without a gather copy, and velocities
    are written into place one ``max_batch`` chunk at a time.
    """

    def __init__(self, tree, tensors, rnd, ctx):
        super().__init__(tree, tensors, rnd, ctx)
        m = rnd.x.shape[0]
        e = rnd.x.shape[1:]
        dev = rnd.x.device
        N = len(tree)
        states = rnd.x.new_empty(N, m, *e)
        states[0] = rnd.x
        all_rows = torch.arange(m, device=dev)
        for l in range(1, tree.max_depth + 1):
            layer = torch.as_tensor(tree.layer(l), device=dev)
            prev = tree.layer(l - 1)
            step = (rnd.n + l - 1).clamp(max=ctx.schedule.steps - 1)
            pos = tensors["parent"][layer] - int(prev[0])
            self.draft(all_rows, states[prev[0] : prev[-1] + 1].transpose(0, 1), step, layer[None], pos, out=states[layer[0] : layer[-1] + 1])
        self.sweep_rows = []  # [m] rows of each Picard sweep's batched call
        self.refined_v = None  # [N, m, *e] the last sweep's velocities: the children's proposal means use them
        if ctx.refine > 0:
            self._picard(states, ctx.refine)
        self.states = states
        node = torch.arange(N, device=dev)
        mask = self.evaluated(node[None].expand(m, -1), all_rows[:, None].expand(-1, N))
        mask[:, 0] &= ~rnd.root_exact
        rest = mask.T  # [node, trajectory]
        if bool(rest[1:].all()) and not bool(rest[0].any()):
            # the common case: nodes 1.. form one contiguous block, evaluated in one call straight from
            # the states (no gather) and kept as returned (no scatter); the roots' velocities are known
            step = (rnd.n[None] + tensors["depth"][1:, None]).clamp(max=ctx.schedule.steps - 1).reshape(-1)
            self.block = ctx.velocity(states[1:].reshape(-1, *e), step, rnd.rows.repeat(N - 1)).view(N - 1, m, *e)
            self.root_vel = rnd.v_root
        else:
            self.block = None
            vel = torch.zeros_like(states)
            nodes_, traj = rest.nonzero(as_tuple=True)
            if nodes_.numel():
                step = (rnd.n[traj] + tensors["depth"][nodes_]).clamp(max=ctx.schedule.steps - 1)
                vel[nodes_, traj] = ctx.velocity(states[nodes_, traj], step, rnd.rows[traj])
            vel[0] = torch.where(per_row(rnd.root_exact, rnd.x), rnd.v_root, vel[0])
            self.vel = vel
        self.call_rows = mask.sum(1)

    def _picard(self, states: torch.Tensor, J: int) -> None:
        """``J`` synchronous Picard sweeps over the drafted tree, in place on ``states [N, m, *e]``.

        Sweep ``j`` evaluates the target at the current snapshot of every internal node of ``T|_{L_n}`` in one
        batched call (the root only where its velocity is not exact; after the first sweep it is), then rebuilds
        the tree breadth-first with the same innovations: a child ``c`` of ``u`` at step ``s`` becomes
        ``mean(x_u, v_u, s) + std(s) xi_c``, with ``x_u`` the parent's rebuilt state, ``v_u`` the sweep's velocity
        at the parent's snapshot and ``xi_c`` the child's keyed noise (the draft's own numbers). This is the
        Picard iteration of ParaDiGMS (Shih et al., 2023) on a tree: after ``j`` sweeps the first ``j`` levels
        equal the target tree's, so at ``J >= L_n`` every child's proposal mean is the target kernel mean at
        its parent.

        Exactness: the snapshot of ``u`` is a function of ``u``'s ancestors' and ``u``'s own innovations
        (and the round's root), never of ``u``'s children's, so given the round's history (the path walked to
        ``u``) each child of ``u`` is ``N(mean(x_u, v_u, s), std(s)^2 I)`` with ``v_u`` already fixed; that
        mean is what :meth:`children` hands the coupling, which is all an exact coupling needs.
        """
        ctx, rnd, t, tree = self.ctx, self.r, self.t, self.tree
        m, e, dev = states.shape[1], states.shape[2:], states.device
        last = ctx.schedule.steps - 1
        node = torch.arange(len(tree), device=dev)
        internal = (t["depth"][:, None] < rnd.depth_limit[None]) & (t["num_children"][:, None] > 0)  # [N, m]
        # the innovations std(s) xi_c, drawn exactly as the draft drew them (same keys, same buffers' dtype)
        innov = torch.empty_like(states)
        for l in range(1, tree.max_depth + 1):
            layer = tree.layer(l)
            keys = rng.fold(rnd.draft_keys[None], rnd.n[None], torch.as_tensor(layer, device=dev).reshape(-1, 1))
            block = innov[layer[0] : layer[-1] + 1]
            rng.normal(keys, e, out=block)
            step = (rnd.n + l - 1).clamp(max=last)
            block *= per_row(ctx.schedule.std(step).to(states.dtype), states[0])[None]
        vel = torch.zeros_like(states)
        for _ in range(J):
            mask = internal.clone()
            mask[0] &= ~rnd.root_exact
            nodes_, traj = mask.nonzero(as_tuple=True)
            vel = torch.zeros_like(states)
            if nodes_.numel():  # one batched call at the snapshot
                step = (rnd.n[traj] + t["depth"][nodes_]).clamp(max=last)
                vel[nodes_, traj] = ctx.velocity(states[nodes_, traj], step, rnd.rows[traj])
            vel[0] = torch.where(per_row(rnd.root_exact, rnd.x), rnd.v_root, vel[0])
            rnd.v_root, rnd.root_exact = vel[0].clone(), torch.ones_like(rnd.root_exact)
            self.sweep_rows.append(mask.sum(0))
            for l in range(1, tree.max_depth + 1):  # breadth-first rebuild with the same innovations
                layer = tree.layer(l)
                lo, hi = layer[0], layer[-1] + 1
                par = t["parent"][node[lo:hi]]
                step = (rnd.n + l - 1).clamp(max=last)
                mean = ctx.schedule.mean(states[par].reshape(-1, *e), vel[par].reshape(-1, *e), step.repeat(hi - lo))
                states[lo:hi] = mean.view(hi - lo, m, *e) + innov[lo:hi]
        self.refined_v = vel

    def children(self, sub, x_u, u, k, step):
        ids = self.child_ids(u, k)
        if self.refined_v is not None:  # the refined proposal mean (see _picard)
            mean = self.ctx.schedule.mean(x_u, self.refined_v[u, sub], step)
        else:
            mean = self.ctx.draft.mean(self.r.frozen[sub], x_u[:, None], step, self.ctx.schedule)[:, 0]
        return mean, self.states[ids, sub[:, None]], ids

    def velocity(self, sub, u, x_u):
        if self.block is None:
            return self.vel[u, sub]
        out = self.block[(u - 1).clamp(min=0), sub]
        root = u == 0
        if bool(root.any()):
            out[root] = self.root_vel[sub[root]]
        return out


class _PathNodes(_Nodes):
    """Path execution: only the nodes the walk visits are drafted; velocities computed on demand."""

    def __init__(self, tree, tensors, rnd, ctx):
        super().__init__(tree, tensors, rnd, ctx)
        internal_rows, all_rows = tree.call_rows_by_depth
        table = torch.as_tensor(all_rows if ctx.evaluate_leaves else internal_rows, device=rnd.x.device)
        self.call_rows = table[rnd.depth_limit] - rnd.root_exact.long()

    def children(self, sub, x_u, u, k, step):
        ids = self.child_ids(u, k)
        mean, kids = self.draft(sub, x_u[:, None], step, ids, torch.zeros(k, dtype=torch.long, device=u.device))
        return mean[:, 0], kids, ids

    def velocity(self, sub, u, x_u):
        root_known = (u == 0) & self.r.root_exact[sub]
        out = self.r.v_root[sub].clone()
        todo = (~root_known).nonzero(as_tuple=True)[0]
        if todo.numel():  # evaluate only what the round's batched call would have had to compute
            out[todo] = self.ctx.velocity(x_u[todo], self.r.n[sub[todo]] + self.t["depth"][u[todo]], self.r.rows[sub[todo]])
        return out


@dataclass
class _Context:
    schedule: Schedule
    coupling: Coupling
    draft: Draft
    prefetch: str
    evaluate_leaves: bool
    velocity: _Velocity
    ids: torch.Tensor | None = None  # [M] trajectory ids (for messages)
    tables: dict | None = None  # Schedule.tables on the model's device (float64)
    coef_table: torch.Tensor | None = None  # [T, 5] the COEFS columns of the tables, in the states' dtype
    key_tables: tuple | None = None  # (draft, verify) keys folded with every root index: [M, T] each
    x_event: tuple = ()  # event shape of the states
    check_contract: bool = False  # check every verdict against the coupling contract
    refine: int = 0  # Picard sweeps over the drafted tree before verification (tree execution only)


def _walk(nodes: _Nodes, rnd: _Round, ctx: _Context, tally: _Tally):
    """Phase 3 of Algorithm 1 (lines 14--23) plus root-velocity prefetch for the next round.

    Returns:
        ``(committed_state [m, *e], steps [m], v_next [m, *e], exact_next [m])``.
    """
    m = rnd.x.shape[0]
    dev = rnd.x.device
    t = nodes.t
    cur = torch.zeros(m, dtype=torch.long, device=dev)
    x_cur = rnd.x.clone()
    v_cur = nodes.velocity(torch.arange(m, device=dev), cur, x_cur)
    _record(ctx, rnd, torch.arange(m, device=dev), x_cur, v_cur, rnd.n)  # the root, verified below
    walking = torch.ones(m, dtype=torch.bool, device=dev)
    steps = torch.zeros(m, dtype=torch.long, device=dev)
    out = rnd.x.clone()
    rejected_parent = torch.full((m,), -1, dtype=torch.long, device=dev)
    sib_states = {}  # rejected rows -> (ids, states) of the siblings at the committed depth
    for l in range(1, nodes.tree.max_depth + 1):  # line 16
        act = walking & (l <= rnd.depth_limit) & (t["num_children"][cur] > 0)
        walking = walking & act
        if not bool(act.any()):
            break
        width = t["num_children"][cur]  # fixed before any row of this depth moves down
        for k in torch.unique(width[act]).tolist():
            sub = (act & (width == k)).nonzero(as_tuple=True)[0]
            u = cur[sub]
            step = rnd.n[sub] + l - 1
            mean_p, kids, ids = nodes.children(sub, x_cur[sub], u, k, step)
            mean_q = ctx.schedule.mean(x_cur[sub], v_cur[sub], step)
            sigma = ctx.schedule.std(step).to(kids.dtype)
            keys = rng.fold(rnd.verify_keys[sub], rnd.n[sub], u)
            try:
                verdict = ctx.coupling(kids, mean_p, mean_q, sigma, rng.KeyedRows(keys))  # line 17
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
            tally.attempts[rnd.rows[sub], l - 1] += 1
            tally.accepts[rnd.rows[sub], l - 1] += verdict.accepted.long()
            at = (rnd.n[sub], torch.full_like(sub, l - 1))
            tally.root_attempts.index_put_(at, torch.ones_like(sub), accumulate=True)
            tally.root_accepts.index_put_(at, verdict.accepted.long(), accumulate=True)
            steps[sub] += 1
            acc, rej = sub[verdict.accepted], sub[~verdict.accepted]
            if rej.numel():  # lines 18--20: commit the residual draw and stop
                rmask = ~verdict.accepted
                out[rej] = verdict.sample[rmask]
                rejected_parent[rej] = u[rmask]
                walking[rej] = False
                sib_states[l] = sib_states.get(l, []) + [(rej, ids[rmask], kids[rmask])]
            if acc.numel():  # line 22: move down to the accepted child
                amask = verdict.accepted
                cur[acc] = ids[amask, verdict.index[amask]]
                x_cur[acc] = verdict.sample[amask]
        # velocities of accepted nodes that are internal in T|_{L_n} are needed one level down
        need = walking & nodes.internal_in_round(cur, torch.arange(m, device=dev))
        if bool(need.any()):
            idx = need.nonzero(as_tuple=True)[0]
            v_cur[idx] = nodes.velocity(idx, cur[idx], x_cur[idx])
            _record(ctx, rnd, idx, x_cur[idx], v_cur[idx], rnd.n[idx] + l)
    finished = rejected_parent < 0  # walked to a leaf of T|_{L_n}
    out[finished] = x_cur[finished]
    return out, steps, _prefetch(nodes, rnd, ctx, finished, cur, x_cur, v_cur, sib_states, out)


def _record(ctx: _Context, rnd: _Round, rows: torch.Tensor, x: torch.Tensor, v: torch.Tensor, n: torch.Tensor) -> None:
    """Push exact data predictions of committed-trajectory states (``x, v [r, *e]`` at state ``n [r]``) to the
    front of rows ``rows`` of the round's draft history; no-op for drafts without history."""
    if rnd.history is not None:
        rnd.history.push(rows, data_prediction(x, v, n, ctx.schedule), n, x)


def _prefetch(nodes: _Nodes, rnd: _Round, ctx: _Context, finished, cur, x_cur, v_cur, sib_states, out):
    """Velocity for the next round's draft (the ``prefetch`` key) and whether it is exact.

    ``nearest``: the committed leaf's own if it was evaluated; else the evaluated sibling nearest the
    committed state; else the parent's. ``parent``: the leaf's own if evaluated, else the parent's.
    ``none``: nothing (the next round pays one call for its root).
    """
    m = rnd.x.shape[0]
    dev = rnd.x.device
    v_next = v_cur.clone()  # for finished rows: the leaf's parent velocity (v_cur is the last verified node's)
    exact = torch.zeros(m, dtype=torch.bool, device=dev)
    if ctx.prefetch == "none":
        return v_next, exact
    all_m = torch.arange(m, device=dev)
    leaf_eval = finished & nodes.evaluated(cur, all_m)
    if bool(leaf_eval.any()):
        idx = leaf_eval.nonzero(as_tuple=True)[0]
        v_next[idx] = nodes.velocity(idx, cur[idx], x_cur[idx])
        exact[idx] = True
    if ctx.prefetch == "nearest":
        for parts in sib_states.values():
            for rej, ids, kids in parts:
                ok = nodes.evaluated(ids, rej[:, None].expand_as(ids))
                dist = torch.linalg.vector_norm((kids - out[rej][:, None]).reshape(*ids.shape, -1), dim=-1)
                dist = torch.where(ok, dist, torch.full_like(dist, float("inf")))
                best = dist.argmin(1)
                has = ok.any(1)
                if bool(has.any()):
                    r2 = rej[has]
                    node = ids[has, best[has]]
                    v_next[r2] = nodes.velocity(r2, node, kids[has, best[has]])
    return v_next, exact


# ----------------------------------------------------------------------------------------------
# The lean round of the tree execution: a fixed tree, a draft with a table form (Draft.table_mean), every row of the
# batch kept in every round (finished rows padded), so each round is a fixed sequence of tensor
# operations and the host waits once per round, in the loop's "are we done" test.


class _LeanTree:
    """Static index tensors of one fixed :class:`DraftTree` for :func:`_lean_round` (built once per run).

    Attributes (``N`` nodes, depth ``L``): ``depth``, ``parent``, ``first_child``, ``num_children`` ``[N]``
    long; ``anc [N, N]`` ``anc[v, w] = 1`` where ``w`` is ``v`` or an ancestor of ``v`` (states' dtype);
    ``layer_sizes`` and ``layer_parents`` (the parent of each node of depth ``l``); ``groups``:
    ``(K, internal nodes [g], their children [g, K])`` per distinct width; ``child_pad [N, Kmax]`` children
    (clamped) and ``child_ok [N, Kmax]`` which of them exist.
    """

    def __init__(self, tree: DraftTree, dev, dtype):
        N, L = len(tree), tree.max_depth
        self.N, self.L = N, L
        t = lambda a: torch.as_tensor(a, dtype=torch.long, device=dev)  # noqa: E731
        self.depth, self.parent = t(tree.depth), t(tree.parent)
        self.first_child, self.num_children = t(tree.first_child), t(tree.num_children)
        anc = np.eye(N)
        for v in range(1, N):  # breadth-first: the parent's row is complete before the child's
            anc[v] += anc[int(tree.parent[v])]
        self.anc = torch.as_tensor(anc, dtype=dtype, device=dev)
        self.anc_t = self.anc[:, 1:].T.contiguous()  # [N-1, N]: which nodes each non-root edge lies above
        self.depth_row, self.depth1_row = self.depth[None], (self.depth + 1)[None]
        self.dm1 = self.depth[1:] - 1
        self.dcol = self.depth.clamp(max=max(L - 1, 0))[None]  # the depth column of a node's verification
        self.parent1, self.parent_c = self.parent[1:], self.parent.clamp(min=0)
        self.levels = torch.arange(L + 1, device=dev)[None]
        self.one = torch.ones((), dtype=dtype, device=dev)
        self.num_children_np = np.asarray(tree.num_children)
        self.depth_np = np.asarray(tree.depth)
        self.layer_sizes = [1] + [int(tree.layer_end[l] - tree.layer_end[l - 1]) for l in range(1, L + 1)]
        self.layer_parents = [t(tree.parent[tree.layer(l)]) for l in range(1, L + 1)]
        self.ids = torch.arange(1, N, device=dev)
        self.key_cache = None
        self.nodes = torch.arange(N, device=dev)
        self.groups, self.groups_np = [], []
        for k in sorted({int(c) for c in tree.num_children if c > 0}):
            u = [v for v in range(N) if int(tree.num_children[v]) == k]
            ch = [[int(tree.first_child[v]) + j for j in range(k)] for v in u]
            self.groups.append((k, t(u), t(ch)))
            self.groups_np.append((k, u, ch))
        kmax = int(tree.num_children.max())
        j = torch.arange(kmax, device=dev)
        self.child_ok = j[None] < self.num_children[:, None]
        self.child_pad = (self.first_child[:, None] + j[None]).clamp(max=N - 1)
        depth, internal = np.asarray(tree.depth), np.asarray(tree.num_children) > 0
        d = np.arange(L + 1)[:, None]
        self.evaluated_by_limit = {  # [L+1, N]: nodes the call evaluates when L_n = row index, per protocol
            leaves: (depth[None] <= d) & ((internal[None] & (depth[None] < d)) | leaves) for leaves in (False, True)}
        self.internal = (self.num_children > 0)[None]
        self.edge_slot = (self.ids - self.first_child[self.parent[1:]])[None]  # each child's place among its siblings
        self.groups = [(k, u, ch, self.depth[u]) for k, u, ch in self.groups]
        up = np.tile(np.arange(N)[:, None], (1, L + 1))  # [N, L+1]: the ancestor of v at depth j (v itself below it)
        for v in range(N):
            u = v
            while u >= 0:
                up[v, : int(tree.depth[u]) + 1] = u
                u = int(tree.parent[u])
        self.anc_at_depth = t(up)
        self.slots = torch.arange(HISTORY_SLOTS, device=dev)[None]


HISTORY_SLOTS = 16  # most records a draft's history may keep in the lean round (Draft.history)


def _plan(self, n: np.ndarray, exact: np.ndarray, end: int, evaluate_leaves: bool, rows: np.ndarray | None = None) -> np.ndarray:
    """Flat indices ``node * M + row`` of the states a round's batched call evaluates, from host copies of
    the rows' state indices ``n [M]`` and root flags ``exact [M]``: the nodes of ``T|_{L_n}`` the protocol
    evaluates (:meth:`_Nodes.evaluated`), without a root whose velocity is known, for live rows only (and only
    rows ``rows``, a bool ``[M]``, where given)."""
    dl = np.clip(end - n, 0, self.L)
    mask = self.evaluated_by_limit[bool(evaluate_leaves)][dl]
    mask[:, 0] &= ~exact
    mask &= (n < end)[:, None]
    if rows is not None:
        mask &= rows[:, None]
    return np.flatnonzero(mask.T)


_LeanTree.plan = _plan

COEFS = ("dt", "a", "b", "sigma", "std", "lsnr")  # the coefficients a lean round gathers per step (lsnr: drafts.table_frozen)
NC = len(COEFS)


@dataclass
class _LeanBuffers:
    """Per-run buffers of the lean round, node-major: ``states [N, M, D]``, ``residual [I, M, D]`` (the verdict
    samples of the internal nodes). ``layers``: per depth ``l``, ``(parents, parent_view, K, out_view)``:
    ``parents`` None where the layer's parents are the whole previous layer with ``K`` children each
    (``parent_view`` that layer, ``out_view`` shaped ``[P, K, M, D]``, or ``[P, M, D]`` with ``K`` None for one
    child), else the parents' node ids (``parent_view`` and ``K`` None, ``out_view [C, M, D]``). ``chunks``: the
    verification calls, ``(K, nodes [c], their slice or None, children [c, K], their slice or None, depths [c],
    whether node 0 is among them, their rows of residual)``, at most :data:`VERIFY_MEMORY` of the states' size
    of temporaries each (at least one node)."""

    states: torch.Tensor
    residual: torch.Tensor
    layers: list
    chunks: list


RESIDUAL_CACHE = 1 << 20  # largest I * M * D for which a round keeps every internal node's verdict sample
KEY_CACHE = 1 << 21  # largest M * T * N for which a run keeps every (row, root, node) key in a table
VERIFY_MEMORY = 0.1  # a verification chunk's temporaries, as a fraction of the states block ...
VERIFY_FLOOR = 1 << 20  # ... or this many elements, whichever is larger


def _as_slice(ids: list[int]) -> slice | None:
    return slice(ids[0], ids[-1] + 1) if ids == list(range(ids[0], ids[-1] + 1)) else None


def _bind(self, M: int, D: int, pool: dict | None = None) -> None:
    """Allocate :class:`_LeanBuffers` for ``M`` rows of ``D`` coordinates (``self.buffers``).

    ``pool``: optional ``{"states": flat, "residual": flat}`` storage shared by the trees of one run (their
    rounds run one after the other and keep nothing in the buffers), each at least this tree's size."""
    dev = self.anc.device
    N = self.N
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
            layers.append((None, states[pa:pb], None if k == 1 else k, out))
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
    # the verdict samples of every internal node, kept where small; else the walk's residuals are drawn
    # again for the one node per row that needs them (same keys, so the same numbers)
    if pos * M * D > RESIDUAL_CACHE:
        residual = None
    elif pool is None:
        residual = torch.empty(pos, M, D, dtype=states.dtype, device=dev)
    else:
        residual = pool["residual"][: pos * M * D].view(pos, M, D)
    self.width_groups = [(k, t(u_np[0]), torch.as_tensor(self.num_children_np == k, device=dev)) for k, u_np, _ in self.groups_np]
    self.pos_c = t(node_pos)
    self.rows = torch.arange(M, device=dev).repeat(N)  # the batch row of every node-major state
    self.buffers = _LeanBuffers(states, residual, layers, chunks)


_LeanTree.bind = _bind


def _lean_supported(tree, execution: str, draft: Draft) -> bool:
    return execution == "tree" and draft.table_mean is not None


def _contract_violation(verdict: Verdict, kids: torch.Tensor) -> torch.Tensor:
    """``[n]`` bool: the verdict breaks the contract (an accepted sample that is not the child its index
    names, or ``accepted`` that disagrees with ``index < K``); device operations only."""
    n, k = kids.shape[:2]
    flat = kids.reshape(n, k, -1)
    index = verdict.index.reshape(n)
    in_range = (index >= 0) & (index <= k)
    pick = flat[torch.arange(n, device=flat.device), index.clamp(0, k - 1)]
    same = (verdict.sample.reshape(n, -1) == pick).all(1)
    return ~in_range | (verdict.accepted.reshape(n) != (index < k)) | (verdict.accepted.reshape(n) & ~same)


def check_verdict_contract(coupling: Coupling, verdict: Verdict, kids: torch.Tensor, describe: Callable[[int], str]) -> None:
    """Raise if ``verdict`` breaks the contract of :class:`specsamp.coupling.Coupling` for ``kids [n, K, *e]``.

    Args:
        describe: row -> where it happened (step and node), for the message.

    Raises:
        ContractError: (a ``ValueError``) naming the coupling and the first offending row's step and node.
    """
    bad = _contract_violation(verdict, kids)
    if bool(bad.any()):
        r = int(bad.nonzero()[0, 0])
        k = kids.shape[1]
        raise ContractError(
            f"coupling {coupling.name!r} broke its contract at {describe(r)}: it returned accepted="
            f"{bool(verdict.accepted.reshape(-1)[r])}, index={int(verdict.index.reshape(-1)[r])} (K={k}), but an accepted "
            "sample must be exactly the child its index names and index < K must hold exactly where accepted "
            "(specsamp.coupling.Coupling); check the rule with specsamp.testing.check_exactness"
        )


class ContractError(ValueError):
    """A coupling returned a verdict that breaks the contract of :class:`specsamp.coupling.Coupling`."""


def _lean_round(ctx: _Context, lt: _LeanTree, st: _Chains, plan: torch.Tensor, plan_kind: str = "some",
                sel: torch.Tensor | None = None):
    """One round of Algorithm 1 for every row of the batch (finished rows padded), without host syncs.

    Drafting: all of the round's noise in one keyed draw (keys ``(trajectory, root, node)`` as in
    :meth:`_Nodes.draft`), the kernel coefficients of every depth gathered once from the schedule's tables,
    then per layer a gather of the parents, the draft's mean (``Draft.table_mean``) and one add: the path
    execution's operations, so both executions draft the same bits. Then one batched target call over
    all nodes; the verdicts of every internal node in one coupling call per width (each node's keys are its
    own, so the numbers are those the walk would draw); the walk is a gather (a node is on the accepted path
    iff every edge above it was the accepted one). Value checks are deferred (:func:`coupling.deferred_checks`).

    Args:
        plan: long ``[P]`` flat indices ``node * M + row`` of the states the batched call evaluates
            (:meth:`_LeanTree.plan`; the velocities of the others stay 0 and are never used).
        plan_kind: ``rest`` (every non-root node of every row; the roots' velocities are known), ``all``
            (every node of every row) or ``some``: the first two read the states in place.
        sel: optional bool ``[M]``: the rows whose round uses this tree (step-dependent trees: one lean round
            per distinct tree of the live rows); the others are padded like finished rows.

    Returns:
        ``(commit, n_new, exact_new, flags, live)``: ``commit(tally)`` writes the round's rows into ``st`` and
        ``tally`` (the other rows are left as they are then, so the rounds of several trees commit one after the
        other); ``n_new [M]`` and ``exact_new [M]`` the state indices and root flags it would write; ``flags``
        a 0-dim bool tensor, True where a deferred value check or the contract check failed (then the caller
        discards the round and repeats it with :func:`_round`, which raises the precise error); ``live [M]``
        the rows the round served.
    """
    sch, tab, draft = ctx.schedule, ctx.tables, ctx.draft
    x, n, dev, dtype = st.x, st.n, st.x.device, st.x.dtype
    M, e, N, L, T = x.shape[0], x.shape[1:], lt.N, lt.L, sch.steps
    end = sch.end_speculative
    ar = torch.arange(M, device=dev)
    live = n < end
    dl = (end - n).clamp(min=0, max=L)  # L_n (0 for finished rows)
    if sel is not None:
        live = live & sel
        dl = torch.where(live, dl, torch.zeros_like(dl))
    v_root, root_exact = st.v_root, st.root_exact
    frozen = draft.freeze(DraftRoot(x=x, v=v_root, n=n, exact=root_exact, history=st.history), sch)
    step = (n[:, None] + lt.levels).clamp(max=T - 1)  # [M, L+1]: step of depth-l nodes
    parent_step = step[:, :L]
    # every kernel coefficient of every depth in one gather: [M, L, NC] (COEFS)
    coefs = ctx.coef_table[parent_step].permute(1, 2, 0)[..., None]  # [L, NC, M, 1], node-major
    per_depth = coefs.reshape(L * NC, M, 1).unbind(0)  # [M, 1] per (depth, coefficient)
    # one keyed draw for the whole round, straight into the node-major states: node v's noise is keyed
    # (trajectory, root, v) as in _Nodes.draft; fold(k, n, v) = fold(fold(k, n), v), fold(k, n) a per-run table
    draft_keys, verify_keys = ctx.key_tables
    buf = lt.buffers
    states = buf.states  # [N, M, D]
    if lt.key_cache is not None:  # per-run tables of every (row, root, node) key
        keys, vkeys_all = lt.key_cache[0][ar, n].T, lt.key_cache[1][ar, n].T  # [N-1, M], [N, M]
    else:
        keys = rng.fold(draft_keys[ar, n][None, :], lt.ids[:, None])  # [N-1, M]
        vkeys_all = rng.fold(verify_keys[ar, n][None, :], lt.nodes[:, None])  # [N, M]: every node's verification
    rng.normal(keys, e, out=states[1:])
    states[1:] *= coefs[lt.dm1, 4]  # std z, as _Nodes.draft scales it
    states[0] = x.reshape(M, -1)
    # drafting (Algorithm 1, line 7): layer by layer with the path execution's operations, so the states
    # are the same bits; a layer whose parents all have K children adds the draft's mean of the parent layer
    # (no gather), other layers gather their parents first
    D = states.shape[2]
    if draft.table_frozen is None:
        frozen_col = frozen.reshape(1, M, D)
        frozen_at = lambda d: frozen_col  # noqa: E731
    else:  # components on a leading axis, combined once for every depth as the draft's mean combines them
        frozen_col = draft.table_frozen(frozen.reshape(M, -1, D).permute(1, 0, 2)[:, None],
                                        dict(zip(COEFS, coefs.unbind(1))))  # [L, M, D]: the parents' steps
        if isinstance(frozen_col, tuple):
            frozen_at = lambda d: tuple(f[d] for f in frozen_col)  # noqa: E731
        else:
            frozen_at = lambda d: frozen_col[d]  # noqa: E731
    for l, (parents, parent_view, k, out_view) in enumerate(buf.layers, start=1):
        c_l = dict(zip(COEFS, per_depth[NC * (l - 1) : NC * l]))
        mean = draft.table_mean(frozen_at(l - 1), parent_view if parents is None else states[parents], c_l)
        out_view += mean if k is None else mean[:, None]
    # the batched target call over the planned rows (what the reference round evaluates); where they are
    # all non-root nodes or all nodes, the call reads the states in place and its output is kept as is
    flat = states.reshape(N * M, -1)
    node_step = step[:, lt.depth].T  # [N, M]
    if plan_kind == "rest":
        v0 = v_root.reshape(M, -1)
        vrest = ctx.velocity(states[1:].reshape(-1, *e), node_step[1:].reshape(-1), lt.rows[M:]).reshape(N - 1, M, -1)
    elif plan_kind == "all":
        out_all = ctx.velocity(flat.reshape(-1, *e), node_step.reshape(-1), lt.rows).reshape(N, M, -1)
        v0, vrest = out_all[0], out_all[1:]
    else:
        full = torch.zeros_like(flat)
        if plan.numel():
            full[plan] = ctx.velocity(flat[plan].reshape(-1, *e), node_step.reshape(-1)[plan], plan % M).reshape(plan.numel(), -1)
        v0 = torch.where(root_exact[:, None], v_root.reshape(M, -1), full[:M])
        vrest = full[M:].view(N - 1, M, -1)

    # verdicts of every internal node, in chunks of nodes sized to the states' memory
    dl_col = dl[:, None]
    internal_r = lt.internal & (lt.depth_row < dl_col)  # [M, N]: verified if visited (never for finished rows)
    acc = torch.zeros(M, N, dtype=torch.bool, device=dev)
    idx = torch.zeros(M, N, dtype=torch.long, device=dev)
    res = buf.residual  # [I, M, D]: each internal node's verdict sample
    bad = torch.zeros((), dtype=torch.bool, device=dev)
    with deferred_checks() as checks:
        for k, u, u_sl, ch, ch_sl, du, has_root, pos in buf.chunks:
            c = u.numel()
            xu = states[u_sl] if u_sl is not None else states[u]  # [c, M, D]
            if has_root:
                vu = torch.cat([v0[None], vrest[u[1:] - 1]]) if c > 1 else v0[None]
            else:
                vu = vrest[u_sl.start - 1 : u_sl.stop - 1] if u_sl is not None else vrest[u - 1]
            cu = dict(zip(COEFS, coefs[du].unbind(1)))  # [c, M, 1] each
            mean_p = draft.table_mean(frozen_at(du), xu, cu)  # the path execution's operations (same bits)
            mean_q = xu + cu["dt"] * (cu["a"] * vu + cu["b"] * xu)
            need = internal_r[:, u].T  # [c, M]
            sigma = torch.where(need, cu["std"][..., 0], lt.one)
            if k == 1 and ch_sl is not None:
                kids = states[ch_sl].reshape(c * M, 1, *e)  # a view: a chain's children are one block
            else:
                kids = states[ch].permute(0, 2, 1, 3).reshape(c * M, k, *e)
            verdict = ctx.coupling(kids, mean_p.reshape(c * M, *e), mean_q.reshape(c * M, *e), sigma.reshape(-1),
                                   rng.KeyedRows(vkeys_all[u].reshape(-1)))  # line 17, every internal node at once
            acc[:, u] = verdict.accepted.reshape(c, M).T
            idx[:, u] = verdict.index.reshape(c, M).T
            if res is not None:
                res[pos] = verdict.sample.reshape(c, M, -1)
            if ctx.check_contract:
                bad = bad | (_contract_violation(verdict, kids).reshape(c, M) & need).any()
            del kids, verdict, mean_p, mean_q, xu, vu
    if checks.bad is not None:
        bad = bad | checks.bad
    # the walk, by gathers: node v is on the accepted path iff every edge above it was taken
    p = lt.parent1
    taken = acc[:, p] & (idx[:, p] == lt.edge_slot) & internal_r[:, p]  # [M, N-1]
    on_path = ((~taken).to(dtype) @ lt.anc_t) == 0  # [M, N]
    ustar = torch.argmax(on_path * lt.depth1_row, 1)  # the last node the walk reached
    rejected = internal_r[ar, ustar]  # it was verified and rejected (lines 18--20)
    finished = live & ~rejected  # walked to a leaf of T|_{L_n}
    steps = torch.where(live, lt.depth[ustar] + rejected.long(), torch.zeros_like(n))
    if res is not None:
        out = torch.where(rejected[:, None], res[lt.pos_c[ustar], ar], states[ustar, ar])
    else:
        out = _residual_again(ctx, lt, states, v0, vrest, coefs, frozen_col, vkeys_all, ustar, rejected)
    rej_col = rejected[:, None]
    last = torch.where(rejected, ustar, lt.parent_c[ustar])  # the last node the walk verified
    v_cur = torch.where((last == 0)[:, None], v0, vrest[(last - 1).clamp(min=0), ar])
    v_leaf = vrest[(ustar - 1).clamp(min=0), ar]  # where finished, u* is a leaf of depth >= 1
    # prefetch (same rules as _prefetch)
    evaluated = (lt.depth_row <= dl_col) & (internal_r | ctx.evaluate_leaves)
    v_next, exact = v_cur, torch.zeros_like(live)
    if ctx.prefetch != "none":
        exact = finished & evaluated[ar, ustar]
        v_next = torch.where(exact[:, None], v_leaf, v_next)
        if ctx.prefetch == "nearest":
            ch = lt.child_pad[ustar]  # [M, Kmax]: the siblings of the committed state
            ok = lt.child_ok[ustar] & evaluated.gather(1, ch) & rej_col
            dist = torch.linalg.vector_norm(states[ch, ar[:, None]] - out[:, None], dim=-1)
            best = torch.where(ok, dist, torch.full_like(dist, float("inf"))).argmin(1)
            v_next = torch.where(ok.any(1)[:, None], vrest[ch[ar, best] - 1, ar], v_next)  # children are never the root
    verified = on_path & internal_r
    if st.history is not None:
        hist = _lean_history(ctx, lt, st, states, v0, vrest, verified, ustar, n)
    call_rows = torch.where(live, evaluated.sum(1) - root_exact.long(), torch.zeros_like(n))
    n_new = n + steps
    exact_new = torch.where(live, exact, root_exact)
    charged = call_rows > 0  # the host's plan has a row of this trajectory exactly where charged

    def commit(tally: _Tally):
        dcol = lt.dcol.expand(M, N)
        ver, ver_acc = verified.long(), (verified & acc).long()
        tally.attempts.scatter_add_(1, dcol, ver)
        tally.accepts.scatter_add_(1, dcol, ver_acc)
        at = (n[:, None].expand(M, N), dcol)
        tally.root_attempts.index_put_(at, ver, accumulate=True)
        tally.root_accepts.index_put_(at, ver_acc, accumulate=True)
        tally.nfe += charged.long()
        tally.call_rows += call_rows
        col = tally.rounds.clamp(max=tally.committed.shape[1] - 1)[:, None]
        tally.committed.scatter_add_(1, col, steps[:, None])
        tally.rounds += live.long()
        live_e = live.reshape((-1,) + (1,) * len(e))
        st.x = torch.where(live_e, out.reshape(x.shape), st.x)  # st as it is now: another tree's round may have
        st.n = torch.where(live, n_new, st.n)                  # committed its rows since this one read it
        st.v_root = torch.where(live_e, v_next.reshape(x.shape), st.v_root)
        st.root_exact = torch.where(live, exact_new, st.root_exact)
        if st.history is not None:
            st.history = st.history.where(~live, hist)

    return commit, n_new, exact_new, bad, live


def _lean_history(ctx, lt, st, states, v0, vrest, verified, ustar, n):
    """The draft history after a lean round, by gathers: the exact data predictions the reference walk records
    (:func:`_record`: the root and every accepted internal node, the nodes ``verified`` on the path, in depth
    order) pushed in front of ``st``'s records, most recent first. Returns the :class:`DraftHistory` of every
    row (rows without a verified node keep their records)."""
    M, H = st.history.n.shape
    ar = torch.arange(M, device=n.device)[:, None]
    nv = verified.sum(1, keepdim=True)  # [M, 1] records of this round
    j = nv - 1 - lt.slots[:, :H]  # [M, H]: depth of the path node slot s records, where >= 0
    node = lt.anc_at_depth[ustar].gather(1, j.clamp(min=0))  # [M, H]
    xs = states[node, ar]  # [M, H, D]
    vs = torch.where((node == 0)[..., None], v0[:, None], vrest[(node - 1).clamp(min=0), ar])
    nn = n[:, None] + lt.depth[node]
    x0 = xs - ctx.coef_table[nn.clamp(max=ctx.schedule.steps - 1), 3][..., None] * vs  # data_prediction's operations
    return st.history.prepend(DraftHistory(x0, nn, xs), nv)


def _residual_again(ctx, lt, states, v0, vrest, coefs, frozen_col, vkeys_all, ustar, rejected) -> torch.Tensor:
    """The committed states ``[M, D]`` of a lean round that kept no verdict samples: where a row's walk stopped
    at a rejection, the verification of that node drawn again (one coupling call per node width, over every
    row: the node's own keys, so the same numbers as the first call); elsewhere the reached leaf."""
    N, M = states.shape[:2]
    e = ctx.x_event
    ar = torch.arange(M, device=states.device)
    out = states[ustar, ar]
    for k, rep, of_width in lt.width_groups:
        mine = of_width[ustar]
        w = torch.where(mine, ustar, rep)  # rows whose node has another width verify a stand-in
        xw = states[w, ar]
        vw = torch.where((w == 0)[:, None], v0, vrest[(w - 1).clamp(min=0), ar])
        cw = dict(zip(COEFS, coefs[lt.depth[w], :, ar].unbind(1)))  # [M, 1] each
        if ctx.draft.table_frozen is None:
            fr = frozen_col[0]
        elif isinstance(frozen_col, tuple):
            fr = tuple(f[lt.depth[w], ar] for f in frozen_col)
        else:
            fr = frozen_col[lt.depth[w], ar]
        mean_p = ctx.draft.table_mean(fr, xw, cw)
        mean_q = xw + cw["dt"] * (cw["a"] * vw + cw["b"] * xw)
        kids = states[lt.first_child[w][:, None] + torch.arange(k, device=w.device)[None], ar[:, None]]  # [M, k, D]
        sigma = torch.where(mine & rejected, cw["std"][:, 0], lt.one)
        verdict = ctx.coupling(kids.reshape(M, k, *e), mean_p.reshape(M, *e), mean_q.reshape(M, *e), sigma,
                               rng.KeyedRows(vkeys_all[w, ar]))
        out = torch.where((mine & rejected)[:, None], verdict.sample.reshape(M, -1), out)
    return out


def _lean_root_call(ctx: _Context, st: _Chains, tally: _Tally, rows: torch.Tensor) -> None:
    """:func:`_root_call` for the live ``rows`` the host already knows (no host sync)."""
    st.v_root[rows] = ctx.velocity(st.x[rows], st.n[rows], rows)
    st.root_exact[rows] = True
    tally.nfe[rows] += 1
    tally.call_rows[rows] += 1
    tally.batch_nfe += 1


TreeRule = DraftTree | Callable[[int], DraftTree]


def _trees_by_root(tree: TreeRule, first: int, end: int, coupling: Coupling) -> dict[int, DraftTree]:
    """``{n: T_n restricted to the steps left}`` for every root state index ``first <= n < end``.

    A callable ``tree(n)`` is called once per root index, before any sampling: the tree of a round
    depends on its root index only, so it is fixed before drafting and the coupling stays exact.
    """
    out = {}
    for n in range(first, end):
        t = tree(n) if callable(tree) else tree
        if not isinstance(t, DraftTree):
            raise ValueError(f"tree({n}) returned {type(t).__name__}, not a DraftTree")
        coupling.check_tree(t)
        if len(t) < 2:
            raise ValueError(f"the draft tree{f' of root {n}' if callable(tree) else ''} must draft at least one state (L >= 1)")
        out[n] = t.restrict(end - n)
    return out


def sample_speculative(
    model,
    schedule: Schedule,
    tree: TreeRule,
    coupling: str | Callable = "dgrs",
    n_samples: int | None = None,
    *,
    draft: str = "velocity",
    prefetch: str = "nearest",
    evaluate_leaves: bool = True,
    execution: str = "path",
    seed: int = 0,
    indices=None,
    cond: dict | None = None,
    max_batch: int | None = None,
    callback: Callable[[dict], None] | None = None,
    warmup: str = "call",
    check_contract: bool | None = None,
    refine: int = 0,
) -> SampleResult:
    """Speculative sampling on a draft tree (Algorithm 1) with any registered coupling.

    Step 0 (from sigma = 1) and step ``T - 1`` (to sigma = 0) are deterministic Euler steps; the
    speculative rounds cover steps ``1..T-2``. A round rooted at state index ``n`` uses ``T|_{L_n}``
    with ``L_n = min(L, T - 1 - n)`` (eq. 11), drafts with ``draft`` from the prefetched root velocity,
    evaluates the tree's nodes in one batched call, and walks down with ``coupling``.

    Args:
        model: velocity model.
        schedule: time grid and kernel (:class:`specsamp.schedule.Schedule`).
        tree: draft tree; the rule's ``max_children`` must admit its widths (:meth:`Coupling.check_tree`).
            Or a callable ``tree(n) -> DraftTree`` giving the tree of rounds rooted at state index ``n``
            (step-dependent trees, called once per ``n`` before sampling; exact, since a round's tree is
            fixed before it drafts). Rows with different trees in one round share one batched call in the
            accounting (``batch_nfe``), as one call over their concatenated rows would.
        coupling: registered name, a :class:`specsamp.coupling.Coupling`, or a bare ``verify`` function.
        n_samples: number of trajectories (ids ``0..n-1``) when ``indices`` is None.
        draft: registered draft name (``velocity``, ``drift``, ``x0``, ``x0_extrap``, ...; :mod:`specsamp.drafts`).
        prefetch: ``nearest``, ``parent`` or ``none``.
        evaluate_leaves: the B=|V| protocol (True) or internal nodes only (False).
        execution: ``tree`` or ``path``.
        seed: run seed.
        indices: explicit trajectory ids ``[M]``.
        cond: per-trajectory conditioning tensors ``[M, ...]``.
        max_batch: rows per forward pass of one batched call.
        callback: called after each round with ``{"round", "live", "batch_nfe", "steps_done"}``
            (``steps_done``: speculative steps committed so far, summed over trajectories).
        warmup: ``call`` (the paper's protocol: one exact target call at the first root, charged to ``nfe``) or
            ``step0`` (draft the first round from the step-0 velocity at sigma = 1; no warm-up call).
        check_contract: check every verdict at run time against the coupling contract (an accepted sample
            is exactly the child its index names; ``accepted`` exactly where ``index < K``). ``None``
            (default): on for couplings defined outside the library (a ``verify`` whose module is not
            under ``specsamp.``), off for the library's own, whose law is tested. The check is device
            operations folded into the round's one host synchronisation.
        refine: Picard sweeps ``J >= 0`` over each round's drafted tree before its verification (0: off, the
            plain drafts). Each sweep is one batched target call at the current snapshot of the round's internal
            nodes, after which the tree is rebuilt breadth-first with the same innovations from the fresh
            velocities at each node's parent; the coupling is handed the refined proposal means, so the law is
            unchanged (the argument: :meth:`_TreeNodes._picard`). At ``J >= L`` every proposal mean is the target
            kernel mean at its parent (the verifier's ``delta`` is 0 wherever the states coincide). Every sweep
            is charged to ``nfe`` and to ``target_rows``; recorded in ``SampleResult.extra["refine"]``. Tree
            execution only, and it runs the reference round (the lean round serves ``refine=0``).

    The tree execution with a draft that has a table form (``Draft.table_mean``: ``velocity``, ``drift``, ``x0``,
    ``x0_extrap``, ``x0_extrap_gated``), on a fixed tree or a tree per root step (one lean round per distinct tree
    of the live rows), runs the lean round (:func:`_lean_round`): every row of the batch in every round
    (finished rows padded, so shapes are static per tree), one keyed draw, one batched product for the
    states, one coupling call per node width, a walk by gathers, and one host synchronisation per round
    (the loop's test). Other configurations run the reference round (:func:`_round`), which the lean one
    repeats exactly where a deferred check fails, to raise the precise error.

    Returns:
        :class:`SampleResult`.

    Raises:
        NonFiniteError: (a ``ValueError``) the target or the draft produced NaN or inf states; the
            message names the trajectory, step and node, ``rows`` the trajectory ids.
        ConfigError: (a ``ValueError``) unknown coupling, draft, prefetch, execution or warmup; a tree
            wider than the coupling allows; ``refine`` not an integer >= 0, or ``refine > 0`` with
            ``execution="path"``.
        ContractError: (a ``ValueError``) with ``check_contract``, a verdict that breaks the contract; the
            message names the coupling, trajectory, step and node.
        ValueError: a tree without drafted states; bad ``n_samples`` or ``indices``.
    """
    coupling = get_coupling(coupling)
    if isinstance(tree, DraftTree):
        coupling.check_tree(tree)
        if len(tree) < 2:
            raise ValueError("the draft tree must draft at least one state (L >= 1)")
    ctx = _Context(
        schedule=schedule,
        coupling=coupling,
        draft=get_draft(draft),
        prefetch=_check_choice("prefetch", prefetch, PREFETCH),
        evaluate_leaves=bool(evaluate_leaves),
        velocity=_Velocity(model, schedule, cond, max_batch),
        check_contract=_contract_default(coupling) if check_contract is None else bool(check_contract),
    )
    _check_choice("execution", execution, EXECUTIONS)
    _check_choice("warmup", warmup, WARMUPS)
    ctx.refine = _check_refine(refine, execution)
    dev = _model_device(model)
    ctx.ids = ids = _trajectory_ids(n_samples, indices, dev)
    M, T, end = ids.numel(), schedule.steps, schedule.end_speculative
    nodes_cls = _TreeNodes if execution == "tree" else _PathNodes
    fields = ("parent", "depth", "num_children", "first_child")
    if isinstance(tree, DraftTree):
        tree = tree.restrict(end - schedule.first_speculative)  # no round can use deeper nodes
        tensors = {k: torch.as_tensor(getattr(tree, k), device=dev) for k in fields}
        tally = _Tally.zeros(M, T, tree.max_depth, dev)
    else:  # step-dependent trees: T_n per root index n, each with its tensors
        by_root = _trees_by_root(tree, schedule.first_speculative, end, coupling)
        per_root = {}  # filled where the reference round runs (the lean round keeps its own tensors)

        def reference_trees():
            if not per_root:
                per_root.update({n: (t, {k: torch.as_tensor(getattr(t, k), device=dev) for k in fields}) for n, t in by_root.items()})
            return per_root

        tally = _Tally.zeros(M, T, max(t.max_depth for t in by_root.values()), dev)

    st = _first_step(ctx, model, seed, ids, warmup, tally)
    if _lean_supported(tree, execution, ctx.draft) and ctx.refine == 0:
        if isinstance(tree, DraftTree):
            reference = lambda live: _round(ctx, tree, tensors, _TreeNodes, st, live, tally)  # noqa: E731
        else:
            reference = lambda live: _reference_groups(ctx, reference_trees(), st, live, tally)  # noqa: E731
        samples = _lean_run(ctx, tree if isinstance(tree, DraftTree) else by_root, reference, st, tally, warmup, callback)
        return _with_refine(tally.result(samples, T), 0)
    r = 0
    while True:  # line 2
        live = (st.n < end).nonzero(as_tuple=True)[0]
        if live.numel() == 0:
            break
        if prefetch == "none" or (r == 0 and warmup == "call"):
            _root_call(ctx, st, live, tally)
        if isinstance(tree, DraftTree):
            _round(ctx, tree, tensors, nodes_cls, st, live, tally)
        else:
            _reference_groups(ctx, reference_trees(), st, live, tally, nodes_cls)
        r += 1
        if callback is not None:
            callback({"round": r, "live": int(live.numel()), "batch_nfe": tally.batch_nfe,
                      "steps_done": int((st.n - schedule.first_speculative).clamp(min=0).sum())})
    return _with_refine(tally.result(_final_step(ctx, st, tally), T), ctx.refine)


def _check_refine(refine, execution: str) -> int:
    """``refine`` checked: an integer >= 0, and 0 unless ``execution == "tree"`` (each sweep needs every internal node)."""
    if isinstance(refine, bool) or not isinstance(refine, (int, np.integer)) or refine < 0:
        raise ConfigError(f"refine={refine!r} is invalid: the number of Picard sweeps per round must be an integer >= 0 "
                          "(0: plain drafts).")
    if refine > 0 and execution != "tree":
        raise ConfigError(f"refine={refine} is invalid with execution={execution}: a Picard sweep evaluates every internal "
                          "node of the drafted tree in one batched call, which only the tree execution drafts; use "
                          "execution=tree, or refine=0.")
    return int(refine)


def _with_refine(res: SampleResult, refine: int) -> SampleResult:
    res.extra["refine"] = refine
    return res


def _coef_table(tables: dict, dtype) -> torch.Tensor:
    """``[T, NC]`` the :data:`COEFS` columns in ``dtype``: the kernel's (:meth:`Schedule.tables`) and the half log-SNR
    of ``sigma`` in that dtype (what the extrapolating drafts' ``mean`` computes per call)."""
    cols = [tables[k].to(dtype) for k in COEFS[:-1]]
    return torch.stack(cols + [_lsnr_feature(cols[COEFS.index("sigma")])], 1)


def _reference_groups(ctx: _Context, per_root: dict, st: _Chains, live: torch.Tensor, tally: _Tally, nodes_cls=None) -> None:
    """The reference rounds of step-dependent trees: one group per root index (the groups' rows would share
    one batched call: charged once)."""
    calls, most = tally.batch_nfe, 0
    roots = st.n[live]
    for n in torch.unique(roots).tolist():
        before = tally.batch_nfe
        _round(ctx, *per_root[n], nodes_cls or _TreeNodes, st, live[roots == n], tally)
        most = max(most, tally.batch_nfe - before)  # 1, or 1 + refine with Picard sweeps
    tally.batch_nfe = calls + most


def _contract_default(coupling: Coupling) -> bool:
    """``check_contract``'s default: on for a coupling whose ``verify`` is defined outside ``specsamp``."""
    module = getattr(coupling.verify, "__module__", None) or ""
    return not (module == "specsamp" or module.startswith("specsamp."))


def _upload(a: np.ndarray, dev) -> torch.Tensor:
    """Host indices to the device without waiting for it (pinned, non-blocking copy on CUDA)."""
    t = torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64))
    if torch.device(dev).type == "cuda":
        return t.pin_memory().to(dev, non_blocking=True)
    return t.to(dev)


def _lean_run(ctx: _Context, tree: DraftTree | dict, reference: Callable, st: _Chains, tally: _Tally, warmup: str,
              callback) -> torch.Tensor:
    """The speculative rounds and the final step with :func:`_lean_round` (the tree execution); returns the samples.

    ``tree``: the run's fixed tree, or ``{n: T_n}`` for step-dependent trees (one lean tree per distinct ``T_n``, built
    when a round first uses it, all sharing one set of buffers). ``reference(live)`` runs the reference round(s)
    on the live rows (where a deferred check fails). Fills the lean fields of ``ctx`` (tables, keys per root).
    """
    schedule, dev = ctx.schedule, st.x.device
    M, T = st.x.shape[0], schedule.steps
    ctx.tables = schedule.tables(dev)
    ctx.x_event = tuple(st.x.shape[1:])
    ctx.coef_table = _coef_table(ctx.tables, st.x.dtype)  # [T, NC]
    steps_all = torch.arange(T, device=dev)[None]
    ctx.key_tables = (rng.fold(st.draft_keys[:, None], steps_all), rng.fold(st.verify_keys[:, None], steps_all))
    D = st.x[0].numel()
    if isinstance(tree, DraftTree):
        trees, lt_of_root, pool = [tree], np.zeros(T, dtype=np.int64), None
    else:
        trees, lt_of_root, seen = [], np.full(T, -1, dtype=np.int64), {}
        for n_root, t_n in tree.items():
            key = tuple(int(p) for p in t_n.parent)
            if key not in seen:
                seen[key] = len(trees)
                trees.append(t_n)
            lt_of_root[n_root] = seen[key]
        internal = max(int((np.asarray(t.num_children) > 0).sum()) for t in trees)
        pool = {"states": st.x.new_empty(max(len(t) for t in trees) * M * D), "residual": st.x.new_empty(internal * M * D)}
    lts = {}

    def lean_tree(g: int) -> _LeanTree:
        if g not in lts:
            lt = lts[g] = _LeanTree(trees[g], dev, st.x.dtype)
            lt.bind(M, D, pool)
            if M * T * lt.N <= KEY_CACHE:
                lt.key_cache = (rng.fold(ctx.key_tables[0][:, :, None], lt.ids[None, None]),
                                rng.fold(ctx.key_tables[1][:, :, None], lt.nodes[None, None]))
        return lts[g]

    return _lean_loop(ctx, lean_tree, lt_of_root, reference, st, tally, warmup, callback)


def _lean_loop(ctx: _Context, lean_tree: Callable, lt_of_root: np.ndarray, reference: Callable, st: _Chains, tally: _Tally,
               warmup: str, callback) -> torch.Tensor:
    """The rounds of :func:`sample_speculative` with :func:`_lean_round`, then the final step; returns the samples.

    ``lean_tree(g)``: the run's :class:`_LeanTree` number ``g``, ``lt_of_root [T]`` which one serves a round rooted at each state
    index (one tree for a fixed tree; step-dependent trees: one lean round per distinct tree of the live
    rows, committed one after the other, charged as one batched call); ``reference(live)`` runs the
    reference round(s) on the live rows.

    One host synchronisation per round: it reads whether a deferred check failed and the rows' new
    state indices and root flags. From those the host knows, before the next round, which rows are live,
    which tree each one uses and which nodes its batched call must evaluate (the same rows the reference
    round sends; finished rows and known velocities are not evaluated). Where a check failed, the round is
    discarded and repeated by the reference round on the live rows (same keys, so the same numbers), which
    raises the precise error (or, where only nodes off the walk's path were bad, commits the same round).
    """
    end = ctx.schedule.end_speculative
    dev = st.x.device
    M = st.x.shape[0]
    n_host = np.full(M, ctx.schedule.first_speculative, dtype=np.int64)  # what _first_step wrote
    exact_host = np.zeros(M, dtype=bool)
    r = 0
    while True:  # line 2; every row is live at the first round (n = 1 < T - 1)
        live_host = n_host < end
        if ctx.prefetch == "none" or (r == 0 and warmup == "call"):
            _lean_root_call(ctx, st, tally, _upload(np.flatnonzero(live_host), dev))
            exact_host = exact_host | live_host
        which = np.where(live_host, lt_of_root[np.minimum(n_host, len(lt_of_root) - 1)], -1)
        groups = np.unique(which[live_host])
        rounds, called = [], False
        n_new, exact_new = st.n, st.root_exact
        for g in groups:
            lt = lean_tree(int(g))
            mine = which == g
            plan = lt.plan(n_host, exact_host, end, ctx.evaluate_leaves, None if len(groups) == 1 else mine)
            kind = "all" if plan.size == lt.N * M else "rest" if plan.size == (lt.N - 1) * M and plan[0] == M else "some"
            plan_t = _upload(plan, dev) if kind == "some" else None  # the other kinds read the states in place
            sel = None if len(groups) == 1 else torch.from_numpy(mine).to(dev)
            commit, n_g, exact_g, bad_g, live_g = _lean_round(ctx, lt, st, plan_t, kind, sel)
            rounds.append((commit, bad_g))
            called = called or plan.size > 0
            if len(groups) == 1:
                n_new, exact_new, bad = n_g, exact_g, bad_g
            else:
                n_new, exact_new = torch.where(live_g, n_g, n_new), torch.where(live_g, exact_g, exact_new)
        if len(groups) > 1:
            bad = torch.stack([b for _, b in rounds]).any()
        payload = torch.cat([bad.long().reshape(1), n_new, exact_new.long()]).tolist()  # the one sync of the round
        if payload[0]:
            reference((st.n < end).nonzero(as_tuple=True)[0])
            n_host, exact_host = st.n.cpu().numpy(), st.root_exact.cpu().numpy()
        else:
            for commit, _ in rounds:
                commit(tally)
            tally.batch_nfe += int(called)  # a round with nothing to evaluate costs no call
            n_host = np.asarray(payload[1 : M + 1], dtype=np.int64)
            exact_host = np.asarray(payload[M + 1 :], dtype=bool)
        r += 1
        if callback is not None:
            callback({"round": r, "live": int((n_host < end).sum()), "batch_nfe": tally.batch_nfe,
                      "steps_done": int((n_host - ctx.schedule.first_speculative).clip(min=0).sum())})
        if not (n_host < end).any():
            break
    return _final_step(ctx, st, tally, _upload(np.flatnonzero(~exact_host), dev))


@dataclass
class _Tally:
    """Per-trajectory accounting of :func:`sample_speculative` (section 5's protocol); becomes the
    :class:`SampleResult`."""

    nfe: torch.Tensor  # [M] batched calls on the speculative steps (warm-up included)
    endpoint_nfe: torch.Tensor  # [M] calls of the two deterministic endpoint steps (1 or 2)
    call_rows: torch.Tensor  # [M] states the speculative calls evaluated
    rounds: torch.Tensor  # [M]
    committed: torch.Tensor  # [M, T - 2] steps committed by each round
    attempts: torch.Tensor  # [M, L] verifications per depth
    accepts: torch.Tensor  # [M, L] accepted verifications per depth
    root_attempts: torch.Tensor  # [T, L] verifications per (root state index, depth), summed over trajectories
    root_accepts: torch.Tensor  # [T, L] accepted ones
    batch_nfe: int = 0  # calls of the batch as a whole

    @classmethod
    def zeros(cls, M: int, T: int, L: int, dev) -> _Tally:
        z = lambda *shape: torch.zeros(*shape, dtype=torch.long, device=dev)  # noqa: E731
        return cls(z(M), z(M), z(M), z(M), z(M, T - 2), z(M, L), z(M, L), z(T, L), z(T, L))

    def charge(self, rows: torch.Tensor, call_rows: torch.Tensor) -> None:
        """One batched call in which trajectories ``rows`` had ``call_rows`` states each (0: not in it)."""
        charged = call_rows > 0  # the host's plan has a row of this trajectory exactly where charged
        self.nfe[rows] += charged.long()
        self.call_rows[rows] += call_rows
        self.batch_nfe += int(bool(charged.any()))

    def result(self, samples: torch.Tensor, T: int) -> SampleResult:
        return SampleResult(
            samples=samples, nfe=self.nfe, nfe_total=self.endpoint_nfe + self.nfe, target_rows=self.call_rows,
            rounds=self.rounds, committed=self.committed, attempts=self.attempts, accepts=self.accepts,
            speculative_steps=T - 2, batch_nfe=self.batch_nfe, attempts_by_root=self.root_attempts,
            accepts_by_root=self.root_accepts,
        )


@dataclass
class _Chains:
    """The ``M`` trajectories between rounds."""

    x: torch.Tensor  # [M, *e] current states Y_n
    n: torch.Tensor  # [M] their state index
    v_root: torch.Tensor  # [M, *e] velocity the next round drafts from
    root_exact: torch.Tensor  # [M] bool: v_root is x's own exact velocity
    draft_keys: torch.Tensor  # [M]
    verify_keys: torch.Tensor  # [M]
    history: DraftHistory | None = None  # [M, H, ...] exact records along the trajectories (drafts with history)


def _first_step(ctx: _Context, model, seed: int, ids: torch.Tensor, warmup: str, tally: _Tally) -> _Chains:
    """Step 0, a deterministic Euler step from sigma = 1 (Algorithm 1, line 1: the chain's first state)."""
    dev = ids.device
    M = ids.numel()
    x = initial_noise(seed, ids, model.event_shape, model.dtype)
    n = torch.zeros(M, dtype=torch.long, device=dev)
    v0 = ctx.velocity(x, n, torch.arange(M, device=dev))
    tally.endpoint_nfe += 1
    # warmup=step0 drafts the first round from the step-0 velocity (at sigma = 1, so not exact at the root)
    st = _Chains(
        x=ctx.schedule.mean(x, v0, n),
        n=n + 1,
        v_root=v0 if warmup == "step0" else torch.zeros_like(x),
        root_exact=torch.zeros(M, dtype=torch.bool, device=dev),
        draft_keys=rng.base_key(seed, ids, "draft", device=dev),
        verify_keys=rng.base_key(seed, ids, "verify", device=dev),
    )
    H = ctx.draft.history
    if H > 0:  # the step-0 state's exact data prediction opens the trajectory's history
        st.history = DraftHistory.empty(x, H)
        st.history.push(torch.arange(M, device=dev), data_prediction(x, v0, n, ctx.schedule), n, x)
    return st


def _root_call(ctx: _Context, st: _Chains, live: torch.Tensor, tally: _Tally) -> None:
    """The roots' exact velocities in a call of their own: the warm-up at the first round (warmup=call,
    charged to ``nfe``), and every round with prefetch=none."""
    st.v_root[live] = ctx.velocity(st.x[live], st.n[live], live)
    st.root_exact[live] = True
    tally.charge(live, torch.ones_like(live))


def _round(ctx: _Context, tree: DraftTree, tensors: dict, nodes_cls, st: _Chains, live: torch.Tensor, tally: _Tally) -> None:
    """One round (Algorithm 1, lines 3--24) for the ``live`` trajectories; updates ``st`` and ``tally``."""
    # line 3: L_n = min(L, N - n) and T_n = T|_{L_n}, with N the end of speculation
    hist = None if st.history is None else st.history.take(live)
    root = DraftRoot(x=st.x[live], v=st.v_root[live], n=st.n[live], exact=st.root_exact[live], history=hist)
    rnd = _Round(
        rows=live,
        x=st.x[live],
        n=st.n[live],
        depth_limit=(ctx.schedule.end_speculative - st.n[live]).clamp(max=tree.max_depth),
        frozen=ctx.draft.freeze(root, ctx.schedule),
        v_root=root.v,
        root_exact=root.exact,
        draft_keys=st.draft_keys[live],
        verify_keys=st.verify_keys[live],
        history=None if hist is None else hist.clone(),  # the walk records into its own copy
    )
    nodes = nodes_cls(tree, tensors, rnd, ctx)  # lines 4--13: drafting and (tree execution) the batched call
    new_x, steps, (v_next, exact_next) = _walk(nodes, rnd, ctx, tally)  # lines 14--23
    for rows in getattr(nodes, "sweep_rows", ()):  # Picard sweeps (refine): one batched call each
        tally.charge(live, rows)
    tally.charge(live, nodes.call_rows)  # a round with nothing to evaluate costs no call
    tally.committed[live, tally.rounds[live]] = steps
    tally.rounds[live] += 1
    st.x[live] = new_x
    st.n[live] += steps  # line 24
    st.v_root[live] = v_next
    st.root_exact[live] = exact_next
    if st.history is not None:
        st.history.put(live, rnd.history)


def _final_step(ctx: _Context, st: _Chains, tally: _Tally, need_rows: torch.Tensor | None = None) -> torch.Tensor:
    """Step ``T - 1``, a deterministic Euler step to sigma = 0; reuses an exact velocity the last round left.

    ``need_rows``: the rows without an exact velocity, when the caller already knows them (no host sync)."""
    M = st.x.shape[0]
    last = torch.full((M,), ctx.schedule.steps - 1, dtype=torch.long, device=st.x.device)
    v_last = st.v_root.clone()
    need = ~st.root_exact
    if need_rows is not None:
        w = need_rows
    elif bool(need.any()):
        w = need.nonzero(as_tuple=True)[0]
    else:
        w = None
    if w is not None and w.numel():
        v_last[w] = ctx.velocity(st.x[w], last[w], w)
        tally.endpoint_nfe[w] += 1
    return ctx.schedule.mean(st.x, v_last, last)
