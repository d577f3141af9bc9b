"""Section 5.3 (Stable Diffusion 3.5 medium): Figure 5 (speedup vs K) and Table 1 (CLIP scores).

Steps, on a GPU host with the weights and COCO captions::

    python run.py +experiment=fig5_sd3 model.prompts.captions_json=/data/captions_val2014.json
    python run.py +experiment=table1_clip model.prompts.captions_json=/data/captions_val2014.json
    python -m experiments.sd3 collect      # -> results/sd3/fig5_table1.csv
    python -m experiments.sd3 figures
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
import pandas as pd

from experiments.common import RESULTS, RULE_COLORS, RULE_LABELS, ok_records, plt, read_csv, save, write_csv
from specsamp.trees import budget

OUT = RESULTS / "sd3"
TABLE = OUT / "fig5_table1.csv"
KS = range(2, 8)
# Section 5.3 text: D-GRS peaks near 1.18x at K=6 (B=42); RMC plateaus at 1.10-1.12x. Table 1's CLIP
# values are not in the text we have, so that column stays empty.
PAPER_SPEEDUP = {("dgrs", 6): "1.18x (peak)", **{("rmc", K): "1.10–1.12x" for K in KS}}


def empty_table() -> pd.DataFrame:
    """Every cell of Figure 5 / Table 1, values empty."""
    rows = [
        {
            "sampler": s,
            "K": K,
            "L": 2,
            "budget": budget(K, 2),
            "speedup_mean": np.nan,
            "speedup_std": np.nan,
            "speedup_sem": np.nan,
            "clip_mean": np.nan,
            "clip_sem": np.nan,
            "paper_speedup": PAPER_SPEEDUP.get((s, K), ""),
        }
        for s in ("rmc", "dgrs")
        for K in KS
    ]
    rows.append(
        {
            "sampler": "standard",
            "K": 1,
            "L": 1,
            "budget": 0,
            "speedup_mean": 1.0,
            "speedup_std": 0.0,
            "speedup_sem": 0.0,
            "clip_mean": np.nan,
            "clip_sem": np.nan,
            "paper_speedup": "1.00x",
        }
    )
    return pd.DataFrame(rows)


def collect(sweep_dir: str = "multirun/fig5_sd3") -> pd.DataFrame:
    """Fill ``results/sd3/fig5_table1.csv`` from the sweep's records (speedups and CLIP scores)."""
    df = ok_records(sweep_dir, "fig5_sd3")
    table = empty_table()
    for _, r in df.iterrows():
        sel = (table["sampler"] == r["sampler"]) & ((table["K"] == r["K"]) | (r["sampler"] == "standard"))
        for c_out, c_in in (
            ("speedup_mean", "speedup_mean"),
            ("speedup_std", "speedup_std"),
            ("speedup_sem", "speedup_sem"),
            ("clip_mean", "clip_score"),
            ("clip_sem", "clip_score_sem"),
        ):
            if c_in in r:
                table.loc[sel, c_out] = r[c_in]
    write_csv(table, TABLE)
    print(f"wrote {TABLE}")
    return table


def fig5(df: pd.DataFrame):
    """Figure 5: speedup vs K at L=2 for both rules (mean ± s.e.), with the paper's values from the
    table's ``paper_speedup`` column: D-GRS's peak as a star, RMC's plateau as a hatched band."""
    from experiments import paper

    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    ours = False
    for rule in ("rmc", "dgrs"):
        s = df[df["sampler"] == rule].dropna(subset=["speedup_mean"]).sort_values("K")
        if s.empty:
            continue
        ours = True
        ax.errorbar(
            s["K"],
            s["speedup_mean"],
            yerr=s["speedup_sem"],
            fmt="o-",
            capsize=3,
            color=RULE_COLORS[rule],
            label=RULE_LABELS[rule],
        )
    for rule in ("rmc", "dgrs"):
        rows = df[(df["sampler"] == rule) & df["paper_speedup"].notna()]
        for lo, hi, text in paper.paper_ranges(rows["paper_speedup"]):
            if lo != hi:
                paper.band(ax, lo, hi, f"paper: {RULE_LABELS[rule]} {text}", color=RULE_COLORS[rule])
        for _, r in rows.iterrows():
            lo, hi = paper.parse_range(r["paper_speedup"])
            if lo == hi:
                ax.plot(
                    [r["K"]],
                    [lo],
                    "*",
                    ms=11,
                    color=paper.PAPER,
                    label=f"paper: {RULE_LABELS[rule]} {lo:g}x at K={int(r['K'])}",
                )
    if not ours:
        ax.text(
            0.5,
            0.04,
            "ours: not run yet (needs a GPU and the SD3.5 weights)",
            ha="center",
            va="bottom",
            transform=ax.transAxes,
            fontsize=8,
            color="0.4",
        )
    ax.axhline(1.0, color="0.5", lw=0.8, ls=":")
    paper.integer_ticks(ax, KS)
    ax.set_ylim(0.95, 1.3)
    ax.set_xlabel("branching K (L = 2, B = K + K^2)")
    ax.set_ylabel("NFE speedup")
    ax.set_title("SD3.5 medium, 512x512, eps=0.8 (Figure 5)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")
    return fig


def figures() -> list:
    """Draw Figure 5 from the committed table into ``results/sd3/``."""
    path = save(fig5(read_csv(TABLE)), OUT / "fig5_speedup_vs_K.png")
    print(f"wrote {path}")
    return [path]


def main(argv=None) -> int:
    """CLI: ``init``, ``collect`` or ``figures``."""
    ap = argparse.ArgumentParser(
        prog="python -m experiments.sd3", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("command", choices=["init", "collect", "figures"])
    ap.add_argument("--sweep", default="multirun/fig5_sd3")
    a = ap.parse_args(argv)
    if a.command == "init":
        write_csv(empty_table(), TABLE)
    elif a.command == "collect":
        collect(a.sweep)
    else:
        figures()
    return 0


if __name__ == "__main__":
    sys.exit(main())
