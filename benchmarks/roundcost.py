"""Where a round's time goes outside the network: ``python -m benchmarks.roundcost`` (part of ``make bench-latency``).

A speculative round on the CPU costs its batched network call plus the round's own work. At one image on
the digits network the call takes about 0.7 ms, and the round's own work is of the same order, so it
decides whether speculation pays in time. This benchmark splits one arm's sampler call (digits network,
tree execution, one torch thread, T = 100, eps = 0.3) into:

- ``network``: inside the target's forward passes (``specsamp.round.context.Velocity.__call__``), timed by a wrapper;
- ``tables``: the per-run tables built before the first round (the tree's index tensors and buffers, the
  per-root coefficient tables, the pre-drawn draft noise and coupling uniforms: the one constructor of
  ``specsamp.round.tables.DenseTables``), timed by a wrapper;
- ``aten``: the self time of every ATen operator the rest of the run dispatches, from ``torch.profiler``
  (allocation operators ``empty*`` shown apart, as ``alloc``), with the operator count;
- ``python``: what remains of the wall time: the interpreter running the round's Python, torch's
  Python-to-C++ argument parsing and dispatch, the host-side bookkeeping.

The uninstrumented run gives the wall time; the profiled run gives the ATen share (the profiler adds a
little time per operator, so the split is of the profiled run, scaled to the uninstrumented wall time).
The split is a time measurement: compare shares within one run of this module, not across machines.
Counts of operators and host syncs, which do not depend on the machine, are :mod:`benchmarks.opcount`'s.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from collections import Counter

import torch

from benchmarks.common import cpu_model
from benchmarks.opcount import ARMS, arm_overrides

DEFAULT_ARMS = ("standard", "rmc chain14", "dgrs 2x3", "x0+optimal B14")
ALLOC_OPS = ("empty", "empty_strided", "empty_like", "resize_")


@contextlib.contextmanager
def _quiet_stderr():
    """Silence file descriptor 2 inside (the profiler's C++ start and stop lines)."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


@contextlib.contextmanager
def _timed_regions():
    """Time the network calls and the per-run table builders; yields ``{region: seconds}``."""
    from specsamp.round import context, tables

    spent = Counter()
    patched = []

    def wrap(owner, name, region):
        fn = getattr(owner, name)

        def inner(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[region] += time.perf_counter() - t0
                spent[region + "_calls"] += 1

        setattr(owner, name, inner)
        patched.append((owner, name, fn))

    wrap(context.Velocity, "__call__", "network")
    wrap(tables.DenseTables, "__init__", "tables")
    try:
        yield spent
    finally:
        for owner, name, fn in reversed(patched):
            setattr(owner, name, fn)


def _sampler_call(overrides: list[str], target):
    """Run one configuration; return the sampler call's wall seconds and its result (as benchmarks.latency)."""
    from benchmarks.latency import _timed_run

    return _timed_run(overrides, target)


def _aten_outside_network(prof) -> tuple[float, float, int]:
    """Self CPU seconds of the ATen operators outside the network scope (all, allocation) and their count."""
    total = alloc = 0.0
    count = 0
    for ev in prof.events():
        if not ev.name.startswith("aten::"):
            continue
        p, inside = ev.cpu_parent, False
        while p is not None:
            if p.name == "specsamp::network":
                inside = True
                break
            p = p.cpu_parent
        if inside:
            continue
        s = ev.self_cpu_time_total / 1e6
        total += s
        count += 1
        if ev.name.split("::", 1)[1] in ALLOC_OPS:
            alloc += s
    return total, alloc, count


def measure(arms=DEFAULT_ARMS, n: int = 1, repeats: int = 5, progress=print) -> list[dict]:
    """Rows ``{arm, n, rounds, wall_ms, network_ms, tables_ms, aten_ms, alloc_ms, python_ms, ops, *_per_round_ms}``:
    the median over ``repeats`` of the uninstrumented wall time, its split from one profiled run."""
    from specsamp.round import context
    from specsamp.runner import build_target, compose, load_config

    target = build_target(load_config(compose(["model=digits"]))[0])
    rows = []
    walls = {a: [] for a in arms}
    splits = {}
    for rep in range(repeats + 1):  # repetition 0 warms caches and allocators and is not kept
        for arm in arms:
            with _timed_regions() as spent:
                s, res = _sampler_call(arm_overrides("digits", arm, n), target)
            if rep:
                walls[arm].append((s, dict(spent)))
    vel_call = context.Velocity.__call__

    def scoped(self, *a, **k):
        with torch.profiler.record_function("specsamp::network"):
            return vel_call(self, *a, **k)

    for arm in arms:
        context.Velocity.__call__ = scoped
        try:
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            with _quiet_stderr():
                prof.start()
            try:
                with _timed_regions() as spent:
                    s_prof, res = _sampler_call(arm_overrides("digits", arm, n), target)
            finally:
                with _quiet_stderr():
                    prof.stop()
        finally:
            context.Velocity.__call__ = vel_call
        aten, alloc, ops = _aten_outside_network(prof)
        rounds = (
            int(max(res.rounds)) if arm != "standard" else int(spent["network_calls"])
        )  # the standard sampler: steps
        splits[arm] = (s_prof, dict(spent), aten, alloc, ops, rounds)
    for arm in arms:
        s_prof, spent_p, aten, alloc, ops, rounds = splits[arm]
        wall = statistics.median(s for s, _ in walls[arm])
        net = statistics.median(sp.get("network", 0.0) for _, sp in walls[arm])
        tables = statistics.median(sp.get("tables", 0.0) for _, sp in walls[arm])
        own_prof = max(s_prof - spent_p.get("network", 0.0) - spent_p.get("tables", 0.0), 1e-12)
        own = max(wall - net - tables, 0.0)
        scale = own / own_prof  # the profiled run's split of the round's own time, scaled to the plain run
        aten_s = min(aten * scale, own)
        row = {
            "arm": arm,
            "n": n,
            "rounds": rounds,
            "wall_ms": wall * 1e3,
            "network_ms": net * 1e3,
            "tables_ms": tables * 1e3,
            "aten_ms": (aten_s - alloc * scale) * 1e3,
            "alloc_ms": alloc * scale * 1e3,
            "python_ms": (own - aten_s) * 1e3,
            "ops": ops,
            "spread_ms": (max(s for s, _ in walls[arm]) - min(s for s, _ in walls[arm])) * 1e3,
        }
        per = max(rounds, 1)
        for k in ("network", "tables", "aten", "alloc", "python"):
            row[f"{k}_per_round_ms"] = row[f"{k}_ms"] / per
        row["ops_per_round"] = ops / per
        row["us_per_op"] = (own * 1e6 / ops) if ops else float("nan")
        rows.append(row)
        if progress:
            unit = "step" if arm == "standard" else "round"
            progress(
                f"  {arm:<16} {wall * 1e3:7.1f} ms [spread {row['spread_ms']:.1f}]  "
                f"{'steps' if arm == 'standard' else 'rounds'} {rounds:>3}  per {unit}: "
                f"network {row['network_per_round_ms']:.2f}  tables {row['tables_per_round_ms']:.2f}  "
                f"aten {row['aten_per_round_ms']:.2f} (+alloc {row['alloc_per_round_ms']:.2f})  "
                f"python {row['python_per_round_ms']:.2f} ms  ({row['ops_per_round']:.0f} ops, "
                f"{row['us_per_op']:.1f} us of own time per op)"
            )
    return rows


def main(argv=None) -> int:
    """CLI (see the module docstring); returns the exit status."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.roundcost", description=__doc__.split("\n\n")[0])
    p.add_argument("--arms", default=",".join(DEFAULT_ARMS), help=f"comma-separated arms of: {', '.join(ARMS)}")
    p.add_argument("--n", type=int, default=1, help="images per batch")
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args(argv)
    arms = [s.strip() for s in a.arms.split(",")]
    if not all(s in ARMS for s in arms) or a.n < 1 or a.repeats < 1:
        print(
            f"error: --arms={a.arms!r} --n={a.n!r} --repeats={a.repeats!r} is invalid: arms among {', '.join(ARMS)}, "
            f"n and repeats integers >= 1",
            file=sys.stderr,
        )
        return 2
    torch.set_num_threads(1)
    print(
        f"round cost on the digits network: {cpu_model()}, torch {torch.__version__}, 1 thread, n={a.n}, "
        f"median of {a.repeats}",
        flush=True,
    )
    measure(arms, a.n, a.repeats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
