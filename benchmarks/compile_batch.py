"""``compile=true`` against eager on a batch: ``python -m benchmarks.compile_batch [--n 5000] [--json PATH]`` (a
section of ``make bench``).

The Gaussian mixture (d = 2, five components, layout 0), T = 8, eps = 0.1, D-GRS on the (2, 3) tree, tree
execution, seed 0, one thread (``OMP_NUM_THREADS=1``): what ``python run.py model.dim=2 steps=8 eps=0.1
execution=tree sampler=dgrs K=2 L=3 compile=true n_samples=5000`` samples. Each arm runs in a fresh interpreter
(the timings exclude its imports): eager, best of two runs; compiled into an empty inductor cache directory
(``TORCHINDUCTOR_CACHE_DIR``, a temporary one), first run (it compiles every graph) and second run (the graphs
compiled); compiled in another fresh process on that cache, first run (TorchDynamo traces again, inductor loads
its kernels). Each row gives its seconds and their ratio to eager's, with the CPU's model. Nothing is asserted.

The compile is a fixed cost per process and batch size (the round's pieces, :class:`specsamp.round.compiled.Stages`), not a
cost per trajectory: the second compiled run is the one that shows the compiled kernels' own speed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from benchmarks.common import cpu_model, table, write_json

N = 5000
COLUMNS = [
    ("arm", "arm", "s"),
    ("n", "n", "d"),
    ("seconds", "seconds", ".2f"),
    ("ratio", "/ eager", ".2f"),
    ("cpu", "CPU", "s"),
]


def _runs(n: int, compile: bool, runs: int) -> list[float]:
    """Seconds of each of ``runs`` runs of the cell in this process."""
    import time

    import torch

    from specsamp import sampler
    from specsamp.models import GaussianMixture
    from specsamp.schedule import Schedule
    from specsamp.trees import DraftTree

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model, sched = GaussianMixture(dim=2, components=5, layout_seed=0), Schedule.make(8, 0.1)
    out = []
    try:
        for _ in range(runs):
            t0 = time.perf_counter()
            sampler.sample_speculative(
                model, sched, DraftTree.uniform(2, 3), "dgrs", n, execution="tree", seed=0, compile=compile
            )
            out.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    return out


def _child(n: int, compile: bool, runs: int, cache: str | None = None, timeout: float = 1800) -> list[float]:
    """:func:`_runs` in a fresh interpreter, one thread, inductor's cache in ``cache`` where given."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    if cache is not None:
        env["TORCHINDUCTOR_CACHE_DIR"] = cache
    args = [
        sys.executable,
        "-m",
        "benchmarks.compile_batch",
        "--child",
        "compiled" if compile else "eager",
        "--n",
        str(n),
        "--runs",
        str(runs),
    ]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env, cwd=root, check=True)
    return json.loads(p.stdout.strip().splitlines()[-1])


def compile_rows(n: int = N, progress=print) -> list[dict]:
    """The section's rows: eager, compiled first run on an empty cache, compiled second run, compiled first run on
    the warm cache (:mod:`benchmarks.compile_batch`); ``seconds``, ``ratio`` (to eager) and ``cpu`` each."""
    cpu = cpu_model()
    eager = min(_child(n, False, 2))
    if progress:
        progress(f"  eager: {eager:.2f} s")
    with tempfile.TemporaryDirectory(prefix="specsamp-inductor-") as cache:
        cold = _child(n, True, 2, cache)
        if progress:
            progress(f"  compiled, empty cache: first run {cold[0]:.2f} s, second {cold[1]:.2f} s")
        warm = _child(n, True, 1, cache)[0]
        if progress:
            progress(f"  compiled, warm cache: first run {warm:.2f} s")
    rows = [
        ("eager (best of 2)", eager),
        ("compiled, first run, empty cache", cold[0]),
        ("compiled, second run", cold[1]),
        ("compiled, first run, warm cache", warm),
    ]
    return [{"arm": arm, "n": n, "seconds": s, "ratio": s / eager, "cpu": cpu} for arm, s in rows]


def main(argv=None) -> int:
    """CLI (see the module docstring); returns the exit status."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.compile_batch", description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=N, help=f"trajectories (default {N})")
    p.add_argument("--json", default=None, help="also write the rows here")
    p.add_argument("--child", choices=("eager", "compiled"), default=None, help=argparse.SUPPRESS)
    p.add_argument("--runs", type=int, default=1, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        print(json.dumps(_runs(a.n, a.child == "compiled", a.runs)), flush=True)
        return 0
    from specsamp.inductor import unavailable

    why = unavailable("cpu")
    if why is not None:
        print(f"error: compile=true is unavailable here: {why}", file=sys.stderr)
        return 2
    rows = compile_rows(a.n)
    print(table(rows, COLUMNS), flush=True)
    write_json(rows, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
