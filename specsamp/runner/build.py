"""From the typed config to objects: the target, the coupling, the schedule and the round tree.

The model and the coupling are built by ``hydra.utils.instantiate`` from their YAML's ``_target_``; the
tree follows from the sampler and the tree rule (:mod:`specsamp.runner.treerules`); ``tree=optimal``
first calibrates a displacement profile on a short run of its own (:func:`calibration_run`) unless
``delta_profile`` is given.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable

import numpy as np
import torch
from hydra.errors import InstantiationException
from omegaconf import OmegaConf

from ..coupling import Coupling
from ..errors import ConfigError
from ..models.base import Target
from ..sampler import SampleResult, sample_speculative
from ..schedule import Schedule
from ..trees import DraftTree, budget as uniform_budget
from .config import CALIBRATION_SEED_OFFSET, KERNEL_SCHEMAS, RunConfig, brings_scheduler, kernel_name, profile_path
from .memory import check_config_sizes, check_nominal_budget, check_tree_nodes
from .outputs import check_scoring, check_target_scores
from .treerules import SEARCHED_TREES, check_search, get_tree_rule


def build_target(run: RunConfig, plan=None) -> Target:
    """The configured target: ``instantiate(model)`` (its ``_target_``), then ``build(device)``; a model that brings
    its own scheduler (:func:`~specsamp.runner.config.brings_scheduler`) is built with ``build(device, plan=plan)``,
    ``plan`` the run's :class:`~specsamp.integrations.schedulers.SchedulerPlan` (None: ``kernel=em``).

    Raises:
        ConfigError: a bad model value, a missing or untrusted checkpoint, weights that cannot be loaded.
    """
    from hydra.utils import instantiate

    try:
        cfg = instantiate(OmegaConf.structured(run.model), _convert_="object")
        return cfg.build(run.device, plan=plan) if brings_scheduler(run.model) else cfg.build(run.device)
    except ConfigError:
        raise
    except InstantiationException as e:
        raise ConfigError(f"model._target_={run.model._target_!r} could not be built: {e.__cause__ or e}") from None
    except (OSError, ValueError, ImportError) as e:
        raise ConfigError(f"model={run.model.name!r} could not be loaded: {e}") from None


def half_precision_note(dtype: torch.dtype) -> None:
    """One line on stderr when the sampler's states are half precision: rounding then enters every kernel mean
    and lowers the acceptance, so the speedup is not that of float32 (measured on the GMM's default cell,
    ``python run.py model.dtype=D``: 2.03x in float64 and float32, 2.01x in float16, 1.75x in bfloat16)."""
    if dtype in (torch.float16, torch.bfloat16):
        bits = 11 if dtype == torch.float16 else 8
        print(
            f"note: model.dtype={str(dtype).removeprefix('torch.')} holds the states and velocities with {bits} significant "
            "bits; that rounding enters every kernel mean and lowers the acceptance, so speedups are below float32's "
            "(GMM, K=2 L=3: 2.03x in float32, 2.01x in float16, 1.75x in bfloat16).",
            file=sys.stderr,
            flush=True,
        )


def load_target(run: RunConfig, target: Target | None, n_images: int, subset: bool, plan=None) -> Target:
    """The run's target: what scoring will need is checked first (against the config's model, or the given
    target; :func:`specsamp.runner.outputs.check_scoring`), then the target is built (unless given), its notes
    printed, and a metric it has no inputs for refused.

    Args:
        run: the typed config.
        target: an already-built target to use instead of the config's model, or None.
        n_images: the trajectories the run samples (the images it scores).
        subset: the run samples a subset of ``n_samples`` (a shard, given ids).
        plan: the run's scheduler plan (:func:`build_schedule`), handed to a model that brings its own scheduler.

    Raises:
        ConfigError: a metric that cannot be scored, or a model that cannot be loaded.
    """
    notes = check_scoring(run, run.model if target is None else target, n_images, subset)
    target = target if target is not None else build_target(run, plan)
    for note in notes:
        print(f"note: {note}", file=sys.stderr, flush=True)
    half_precision_note(target.model.dtype)
    check_target_scores(run, target)
    return target


def build_coupling(run: RunConfig) -> Coupling | None:
    """The sampler's coupling, ``instantiate(sampler.coupling)``; None for the standard sampler.

    Raises:
        ConfigError: the node does not build a :class:`~specsamp.coupling.Coupling`, or a one-child rule
            (``max_children=1``) with a tree other than a chain.
    """
    from hydra.utils import instantiate

    node = run.sampler.coupling
    if node is None:
        return None
    try:
        coupling = instantiate(node)
    except InstantiationException as e:
        raise ConfigError(
            f"sampler={run.sampler.name!r} is invalid: its coupling could not be built: {e.__cause__ or e}"
        ) from None
    if not isinstance(coupling, Coupling):
        raise ConfigError(
            f"sampler={run.sampler.name!r} is invalid: sampler.coupling builds {type(coupling).__name__}, "
            "not a specsamp.coupling.Coupling."
        )
    if coupling.max_children == 1 and run.tree != "uniform":
        raise ConfigError(
            f"tree={run.tree!r} is invalid with sampler={run.sampler.name}: a one-child rule runs a chain (tree=uniform)."
        )
    return coupling


def build_schedule(run: RunConfig, event_shape: tuple | None = None):
    """The run's time grid and kernel, once what the config alone sizes is checked
    (:func:`specsamp.runner.memory.check_config_sizes`), and the scheduler plan it came from (None: ``kernel=em``).

    In order: the model's own scheduler where it brings one (``run.model.scheduler_plan(steps, kernel)``, the
    kernel's name, None for ``kernel=auto``; :meth:`specsamp.models.base.TargetConfig.scheduler_plan`); else
    ``kernel=em``: the paper's grid of ``steps`` and ``eps`` with the model's ``shift``; else a kernel's own grid from
    its keys (``grid_keys``: the k-diffusion samplers' Karras levels); else the diffusers scheduler
    that the kernel's keys configure (:func:`kernel_scheduler`), read by
    :func:`specsamp.integrations.schedulers.from_scheduler` at ``steps`` (the shipped models return the linear
    path's velocity, which every kernel takes, so their grid is all a run reads of the plan).

    Args:
        run: the typed config.
        event_shape: the shape of one state where already known (a given target); else it is read from the
            config (:func:`specsamp.runner.memory.config_event_shape`). Only DDPM's dynamic thresholding reads it.

    Returns:
        ``(schedule, plan)``.

    Raises:
        ConfigError: a size that cannot fit, or a grid or scheduler option that cannot be made or is not reproduced.
    """
    from .memory import config_event_shape

    check_config_sizes(run)
    name = kernel_name(run)
    plan = (
        run.model.scheduler_plan(run.steps, None if name == "auto" else name)
        if hasattr(run.model, "scheduler_plan")
        else None
    )
    if plan is not None:
        return plan.schedule, plan
    if name == "auto":
        names = [k for k in KERNEL_SCHEMAS if k != "auto"]
        raise ConfigError(
            f"kernel=auto is invalid with model={run.model.name}: the model brings no scheduler of its own "
            f"here; set kernel={', '.join(names[:-1])} or {names[-1]}."
        )
    if name == "em":
        try:
            return Schedule.make(run.steps, run.eps, shift=float(run.model.shift)), None
        except ValueError as e:
            raise ConfigError(str(e)) from None
    from ..kernels import get_kernel
    from ..schedulers import from_scheduler

    own = get_kernel(name)
    if own.grid_keys:  # a kernel that makes its own grid (k-diffusion's samplers on Karras' levels)
        keys = {key: getattr(run.kernel, key) for key in own.grid_keys}
        options = {key: getattr(run.kernel, key) for key in own.run_options}
        return Schedule(own.make_grid(run.steps, **keys), 1.0, name, options), None
    shape = event_shape if event_shape is not None else config_event_shape(run.model)
    k = run.kernel
    options = {key: getattr(k, key) for key in get_kernel(name).run_options}
    try:
        plan = from_scheduler(kernel_scheduler(run), run.steps, event_ndim=len(shape) if shape else 3, **options)
    except ConfigError as e:
        spacing = (
            f", kernel.timestep_spacing={k.timestep_spacing}, kernel.steps_offset={k.steps_offset}"
            if hasattr(k, "timestep_spacing")
            else ""
        )
        raise ConfigError(f"steps={run.steps} is invalid with kernel={name}{spacing}: {str(e).rstrip('.')}.") from None
    return plan.schedule, plan


def kernel_scheduler(run: RunConfig):
    """The diffusers scheduler that ``run.kernel``'s keys configure: ``DDPMScheduler``,
    ``EulerAncestralDiscreteScheduler`` or ``FlowMatchEulerDiscreteScheduler(stochastic_sampling=True)`` (its
    ``shift`` the kernel's, or ``model.shift`` when null).

    Raises:
        ConfigError: diffusers is not installed, or the scheduler refuses the keys.
    """
    import dataclasses

    from ..kernels import get_kernel

    k = run.kernel
    kernel = get_kernel(k.name)
    keys = {f.name: getattr(k, f.name) for f in dataclasses.fields(k) if f.name not in ("name", *kernel.run_options)}
    try:
        import diffusers
    except ImportError as e:
        raise ConfigError(
            f"kernel={k.name} is invalid here: it builds its grid with a diffusers scheduler, which cannot "
            f"be imported ({e}); pip install diffusers, or use kernel=em."
        ) from None
    cls = getattr(diffusers, kernel.schedulers[0])
    keys = kernel.scheduler_config(keys, getattr(run.model, "shift", None))
    try:
        return cls(**keys)
    except (ValueError, NotImplementedError, TypeError) as e:
        raise ConfigError(
            f"kernel={k.name} is invalid with "
            + ", ".join(f"kernel.{a}={b!r}" for a, b in keys.items() if a != "stochastic_sampling")
            + f": diffusers' {cls.__name__} refuses them ({' '.join(str(e).split())})."
        ) from None


def find_tree(
    run: RunConfig,
    coupling: Coupling | None,
    schedule: Schedule,
    target: Callable[[], Target],
    callback: Callable[[int, int], None] | None = None,
) -> tuple[object, dict, dict | None]:
    """The run's round tree, found once: a tree rule's (built before the model loads), or a searched one
    (``tree=optimal*``): its nominal budget, search and given profile refused first, then the tree searched
    from that profile, or from one calibrated on the target (:func:`calibrated_profile`).

    Args:
        run: the typed config; coupling: its coupling (None: the standard sampler, no tree).
        schedule: the run's grid (the tree is cut at ``T - 2`` levels).
        target: returns the run's target (loaded on its first call; only a calibration calls it here).
        callback: the search's progress, ``callback(done, total)``.

    Returns:
        ``(tree, tree_fields, calibration)``: the tree (None for the standard sampler), the record's fields
        of it (:data:`specsamp.runner.records.TREE_FIELDS`), and the calibration run's cost (None: none ran).

    Raises:
        ConfigError: what :func:`build_tree` refuses, and a searched tree's budget, search or profile.
    """
    searched = coupling is not None and run.tree in SEARCHED_TREES and coupling.max_children != 1
    profile = calibrated = calibration = None
    if searched:  # refused before the model loads and before any calibration run
        if run.budget is None:
            check_nominal_budget(run)
        check_search(run, coupling, run.budget or uniform_budget(run.K, run.L))
        profile = given_profile(run)
    if searched and run.delta_profile is None:  # calibrate then search: the calibration samples the target
        calibrated, calibration = calibrated_profile(target(), schedule, run)
    tree, budget = build_tree(run, coupling, schedule.steps - 2, calibrated or profile, callback if searched else None)
    fields = {
        "tree": tree.describe() if tree is not None else "none",
        "budget": budget,
        "call_rows": tree.call_rows(run.evaluate_leaves) if tree is not None else 1,
        **({"refine": run.refine} if tree is not None and run.refine else {}),
        **({"delta_profile": calibrated} if searched else {}),
        **(
            {"trees_by_root": tree.parents()}
            if searched and run.tree == "optimal_per_step"
            else {"tree_parent": tree.parent.tolist()}
            if searched
            else {}
        ),
    }
    return tree, fields, calibration


def build_tree(
    run: RunConfig,
    coupling: Coupling | None,
    horizon: int,
    delta_profile=None,
    callback: Callable[[int, int], None] | None = None,
):
    """The round tree and its nominal drafted-state budget ``B``, built by the tree rule ``run.tree``
    (:mod:`specsamp.runner.treerules`: a registered name or ``pkg.module:name``).

    A one-child rule (``rmc``) runs a chain: of length ``B = K + ... + K^L`` with ``match=budget``, or
    with as many target rows as the (K, L) tree with ``match=verification``. Chains and trees deeper than
    the speculative horizon ``T - 2`` are built only to that depth: no round can use deeper nodes
    (eq. 11), so the law and every count are unchanged; the record keeps the nominal B.

    Args:
        run: the typed config.
        coupling: the built coupling, or None (the standard sampler: no tree).
        horizon: ``T - 2``.
        delta_profile: ``tree=optimal``'s displacement per depth (given or calibrated); for
            ``optimal_per_step``, rows per root state index ``1..T-2`` (one row: the same for every root).
        callback: progress of the search, ``callback(done, total)`` (depths, or roots for ``optimal_per_step``).

    Returns:
        ``(tree, budget)``; ``(None, 0)`` for the standard sampler; for ``optimal_per_step`` the tree is a
        :class:`specsamp.treesearch.TreesByRoot` (each root's tree drafts at most ``budget`` states and is
        searched at the depth its root has left, minimising the expected rounds to the end).

    Raises:
        ConfigError: a tree that does not fit in memory, a search refused up front, or more Picard sweeps
            (``refine``) than the tree has levels within ``T - 2``.
    """
    if coupling is None:
        return None, 0
    check_tree_nodes(run, coupling, horizon)
    if coupling.max_children == 1:
        K, L = run.K, run.L
        if run.match == "budget":
            length = uniform_budget(K, L)
        else:
            # rows of the (K, L) tree: |V| = B + 1 with leaves, |I| = 1 + K + ... + K^(L-1) without;
            # a chain of length l evaluates l + 1 rows with leaves and l without.
            length = uniform_budget(K, L) if run.evaluate_leaves else 1 + (uniform_budget(K, L - 1) if L > 1 else 0)
        tree, budget = DraftTree.chain(min(length, horizon)), length
    else:
        tree, budget = get_tree_rule(run.tree).build(run, coupling, horizon, delta_profile, callback)
    if isinstance(tree, DraftTree):
        coupling.check_tree(tree)
    depth = min(getattr(tree, "largest", tree).max_depth, horizon)  # step-dependent trees: their largest round's
    if run.refine > depth:
        raise ConfigError(
            f"refine={run.refine} is invalid for this tree ({tree.describe()}, {depth} level(s) within T-2): "
            f"after {depth} Picard sweep(s) every proposal mean is the target kernel mean at its parent, so "
            "further sweeps change nothing but each costs a batched target call per round; use "
            f"refine={depth} or less."
        )
    return tree, budget


def calibration_run(
    target: Target, schedule: Schedule, run: RunConfig, n: int = 64, K: int = 2, L: int = 8
) -> SampleResult:
    """The short run that calibrates ``tree=optimal``: D-GRS with the configured draft on a uniform
    ``(K, L)`` tree (``L`` capped at ``T - 2``) for ``n`` trajectories (ids ``0..n-1``), under its own
    seed (``seed + CALIBRATION_SEED_OFFSET``: the main run's randomness is untouched, so the tree it gets
    is independent of its samples and exactness is kept). ``n`` does not depend on ``n_samples``, so
    trajectory ``i`` of a run gets the same tree, counts and sample whatever the run's size or shard.

    Returns:
        The run's :class:`SampleResult` (its ``nfe`` and ``target_rows`` are the calibration's cost).
    """
    tree = DraftTree.uniform(K, min(L, schedule.steps - 2))
    ids = torch.arange(n, device=torch.device(getattr(target.model, "device", "cpu")))
    cond = target.cond_for(ids, run.seed) if target.cond_for is not None else None
    return sample_speculative(
        target.model,
        schedule,
        tree,
        "dgrs",
        seed=run.seed + CALIBRATION_SEED_OFFSET,
        indices=ids,
        cond=cond,
        draft=run.draft,
        prefetch=run.prefetch,
        evaluate_leaves=run.evaluate_leaves,
        max_batch=run.max_batch or target.max_batch,
        warmup=run.warmup,
    )


def calibrate(
    target: Target, schedule: Schedule, run: RunConfig, n: int = 64, K: int = 2, L: int = 8, min_attempts: int = 24
) -> tuple[dict, SampleResult]:
    """Both calibrated profiles from one :func:`calibration_run`.

    ``profile``: ``delta`` per depth ``1..L`` from each depth's pooled acceptance (``tree=optimal``).
    ``per_root``: one such profile per root state index ``1..T-2`` (``tree=optimal_per_step``), each
    cell pooling the counts of neighbouring root indices until it has ``min_attempts`` attempts
    (:func:`specsamp.treesearch.deltas_by_root`).

    Returns:
        ``(profiles, result)``: ``profiles = {"profile": [...], "per_root": [[...], ...]}`` and the
        calibration's :class:`SampleResult` (its calls: :func:`calibration_cost`).
    """
    from ..treesearch import deltas_by_root, deltas_from_acceptance

    r = calibration_run(target, schedule, run, n, K, L)
    rates = (r.accepts.sum(0).double() / r.attempts.sum(0).double().clamp_min(1)).cpu().numpy()
    table = deltas_by_root(r.attempts_by_root.cpu().numpy(), r.accepts_by_root.cpu().numpy(), K, "dgrs", min_attempts)
    first, end = schedule.first_speculative, schedule.end_speculative
    return {
        "profile": [float(d) for d in deltas_from_acceptance(rates, K, "dgrs")],
        "per_root": [[float(d) for d in row] for row in table[first:end]],
    }, r


def calibrated_profile(target: Target, schedule: Schedule, run: RunConfig) -> tuple[list, dict]:
    """The profile a searched tree (``run.tree``) reads, calibrated on ``target`` (:func:`calibrate`), and the
    calibration's cost as the record holds it (:func:`calibration_cost`, not charged to the speedup)."""
    profiles, r = calibrate(target, schedule, run)
    return profiles["per_root" if run.tree == "optimal_per_step" else "profile"], {
        **calibration_cost(r),
        "charged": False,
    }


def calibration_cost(r: SampleResult) -> dict:
    """What a calibration run cost, for the record: ``{trajectories, nfe, nfe_total, target_rows}`` summed over
    its trajectories (``nfe_total`` adds the endpoint calls; ``target_rows``: states the target evaluated)."""
    return {
        "trajectories": int(r.nfe.numel()),
        "nfe": int(r.nfe.sum()),
        "nfe_total": int(r.nfe_total.sum()),
        "target_rows": int(r.target_rows.sum()),
    }


def load_profile(value) -> dict:
    """A shipped or saved profile file: ``value`` names ``conf/profiles/<value>.json`` or is a ``.json`` path.

    Returns:
        The file's mapping: ``profile`` (per depth), ``per_root`` (per root index ``1..T-2``, then per
        depth) and ``config`` (what it was calibrated for).

    Raises:
        ConfigError: the file is missing or not such a mapping.
    """
    path = profile_path(str(value))
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or "profile" not in data or "per_root" not in data:
            raise ValueError("needs keys 'profile' and 'per_root'")
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"delta_profile={value!r} is invalid: {path} could not be read as a profile file ({e})."
        ) from None
    return data


def given_profile(run: RunConfig):
    """The profile the config gives for its searched tree (a list, a list of lists, or a profile file's entry
    for ``run.tree``), or None (calibrate). Called before the model is built, so that a profile that cannot
    serve this run is refused up front.

    A profile file calibrated for another model, draft or eps is used as given, with a note on stderr (a
    profile steers only efficiency; the law stays exact). ``tree=optimal_per_step`` needs one row per root
    step ``1..T-2`` (or a single row): a per-root table made for another T is refused, naming both T.

    Raises:
        ConfigError: the file cannot be read, or a per-root table whose rows do not match ``T - 2``.
    """
    v = run.delta_profile
    if v is None:
        return None
    horizon = run.steps - 2
    if not isinstance(v, str):
        if run.tree == "optimal_per_step" and np.ndim(v) == 2 and len(v) not in (1, horizon):
            raise ConfigError(
                f"delta_profile is invalid for tree=optimal_per_step with steps={run.steps}: it has {len(v)} "
                f"rows, but the tree per root step needs one per root step 1..{horizon} (T-2 = {horizon} rows), "
                "or a single row used for every root."
            )
        return v
    data = load_profile(v)
    cfg = data.get("config", {})
    rows = data["per_root"]
    if run.tree == "optimal_per_step" and len(rows) not in (1, horizon):
        made = f"steps={cfg['steps']}" if "steps" in cfg else f"{len(rows) + 2} steps"
        raise ConfigError(
            f"delta_profile={v!r} is invalid for tree=optimal_per_step with steps={run.steps}: it was "
            f"calibrated for {made} ({len(rows)} root steps), and this run has {horizon} root steps "
            f"(T-2). Calibrate one for steps={run.steps} (python -m experiments.calibrate ... "
            f"steps={run.steps}), use tree=optimal (one profile per depth), or delta_profile=null."
        )
    # a profile is made on one kernel (em's carry its eps, a scheduler kernel's its name): name what differs
    em = kernel_name(run) == "em"
    mine = {
        "model": run.model.name,
        "draft": run.draft,
        "steps": run.steps,
        **({"eps": run.eps} if em else {}),
        "kernel": "em" if em else kernel_name(run),
    }
    cfg = {"kernel": "em", **cfg}
    differ = {
        k: (cfg[k], x) for k, x in mine.items() if k in cfg and cfg[k] != x and not (k == "kernel" and x == "auto")
    }
    if differ:
        print(
            "note: delta_profile="
            + v
            + " was calibrated for "
            + ", ".join(f"{k}={a!r}" for k, (a, _) in differ.items())
            + ", not "
            + ", ".join(f"{k}={b!r}" for k, (_, b) in differ.items())
            + "; used as given.",
            file=sys.stderr,
        )
    entry = "per_root" if run.tree == "optimal_per_step" else "profile"
    _check_profile_entry(v, profile_path(v), entry, data[entry])
    return data[entry]


def _first_bad(values):
    """The first item of a (possibly nested) list that is not a finite number >= 0, or None."""
    for x in values if isinstance(values, (list, tuple)) else [values]:
        if isinstance(x, (list, tuple)):
            bad = _first_bad(x)
            if bad is not None:
                return bad
        elif isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or x < 0:
            return x
    return None


def _check_profile_entry(value, path, entry: str, rows) -> None:
    """Refuse a profile file's entry that is not a non-empty list of finite numbers >= 0 (``per_root``: a list of
    such lists), naming the key, the file, the entry and its first bad value.

    Raises:
        ConfigError: the paragraph.
    """
    lists = (
        rows
        if entry == "per_root" and isinstance(rows, list) and rows and all(isinstance(r, list) for r in rows)
        else [rows]
    )
    empty = any(not isinstance(r, list) or not r for r in lists)
    bad = None if empty else _first_bad(rows)
    if not empty and bad is None:
        return
    shape = (
        "a non-empty list of lists (one per root step) of"
        if entry == "per_root"
        else "a non-empty list (one per depth) of"
    )
    held = "an empty or malformed list" if empty else f"the value {bad!r}"
    raise ConfigError(
        f"delta_profile={value!r} is invalid: the {entry!r} entry of {path} must be {shape} finite numbers "
        f">= 0, and it holds {held}. Calibrate a new one (python -m experiments.calibrate), give delta_profile "
        "as a list of values, or delta_profile=null (calibrate)."
    )
