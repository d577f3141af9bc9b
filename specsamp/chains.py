"""The batch of trajectories between rounds, and the round's policy both layouts share (``docs/architecture.md``).

Round internals: the private names of ``chains``, ``rounds``, ``lean`` and ``leantree`` are imported only by those
modules, :mod:`specsamp.sampler` and :mod:`specsamp.compiled`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from . import arguments, rng
from .arguments import network_output
from .batching import batched, row_reduce
from .coupling import Coupling
from .drafts import Draft, DraftHistory, data_prediction
from .result import SampleResult
from .schedule import Schedule


class _Velocity:
    """Target evaluations ``v(x, sigma_n)`` for rows of given trajectories, with their conditioning."""

    def __init__(self, model, schedule: Schedule, cond: dict | None, max_batch: int | None):
        self.model, self.schedule, self.cond, self.max_batch = model, schedule, cond or {}, max_batch

    def __call__(self, x: torch.Tensor, n: torch.Tensor, traj: torch.Tensor) -> torch.Tensor:
        sigma = self.schedule.sigmas.to(x.device)[n]
        cond = {k: c[traj] for k, c in self.cond.items()}
        return network_output(batched(self.model, x, sigma, self.max_batch, cond), x.shape).to(x.dtype)


def initial_noise(seed: int, ids: torch.Tensor, event_shape, dtype) -> torch.Tensor:
    """Initial states ``x ~ N(0, I)`` at ``sigma = 1``, ``[M, *event_shape]`` in ``dtype`` on the device of ``ids``
    (``[M]`` long trajectory ids; ``seed`` in ``[0, rng.MAX_SEED]``). Row ``i`` depends on ``(seed, ids[i])`` only
    (:mod:`specsamp.rng`), so samplers run with the same seed start from the same noise."""
    keys = rng.base_key(seed, ids, "init", device=ids.device)
    return rng.normal(keys, event_shape, dtype=dtype)


@dataclass
class _Context:
    """What every round of one speculative run reads: the kernel, the rules, the target, and (lean round) tables."""

    schedule: Schedule
    coupling: Coupling
    draft: Draft
    prefetch: str
    evaluate_leaves: bool
    velocity: _Velocity
    ids: torch.Tensor | None = None  # [M] trajectory ids (for messages)
    coef_table: torch.Tensor | None = None  # [T, C] the kernel's coefficient table in the states' dtype (lean round)
    key_tables: tuple | None = None  # (draft, verify) keys folded with every root index: [M, T] each
    x_event: tuple = ()  # event shape of the states
    check_contract: bool = False  # check every verdict against the coupling contract
    refine: int = 0  # Picard sweeps over the drafted tree before verification (tree execution only)
    compiled: bool = False  # the lean round runs under torch.compile (specsamp.compiled)
    step_keys: torch.Tensor | None = None  # [M] the standard sampler's step keys (kernels with noisy endpoints)


def round_masks(depth, has_children, depth_limit, evaluate_leaves: bool):
    """``(internal, evaluated)`` masks of nodes at ``depth`` (children where ``has_children``) in ``T|_{L_n}``,
    ``L_n = depth_limit``: verified where the walk reaches them; rows of the round's call (all with ``evaluate_leaves``,
    B=|V|; else the internal ones), known roots still in. Torch or numpy, broadcasting; the one rule, every layout."""
    internal = (depth < depth_limit) & has_children
    return internal, (depth <= depth_limit) & (internal | evaluate_leaves)


def count_verifications(tally: _Tally, n: torch.Tensor, cols: torch.Tensor, ver: torch.Tensor, acc: torch.Tensor,
                        rows: torch.Tensor | None = None) -> None:
    """Section 5's verification counts of a round, per row and depth and per (root index, depth): ``ver``, ``acc``
    ``[m, X]`` (long, 0/1) verifications made and accepted, ``cols [m, X]`` their depth column (the verified
    node's depth), for batch rows ``rows [m]`` (distinct; None: all) of rounds rooted at ``n [m]``."""
    if rows is None:
        tally.attempts.scatter_add_(1, cols, ver)
        tally.accepts.scatter_add_(1, cols, acc)
    else:
        mine = (rows[:, None].expand_as(cols), cols)
        tally.attempts.index_put_(mine, ver, accumulate=True)
        tally.accepts.index_put_(mine, acc, accumulate=True)
    at = (n[:, None].expand_as(cols), cols)
    tally.root_attempts.index_put_(at, ver, accumulate=True)
    tally.root_accepts.index_put_(at, acc, accumulate=True)


def commit_round(st: _Chains, tally: _Tally, live: torch.Tensor, x: torch.Tensor, n_new: torch.Tensor, steps: torch.Tensor,
                 v: torch.Tensor, exact: torch.Tensor, history=None) -> None:
    """Algorithm 1, line 24, for the rows a round served: state ``x``, index ``n_new``, next root velocity ``v``
    and its ``exact`` flag, the draft's history, the committed ``steps`` and the round count. Sparse: ``live``
    long ``[m]`` (distinct), values for those rows, written in place. Dense: ``live`` bool ``[M]``, values for every
    row (rows outside it keep theirs, ``steps`` 0), assigned anew: another tree's round may have committed since."""
    if live.dtype == torch.bool:
        tally.committed.scatter_add_(1, tally.rounds.clamp(max=tally.committed.shape[1] - 1)[:, None], steps[:, None])
        tally.rounds += live
        live_e = live.reshape((-1,) + (1,) * (st.x.ndim - 1))
        st.x, st.n = torch.where(live_e, x, st.x), torch.where(live, n_new, st.n)
        st.v_root, st.root_exact = torch.where(live_e, v, st.v_root), torch.where(live, exact, st.root_exact)
        if st.history is not None:
            st.history = st.history.where(~live, history)
        return
    tally.committed[live, tally.rounds[live]] = steps
    tally.rounds[live] += 1
    st.x[live], st.n[live], st.v_root[live], st.root_exact[live] = x, n_new, v, exact
    if st.history is not None:
        st.history.put(live, history)


def leaf_prefetch(prefetch: str, finished: torch.Tensor, leaf_evaluated: Callable[[], torch.Tensor]) -> torch.Tensor:
    """The prefetch rules' leaf half, ``exact [m]``: rows whose walk finished (``finished [m]``) at a leaf the
    call evaluated (``leaf_evaluated()``, asked only when read) take its velocity, exact; ``prefetch=none``:
    none (the next round calls its root). Elsewhere the last verified node's, or :func:`nearest_sibling`'s."""
    if prefetch == "none":
        return torch.zeros_like(finished)
    return finished & leaf_evaluated()


def nearest_sibling(ok: torch.Tensor, kids: torch.Tensor, x: torch.Tensor, inf) -> tuple[torch.Tensor, torch.Tensor]:
    """``prefetch=nearest`` where a walk stopped at a rejection: of the stopped node's children ``kids [r, K, ...]``
    the call evaluated (``ok [r, K]``), the nearest (Euclidean) to the committed state ``x [r, ...]``. Returns
    ``(has [r], best [r])``: whether there is one, and its index. The other rules: :func:`leaf_prefetch`."""
    d = kids - x[:, None]
    dist = row_reduce(lambda t: torch.linalg.vector_norm(t, dim=-1), d if d.ndim == 3 else d.reshape(*ok.shape, -1))
    return ok.any(1), torch.where(ok, dist, inf).argmin(1)


@dataclass
class _Tally:
    """Section 5's per-trajectory counts of a speculative run; :meth:`result` makes the :class:`SampleResult`."""

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

    def charge(self, rows: torch.Tensor | None, call_rows: torch.Tensor, batch: bool = True) -> None:
        """One batched call in which rows ``rows`` (None: all) had ``call_rows`` states each (0: not in it).
        ``batch``: count it in ``batch_nfe`` here (one host sync); the dense layout counts from its host plan."""
        charged = call_rows > 0  # the host's plan has a row of this trajectory exactly where charged
        if rows is None:
            self.nfe += charged
            self.call_rows += call_rows
        else:
            self.nfe[rows] += charged.long()
            self.call_rows[rows] += call_rows
        if batch:
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


def initial_state(schedule: Schedule, seed: int, ids: torch.Tensor, event_shape, dtype, init=None) -> torch.Tensor:
    """The first states ``[M, *event]``: ``init`` where given (on the linear path at ``sigmas[0]``; ValueError
    unless of that shape), else :func:`initial_noise` times the kernel's initial scale where it has one. Binds
    the event shape to the kernel first (:meth:`specsamp.kernels.Kernel.bind_event`)."""
    schedule.kernel.bind_event(event_shape)
    if init is not None:
        x = arguments.states("init", init).to(device=ids.device, dtype=dtype)
        if tuple(x.shape) != (ids.numel(), *event_shape):
            raise ValueError(f"init has shape {tuple(x.shape)}: need {(ids.numel(), *event_shape)} (trajectories, event)")
        return x.clone()
    x = initial_noise(seed, ids, event_shape, dtype)
    scale = schedule.initial_scale()
    return x if scale is None else x * scale


def endpoint_noise(ctx: _Context, x: torch.Tensor, n: int) -> torch.Tensor:
    """``x`` plus the kernel's noise of endpoint step ``n`` (0 or ``T - 1``) where the kernel has one there,
    keyed as the standard sampler keys its step ``n``; ``x`` itself for Euler--Maruyama (no noise, no bits)."""
    std = float(ctx.schedule.std(torch.tensor([n]))[0]) if ctx.schedule.stochastic_endpoints else 0.0
    return x if std == 0.0 else x + std * rng.normal(rng.fold(ctx.step_keys, n), tuple(x.shape[1:]), dtype=x.dtype)


def _first_step(ctx: _Context, model, seed: int, ids: torch.Tensor, warmup: str, tally: _Tally, init=None) -> _Chains:
    """Step 0 (Algorithm 1, line 1): deterministic Euler from sigma = 1 for Euler--Maruyama, else the scheduler's."""
    dev, M = ids.device, ids.numel()
    x = initial_state(ctx.schedule, seed, ids, model.event_shape, model.dtype, init)
    n, rows = torch.zeros(M, dtype=torch.long, device=dev), torch.arange(M, device=dev)
    v0 = ctx.velocity(x, n, rows)
    tally.endpoint_nfe += 1
    if ctx.schedule.stochastic_endpoints:
        ctx.step_keys = rng.base_key(seed, ids, "step", device=dev)
    # warmup=step0 drafts the first round from the step-0 velocity (at sigma = 1, so not exact at the root)
    st = _Chains(
        x=endpoint_noise(ctx, ctx.schedule.mean(x, v0, n), 0),
        n=n + 1,
        v_root=v0 if warmup == "step0" else torch.zeros_like(x),
        root_exact=torch.zeros(M, dtype=torch.bool, device=dev),
        draft_keys=rng.base_key(seed, ids, "draft", device=dev),
        verify_keys=rng.base_key(seed, ids, "verify", device=dev),
    )
    H = ctx.draft.history
    if H > 0:  # the step-0 state's exact data prediction opens the trajectory's history
        st.history = DraftHistory.empty(x, H)
        st.history.push(rows, data_prediction(x, v0, n, ctx.schedule), n, x)
    return st


def _root_call(ctx: _Context, st: _Chains, live: torch.Tensor, tally: _Tally) -> None:
    """The roots' exact velocities in a call of their own (the warm-up, charged to ``nfe``; every prefetch=none round).
    ``live`` is never empty (the loop stops first), so the call is charged without asking the device."""
    st.v_root[live] = ctx.velocity(st.x[live], st.n[live], live)
    st.root_exact[live] = True
    tally.nfe[live] += 1
    tally.call_rows[live] += 1
    tally.batch_nfe += 1


def run_rounds(ctx: _Context, st: _Chains, tally: _Tally, warmup: str, callback, layout) -> torch.Tensor:
    """The loop over rounds (Algorithm 1, line 2; ``docs/architecture.md``, "The round as one diagram"), then the last
    step; returns the samples. ``layout`` (:class:`specsamp.rounds.SparseLayout`, :class:`specsamp.lean.DenseLayout`)
    gives the live rows (``live()``, None when none is), calls their roots (``root_call``), runs the ``round``, reports
    ``progress`` and, where known without asking the device, the rows the last step must evaluate (``need_rows()``)."""
    r = 0
    while (live := layout.live()) is not None:
        if ctx.prefetch == "none" or (r == 0 and warmup == "call"):
            layout.root_call(live)
        layout.round(live)
        r += 1
        if callback is not None:
            callback(layout.progress(r, live))
    return _final_step(ctx, st, tally, layout.need_rows())


def _final_step(ctx: _Context, st: _Chains, tally: _Tally, need_rows: torch.Tensor | None = None) -> torch.Tensor:
    """Step ``T - 1``, a deterministic Euler step to sigma = 0, reusing an exact velocity the last round left;
    ``need_rows``: the rows without one, where the caller knows them (no host sync)."""
    T1 = ctx.schedule.steps - 1
    last = torch.full((st.x.shape[0],), T1, dtype=torch.long, device=st.x.device)
    v_last = st.v_root.clone()
    w = (~st.root_exact).nonzero(as_tuple=True)[0] if need_rows is None else need_rows
    if w.numel():
        v_last[w] = ctx.velocity(st.x[w], last[w], w)
        tally.endpoint_nfe[w] += 1
    return endpoint_noise(ctx, ctx.schedule.mean(st.x, v_last, last), T1)
