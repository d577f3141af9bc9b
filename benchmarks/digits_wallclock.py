"""Wall clock per image on the digits network: standard sampler vs the tree execution, side by side.

``python benchmarks/digits_wallclock.py`` (``make bench-digits``; about ten minutes on one shared thread, most of it the
(4, 4) tree).

One process, one loaded network, the same images (``seed``, ids ``0..n-1``, uniform labels) for every
row: the standard Euler-Maruyama sampler (T network calls of ``n`` rows), then D-GRS with
``execution=tree`` (what runs on a GPU: every node of the draft tree is drafted and the whole tree is
evaluated in one batched call per round) at each (K, L), and the same rule with ``execution=path``
(only the visited nodes; same law and counts) for reference. Each configuration is timed ``--repeats``
times after one warm-up run; the table gives the median seconds per image, the NFE speedup
``(T - 2) / calls``, the network rows per image, and the wall-clock speedup over the standard sampler.

Writes ``results/digits/wallclock.csv`` (with ``--out``) and prints the table. Not a test: numbers
depend on the machine and on what else runs on it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main(argv=None) -> int:
    """CLI: ``--n`` images, ``--shapes 2x3,2x5,...``, ``--threads``, ``--repeats``, ``--out CSV``."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=16, help="images per batch (one batched network call serves all)")
    ap.add_argument("--shapes", default="2x3,2x5,3x4,4x4", help="(K, L) shapes, e.g. 2x3,3x4")
    ap.add_argument("--eps", type=float, default=0.3)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument(
        "--levers",
        action="store_true",
        help="also time the levers beyond the paper at B=62 (x0 draft + optimal tree from the shipped "
        "profile, and the paper's D-GRS (2,5) beside it)",
    )
    ap.add_argument("--out", default=None, help="write the table as CSV here")
    a = ap.parse_args(argv)
    try:
        shapes = [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",")]
        assert all(len(s) == 2 and min(s) >= 1 for s in shapes)
    except (ValueError, AssertionError):
        print(
            f"error: --shapes={a.shapes!r} is invalid: use KxL pairs separated by commas, e.g. 2x3,3x4", file=sys.stderr
        )
        return 2

    import pandas as pd
    import torch

    from benchmarks.common import cpu_model
    from specsamp.runner import build_target, compose, load_config, run_config

    torch.set_num_threads(a.threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(a.threads))
    base = ["model=digits", f"n_samples={a.n}", f"eps={a.eps}", f"steps={a.steps}", "progress=false"]
    arms = [("standard", None, ["sampler=standard"])]
    for K, L in shapes:
        arms.append(("dgrs tree", (K, L), ["sampler=dgrs", f"K={K}", f"L={L}", "execution=tree"]))
        arms.append(("dgrs path", (K, L), ["sampler=dgrs", f"K={K}", f"L={L}", "execution=path"]))
    if a.levers:  # the shipped profile: no calibration run inside the timing; the tree search is timed
        lever = ["sampler=dgrs", "draft=x0", "tree=optimal", "budget=62", "delta_profile=edm-digits-8x8-cond_x0"]
        for execution in ("tree", "path"):
            arms.append((f"x0+optimal {execution}", (None, None), [*lever, f"execution={execution}"]))
    rows, target = [], None
    for name, shape, ov in arms:
        d = compose(base + ov)
        target = target or build_target(load_config(d)[0])
        times = []
        for rep in range(a.repeats + 1):
            t0 = time.perf_counter()
            rec, res = run_config(d, target=target)
            if rep:  # the first run warms caches and allocators
                times.append(time.perf_counter() - t0)
        sec = statistics.median(times)
        rows.append(
            {
                "execution": name,
                "K": shape[0] if shape else None,
                "L": shape[1] if shape else None,
                "budget": rec["budget"],
                "n_images": a.n,
                "seconds_per_image": sec / a.n,
                "nfe_speedup": rec["speedup"]["mean"],
                "batch_nfe": res.batch_nfe,
                "rows_per_image": float(res.target_rows.double().mean()),
            }
        )
        print(
            f"{name:10s} {str(shape or ''):8s} {sec / a.n * 1e3:8.1f} ms/image  NFE speedup {rec['speedup']['mean']:.2f}x  "
            f"rows/image {rows[-1]['rows_per_image']:.0f}",
            flush=True,
        )
    df = pd.DataFrame(rows)
    std = df.loc[df["execution"] == "standard", "seconds_per_image"].iloc[0]
    df["wall_speedup"] = std / df["seconds_per_image"]
    df["threads"] = a.threads
    df["cpu"] = cpu_model()
    df["torch"] = torch.__version__
    print(df.drop(columns=["cpu", "torch"]).to_string(index=False, float_format=lambda v: f"{v:.4g}"))
    if a.out:
        from specsamp.io import atomic_write

        atomic_write(Path(a.out), lambda f: df.to_csv(f, index=False, float_format="%.6g"), mode="w")
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
