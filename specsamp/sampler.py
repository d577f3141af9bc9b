"""Samplers: the standard Euler--Maruyama chain and speculative sampling on draft trees (Algorithm 1).

Both are plain functions of ``(model, schedule, ...)`` in the k-diffusion style. Trajectories are
batched: one batched target call serves every live trajectory of a round. All randomness is keyed by
``(seed, trajectory index, step, node)`` (:mod:`specsamp.rng`), so the random numbers of a trajectory do
not depend on the batch it ran in, and the two executions of the speculative sampler draw identical
numbers. A trajectory's counts are then equal bitwise across executions, ``max_batch``, batches and index
subsets; its sample is equal to the rounding of the model's batched evaluation (a row's output may
differ in the last bits with its batch), not bitwise (README, "What is equal across splits"):

- ``tree``: draft every node of ``T|_{L_n}``, evaluate all of them in one batched target call, then walk
  (what runs on a GPU);
- ``path``: draft and evaluate only what the acceptance walk visits (cheap sweeps on analytic targets).

They share the drafting, verification walk, prefetch and accounting code below; they differ only in
how a node's state and velocity are obtained (:class:`_TreeNodes` and :class:`_PathNodes`).

Accounting (the paper's protocol, section 5; ``docs/protocol.md``): ``nfe`` counts batched target
calls on the speculative steps ``1..T-2``, the warm-up call at the first root included;
``speedup = (T - 2) / nfe``. ``nfe_total`` adds the two deterministic endpoint steps. ``target_rows``
counts the states the speculative calls evaluated.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from . import rng
from .coupling import Coupling, NonFiniteError, get_coupling
from .drafts import Draft, DraftRoot, data_prediction, get_draft
from .errors import ConfigError
from .models.base import batched
from .schedule import Schedule, per_row
from .trees import DraftTree

PREFETCH = ("nearest", "parent", "none")
EXECUTIONS = ("tree", "path")
WARMUPS = ("call", "step0")


@dataclass
class SampleResult:
    """What a sampler returns, per trajectory.

    Attributes:
        samples: ``[M, *event]`` final states (sigma = 0).
        nfe: ``[M]`` batched target calls on the speculative steps ``1..T-2`` (warm-up included).
        nfe_total: ``[M]`` all batched target calls, the two endpoint steps included.
        target_rows: ``[M]`` states evaluated by the speculative calls.
        rounds: ``[M]`` speculative rounds.
        committed: ``[M, R]`` steps committed by each round (0-padded).
        attempts: ``[M, L]`` verifications attempted at each depth.
        accepts: ``[M, L]`` verifications that accepted a child at each depth.
        speculative_steps: ``T - 2``.
        batch_nfe: batched calls the whole batch spent on speculative steps (its slowest member).
        attempts_by_root: ``[T, L]`` verifications attempted at each depth by rounds rooted at each state
            index ``n``, summed over trajectories (per-step calibration; None from the standard sampler).
        accepts_by_root: ``[T, L]`` accepted verifications, likewise.
    """

    samples: torch.Tensor
    nfe: torch.Tensor
    nfe_total: torch.Tensor
    target_rows: torch.Tensor
    rounds: torch.Tensor
    committed: torch.Tensor
    attempts: torch.Tensor
    accepts: torch.Tensor
    speculative_steps: int
    batch_nfe: int = 0
    extra: dict = field(default_factory=dict)
    attempts_by_root: torch.Tensor | None = None
    accepts_by_root: torch.Tensor | None = None

    @property
    def speedup(self) -> torch.Tensor:
        """Per-trajectory NFE speedup ``(T - 2) / nfe`` (float64 ``[M]``)."""
        return self.speculative_steps / self.nfe.double()

    @property
    def batch_speedup(self) -> float:
        """Speedup of the batch as a whole: ``(T - 2) / batch_nfe``."""
        return self.speculative_steps / max(self.batch_nfe, 1)


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
    hist_x0: torch.Tensor | None = None  # [m, H, *e] the draft's history (DraftRoot.hist_x0); None when H = 0
    hist_n: torch.Tensor | None = None  # [m, H]
    hist_x: torch.Tensor | None = None  # [m, H, *e] the states of those records (DraftRoot.hist_x)


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

    def children(self, sub, x_u, u, k, step):
        ids = self.child_ids(u, k)
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
    if rnd.hist_x0 is None:
        return
    _push_history(rnd.hist_x0, rnd.hist_n, rnd.hist_x, rows, data_prediction(x, v, n, ctx.schedule), n, x)


def _push_history(hist_x0: torch.Tensor, hist_n: torch.Tensor, hist_x: torch.Tensor, rows: torch.Tensor, x0: torch.Tensor,
                  n: torch.Tensor, x: torch.Tensor) -> None:
    """Shift rows ``rows`` of ``hist_x0 [M, H, *e]``, ``hist_n [M, H]``, ``hist_x [M, H, *e]`` back one slot and
    write ``x0``, ``n``, ``x`` in front."""
    if hist_x0.shape[1] > 1:
        hist_x0[rows, 1:] = hist_x0[rows, :-1].clone()
        hist_n[rows, 1:] = hist_n[rows, :-1].clone()
        hist_x[rows, 1:] = hist_x[rows, :-1].clone()
    hist_x0[rows, 0] = x0
    hist_n[rows, 0] = n
    hist_x[rows, 0] = x


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

    Returns:
        :class:`SampleResult`.

    Raises:
        NonFiniteError: (a ``ValueError``) the target or the draft produced NaN or inf states; the
            message names the trajectory, step and node, ``rows`` the trajectory ids.
        ConfigError: (a ``ValueError``) unknown coupling, draft, prefetch, execution or warmup; a tree
            wider than the coupling allows.
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
    )
    _check_choice("execution", execution, EXECUTIONS)
    _check_choice("warmup", warmup, WARMUPS)
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
        per_root = {n: (t, {k: torch.as_tensor(getattr(t, k), device=dev) for k in fields}) for n, t in by_root.items()}
        tally = _Tally.zeros(M, T, max(t.max_depth for t in by_root.values()), dev)

    st = _first_step(ctx, model, seed, ids, warmup, tally)
    r = 0
    while True:  # line 2
        live = (st.n < end).nonzero(as_tuple=True)[0]
        if live.numel() == 0:
            break
        if prefetch == "none" or (r == 0 and warmup == "call"):
            _root_call(ctx, st, live, tally)
        if isinstance(tree, DraftTree):
            _round(ctx, tree, tensors, nodes_cls, st, live, tally)
        else:  # one group per root index (the groups' rows would share one batched call: charged once)
            calls = tally.batch_nfe
            roots = st.n[live]
            for n in torch.unique(roots).tolist():
                _round(ctx, *per_root[n], nodes_cls, st, live[roots == n], tally)
            tally.batch_nfe = calls + int(tally.batch_nfe > calls)
        r += 1
        if callback is not None:
            callback({"round": r, "live": int(live.numel()), "batch_nfe": tally.batch_nfe,
                      "steps_done": int((st.n - schedule.first_speculative).clamp(min=0).sum())})
    return tally.result(_final_step(ctx, st, tally), T)


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
        charged = call_rows > 0
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
    hist_x0: torch.Tensor | None = None  # [M, H, *e] exact data predictions along the trajectory (drafts with history)
    hist_n: torch.Tensor | None = None  # [M, H] their state indices, -1 = empty
    hist_x: torch.Tensor | None = None  # [M, H, *e] the states of those records


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
        st.hist_x0 = x.new_zeros((M, H) + tuple(x.shape[1:]))
        st.hist_n = torch.full((M, H), -1, dtype=torch.long, device=dev)
        st.hist_x = x.new_zeros((M, H) + tuple(x.shape[1:]))
        _push_history(st.hist_x0, st.hist_n, st.hist_x, torch.arange(M, device=dev), data_prediction(x, v0, n, ctx.schedule), n, x)
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
    hist_x0 = None if st.hist_x0 is None else st.hist_x0[live]
    hist_n = None if st.hist_n is None else st.hist_n[live]
    hist_x = None if st.hist_x is None else st.hist_x[live]
    root = DraftRoot(x=st.x[live], v=st.v_root[live], n=st.n[live], exact=st.root_exact[live], hist_x0=hist_x0, hist_n=hist_n,
                     hist_x=hist_x)
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
        hist_x0=None if hist_x0 is None else hist_x0.clone(),  # the walk records into its own copy
        hist_n=None if hist_n is None else hist_n.clone(),
        hist_x=None if hist_x is None else hist_x.clone(),
    )
    nodes = nodes_cls(tree, tensors, rnd, ctx)  # lines 4--13: drafting and (tree execution) the batched call
    new_x, steps, (v_next, exact_next) = _walk(nodes, rnd, ctx, tally)  # lines 14--23
    tally.charge(live, nodes.call_rows)  # a round with nothing to evaluate costs no call
    tally.committed[live, tally.rounds[live]] = steps
    tally.rounds[live] += 1
    st.x[live] = new_x
    st.n[live] += steps  # line 24
    st.v_root[live] = v_next
    st.root_exact[live] = exact_next
    if st.hist_x0 is not None:
        st.hist_x0[live] = rnd.hist_x0
        st.hist_n[live] = rnd.hist_n
        st.hist_x[live] = rnd.hist_x


def _final_step(ctx: _Context, st: _Chains, tally: _Tally) -> torch.Tensor:
    """Step ``T - 1``, a deterministic Euler step to sigma = 0; reuses an exact velocity the last round left."""
    M = st.x.shape[0]
    last = torch.full((M,), ctx.schedule.steps - 1, dtype=torch.long, device=st.x.device)
    v_last = st.v_root.clone()
    need = ~st.root_exact
    if bool(need.any()):
        w = need.nonzero(as_tuple=True)[0]
        v_last[w] = ctx.velocity(st.x[w], last[w], w)
        tally.endpoint_nfe[w] += 1
    return ctx.schedule.mean(st.x, v_last, last)
