"""Latency at two git revisions, interleaved in one sitting: ``python -m benchmarks.revlatency REV``.

A refactor of the round must not make it slower. This times the sampler call of a few arms (the digits
network's paper protocol, tree execution, one image, one torch thread) at git revision ``REV`` (checked out in a
temporary worktree) and in this checkout. Each side runs in its own long-lived Python process, which imports
its own tree's ``specsamp`` once and keeps its caches warm; the parent sends them one run at a time, repeat-major
and alternating which side goes first, so load on the machine hits both alike. One warm-up run per arm and
side is not kept. The table gives, per arm, each side's median and range in milliseconds and the ratio of the
medians (``HEAD / REV``: below 1 is faster here), with the CPU's model.

    python -m benchmarks.revlatency 0e196ae                      # default arms, 9 repeats
    python -m benchmarks.revlatency 0e196ae --arms "dgrs 2x3,rmc chain14" --repeats 15 --n 1

Only the sampler call is timed (:func:`specsamp.sampler.sample_speculative` or ``sample_standard`` as the
runner calls them), not the model's construction, the tree search or the record.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.common import cpu_model
from benchmarks.opcount import ARMS, arm_overrides

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_ARMS = ("standard", "dgrs 2x3", "rmc chain14", "x0+optimal B14", "markmax 2x3")

# the child: reads one JSON override list per line, runs it through its own tree's runner, prints the seconds
CHILD = r"""
import json, sys, time
import torch
torch.set_num_threads(1)
from specsamp.runner import build_target, compose, load_config, loop

target = build_target(load_config(compose(["model=digits"]))[0])
spec, std = loop.sample_speculative, loop.sample_standard
box = {}

def wrap(fn):
    def inner(*a, **k):
        t0 = time.perf_counter()
        res = fn(*a, **k)
        box["s"] = time.perf_counter() - t0
        return res
    return inner

loop.sample_speculative, loop.sample_standard = wrap(spec), wrap(std)
print("ready", flush=True)
for line in sys.stdin:
    loop.run_config(compose(json.loads(line)), target=target)
    print(box["s"], flush=True)
"""


class Side:
    """One tree's child process: :meth:`time` runs an override list there and returns its sampler seconds."""

    def __init__(self, tree: Path, out_dir: Path):
        env = dict(os.environ, PYTHONPATH=str(tree), OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", CHILD],
            cwd=out_dir,
            env=env,
            text=True,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        if self.proc.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the benchmark's child for {tree} did not start (exit {self.proc.poll()})")

    def time(self, overrides: list[str]) -> float:
        self.proc.stdin.write(json.dumps(overrides) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the benchmark's child ended (exit {self.proc.wait()}) on {overrides}")
        return float(line)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def measure(rev: str, arms=DEFAULT_ARMS, n: int = 1, repeats: int = 9, progress=print) -> list[dict]:
    """Rows ``{arm, rev_ms, rev_min, rev_max, head_ms, head_min, head_max, ratio}``, ``ratio`` = head / rev medians."""
    with tempfile.TemporaryDirectory(prefix="revlatency-") as tmp:
        tmp = Path(tmp)
        wt = tmp / "rev"
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(wt), rev], cwd=ROOT, check=True)
        try:
            sides = {"rev": Side(wt, tmp), "head": Side(ROOT, tmp)}
            times: dict = {(a, s): [] for a in arms for s in sides}
            for rep in range(repeats + 1):  # repetition 0 warms both sides and is not kept
                for a in arms:
                    ov = arm_overrides("digits", a, n) + [f"hydra.run.dir={tmp / 'out'}"]
                    for s in ("rev", "head") if rep % 2 else ("head", "rev"):
                        t = sides[s].time(ov)
                        if rep:
                            times[(a, s)].append(t)
            for side in sides.values():
                side.close()
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(wt)], cwd=ROOT, check=False)
    rows = []
    for a in arms:
        r, h = times[(a, "rev")], times[(a, "head")]
        row = {
            "arm": a,
            "rev_ms": 1e3 * statistics.median(r),
            "rev_min": 1e3 * min(r),
            "rev_max": 1e3 * max(r),
            "head_ms": 1e3 * statistics.median(h),
            "head_min": 1e3 * min(h),
            "head_max": 1e3 * max(h),
        }
        row["ratio"] = row["head_ms"] / row["rev_ms"]
        rows.append(row)
        if progress:
            progress(
                f"  {a:<16} {rev}: {row['rev_ms']:8.1f} ms [{row['rev_min']:.1f}-{row['rev_max']:.1f}]   "
                f"here: {row['head_ms']:8.1f} ms [{row['head_min']:.1f}-{row['head_max']:.1f}]   "
                f"here/{rev} {row['ratio']:.3f}"
            )
    return rows


def main(argv=None) -> int:
    """CLI (see the module docstring); returns the exit status."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.revlatency", description=__doc__.split("\n\n")[0])
    p.add_argument("rev", help="the git revision to compare this checkout against")
    p.add_argument("--arms", default=",".join(DEFAULT_ARMS), help=f"comma-separated arms of: {', '.join(ARMS)}")
    p.add_argument("--n", type=int, default=1, help="images per batch")
    p.add_argument("--repeats", type=int, default=9, help="kept runs per arm and side (after one warm-up)")
    args = p.parse_args(argv)
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = [a for a in arms if a not in ARMS]
    if unknown or args.n < 1 or args.repeats < 1:
        p.error(f"--arms {unknown} unknown (valid: {', '.join(ARMS)})" if unknown else "--n and --repeats must be >= 1")
    print(
        f"digits network, tree execution, n={args.n}, one torch thread, {args.repeats} repeats interleaved, "
        f"CPU: {cpu_model()}"
    )
    measure(args.rev, arms, args.n, args.repeats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
