"""The section 5.1 mixture at batch 1 and batched, against the per-trajectory numpy loop.

``python -m benchmarks.gmm_batch1 [--repeats 5] [--single 4] [--batch 100] [--compile] [--out results/gmm/batch1.csv]``

Cells of the section 5.1 grid (d = 500, five components, T = 30, eps = 0.1): D-GRS (2,3), D-GRS (5,3) and
RMC on a chain of 14. For each cell, in one process and interleaved within every repeat (so load hits
every arm alike): the numpy loop of :mod:`benchmarks.numpy_lazy` (one trajectory at a time), specsamp
with one trajectory per call (``--single`` calls, trajectory ids 0, 1, ...) and specsamp with ``--batch``
trajectories in one call, each in the ``tree`` and ``path`` executions. Every time is seconds per
trajectory; a row reports the median and the range over the repeats, and the ratio to the numpy loop's
median (below 1: specsamp is faster). One torch thread.

The counted columns say where the time of a single trajectory goes: ATen operations per trajectory
(everything the sampler dispatches, the network and the coupling included; :mod:`benchmarks.opcount`) and
the time per operation they imply. Nothing here is asserted anywhere.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
import time

import torch

CELLS = (("dgrs", 2, 3), ("dgrs", 5, 3), ("rmc", 2, 3))
"""``(rule, K, L)``: D-GRS on uniform(K, L); RMC on the chain of the same budget (B = 14 for (2, 3))."""


def _setup():
    from benchmarks.numpy_lazy import NumpyGMM
    from specsamp.models import GaussianMixture
    from specsamp.schedule import Schedule

    gmm = GaussianMixture(dim=500, components=5, layout_seed=0, dtype=torch.float64)
    return gmm, NumpyGMM(gmm.means.cpu().numpy(), gmm.stds.cpu().numpy()), Schedule.make(30, 0.1)


def _tree(rule, K, L):
    from specsamp.trees import DraftTree, budget

    return DraftTree.uniform(K, L) if rule == "dgrs" else DraftTree.chain(budget(K, L))


def measure(
    repeats: int = 5, single: int = 4, batch: int = 100, cells=CELLS, progress=print, compile: bool = False
) -> list[dict]:
    """Rows ``{cell, arm, n, median_s, min_s, max_s, ratio, ops_per_traj, us_per_op}`` (seconds per trajectory).

    ``compile``: also the tree execution at one trajectory under ``compile=true`` (compiled in the warm-up;
    its ``ops_per_traj`` counts ATen calls from Python and fused kernel launches, ``benchmarks.opcount.counting_compiled``).

    Raises:
        ValueError: ``repeats < 1``, ``single < 1`` or ``batch < 1``.
    """
    if min(repeats, single, batch) < 1:
        raise ValueError(f"repeats={repeats}, single={single}, batch={batch}: each must be >= 1")
    from benchmarks.numpy_lazy import run_cell
    from benchmarks.opcount import counting, counting_compiled
    from specsamp.sampler import sample_speculative

    torch.set_num_threads(1)
    gmm, base, sch = _setup()
    rows = []
    for rule, K, L in cells:
        tree = _tree(rule, K, L)
        cell = f"{rule} ({K},{L})"
        arms = {"numpy loop": (None, 1, False)}
        for ex in ("tree", "path"):
            arms[f"specsamp {ex} n=1"] = (ex, 1, False)
            arms[f"specsamp {ex} n={batch}"] = (ex, batch, False)
        if compile:
            arms["specsamp tree n=1 compiled"] = ("tree", 1, True)

        def run(arm, r, arms=arms, rule=rule, K=K, L=L, tree=tree):  # this cell's, bound now
            ex, n, comp = arms[arm]
            if ex is None:
                t0 = time.perf_counter()
                run_cell(base, 30, 0.1, K, L, rule, single, seed=r)
                return (time.perf_counter() - t0) / single
            if n == 1:
                t0 = time.perf_counter()
                for i in range(single):
                    sample_speculative(gmm, sch, tree, rule, indices=[i], execution=ex, seed=r, compile=comp)
                return (time.perf_counter() - t0) / single
            t0 = time.perf_counter()
            sample_speculative(gmm, sch, tree, rule, n, execution=ex, seed=r)
            return (time.perf_counter() - t0) / n

        for arm in arms:  # warm-up: first calls pay for allocation and lazy imports
            run(arm, 10_000)
        times = {arm: [] for arm in arms}
        for r in range(repeats):
            for arm in arms:
                times[arm].append(run(arm, r))
        ref = statistics.median(times["numpy loop"])
        for arm, ts in times.items():
            ex, n, comp = arms[arm]
            ops = None
            if ex is not None and n == 1:
                with counting_compiled() if comp else counting() as c:
                    sample_speculative(gmm, sch, tree, rule, indices=[0], execution=ex, seed=0, compile=comp)
                ops = c.total_ops
            med = statistics.median(ts)
            rows.append(
                {
                    "cell": cell,
                    "arm": arm,
                    "n": n if ex is not None else 1,
                    "median_s": med,
                    "min_s": min(ts),
                    "max_s": max(ts),
                    "ratio": med / ref,
                    "ops_per_traj": ops,
                    "us_per_op": None if ops is None else 1e6 * med / ops,
                }
            )
            if progress:
                progress(
                    f"  {cell} {arm}: {1e3 * med:.2f} ms per trajectory [{1e3 * min(ts):.2f}-{1e3 * max(ts):.2f}], "
                    f"{med / ref:.2f}x the numpy loop" + (f", {ops} ops, {1e6 * med / ops:.1f} us/op" if ops else "")
                )
    return rows


FIELDS = ("cell", "arm", "n", "median_s", "min_s", "max_s", "ratio", "ops_per_traj", "us_per_op")


def main(argv=None) -> int:
    """CLI (see the module docstring); returns the exit status."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.gmm_batch1", description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=5, help="interleaved repeats per arm (median and range)")
    p.add_argument("--single", type=int, default=4, help="trajectories timed one call each, per repeat")
    p.add_argument("--batch", type=int, default=100, help="trajectories of the batched call")
    p.add_argument("--out", default=None, help="CSV to write (results/gmm/batch1.csv)")
    p.add_argument("--compile", action="store_true", help="also the tree execution at n=1 under compile=true")
    a = p.parse_args(argv)
    if min(a.repeats, a.single, a.batch) < 1:
        print(
            f"error: --repeats={a.repeats}, --single={a.single}, --batch={a.batch}: each must be an integer >= 1",
            file=sys.stderr,
        )
        return 2
    print(
        f"GMM d=500, T=30, eps=0.1: seconds per trajectory, torch {torch.__version__}, 1 thread, "
        f"median [min-max] of {a.repeats}",
        flush=True,
    )
    comp = False
    if a.compile:
        from specsamp.inductor import unavailable

        why = unavailable("cpu")
        if why is not None:
            print(f"error: --compile: {why}", file=sys.stderr)
            return 2
        comp = True
    rows = measure(a.repeats, a.single, a.batch, progress=lambda s: print(s, flush=True), compile=comp)
    if a.out:
        with open(a.out, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=FIELDS)
            w.writeheader()
            for r in rows:
                w.writerow(
                    {k: (f"{v:.6g}" if isinstance(v, float) else ("" if v is None else v)) for k, v in r.items()}
                )
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
