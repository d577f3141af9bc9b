"""Picard-refined drafts (``refine=J``) against plain drafts, on the mixture, digits and patches32.

Every arm runs the tree execution (a sweep needs every internal node), D-GRS, seed 0, one torch thread.
Per cell ``(model, K, L)`` the arms are:

- ``plain``: the uniform ``(K, L)`` tree, plain drafts;
- ``refine=J`` (J = 1, 2): the same tree, J Picard sweeps per round (J extra batched calls of the round's
  internal nodes);
- ``plain, rows of refine=J``: a plain tree of the same depth whose round has as many target rows as the
  refined round (``J |I| + |V|``; the widths found by :func:`matched_widths`).

The matching: at the same number of sequential calls is ``speedup = (T - 2) / nfe`` (steps committed per
sequential target call, sweeps included); at the same total of target rows is ``steps_per_100_rows =
100 (T - 2) / target_rows`` (steps per row the target evaluated), and the ``rows of refine=J`` arm spends
a refined round's rows on a wider plain tree instead of on sweeps. Mean and standard error over
trajectories; no timings.

``python -m experiments.refine [--models gmm digits patches32] [--n N]`` writes
``results/<model>/refine.csv``.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
import pandas as pd

from experiments.common import RESULTS, write_csv

CELLS = {  # model: (overrides, [(K, L), ...], trajectories)
    "gmm": ([], [(2, 3), (3, 2), (2, 5), (1, 8)], 100),  # the section 5.1 cell (T=30, eps=0.1, d=500) and more shapes
    "digits": (["model=digits", "steps=100", "eps=0.3"], [(2, 3), (2, 5), (1, 8)], 100),
    "patches32": (["model=patches32"], [(2, 3), (1, 8)], 40),  # its own default T=100, eps=0.3
}
SWEEPS = (1, 2)


def rows_per_round(widths) -> tuple[int, int]:
    """``(|V|, |I|)`` of the tree with per-depth widths ``widths`` (root included in both)."""
    sizes = np.cumprod(widths)
    return 1 + int(sizes.sum()), 1 + int(sizes[:-1].sum())


def matched_widths(rows: int, depth: int, most: int = 12) -> list[int]:
    """Non-increasing widths of ``depth`` levels whose tree has ``|V|`` closest to ``rows`` (ties: the wider root)."""

    def shapes(left, top):  # non-increasing width sequences, widest first
        if left == 0:
            yield ()
            return
        for w in range(top, 0, -1):
            for rest in shapes(left - 1, w):
                yield (w,) + rest

    best = None
    for w in shapes(depth, most):
        gap = abs(rows_per_round(w)[0] - rows)
        if best is None or gap < best[0]:
            best = (gap, list(w))
    return best[1]


def _stats(x: np.ndarray) -> tuple[float, float]:
    return float(x.mean()), float(x.std(ddof=1) / np.sqrt(len(x))) if len(x) > 1 else 0.0


def run(models=None, n_samples: int | None = None) -> dict:
    """Run every arm of every cell through :func:`specsamp.runner.run_config`; write one CSV per model."""
    import torch

    from specsamp.runner import compose, run_config, summary_line

    torch.set_num_threads(1)
    out = {}
    for model, (base, cells, n_default) in CELLS.items():
        if models is not None and model not in models:
            continue
        n = n_samples or n_default
        rows = []
        for K, L in cells:
            V, I = rows_per_round([K] * L)
            arms = [("plain", [f"K={K}", f"L={L}"], 0)]
            arms += [(f"refine={J}", [f"K={K}", f"L={L}", f"refine={J}"], J) for J in SWEEPS]
            for J in SWEEPS:
                w = matched_widths(J * I + V, L)
                arms.append((f"plain, rows of refine={J}", ["tree=widths", f"widths=[{','.join(map(str, w))}]"], 0))
            for arm, ov, J in arms:
                d = compose([*base, "sampler=dgrs", "execution=tree", *ov, f"n_samples={n}", "progress=false"])
                rec, res = run_config(d)
                print(f"{model} K={K} L={L} {arm:26s} {summary_line(rec)}", flush=True)
                T2 = res.speculative_steps
                sp = _stats(T2 / res.nfe.double().cpu().numpy())
                per_rows = _stats(100.0 * T2 / res.target_rows.double().cpu().numpy())
                acc = res.accepts.sum(0).double() / res.attempts.sum(0).clamp(min=1).double()
                rows.append(
                    {
                        "model": model,
                        "K": K,
                        "L": L,
                        "arm": arm,
                        "refine": J,
                        "tree": rec["tree"],
                        "round_rows": rec["call_rows"] + J * (I if J else 0),
                        "speedup_mean": sp[0],
                        "speedup_sem": sp[1],
                        "steps_per_100_rows_mean": per_rows[0],
                        "steps_per_100_rows_sem": per_rows[1],
                        "nfe_mean": float(res.nfe.double().mean()),
                        "target_rows_mean": float(res.target_rows.double().mean()),
                        "acceptance_per_depth": " ".join(f"{a:.3f}" for a in acc.tolist()),
                        "eps": rec["eps"],
                        "steps": rec["steps"],
                        "n_samples": n,
                    }
                )
        df = pd.DataFrame(rows)
        path = RESULTS / model / "refine.csv"
        write_csv(df, path)
        print(f"wrote {path}")
        out[model] = df
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", choices=list(CELLS), default=None)
    p.add_argument("--n", type=int, default=None, help="trajectories per arm (default: per model, see CELLS)")
    a = p.parse_args(argv)
    if a.n is not None and a.n < 2:
        print(f"error: --n={a.n} is invalid: need at least 2 trajectories per arm (a standard error).", file=sys.stderr)
        return 2
    run(a.models, a.n)
    return 0


if __name__ == "__main__":
    sys.exit(main())
