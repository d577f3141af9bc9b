"""The run's context, the batch of trajectories between rounds, and the round's policy both layouts share
(``docs/architecture.md``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..arguments import network_output
from ..batching import batched, row_reduce
from ..coupling import Coupling
from ..drafts import Draft, DraftHistory
from ..result import SampleResult
from ..schedule import Schedule


class Velocity:
    """Target evaluations ``v(x, sigma_n)`` for rows of given trajectories, with their conditioning."""

    def __init__(self, model, schedule: Schedule, cond: dict | None, max_batch: int | None):
        self.model, self.schedule, self.cond, self.max_batch = model, schedule, cond or {}, max_batch

    def __call__(self, x: torch.Tensor, n: torch.Tensor, traj: torch.Tensor) -> torch.Tensor:
        sigma = self.schedule.sigmas.to(x.device)[n]
        cond = {k: c[traj] for k, c in self.cond.items()}
        return network_output(batched(self.model, x, sigma, self.max_batch, cond), x.shape).to(x.dtype)


@dataclass(frozen=True)
class Context:
    """What every round of one speculative run reads, fixed before the first step (:func:`build_context`): the kernel,
    the rules, the target, the run's keys and (dense round) its tables. Frozen: nothing is assigned to it afterwards."""

    schedule: Schedule
    coupling: Coupling  # as the round calls it (compiled: :func:`specsamp.round.compiled.for_compile`'s)
    draft: Draft
    prefetch: str
    evaluate_leaves: bool
    velocity: Velocity
    ids: torch.Tensor  # [M] trajectory ids (for messages)
    draft_keys: torch.Tensor  # [M] each trajectory's draft stream key
    verify_keys: torch.Tensor  # [M] each trajectory's verification stream key
    step_keys: torch.Tensor | None = None  # [M] the standard sampler's step keys (kernels with noisy endpoints)
    check_contract: bool = False  # check every verdict against the coupling contract
    refine: int = 0  # Picard sweeps over the drafted tree before verification (tree execution only)
    compiled: bool = False  # the dense round runs under torch.compile (specsamp.round.compiled)
    draft_form: str = "loop"  # the dense round drafts layer by layer, or "closed" (specsamp.round.split.closed_draft)
    x_event: tuple = ()  # event shape of the states
    coef_table: torch.Tensor | None = None  # [T, C] the kernel's coefficient table in the states' dtype (dense round)
    key_tables: tuple | None = None  # (draft, verify) keys folded with every root index: [M, T] each (dense round)


def build_context(
    schedule: Schedule, velocity: Velocity, ids: torch.Tensor, seed: int, rules: dict, dense: tuple | None
) -> Context:
    """The run's :class:`Context`, every field set here once: ``rules``, the :class:`Context` fields ``coupling``,
    ``draft``, ``prefetch``, ``evaluate_leaves``, ``check_contract``, ``refine``, ``compiled`` (the coupling as the round
    calls it); the keys of trajectories ``ids [M]`` under ``seed`` (:func:`specsamp.rng.base_key`: ``draft``,
    ``verify``, and ``step`` where the kernel's endpoint steps are noisy); ``dense``: ``(event_shape, dtype)`` of the
    states for the dense round (its coefficient table and per-root key tables ``[M, T]``), None for the sparse one."""
    from .. import rng

    dev, T = ids.device, schedule.steps
    keys = {name: rng.base_key(seed, ids, name, device=dev) for name in ("draft", "verify")}
    step_keys = rng.base_key(seed, ids, "step", device=dev) if schedule.stochastic_endpoints else None
    extra = {}
    if dense is not None:
        steps_all = torch.arange(T, device=dev)[None]
        extra = dict(
            x_event=tuple(dense[0]),
            coef_table=schedule.kernel.table(dev, dense[1]),
            key_tables=tuple(rng.round_keys(keys[k][:, None], steps_all) for k in ("draft", "verify")),
        )
    return Context(
        schedule=schedule,
        velocity=velocity,
        ids=ids,
        draft_keys=keys["draft"],
        verify_keys=keys["verify"],
        step_keys=step_keys,
        **rules,
        **extra,
    )


def round_masks(depth, has_children, depth_limit, evaluate_leaves: bool):
    """``(internal, evaluated)`` masks of nodes at ``depth`` (children where ``has_children``) in ``T|_{L_n}``,
    ``L_n = depth_limit``: verified where the walk reaches them; rows of the round's call (all with ``evaluate_leaves``,
    B=|V|; else the internal ones), known roots still in. Torch or numpy, broadcasting; the one rule, every layout."""
    internal = (depth < depth_limit) & has_children
    return internal, (depth <= depth_limit) & (internal | evaluate_leaves)


def count_verifications(
    tally: Tally,
    n: torch.Tensor,
    cols: torch.Tensor,
    ver: torch.Tensor,
    acc: torch.Tensor,
    rows: torch.Tensor | None = None,
) -> None:
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


class Commit(NamedTuple):
    """What a round commits for the rows it served (Algorithm 1, line 24): states ``x``, indices ``n``, the
    committed ``steps``, the next root velocities ``v`` and their ``exact`` flags, the draft's ``history`` (or None),
    a multistep kernel's ``past`` (:attr:`Chains.past`; or None)."""

    x: torch.Tensor
    n: torch.Tensor
    steps: torch.Tensor
    v: torch.Tensor
    exact: torch.Tensor
    history: DraftHistory | None = None
    past: tuple | None = None


def commit_round(st: Chains, tally: Tally, live: torch.Tensor, new: Commit) -> None:
    """Algorithm 1, line 24, for the rows a round served: ``new`` written into ``st``, its committed steps and the
    round count into ``tally``. Sparse: ``live`` long ``[m]`` (distinct), values for those rows, written in place.
    Dense: ``live`` bool ``[M]``, values for every row (rows outside it keep theirs, ``steps`` 0), assigned anew:
    another tree's round may have committed since."""
    x, n_new, steps, v, exact, history, past = new
    if st.past is not None:  # a multistep kernel's records: new tensors (the old ones may be shared or read still)
        if live.dtype == torch.bool:
            keep = live.reshape((-1,) + (1,) * (st.x.ndim - 1))
            st.past = tuple(torch.where(keep, p, old) for p, old in zip(past, st.past))
        else:
            st.past = tuple(old.index_put((live,), p) for p, old in zip(past, st.past))
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
class Tally:
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
    def zeros(cls, M: int, T: int, L: int, dev) -> Tally:
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
            samples=samples,
            nfe=self.nfe,
            nfe_total=self.endpoint_nfe + self.nfe,
            target_rows=self.call_rows,
            rounds=self.rounds,
            committed=self.committed,
            attempts=self.attempts,
            accepts=self.accepts,
            speculative_steps=T - 2,
            batch_nfe=self.batch_nfe,
            attempts_by_root=self.root_attempts,
            accepts_by_root=self.root_accepts,
        )


@dataclass
class Chains:
    """The ``M`` trajectories between rounds."""

    x: torch.Tensor  # [M, *e] current states Y_n
    n: torch.Tensor  # [M] their state index
    v_root: torch.Tensor  # [M, *e] velocity the next round drafts from
    root_exact: torch.Tensor  # [M] bool: v_root is x's own exact velocity
    history: DraftHistory | None = None  # [M, H, ...] exact records along the trajectories (drafts with history)
    # a multistep kernel's (Kernel.order > 1) records (Kernel.record) of the order - 1 states before x on each
    # trajectory, most recent first: order - 1 tensors [M, *e] (the first steps' stand-ins: Kernel.mean); else None
    past: tuple | None = None
