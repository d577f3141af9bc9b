"""Latency of the speculative sampler on the digits network: ``python -m benchmarks.latency`` (``make bench-latency``).

Seconds per batch of ``n`` images (n = 1, 2, 4, 8) for the standard sampler and each speculative arm of
:data:`benchmarks.opcount.ARMS` (tree execution, the digits network's paper protocol: T = 100, eps = 0.3),
on one torch thread, all arms interleaved in one process (repeat-major, so machine load hits every arm
alike), median and range of ``--repeats`` runs after one warm-up. Only the sampler call is timed (the
tree search, records and statistics are not).

With ``--pad MS``, every network call is padded to a fixed cost: after the call the process sleeps for
``MS`` minus the call's own time (a call that costs the same whatever its rows, as on a GPU below its
knee); ``--pad 0`` is the real CPU. The ideal speedup of an arm is the standard sampler's network calls
over the arm's (both counted); the wall-clock speedup is the standard sampler's median time over the
arm's; ``realised`` is their ratio.

With ``--compile``, every speculative arm also runs with ``compile=true`` (the dense round under
``torch.compile``; :mod:`specsamp.round.compiled`), interleaved with the eager arms: the row's ``compile`` column is
True, ``vs_eager`` its eager arm's median over its own, and ``compile_s`` the one-off cost (the warm-up run,
which compiles, less the median run).

Writes ``--out CSV`` (``results/digits/latency.csv``) with the load average before and after. Timings
depend on the machine and on what else runs on it: compare rows of one file, not files.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks.common import cpu_model
from benchmarks.opcount import ARMS, arm_overrides

DEFAULT_ARMS = ("standard", "dgrs 2x3", "dgrs 2x5", "rmc chain14", "x0+optimal B14", "x0+optimal B62")


class PaddedVelocity:
    """A velocity model whose every call lasts at least ``pad_s`` seconds (it sleeps for the rest); counts calls.

    Args:
        model: the velocity model (its other attributes are passed through).
        pad_s: the fixed cost of one call in seconds (0: no padding).
    """

    def __init__(self, model, pad_s: float):
        self.model, self.pad_s, self.calls = model, pad_s, 0

    def __getattr__(self, name):
        return getattr(self.model, name)

    def __call__(self, x, sigma, **cond):
        t0 = time.perf_counter()
        out = self.model(x, sigma, **cond)
        self.calls += 1
        if self.pad_s > 0:
            rest = self.pad_s - (time.perf_counter() - t0)
            if rest > 0:
                time.sleep(rest)
        return out


def _timed_run(overrides: list[str], target) -> tuple[float, object]:
    """Run one configuration; return the sampler call's wall seconds and its result."""
    from specsamp.runner import compose, loop

    box = {}
    spec, std = loop.sample_speculative, loop.sample_standard

    def wrap(fn):
        def inner(*a, **k):
            t0 = time.perf_counter()
            res = fn(*a, **k)
            box["s"], box["res"] = time.perf_counter() - t0, res
            return res

        return inner

    loop.sample_speculative, loop.sample_standard = wrap(spec), wrap(std)
    try:
        loop.run_config(compose(overrides), target=target)
    finally:
        loop.sample_speculative, loop.sample_standard = spec, std
    return box["s"], box["res"]


def measure(
    pads_ms=(0, 2, 5, 20), ns=(1, 2, 4, 8), arms=DEFAULT_ARMS, repeats: int = 5, progress=print, compile: bool = False
) -> list[dict]:
    """Rows ``{pad_ms, n, arm, compile, median_s, min_s, max_s, calls, ideal_speedup, wall_speedup, realised, ...}``;
    with ``compile``, every speculative arm twice (eager, then ``compile=true``, with ``vs_eager`` and ``compile_s``)."""
    from specsamp.runner import build_target, compose, load_config

    base = build_target(load_config(compose(["model=digits"]))[0])
    variants = [(a, False) for a in arms] + ([(a, True) for a in arms if a != "standard"] if compile else [])
    rows = []
    for pad in pads_ms:
        padded = PaddedVelocity(base.model, pad / 1000.0)
        target = dataclasses.replace(base, model=padded)
        times = {(n, v): [] for n in ns for v in variants}
        calls, nfe, first = {}, {}, {}
        for rep in range(repeats + 1):  # repetition 0 warms caches and allocators (and compiles), and is not kept
            for n in ns:
                for v in variants:
                    arm, comp = v
                    padded.calls = 0
                    s, res = _timed_run(arm_overrides("digits", arm, n) + (["compile=true"] if comp else []), target)
                    calls[(n, v)] = padded.calls
                    nfe[(n, v)] = float(res.speedup.mean())
                    if rep:
                        times[(n, v)].append(s)
                    else:
                        first[(n, v)] = s
        for n in ns:
            std = statistics.median(times[(n, ("standard", False))])
            for v in variants:
                arm, comp = v
                t = times[(n, v)]
                med = statistics.median(t)
                ideal = calls[(n, ("standard", False))] / calls[(n, v)]
                row = {
                    "pad_ms": pad,
                    "n": n,
                    "arm": arm,
                    "median_s": med,
                    "min_s": min(t),
                    "max_s": max(t),
                    "calls": calls[(n, v)],
                    "nfe_speedup": nfe[(n, v)],
                    "ideal_speedup": ideal,
                    "wall_speedup": std / med,
                    "realised": std / med / ideal,
                    "repeats": len(t),
                }
                if compile:
                    eager = statistics.median(times[(n, (arm, False))])
                    row.update(compile=comp, vs_eager=eager / med, compile_s=first[(n, v)] - med if comp else 0.0)
                rows.append(row)
                if progress:
                    extra = f"  {eager / med:5.2f}x eager, compile {row['compile_s']:.1f} s" if compile and comp else ""
                    progress(
                        f"  pad {pad:>2} ms n={n} {arm + (' +compile' if comp else ''):<24} {med * 1e3:8.1f} ms "
                        f"[{min(t) * 1e3:.1f}-{max(t) * 1e3:.1f}]  calls {row['calls']:>3}  ideal {ideal:5.2f}x  "
                        f"wall {row['wall_speedup']:5.2f}x  realised {row['realised']:.0%}{extra}"
                    )
    return rows


def main(argv=None) -> int:
    """CLI (see the module docstring); returns the exit status."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.latency", description=__doc__.split("\n\n")[0])
    p.add_argument("--pad", default="0,2,5,20", help="comma-separated fixed call costs in ms (0: the real CPU)")
    p.add_argument("--n", default="1,2,4,8", help="comma-separated images per batch")
    p.add_argument("--arms", default=",".join(DEFAULT_ARMS), help=f"comma-separated arms of: {', '.join(ARMS)}")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--compile", action="store_true", help="also run every speculative arm with compile=true")
    p.add_argument("--out", default=None, help="write the rows as CSV here")
    a = p.parse_args(argv)
    try:
        pads = [float(v) for v in a.pad.split(",")]
        ns = [int(v) for v in a.n.split(",")]
        arms = [s.strip() for s in a.arms.split(",")]
        assert all(v >= 0 for v in pads) and all(v >= 1 for v in ns) and all(s in ARMS for s in arms) and a.repeats >= 1
        assert "standard" in arms
    except (ValueError, AssertionError):
        print(
            f"error: --pad={a.pad!r} --n={a.n!r} --arms={a.arms!r} --repeats={a.repeats!r} is invalid: pads are ms >= 0, "
            f"n integers >= 1, arms among {', '.join(ARMS)} (standard included), repeats >= 1",
            file=sys.stderr,
        )
        return 2
    torch.set_num_threads(1)
    load0 = os.getloadavg()[0]
    print(
        f"latency on the digits network: {cpu_model()}, torch {torch.__version__}, 1 thread, load average {load0:.2f}",
        flush=True,
    )
    if a.compile:
        from specsamp.inductor import unavailable

        why = unavailable("cpu")
        if why is not None:
            print(f"error: --compile is invalid here: {why}", file=sys.stderr)
            return 2
    rows = measure(pads, ns, arms, a.repeats, compile=a.compile)
    load1 = os.getloadavg()[0]
    print(f"load average {load0:.2f} before, {load1:.2f} after ({os.cpu_count()} CPUs)", flush=True)
    if a.out:
        import pandas as pd

        from specsamp.io import atomic_write

        df = pd.DataFrame(rows)
        df["load_before"], df["load_after"], df["cpus"] = load0, load1, os.cpu_count()
        df["cpu"] = cpu_model()
        df["torch"] = torch.__version__
        atomic_write(Path(a.out), lambda f: df.to_csv(f, index=False, float_format="%.6g"), mode="w")
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
