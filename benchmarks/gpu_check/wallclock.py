"""Section ``wallclock``: standard vs speculative sampling on the digits network, and the host's waits."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from benchmarks.common import TimedModel, fmt_stats, now, peak_mib, peak_reset, stats
from benchmarks.gpu_check.harness import Context, section
from benchmarks.gpu_check.support import DIGITS, EPS, ROOT, digits_velocity, run_arm
from specsamp.schedule import Schedule
from specsamp.trees import DraftTree

PROFILE = ROOT / "conf" / "profiles" / "edm-digits-8x8-cond_x0.json"
SHARE = 0.45  # of --budget-s, after which the section starts no new measurement


def x0_optimal_tree(budget: int, steps: int) -> DraftTree:
    """``tree=optimal`` for the x0 draft from the shipped profile: the search ``tree=optimal`` runs (D-GRS
    positional acceptance from the per-depth profile, depth capped at ``T - 2`` and the budget, width at 32)."""
    from specsamp import treesearch

    profile = json.loads(PROFILE.read_text())["profile"]
    positional = treesearch.profile_positional(profile, "dgrs")
    return treesearch.optimal_tree(budget, positional, min(steps - 2, budget), min(32, budget))


def arms(steps: int) -> list[dict]:
    """The wall-clock section's arms: ``name, tree, coupling, draft, budget`` (standard: tree None)."""
    h = steps - 2
    return [
        {"name": "standard", "tree": None, "coupling": None, "draft": None, "budget": 0},
        {
            "name": "dgrs (2,3)",
            "tree": DraftTree.uniform(2, min(3, h)),
            "coupling": "dgrs",
            "draft": "velocity",
            "budget": 14,
        },
        {
            "name": "dgrs (2,5)",
            "tree": DraftTree.uniform(2, min(5, h)),
            "coupling": "dgrs",
            "draft": "velocity",
            "budget": 62,
        },
        {
            "name": "rmc chain 14",
            "tree": DraftTree.chain(min(14, h)),
            "coupling": "rmc",
            "draft": "velocity",
            "budget": 14,
        },
        {
            "name": "x0+optimal B=14",
            "tree": x0_optimal_tree(14, steps),
            "coupling": "dgrs",
            "draft": "x0",
            "budget": 14,
        },
        {
            "name": "x0+optimal B=62",
            "tree": x0_optimal_tree(62, steps),
            "coupling": "dgrs",
            "draft": "x0",
            "budget": 62,
        },
    ]


@section("wallclock")
def wallclock(ctx: Context) -> dict:
    """Wall clock of every arm (:func:`arms`) at every batch on the digits network (section 2 of
    :mod:`benchmarks.gpu_check`).

    Returns:
        ``{"rows": [{arm, batch, budget, wall_s, network_s, other_s (median [min-max]), per_image_s,
        wall_speedup (standard median / arm median), nfe_speedup (mean over images), batch_nfe,
        rounds_mean, rows_per_image, peak_mib, calls: {rows: count}}], "trees": {arm: parent list}}``.
    """
    dev = ctx.device
    model = TimedModel(digits_velocity(dev))
    schedule = Schedule.make(ctx.steps, EPS)
    t = time.perf_counter()
    the_arms = arms(ctx.steps)
    search_s = time.perf_counter() - t
    rows, calls = ctx.partial.setdefault("rows", []), {}
    for n in ctx.batches:
        base = None
        for arm in the_arms:
            if ctx.over_share(SHARE):
                rows.append({"arm": arm["name"], "batch": n, "skipped": "the section's share of the budget is spent"})
                continue
            model.reset()
            res = run_arm(model, arm, schedule, n, ctx.seed)  # warm-up: the same shapes as the timed runs
            call_rows = list(model.rows)
            walls, nets, differ = [], [], 0
            peak_reset(dev)
            for _ in range(ctx.repeats):
                model.reset()
                t = now(dev)
                res = run_arm(model, arm, schedule, n, ctx.seed)
                walls.append(now(dev) - t)
                nets.append(model.network_s())
                differ += model.rows != call_rows  # same seed, same calls, unless the device's arithmetic varies
            w = stats(walls)
            base = w["median"] if arm["tree"] is None else base
            hist = {}
            for r in call_rows:
                hist[r] = hist.get(r, 0) + 1
            calls[(arm["name"], n)] = hist
            rows.append(
                {
                    "arm": arm["name"],
                    "batch": n,
                    "budget": arm["budget"],
                    "wall_s": w,
                    "network_s": stats(nets),
                    "other_s": stats([a - b for a, b in zip(walls, nets)]),
                    "per_image_s": w["median"] / n,
                    "wall_speedup": (base / w["median"]) if base else None,
                    "nfe_speedup": float(res.speedup.double().mean()) if arm["tree"] is not None else 1.0,
                    "batch_nfe": int(res.batch_nfe),
                    "rounds_mean": float(res.rounds.double().mean()),
                    "rows_per_image": float(res.target_rows.double().mean()),
                    "peak_mib": peak_mib(dev),
                    "calls": {str(k): v for k, v in sorted(hist.items())},
                    "runs_with_other_calls": differ,
                }
            )
            ctx.log(f"  wallclock {arm['name']:<16} x{n:<3}: {fmt_stats(w)}, NFE speedup {rows[-1]['nfe_speedup']:.2f}")
    syncs = {}
    n_sync = 16 if 16 in ctx.batches else max(ctx.batches)
    for arm in the_arms:
        if dev.type != "cuda" or ctx.over_share(SHARE):
            break
        syncs[arm["name"]] = host_syncs(model, arm, schedule, n_sync, ctx.seed)
        ctx.log(
            f"  host syncs {arm['name']:<16} x{n_sync}: {syncs[arm['name']]['total']} "
            f"({syncs[arm['name']]['per_round']:.1f} per round)"
        )
    ctx.shared["wallclock"] = {"rows": rows, "calls": calls}
    lines = [
        f"wallclock {r['arm']:<16} x{r['batch']:<3}: {fmt_stats(r['wall_s'])} (network {fmt_stats(r['network_s'])}), "
        f"NFE speedup {r['nfe_speedup']:.2f}, wall speedup {r['wall_speedup'] or float('nan'):.2f}"
        for r in rows
        if "wall_s" in r
    ]
    trees = {a["name"]: (a["tree"].parent.tolist() if a["tree"] is not None else None) for a in the_arms}
    lines += [
        f"host syncs {k:<16} x{n_sync}: {v['total']} in all, {v['per_round']:.1f} per round; most at "
        + ", ".join(f"{w} ({c})" for w, c in v["where"][:3])
        for k, v in syncs.items()
    ]
    return {
        "network": DIGITS,
        "steps": ctx.steps,
        "eps": EPS,
        "execution": "tree",
        "repeats": ctx.repeats,
        "tree_search_s": search_s,
        "trees": trees,
        "rows": rows,
        "host_syncs": syncs,
        "host_syncs_batch": n_sync if syncs else None,
        "summary": lines,
        "passed": True,
    }


def host_syncs(model, arm: dict, schedule: Schedule, n: int, seed: int) -> dict:
    """Synchronising CUDA operations (the host waiting on the device) in one run of ``arm``, by source line.

    Counted with ``torch.cuda.set_sync_debug_mode("warn")``, whose warning names the Python line that
    asked; a round that is a fixed dataflow with no host round-trips has none.

    Returns:
        ``{"total", "per_round" (over the run's rounds, the slowest image's), "where": [[file:line, count], ...]}``
        (most frequent first, at most 20).
    """
    import warnings

    counts: dict[str, int] = {}
    before = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            res = run_arm(model, arm, schedule, n, seed)
        finally:
            torch.cuda.set_sync_debug_mode(before)
    for w in caught:
        if "synchroniz" not in str(w.message):
            continue
        try:
            where = f"{Path(w.filename).resolve().relative_to(ROOT)}:{w.lineno}"
        except ValueError:
            where = f"{Path(w.filename).name}:{w.lineno}"
        counts[where] = counts.get(where, 0) + 1
    total = sum(counts.values())
    rounds = max(int(res.rounds.max()), 1) if arm["tree"] is not None else schedule.steps
    return {
        "total": total,
        "per_round": total / rounds,
        "where": sorted(([k, v] for k, v in counts.items()), key=lambda kv: -kv[1])[:20],
    }
