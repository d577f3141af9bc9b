"""Shared plotting and table helpers for the experiment modules (matplotlib, pandas)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "results"
RULE_COLORS = {"rmc": "#d62728", "dgrs": "#1f77b4", "standard": "#7f7f7f"}
RULE_LABELS = {"rmc": "RMC (chain)", "dgrs": "D-GRS (tree)", "standard": "standard"}


def save(fig, path: Path) -> Path:
    """Save a figure as PNG (150 dpi) and close it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=150, bbox_inches="tight")
    plt.close(fig)
    return path


def read_csv(path: Path) -> pd.DataFrame:
    """Read a committed results table; a clear error when it is missing."""
    if not path.exists():
        raise SystemExit(f"error: {path} does not exist; run the experiment's sweep and collect step first")
    return pd.read_csv(path)


def write_csv(df: pd.DataFrame, path: Path) -> Path:
    """Write a table atomically (:func:`specsamp.io.atomic_write`)."""
    from specsamp.io import atomic_write

    return atomic_write(path, lambda f: df.to_csv(f, index=False, float_format="%.6g"), mode="w")


def ok_records(sweep_dir: str, experiment: str) -> pd.DataFrame:
    """The finished jobs of a sweep (:func:`specsamp.runner.report.collect`, status ``ok``).

    A missing sweep directory prints which ``+experiment=`` to run and exits with status 2.
    """
    import sys

    from specsamp.runner.report import collect

    try:
        df = collect(sweep_dir)
    except FileNotFoundError as e:
        print(f"error: {e}; run `python run.py +experiment={experiment}` first", file=sys.stderr)
        raise SystemExit(2) from None
    return df[df["status"] == "ok"].copy()


def profile_text(profile) -> str:
    """A recorded ``delta_profile`` for a table cell: ``0.492/1.749/...`` per depth, or ``per-root (R rows)``."""
    if not profile:
        return ""
    if isinstance(profile[0], list):
        return f"per-root ({len(profile)} rows)"
    return "/".join(f"{x:.3f}" for x in profile)


def _frontier_panel(ax, df: pd.DataFrame, colors: dict, hline=None) -> None:
    for arm, s in df.groupby("arm", sort=False):
        s = s.sort_values("budget")
        style = "--" if arm.startswith("paper") else ":" if "affine" in arm else "-"
        ax.errorbar(
            s["budget"],
            s["speedup_mean"],
            yerr=s["speedup_sem"],
            fmt="o" + style,
            ms=4,
            capsize=3,
            color=colors[arm],
            label=arm + (" (mixture-specific)" if "affine" in arm else ""),
        )
    if hline is not None:
        ax.axhline(hline[0], color="0.4", lw=0.8, ls=":", label=hline[1])
    budgets = sorted(df["budget"].unique())
    ax.set_xscale("log")
    ax.set_xticks(budgets, [str(b) for b in budgets])
    ax.xaxis.set_minor_formatter(plt.NullFormatter())
    ax.set_xlabel("proposal budget B (drafted states)")
    ax.grid(alpha=0.3)


def levers_frontier(df: pd.DataFrame, *, title: str, ylabel: str, figsize=(7, 4.5), hline=None):
    """Speedup vs budget, one line per lever arm of a ``levers``/``beyond`` table (``arm``, ``budget``,
    ``speedup_mean``, ``speedup_sem``): the paper's arms dashed, the mixture-specific ``x0_affine`` arms
    dotted and, when there are any, on a panel of their own (with the paper's D-GRS arm for reference),
    so that their much higher speedups do not squeeze the general levers into a sliver of the axis.
    ``hline``: ``(y, label)`` of a reference line (e.g. the paper's best), drawn on both panels."""
    cmap = plt.get_cmap("tab20")
    colors = {arm: cmap(i) for i, arm in enumerate(df["arm"].drop_duplicates())}
    specific = df["arm"].str.contains("affine")
    if not specific.any():
        fig, ax = plt.subplots(figsize=figsize)
        _frontier_panel(ax, df, colors, hline)
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        return fig
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(figsize[0] * 1.45, figsize[1]), gridspec_kw={"width_ratios": [2, 1]})
    _frontier_panel(ax, df[~specific], colors, hline)
    reference = df[df["arm"].str.startswith("paper D-GRS")]
    _frontier_panel(ax2, pd.concat([reference, df[specific]]), colors, hline)
    ax.set_ylabel(ylabel)
    ax.set_title("general levers", fontsize=10)
    ax2.set_title("mixture-specific (x0_affine)", fontsize=10)
    fig.suptitle(title)
    handles, labels = {}, []
    for a in (ax, ax2):
        for h, lab in zip(*a.get_legend_handles_labels()):
            if lab not in handles:
                handles[lab] = h
                labels.append(lab)
    fig.legend([handles[lab] for lab in labels], labels, fontsize=7, loc="upper left", bbox_to_anchor=(0.99, 0.93))
    fig.tight_layout()
    return fig
