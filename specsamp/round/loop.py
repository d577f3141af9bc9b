"""The run of a speculative sampler: its first step, the loop over rounds (Algorithm 1, line 2) and its last step.

The round itself: :mod:`specsamp.round.dense` and :mod:`specsamp.round.sparse`; what they share:
:mod:`specsamp.round.context`.
"""

from __future__ import annotations

import torch

from .. import arguments, rng
from ..drafts import DraftHistory, data_prediction
from ..kernels import shift_history
from ..schedule import Schedule
from .context import Chains, Context, Tally


def initial_noise(seed: int, ids: torch.Tensor, event_shape, dtype) -> torch.Tensor:
    """Initial states ``x ~ N(0, I)`` at ``sigma = 1``, ``[M, *event_shape]`` in ``dtype`` on the device of ``ids``
    (``[M]`` long trajectory ids; ``seed`` in ``[0, rng.MAX_SEED]``). Row ``i`` depends on ``(seed, ids[i])`` only
    (:mod:`specsamp.rng`), so samplers run with the same seed start from the same noise."""
    keys = rng.base_key(seed, ids, "init", device=ids.device)
    return rng.normal(keys, event_shape, dtype=dtype)


def initial_state(schedule: Schedule, seed: int, ids: torch.Tensor, event_shape, dtype, init=None) -> torch.Tensor:
    """The first states ``[M, *event]``: ``init`` where given (on the linear path at ``sigmas[0]``; ValueError
    unless of that shape), else :func:`initial_noise` times the kernel's initial scale where it has one. Binds
    the event shape to the kernel first (:meth:`specsamp.kernels.Kernel.bind_event`)."""
    schedule.kernel.bind_event(event_shape)
    if init is not None:
        x = arguments.states("init", init).to(device=ids.device, dtype=dtype)
        if tuple(x.shape) != (ids.numel(), *event_shape):
            raise ValueError(
                f"init has shape {tuple(x.shape)}: need {(ids.numel(), *event_shape)} (trajectories, event)"
            )
        return x.clone()
    x = initial_noise(seed, ids, event_shape, dtype)
    scale = schedule.initial_scale()
    return x if scale is None else x * scale


def endpoint_noise(ctx: Context, x: torch.Tensor, n: int) -> torch.Tensor:
    """``x`` plus the kernel's noise of endpoint step ``n`` (0 or ``T - 1``) where the kernel has one there,
    keyed as the standard sampler keys its step ``n``; ``x`` itself for Euler--Maruyama (no noise, no bits)."""
    std = float(ctx.schedule.std(torch.tensor([n]))[0]) if ctx.schedule.stochastic_endpoints else 0.0
    return x if std == 0.0 else x + std * rng.normal(rng.fold(ctx.step_keys, n), tuple(x.shape[1:]), dtype=x.dtype)


def first_step(ctx: Context, model, seed: int, warmup: str, tally: Tally, init=None) -> Chains:
    """Step 0 (Algorithm 1, line 1) for the trajectories ``ctx.ids``: deterministic Euler from sigma = 1 for
    Euler--Maruyama, else the scheduler's."""
    ids = ctx.ids
    dev, M = ids.device, ids.numel()
    x = initial_state(ctx.schedule, seed, ids, model.event_shape, model.dtype, init)
    n, rows = torch.zeros(M, dtype=torch.long, device=dev), torch.arange(M, device=dev)
    v0 = ctx.velocity(x, n, rows)
    tally.endpoint_nfe += 1
    # warmup=step0 drafts the first round from the step-0 velocity (at sigma = 1, so not exact at the root)
    st = Chains(
        x=endpoint_noise(ctx, ctx.schedule.mean(x, v0, n), 0),
        n=n + 1,
        v_root=v0 if warmup == "step0" else torch.zeros_like(x),
        root_exact=torch.zeros(M, dtype=torch.bool, device=dev),
    )
    order = ctx.schedule.kernel.order
    if order > 1:  # the step-0 state's record opens a multistep kernel's past (Chains.past)
        st.past = shift_history(None, ctx.schedule.record(x, v0, n), order)
    H = ctx.draft.history
    if H > 0:  # the step-0 state's exact data prediction opens the trajectory's history
        st.history = DraftHistory.empty(x, H)
        st.history.push(rows, data_prediction(x, v0, n, ctx.schedule), n, x)
    return st


def root_call(ctx: Context, st: Chains, live: torch.Tensor, tally: Tally) -> None:
    """The roots' exact velocities in a call of their own (the warm-up, charged to ``nfe``; every prefetch=none round).
    ``live`` is never empty (the loop stops first), so the call is charged without asking the device."""
    st.v_root[live] = ctx.velocity(st.x[live], st.n[live], live)
    st.root_exact[live] = True
    tally.nfe[live] += 1
    tally.call_rows[live] += 1
    tally.batch_nfe += 1


def run_rounds(ctx: Context, st: Chains, tally: Tally, warmup: str, callback, layout) -> torch.Tensor:
    """The loop over rounds (Algorithm 1, line 2; ``docs/architecture.md``, "The round as one diagram"), then the last
    step; returns the samples. ``layout`` (:class:`specsamp.round.layouts.SparseLayout`,
    :class:`~specsamp.round.layouts.DenseLayout`)
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
    return final_step(ctx, st, tally, layout.need_rows())


def final_step(ctx: Context, st: Chains, tally: Tally, need_rows: torch.Tensor | None = None) -> torch.Tensor:
    """Step ``T - 1``, a deterministic Euler step to sigma = 0, reusing an exact velocity the last round left;
    ``need_rows``: the rows without one, where the caller knows them (no host sync)."""
    T1 = ctx.schedule.steps - 1
    last = torch.full((st.x.shape[0],), T1, dtype=torch.long, device=st.x.device)
    v_last = st.v_root.clone()
    w = (~st.root_exact).nonzero(as_tuple=True)[0] if need_rows is None else need_rows
    if w.numel():
        v_last[w] = ctx.velocity(st.x[w], last[w], w)
        tally.endpoint_nfe[w] += 1
    return endpoint_noise(ctx, ctx.schedule.mean(st.x, v_last, last, st.past), T1)
