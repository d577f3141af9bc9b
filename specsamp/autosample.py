"""``auto``: measure what a call costs, predict how far drafts are accepted, choose the round, sample, and record why.

:func:`sample_auto` is the sampler ``auto`` runs (``run.py sampler=auto``, and the default of the k-diffusion
functions, :func:`specsamp.integrations.diffusers.speculative` and the ComfyUI node). Before its first round it has:

1. **the call's cost curve** (:mod:`specsamp.cost`): given by the user (``call_cost``), found in the cache under the
   model's key, device, dtype and state shape, or measured on the model within a bounded number of calls (then kept);
2. **the displacement profile per root step** (:mod:`specsamp.profiles`): given (``delta_profile``), found in the
   cache under the model's key, kernel, grid and draft, or measured by a *pilot*: a short D-GRS run of ``pilot``
   trajectories on a chain (``pilot_depth`` drafted states), under its own seed, whose per-root acceptance gives the
   profile (:func:`specsamp.profiles.deltas_by_root`; then kept);
3. **the round's own host cost** (:class:`specsamp.auto.HostCost`): measured on a stand-in network that costs
   nothing (:func:`specsamp.hostcost.measure_host_cost`: the loop's step and each coupling's round on two trees),
   then kept per machine;
4. **the plan** (:func:`specsamp.auto.choose`): the plain loop, RMC chains or D-GRS trees, one per root step,
   whichever commits the most steps per second by that curve, that host cost and that profile. The plain loop stays
   a candidate: ``auto`` runs the loop unless a plan is predicted faster by its ``margin`` (default 15%, about the
   prediction's error measured on one CPU).

Exactness. The plan is fixed before the run's first round and reads only the curve, the host cost and the profile:
none of them depends on the run's own draws (the pilot runs under ``seed + PILOT_SEED_OFFSET``, so its randomness is
disjoint from the run's). Each round is then an exact round of the chosen coupling on the chosen tree, so the samples
have the target chain's law whatever is chosen; the loop is the standard sampler itself.

Cost. A first run on a model pays the curve's calls (at most 64), the pilot (a few calls of ``pilot x (pilot_depth +
1)`` rows per ``pilot_depth`` steps) and the host's stand-in runs; all are recorded. A later run in the same process, or with a
cache file (:class:`AutoCache` ``path``, or the ``SPECSAMP_CACHE_DIR`` environment variable), reuses them and plans
from the cache (a plan costs under a second to search for a run of any length).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from . import arguments, rng
from .auto import BUDGETS, COUPLINGS, HostCost, Hosts, Plan, choose, loop_option
from .autocache import AutoCache, default_cache, model_key, profile_key
from .cost import CallCost, call_cost_from, cost_key, measure_call_cost
from .drafts import get_draft
from .errors import ConfigError
from .hostcost import Timed, hardware, measure_host_cost
from .inductor import check_compile
from .profiles import check_profile, deltas_by_root
from .result import SampleResult
from .sampler import _model_device, _refuse_unknown, _trajectory_ids, sample_speculative, sample_standard
from .schedule import Schedule
from .trees import DraftTree

PILOT_SEED_OFFSET = 2_000_003
"""The pilot's seed is the run's plus this: its keyed draws are disjoint from the run's, so the plan it informs is
independent of the samples (exactness)."""

PASSED_ON = ("prefetch", "warmup", "evaluate_leaves", "check_contract", "compile")
"""The keywords :func:`sample_auto` hands on to :func:`specsamp.sampler.sample_speculative` (tree execution)."""


def runs_auto(tree_given: bool, options: dict) -> bool:
    """Whether an entry point that defaults to ``auto`` (the k-diffusion functions, ``speculative(pipe)``) runs it: no
    tree asked for (``tree_given``: ``K``, ``L``, ``tree``, ``budget`` or ``coupling`` given), and the tree execution
    without Picard sweeps in ``options`` (what ``auto`` prices); otherwise the entry point's fixed tree runs."""
    return not tree_given and options.get("execution", "tree") == "tree" and not options.get("refine")


def auto_options(options: dict) -> dict:
    """An entry point's speculative options as :func:`sample_auto` takes them: without ``execution`` and ``refine``
    (it fixes both), with the persistent cache (:func:`default_cache`) unless one is given, so that the same seed
    gives the same trees the next time on this machine."""
    opts = {k: v for k, v in options.items() if k not in ("execution", "refine")}
    opts["cache"] = opts.get("cache") or default_cache(persist=True)
    return opts


@dataclass
class AutoChoice:
    """What ``auto`` decided before sampling, and from what.

    Attributes:
        plan: the :class:`specsamp.auto.Plan`.
        curve: the call's cost curve used.
        host: the host cost used (one, or one per coupling).
        profile_source: ``given``, ``cached`` or ``pilot``; curve_source: ``given``, ``cached`` or ``measured``.
        pilot: the pilot's cost (trajectories, calls, rows, seconds), None when none ran.
        setup_seconds: wall seconds spent measuring, piloting and planning.
    """

    plan: Plan
    curve: CallCost
    host: Hosts
    profile_source: str
    curve_source: str
    pilot: dict | None = None
    setup_seconds: float = 0.0

    def tree_rule(self) -> Callable[[int], DraftTree]:
        """``tree(n)`` for :func:`specsamp.sampler.sample_speculative`: the plan's tree at root ``n``."""
        return self.plan.tree

    def record(self, steps: int, realised_seconds: float | None = None) -> dict:
        """The run record's ``auto`` entry: the choice, why (rates per candidate), the curve, the host cost, where the
        profile came from, and the predicted against the realised seconds of the sampling (``steps``: ``T``)."""
        rate = self.plan.predicted_rate()
        predicted = (steps - 2) / rate + 2 * self.plan.loop.seconds
        out = {
            **self.plan.summary(),
            "call_cost": self.curve.as_dict(),
            "host_cost_ms": {
                c: {"fixed": 1e3 * h.fixed, "per_row": 1e3 * h.per_row, "loop_step": 1e3 * h.loop_step}
                for c, h in (self.host.items() if isinstance(self.host, dict) else [("all", self.host)])
            },
            "curve_source": self.curve_source,
            "profile_source": self.profile_source,
            "pilot": self.pilot,
            "setup_seconds": round(self.setup_seconds, 4),
            "predicted_seconds": round(predicted, 6),
        }
        if self.plan.by_root:  # steps per round as a run sees them: a harmonic mean over roots (auto.plan_rate)
            harmonic = len(self.plan.by_root) / sum(1.0 / o.steps for o in self.plan.by_root)
            out["predicted_steps_per_round"] = round(harmonic, 3)
        if realised_seconds is not None:
            out["realised_seconds"] = round(realised_seconds, 6)
            out["realised_over_predicted"] = round(realised_seconds / predicted, 4) if predicted > 0 else None
        return out


def _loop_choice(curve: CallCost | None, host, M: int, curve_source: str, t0: float) -> AutoChoice:
    """The plain loop, chosen without a plan (no round to plan, or none that fits): the curve where one was given or
    measured, else an empty one."""
    curve = curve if curve is not None else CallCost((1,), (0.0,), "none")
    host = host or HostCost()
    loop = loop_option(curve, host, M)
    plan = Plan(None, [], loop, {"loop": loop.rate})
    return AutoChoice(plan, curve, host, "none", curve_source, None, time.perf_counter() - t0)


def _profile_rows(delta_profile, n_roots: int) -> list[list[float]]:
    """A given profile as one row per root: a flat list (every root alike) or one list per root ``1 .. T - 2``."""
    valid = f"a list of deltas per depth, or {n_roots} such lists (one per root step 1 .. T - 2), each finite and >= 0"
    try:
        if len(delta_profile) and all(np.ndim(r) == 0 for r in delta_profile):
            return [[float(d) for d in check_profile(delta_profile)]] * n_roots
        rows = [[float(d) for d in check_profile(r)] for r in delta_profile]
    except (TypeError, ValueError):
        raise arguments.refuse("delta_profile", delta_profile, f"must be {valid}") from None
    if len(rows) != n_roots:
        raise arguments.refuse("delta_profile", f"<{len(rows)} rows>", f"must be {valid}")
    return rows


def pilot_profile(
    model,
    schedule: Schedule,
    *,
    trajectories: int = 4,
    depth: int = 32,
    draft="velocity",
    seed: int = 0,
    cond: dict | None = None,
    max_batch: int | None = None,
    min_attempts: int = 24,
) -> tuple[list[list[float]], dict]:
    """The displacement profile of each root step ``1 .. T - 2``, measured by a pilot: D-GRS on a chain of ``depth``
    drafted states (cut at ``T - 2``) for ``trajectories`` trajectories under ``seed + PILOT_SEED_OFFSET``, its
    per-root acceptance pooled over neighbouring roots until ``min_attempts`` attempts
    (:func:`specsamp.profiles.deltas_by_root`).

    Args:
        cond: the run's per-trajectory conditioning ``[M, ...]``; the pilot's trajectory ``i`` takes row ``i mod M``.

    Returns:
        ``(rows, cost)``: ``rows[n - 1]`` the profile of root ``n`` (per depth ``1 .. depth``), ``cost`` the pilot's
        ``{trajectories, calls, rows, seconds}``.
    """
    horizon = schedule.end_speculative - schedule.first_speculative
    dev = _model_device(model)
    ids = torch.arange(trajectories, device=dev)
    pc = None
    if cond:
        pc = {k: v[torch.arange(trajectories, device=v.device) % v.shape[0]] for k, v in cond.items()}
    timed = Timed(model)
    stamps: list[tuple[float, float]] = []  # (clock, network seconds so far) after each round

    def stamp(info) -> None:
        stamps.append((time.perf_counter(), timed.seconds))

    t0 = time.perf_counter()
    r = sample_speculative(
        timed,
        schedule,
        DraftTree.chain(max(1, min(depth, horizon))),
        "dgrs",
        seed=(seed + PILOT_SEED_OFFSET) % (rng.MAX_SEED + 1),
        indices=ids,
        cond=pc,
        draft=draft,
        max_batch=max_batch,
        execution="tree",
        callback=stamp,
    )
    seconds = time.perf_counter() - t0
    table = deltas_by_root(r.attempts_by_root.cpu().numpy(), r.accepts_by_root.cpu().numpy(), 1, "dgrs", min_attempts)
    rows = [[float(d) for d in row] for row in table[schedule.first_speculative : schedule.end_speculative]]
    # a round's own seconds outside the network: the median over consecutive rounds of the time between them less
    # their network's (the run's fixed work, before the first round and after the last, is left out)
    gaps = sorted((b[0] - a[0]) - (b[1] - a[1]) for a, b in zip(stamps, stamps[1:]))
    rounds = max(int(r.batch_nfe), 1)
    host = gaps[len(gaps) // 2] if gaps else max(seconds - timed.seconds, 0.0) / rounds
    cost = {
        "trajectories": trajectories,
        "calls": int(r.batch_nfe) + 2,
        "rows": int(r.target_rows.sum()),
        "seconds": round(seconds, 4),
        "network_seconds": round(timed.seconds, 4),
        # the round's own seconds outside the network, per round, at `depth` drafted states a trajectory
        "host_ms_per_round": round(1e3 * max(host, 0.0), 4),
        "depth": min(depth, horizon),
    }
    return rows, cost


def _admitted_budgets(budgets, M, model, schedule, max_batch, max_width) -> tuple[int, ...]:
    """The budgets whose rounds the memory estimate admits for ``M`` trajectories (:func:`arguments.check_sampler_memory`:
    the same bound every entry point applies)."""
    kept = []
    for b in sorted(set(budgets)):
        try:
            arguments.check_sampler_memory(
                (b + 1, min(max_width, b), b),
                M,
                model.event_shape,
                model.dtype,
                _model_device(model),
                execution="tree",
                steps=schedule.steps,
                max_batch=max_batch,
                row_bytes=getattr(model, "row_bytes", 0),
            )
        except ConfigError:
            break
        kept.append(b)
    return tuple(kept)


def real_rounds(hosts: dict[str, HostCost], pilot: list[float] | None) -> dict[str, HostCost]:
    """The stand-in's host costs raised to what the pilot's real rounds took outside the network, where they took
    more: a real round draws residuals, switches trees, and carries its run's fixed work, which a stand-in whose
    drafts are always accepted does not (measured: 1.8 to 2.4 times on one CPU). ``pilot``: ``[seconds a round,
    drafted states]``; None leaves ``hosts`` as they are. Each coupling is scaled by the same factor, taken against
    the chain's model (the pilot's rounds are chains)."""
    if pilot is None:
        return hosts
    seconds, depth = pilot
    base = hosts.get("rmc", next(iter(hosts.values())))
    factor = max(1.0, seconds / base(depth)) if base(depth) > 0 else 1.0
    return {c: HostCost(h.fixed * factor, h.per_row * factor, h.loop_step) for c, h in hosts.items()}


def _pilot_size(trajectories: int, depth: int, model, schedule: Schedule, max_batch) -> tuple[int, int]:
    """The largest pilot, ``(trajectories, depth)``, no larger than asked, whose chain rounds the memory estimate
    admits (trajectories halved first, then the depth); ``(0, 0)`` where not even one trajectory's chain of one fits."""
    depth = max(1, min(depth, schedule.end_speculative - schedule.first_speculative))
    while depth >= 1:
        m = trajectories
        while m >= 1:
            if _admitted_budgets((depth,), m, model, schedule, max_batch, 1):
                return m, depth
            m //= 2
        depth //= 2
    return 0, 0


def plan_auto(
    model,
    schedule: Schedule,
    M: int,
    *,
    draft="velocity",
    seed: int = 0,
    cond: dict | None = None,
    max_batch: int | None = None,
    call_cost=None,
    host_cost: HostCost | None = None,
    delta_profile=None,
    cache: AutoCache | None = None,
    pilot: int = 4,
    pilot_depth: int = 32,
    couplings: Sequence[str] = COUPLINGS,
    budgets: Sequence[int] = BUDGETS,
    max_width: int = 4,
    margin: float = 0.15,
) -> AutoChoice:
    """The choice :func:`sample_auto` samples with, for ``M`` trajectories sharing each call (module docstring).

    Raises:
        ConfigError: a bad ``call_cost``, ``host_cost``, ``delta_profile``, ``cache``, ``pilot``, ``pilot_depth``,
            ``couplings``, ``budgets``, ``max_width`` or ``margin``, each named with what is valid.
    """
    t0 = time.perf_counter()
    cache = default_cache() if cache is None else cache
    if not isinstance(cache, AutoCache):
        raise arguments.refuse("cache", cache, "must be a specsamp.autosample.AutoCache or None (the process's)")
    host_given = host_cost is not None
    if host_cost is not None and not isinstance(host_cost, HostCost):
        raise arguments.refuse("host_cost", host_cost, "must be a specsamp.auto.HostCost or None (the defaults)")
    pilot = arguments.integer("pilot", pilot, 1, 1024)
    pilot_depth = arguments.integer("pilot_depth", pilot_depth, 1, 1024)
    max_width = arguments.integer("max_width", max_width, 1, 64)
    if not (isinstance(margin, (int, float)) and not isinstance(margin, bool) and 0 <= margin < 10):
        raise arguments.refuse("margin", margin, "must be a number in [0, 10): the loop is kept unless beaten by it")
    bad = [c for c in (couplings if isinstance(couplings, (list, tuple)) else [couplings]) if c not in COUPLINGS]
    if bad or not isinstance(couplings, (list, tuple)) or not couplings:
        raise arguments.refuse("couplings", couplings, f"must be a non-empty list of {', '.join(COUPLINGS)}")
    if not isinstance(budgets, (list, tuple)) or not budgets:
        raise arguments.refuse("budgets", budgets, "must be a non-empty list of integers >= 1")
    budgets = tuple(arguments.integer("budgets", b, 1, 4096) for b in budgets)
    n_roots = schedule.end_speculative - schedule.first_speculative
    given_rows = _profile_rows(delta_profile, n_roots) if delta_profile is not None and n_roots > 0 else None
    curve = call_cost_from(call_cost) if call_cost is not None else None
    admitted = _admitted_budgets(budgets, M, model, schedule, max_batch, max_width) if n_roots > 0 else ()
    if not admitted:  # no round to plan, or none that fits in memory: the loop, without measuring anything
        return _loop_choice(curve, host_cost, M, "none", t0)
    key = model_key(model)
    shape = tuple(model.event_shape)
    dev = _model_device(model)

    if curve is not None:
        curve_source = "given"
    else:
        ck = cost_key(f"{key}@{hardware(dev)}", dev, model.dtype, shape)
        top = M * (max(admitted, default=0) + 1)  # the largest call a plan can make: every trajectory's tree
        curve = cache.costs.get(ck)
        if curve is not None and curve.rows[0] <= M and curve.rows[-1] >= top // 2:
            curve_source = "cached"
        else:  # the rows this batch's calls take, M to top, doubling; merged with a cached curve's other points
            rows = sorted({M << i for i in range(max(top // M, 1).bit_length())} | {top})  # and the largest call
            got = measure_call_cost(
                model,
                shape,
                dtype=model.dtype,
                device=dev,
                cond=cond,
                rows=rows,
                max_rows=max(top, M),
                level=float(schedule.sigmas[schedule.first_speculative]),
            )
            if curve is not None:
                points = {**dict(zip(curve.rows, curve.seconds)), **dict(zip(got.rows, got.seconds))}
                got = CallCost(tuple(sorted(points)), tuple(points[r] for r in sorted(points)), got.source, got.device)
            curve, curve_source = got, "measured"
            cache.costs.put(ck, curve)
    pilot_cost = None
    pk = profile_key(key, schedule, getattr(draft, "name", str(draft)))
    hk = f"{pk}@{hardware(dev)}"  # the round's host cost: this kernel, grid and draft on this machine
    if given_rows is not None:
        rows_by_root, profile_source = given_rows, "given"
    elif pk in cache.profiles:
        rows_by_root, profile_source = cache.profiles[pk], "cached"
    else:  # a pilot the memory estimate admits (fewer trajectories first), else nothing to plan from: the loop
        pilot, pilot_depth = _pilot_size(pilot, pilot_depth, model, schedule, max_batch)
        if pilot == 0:
            return _loop_choice(curve, host_cost, M, curve_source, t0)
        rows_by_root, pilot_cost = pilot_profile(
            model,
            schedule,
            trajectories=pilot,
            depth=pilot_depth,
            draft=draft,
            seed=seed,
            cond=cond,
            max_batch=max_batch,
        )
        cache.put_profile(pk, rows_by_root, (pilot_cost["host_ms_per_round"] / 1e3, pilot_cost["depth"]))
        profile_source = "pilot"
    if not host_given:  # one per coupling: D-GRS's round does more host work than RMC's
        host_cost = {}
        for c in couplings:
            ckey = f"{hk}|M={M}|{c}"
            if ckey not in cache.hosts:
                cache.put_host(ckey, measure_host_cost(schedule, shape, model.dtype, dev, M, coupling=c, draft=draft))
            host_cost[c] = cache.hosts[ckey]
        host_cost = real_rounds(host_cost, cache.pilot_hosts.get(pk))
    if profile_source != "given":  # a profile is known to the pilot's depth: deeper rounds would be extrapolation
        admitted = tuple(b for b in admitted if b <= pilot_depth) or admitted[:1]
    inputs = (
        rows_by_root,
        curve.rows,
        curve.seconds,
        sorted((c, repr(h)) for c, h in host_cost.items()) if isinstance(host_cost, dict) else repr(host_cost),
        M,
        list(couplings),
        admitted,
        max_width,
        margin,
    )
    plan_key = hashlib.sha1(json.dumps(inputs).encode()).hexdigest()  # a plan is a function of these alone
    plan = cache.plans.get(plan_key)
    if plan is None:
        plan = choose(
            rows_by_root,
            curve,
            host_cost,
            batch=M,
            couplings=couplings,
            budgets=admitted,
            max_width=max_width,
            margin=margin,
        )
        cache.put_plan(plan_key, plan)
    return AutoChoice(plan, curve, host_cost, profile_source, curve_source, pilot_cost, time.perf_counter() - t0)


def sample_auto(
    model,
    schedule: Schedule,
    n_samples: int | None = None,
    *,
    draft="velocity",
    seed: int = 0,
    indices=None,
    cond: dict | None = None,
    max_batch: int | None = None,
    callback: Callable[[dict], None] | None = None,
    init: torch.Tensor | None = None,
    call_cost=None,
    host_cost: HostCost | None = None,
    delta_profile=None,
    cache: AutoCache | None = None,
    pilot: int = 4,
    pilot_depth: int = 32,
    couplings: Sequence[str] = COUPLINGS,
    budgets: Sequence[int] = BUDGETS,
    max_width: int = 4,
    margin: float = 0.15,
    **options,
) -> SampleResult:
    """Sample with whatever commits the most steps per second here: the plain loop, RMC chains or D-GRS trees, per
    root step (module docstring); exact whatever it chooses.

    Args:
        model, schedule, n_samples, seed, indices, cond, max_batch, callback, init: as
            :func:`specsamp.sampler.sample_speculative` (the loop's callback is :func:`~specsamp.sampler.sample_standard`'s).
        draft: the draft of the speculative rounds.
        call_cost: the call's cost curve, ``{rows: milliseconds}`` or pairs (:func:`specsamp.cost.call_cost_from`);
            None: cached or measured.
        host_cost: a round's own cost (:class:`specsamp.auto.HostCost`, for every coupling); None: measured on this
            machine per coupling (:func:`specsamp.hostcost.measure_host_cost`), cached.
        delta_profile: per depth, or per root step then per depth; None: cached or piloted.
        cache: an :class:`AutoCache`; None: the process's (:func:`default_cache`).
        pilot, pilot_depth: the pilot's trajectories and chain length (no round drafts more than that from a
            piloted profile: deeper, its acceptance would be extrapolated).
        couplings, budgets, max_width, margin: the candidates (:func:`specsamp.auto.choose`).
        **options: ``prefetch``, ``warmup``, ``evaluate_leaves``, ``check_contract``, ``compile`` for the rounds.

    Returns:
        :class:`SampleResult` whose ``extra["auto"]`` is :meth:`AutoChoice.record` (what was chosen and why, the
        curve, the predicted and realised seconds).

    Raises:
        ConfigError: any bad argument, named with its value and what is valid, before the first network call.
    """
    _refuse_unknown(sample_auto, {k: v for k, v in options.items() if k not in PASSED_ON})
    arguments.sampler_inputs(model, schedule, cond)
    get_draft(draft)
    arguments.function("callback", callback, optional=True)
    ids = _trajectory_ids(n_samples, indices, _model_device(model))
    check_compile(options.get("compile", False), "tree", _model_device(model))
    choice = plan_auto(
        model,
        schedule,
        ids.numel(),
        draft=draft,
        seed=seed,
        cond=cond,
        max_batch=max_batch,
        call_cost=call_cost,
        host_cost=host_cost,
        delta_profile=delta_profile,
        cache=cache,
        pilot=pilot,
        pilot_depth=pilot_depth,
        couplings=couplings,
        budgets=budgets,
        max_width=max_width,
        margin=margin,
    )
    common = dict(seed=seed, indices=ids, cond=cond, max_batch=max_batch, callback=callback, init=init)
    t0 = time.perf_counter()
    if choice.plan.use_loop:
        res = sample_standard(model, schedule, **common)
    else:
        res = sample_speculative(
            model,
            schedule,
            choice.tree_rule(),
            choice.plan.coupling,
            draft=draft,
            execution="tree",
            **common,
            **options,
        )
    res.extra["auto"] = choice.record(schedule.steps, time.perf_counter() - t0)
    if not choice.plan.use_loop:  # how far the rounds went, beside the prediction (the profile's error shows here)
        res.extra["auto"]["realised_steps_per_round"] = round(
            (schedule.steps - 2) / float(res.rounds.double().mean()), 3
        )
    return res
