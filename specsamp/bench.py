"""Wall-clock benchmark of the core: ``python -m specsamp.bench [--quick] [--device cpu|cuda]``.

Two measurements, each the best of ``--repeats`` timed runs (``time.perf_counter``; torch's thread
count is left at its default):

1. **GMM cell** (section 5.1): d = 500, 5 components, T = 30, eps = 0.1, 100 trajectories, D-GRS on the
   uniform (5, 3) tree; trajectories per second of the ``path`` and ``tree`` executions and their ratio.
2. **Coupling throughput**: one D-GRS verification of n = 1024 parent nodes with K = 7 children of an
   SD3 latent event (16 x 64 x 64, float32; the children alone take ~1.9 GB), and RMC (K = 1) on the
   same event; parent nodes per second.

``--quick`` shrinks both (20 trajectories, 64 parent nodes, one repeat) for a smoke run. Timings are
informative only; nothing here asserts on them.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable

import torch

from . import rng
from .coupling import dgrs, rmc
from .models import GaussianMixture
from .sampler import sample_speculative
from .schedule import Schedule
from .trees import DraftTree


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_of(fn: Callable[[int], object], repeats: int, device: torch.device) -> tuple[float, object]:
    """Run ``fn(r)`` for ``r = 0..repeats-1``; return the shortest wall time and the last result."""
    best, out = math.inf, None
    for r in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        out = fn(r)
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return best, out


def bench_gmm(trajectories: int, repeats: int, device: torch.device, dim: int = 500, K: int = 5, L: int = 3) -> list[dict]:
    """Section 5.1 cell: trajectories per second of both executions."""
    model = GaussianMixture(dim=dim, components=5, layout_seed=0, device=device)
    schedule = Schedule.make(30, 0.1)
    tree = DraftTree.uniform(K, L)
    rows = []
    for execution in ("path", "tree"):  # untimed warm-up (first-call allocations, lazy inits)
        sample_speculative(model, schedule, tree, "dgrs", 2, execution=execution, seed=0)
    for execution in ("path", "tree"):
        t, res = best_of(
            lambda r, ex=execution: sample_speculative(model, schedule, tree, "dgrs", trajectories, execution=ex, seed=r),
            repeats,
            device,
        )
        rows.append(
            {
                "section": "gmm",
                "setting": f"d={dim} T=30 M={trajectories} dgrs({K},{L}) {execution}",
                "seconds": t,
                "throughput": trajectories / t,
                "unit": "traj/s",
                "nfe_speedup": float(res.speedup.mean()),
            }
        )
    rows.append(
        {
            "section": "gmm",
            "setting": "tree / path throughput",
            "seconds": float("nan"),
            "throughput": rows[1]["throughput"] / rows[0]["throughput"],
            "unit": "x",
        }
    )
    return rows


def _verify_problem(n: int, K: int, event: tuple[int, ...], device: torch.device, seed: int = 0, delta: float = 1.5):
    """``n`` parent nodes with ``K`` float32 children each, target mean ``delta`` kernel scales away."""
    g = torch.Generator(device=device).manual_seed(seed)
    sigma = 0.05
    mean_p = torch.randn(n, *event, generator=g, device=device)
    direction = torch.randn(n, *event, generator=g, device=device)
    direction /= torch.linalg.vector_norm(direction.reshape(n, -1), dim=1).reshape(-1, *([1] * len(event)))
    mean_q = mean_p + sigma * delta * direction
    del direction
    children = torch.randn(n, K, *event, generator=g, device=device)
    children.mul_(sigma).add_(mean_p[:, None])
    return children, mean_p, mean_q, sigma


def bench_coupling(n: int, K: int, repeats: int, device: torch.device, event: tuple[int, ...] = (16, 64, 64)) -> list[dict]:
    """Parent nodes per second of one batched D-GRS (K children) and RMC (first child only) verification."""
    children, mean_p, mean_q, sigma = _verify_problem(n, K, event, device)
    keys = rng.base_key(0, torch.arange(n, device=device), "verify", device=device)
    shape = "x".join(map(str, event))
    rows = []
    for name, fn, kids in (("dgrs", dgrs, children), ("rmc", rmc, children[:, :1])):
        t, verdict = best_of(
            lambda r, fn=fn, kids=kids: fn(kids, mean_p, mean_q, sigma, generator=rng.KeyedRows(rng.fold(keys, r))),
            repeats,
            device,
        )
        rows.append(
            {
                "section": "coupling",
                "setting": f"{name} K={kids.shape[1]} n={n} {shape} f32",
                "seconds": t,
                "throughput": n / t,
                "unit": "nodes/s",
                "acceptance": float(verdict.accepted.float().mean()),
            }
        )
        del verdict
    return rows


def format_table(rows: list[dict]) -> str:
    """Fixed-width table of benchmark rows (``section, setting, seconds, throughput, unit`` + extras)."""
    lines = [f"{'section':<9} {'setting':<40} {'best s':>9} {'throughput':>14}  extra"]
    for r in rows:
        sec = "" if math.isnan(r["seconds"]) else f"{r['seconds']:.3f}"
        extra = ""
        if "nfe_speedup" in r:
            extra = f"NFE speedup {r['nfe_speedup']:.3f}"
        elif "acceptance" in r:
            extra = f"acceptance {r['acceptance']:.3f}"
        thr = f"{r['throughput']:.2f} {r['unit']}"
        lines.append(f"{r['section']:<9} {r['setting']:<40} {sec:>9} {thr:>14}  {extra}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """CLI ``python -m specsamp.bench [--quick] [--device D] [--threads N] [--json]``; returns the exit status."""
    p = argparse.ArgumentParser(prog="python -m specsamp.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small sizes and one repeat (smoke run)")
    p.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    p.add_argument("--repeats", type=int, default=None, help="timed repeats per measurement (default 3; 1 with --quick)")
    p.add_argument("--trajectories", type=int, default=None, help="GMM trajectories (default 100; 20 with --quick)")
    p.add_argument("--nodes", type=int, default=None, help="parent nodes of the coupling batch (default 1024; 64 with --quick)")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's own choice)")
    p.add_argument("--skip-coupling", action="store_true", help="only the GMM cell")
    p.add_argument("--json", default=None, help="also write the rows to this JSON file")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if args.threads is not None:
        if args.threads < 1:
            p.error("--threads must be >= 1")
        torch.set_num_threads(args.threads)
    repeats = args.repeats or (1 if args.quick else 3)
    trajectories = args.trajectories or (20 if args.quick else 100)
    nodes = args.nodes or (64 if args.quick else 1024)
    if repeats < 1 or trajectories < 1 or nodes < 1:
        p.error("--repeats, --trajectories and --nodes must be >= 1")

    print(f"specsamp bench: torch {torch.__version__}, device {device}, threads {torch.get_num_threads()}, best of {repeats}", flush=True)
    rows = bench_gmm(trajectories, repeats, device)
    print(format_table(rows), flush=True)
    if not args.skip_coupling:
        crow = bench_coupling(nodes, 7, repeats, device)
        print(format_table(crow).split("\n", 1)[1], flush=True)
        rows += crow
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "device": str(device), "threads": torch.get_num_threads(), "repeats": repeats, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
