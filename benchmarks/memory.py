"""Peak memory of one speculative round and of one coupling call: ``python -m benchmarks.memory``.

Each measurement runs in a fresh process and reports the growth of its peak resident set size
(``getrusage``) over the process's peak just before the measured work, in MiB. A round is the
``tree`` execution (every node drafted and evaluated) of D-GRS on the uniform (5, 3) tree, B = 155,
with ``M`` trajectories, a cheap analytic target (``v = -x``) and T = 5 (one round of three steps
when everything is accepted). The coupling call verifies ``M`` parents with K = 5 float32 children.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from benchmarks.common import LinearVelocity, in_subprocess, peak_rss_mib, write_json

SHAPES = {"3x32x32": (3, 32, 32), "4x64x64": (4, 64, 64)}


def _one(kind: str, shape: tuple[int, ...], m: int) -> dict:
    from specsamp import rng
    from specsamp.coupling import dgrs
    from specsamp.sampler import sample_speculative
    from specsamp.schedule import Schedule
    from specsamp.trees import DraftTree

    torch.set_num_threads(1)
    model = LinearVelocity(shape)
    sch, tree = Schedule.make(5, 0.3), DraftTree.uniform(5, 3)
    g = torch.Generator().manual_seed(0)
    if kind == "coupling":
        mean_p = torch.randn(m, *shape, generator=g)
        mean_q = mean_p + 0.01 * torch.randn(m, *shape, generator=g)
        kids = mean_p[:, None] + 0.05 * torch.randn(m, 5, *shape, generator=g)
        keys = rng.base_key(0, torch.arange(m), "verify")
        dgrs(kids[:2], mean_p[:2], mean_q[:2], 0.05, rng.KeyedRows(keys[:2]))  # warm-up
        base = peak_rss_mib()
        dgrs(kids, mean_p, mean_q, 0.05, rng.KeyedRows(keys))
        inputs = kids.numel() * 4 / 2**20
    else:
        sample_speculative(model, sch, tree, "dgrs", 1, execution="tree")  # warm-up
        base = peak_rss_mib()
        sample_speculative(model, sch, tree, "dgrs", m, execution="tree")
        inputs = m * len(tree) * torch.Size(shape).numel() * 4 / 2**20
    return {
        "what": kind,
        "shape": "x".join(map(str, shape)),
        "M": m,
        "peak_growth_mib": peak_rss_mib() - base,
        "state_block_mib": inputs,
    }


def main(argv=None) -> int:
    """CLI: ``python -m benchmarks.memory [--trajectories M] [--json PATH]``; prints one table."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.memory", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--trajectories", type=int, default=16, help="trajectories (round) or parents (coupling); default 16"
    )
    p.add_argument("--one", nargs=2, metavar=("KIND", "SHAPE"), help=argparse.SUPPRESS)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    if a.one:
        print(json.dumps(_one(a.one[0], SHAPES[a.one[1]], a.trajectories)))
        return 0
    rows = []
    print(f"{'what':<9} {'state':<8} {'M':>4} {'peak growth MiB':>16} {'node block MiB':>15}", flush=True)
    for kind in ("round", "coupling"):
        for name in SHAPES:
            r = json.loads(
                in_subprocess("benchmarks.memory", "--one", kind, name, "--trajectories", str(a.trajectories))
            )
            rows.append(r)
            print(
                f"{r['what']:<9} {r['shape']:<8} {r['M']:>4} {r['peak_growth_mib']:>16.1f} {r['state_block_mib']:>15.1f}",
                flush=True,
            )
    write_json(rows, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
