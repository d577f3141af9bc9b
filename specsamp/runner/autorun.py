"""``sampler=auto`` in a run: the choice made before sampling (:func:`specsamp.autosample.plan_auto`) as the runner's
tree, coupling and record fields."""

from __future__ import annotations

import torch

from ..autosample import default_cache, plan_auto
from ..errors import ConfigError
from ..schedule import Schedule
from ..treesearch import TreesByRoot
from .build import load_profile


def auto_profile(value):
    """``delta_profile`` as auto reads it: None (cached or piloted), a list (per depth, or per root step then per
    depth), or a shipped profile's name / ``.json`` path, whose ``per_root`` entry is used."""
    if value is None or isinstance(value, (list, tuple)):
        return value
    return load_profile(value)["per_root"]


def plan_run(run, schedule: Schedule, target, prepared, max_batch: int | None):
    """The run's tree (a :class:`~specsamp.treesearch.TreesByRoot`, or None for the plain loop), its record fields and
    the ``auto`` record entry, planned for the run's first batch (``batch_size`` trajectories share each call).

    Raises:
        ConfigError: a bad ``delta_profile`` (its length against ``T - 2`` roots included).
    """
    n_total = prepared.n_trajectories
    M = min(run.batch_size or n_total, n_total)
    ids = prepared.ids[:M].to(torch.device(getattr(target.model, "device", run.device)))
    cond = target.cond_for(ids, run.seed) if target.cond_for is not None else None
    try:
        choice = plan_auto(
            target.model,
            schedule,
            M,
            draft=run.draft,
            seed=run.seed,
            cond=cond or None,
            max_batch=max_batch,
            delta_profile=auto_profile(run.delta_profile),
            cache=default_cache(persist=True),
        )
    except ValueError as e:  # a profile's or a size's refusal: a user error, exit 2
        raise ConfigError(str(e)) from None
    record = choice.record(schedule.steps)
    if choice.plan.use_loop:
        return None, {"tree": "none (auto: the plain loop)", "budget": 0, "call_rows": 1}, record
    first, end = schedule.first_speculative, schedule.end_speculative
    trees = TreesByRoot({n: choice.plan.tree(n) for n in range(first, end)})
    fields = {
        "tree": f"auto: {choice.plan.coupling}, {len(record['by_root'])} segment(s) by root step",
        "budget": len(trees.largest) - 1,
        "call_rows": trees.call_rows(run.evaluate_leaves),
        "trees_by_root": trees.parents(),
    }
    return trees, fields, record
