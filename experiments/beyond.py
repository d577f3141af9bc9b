"""Beyond the paper (issue 8): drafts, couplings and trees that stay exact, on the section 5.1 mixture.

Levers, each alone and combined, at matched budgets B in {14, 62, 155}, 100 trajectories, seed 0:

- draft ``x0``: freeze the root's data prediction and rebuild the velocity at every drafted node;
- coupling ``markmax``: the marked-maximum list coupling (reaches the bound alpha*_K where certified);
- tree ``optimal``: the budget-B tree maximising expected committed steps for a calibrated delta profile.

``python -m experiments.beyond run`` samples (about two minutes here) and writes
``results/gmm/beyond.csv``; ``figures`` draws the frontier and the acceptance-vs-bound curves from it
and from theory.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
import pandas as pd

from experiments.common import RESULTS, plt, read_csv, save, write_csv
from specsamp import theory

OUT = RESULTS / "gmm"
CSV = OUT / "beyond.csv"
BUDGETS = {14: (2, 3), 62: (2, 5), 155: (5, 3)}  # the paper's uniform (K, L) at each budget
ARMS = {  # name: overrides (K, L are filled per budget)
    "paper RMC (chain of B)": ["sampler=rmc"],
    "paper D-GRS (uniform tree)": ["sampler=dgrs"],
    "x0 draft": ["sampler=dgrs", "draft=x0"],
    "markmax coupling": ["sampler=markmax"],
    "optimal tree": ["sampler=dgrs", "tree=optimal"],
    "x0 + RMC chain": ["sampler=rmc", "draft=x0"],
    "x0 + optimal tree": ["sampler=dgrs", "draft=x0", "tree=optimal"],
    "x0 + optimal tree + markmax": ["sampler=markmax", "draft=x0", "tree=optimal"],
}


def run(n_samples: int = 100) -> pd.DataFrame:
    """Run every arm at every budget through :func:`specsamp.experiment.run_config` (same records as run.py)."""
    import torch
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from experiments.common import ROOT
    from specsamp.experiment import run_config, summary_line

    torch.set_num_threads(1)
    rows = []
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        for B, (K, L) in BUDGETS.items():
            for arm, ov in ARMS.items():
                cfg = compose(config_name="config", overrides=[*ov, f"K={K}", f"L={L}", f"budget={B}", f"n_samples={n_samples}"])
                d = OmegaConf.to_container(cfg, resolve=True)
                d.pop("hydra", None)
                rec, _ = run_config(d)
                print(f"{arm:30s} {summary_line(rec)}", flush=True)
                rows.append({"arm": arm, "budget": B, "tree": rec["tree"], "sampler": rec["sampler"], "draft": d["draft"],
                             "speedup_mean": rec["speedup"]["mean"], "speedup_sem": rec["speedup"]["sem"],
                             "nfe_mean": rec["nfe"]["mean"], "target_rows_mean": rec["target_rows"]["mean"],
                             "acceptance_pooled": rec["acceptance_pooled"],
                             "delta_profile": "/".join(f"{x:.3f}" for x in rec.get("delta_profile") or []),
                             "n_samples": n_samples, "wall_seconds": rec["wall_seconds"]})
    df = pd.DataFrame(rows)
    write_csv(df, CSV)
    print(f"wrote {CSV}")
    return df


def _frontier(df: pd.DataFrame):
    fig, ax = plt.subplots(figsize=(7, 4.5))
    cmap = plt.get_cmap("tab10")
    for i, (arm, s) in enumerate(df.groupby("arm", sort=False)):
        s = s.sort_values("budget")
        style = "--" if arm.startswith("paper") else "-"
        ax.errorbar(s["budget"], s["speedup_mean"], yerr=s["speedup_sem"], fmt="o" + style, ms=4, capsize=3,
                    color=cmap(i), label=arm)
    ax.axhline(2.34, color="0.4", lw=0.8, ls=":", label="paper's best (2.34x at B=137,256)")
    ax.set_xscale("log")
    ax.set_xticks(sorted(df["budget"].unique()), [str(b) for b in sorted(df["budget"].unique())])
    ax.xaxis.set_minor_formatter(plt.NullFormatter())
    ax.set_xlabel("proposal budget B (drafted states)")
    ax.set_ylabel("expected speedup (100 trajectories, ±1 s.e.)")
    ax.set_title("Gaussian mixture: levers beyond the paper, all exact")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return fig


def _acceptance_vs_bound():
    from specsamp.listcoupling import markmax_acceptance

    delta = np.linspace(0.0, 5.0, 101)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    cmap = plt.get_cmap("viridis")
    for i, K in enumerate((2, 4, 8, 16)):
        c = cmap(i / 3)
        bound = theory.list_coupling_bound(delta, K)
        dg = theory.dgrs_acceptance(delta, K)
        mm = markmax_acceptance(delta, K)
        axes[0].plot(delta, dg, ":", color=c)
        axes[0].plot(delta, mm, "-", color=c, label=f"K={K}")
        axes[0].plot(delta, bound, "--", color=c, lw=0.8)
        axes[1].plot(delta, bound - dg, ":", color=c)
        axes[1].plot(delta, bound - mm, "-", color=c, label=f"K={K}")
    axes[0].plot([], [], "k:", label="D-GRS (paper)")
    axes[0].plot([], [], "k-", label="markmax (ours)")
    axes[0].plot([], [], "k--", lw=0.8, label=r"bound $\alpha^*_K$")
    axes[0].set_ylabel("per-node acceptance")
    axes[1].set_ylabel(r"gap to the bound $\alpha^*_K$")
    for ax in axes:
        ax.set_xlabel(r"$\delta$")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("List couplings of K i.i.d. drafts: acceptance and gap to the exact-coupling bound (theory)")
    return fig


def figures() -> list:
    """The frontier (from beyond.csv) and the acceptance-vs-bound curves (theory)."""
    out = [save(_frontier(read_csv(CSV)), OUT / "beyond_frontier.png"),
           save(_acceptance_vs_bound(), OUT / "beyond_acceptance.png")]
    for p in out:
        print(f"wrote {p}")
    return out


def table(df: pd.DataFrame) -> str:
    """Markdown table: speedup ± s.e. per arm (rows) and budget (columns)."""
    piv = df.assign(v=[f"{m:.2f} ± {s:.2f}" for m, s in zip(df["speedup_mean"], df["speedup_sem"])])
    piv = piv.pivot(index="arm", columns="budget", values="v").reindex(list(ARMS))
    lines = ["| lever | " + " | ".join(f"B={b}" for b in piv.columns) + " |", "|---|" + "---|" * len(piv.columns)]
    lines += [f"| {arm} | " + " | ".join(piv.loc[arm]) + " |" for arm in piv.index]
    return "\n".join(lines)


def main(argv=None) -> int:
    """CLI: ``run``, ``figures`` or ``table``."""
    ap = argparse.ArgumentParser(prog="python -m experiments.beyond", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=["run", "figures", "table"])
    ap.add_argument("--n", type=int, default=100)
    a = ap.parse_args(argv)
    if a.command == "run":
        run(a.n)
    elif a.command == "figures":
        figures()
    else:
        print(table(read_csv(CSV)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
