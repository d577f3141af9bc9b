"""The paper's reported values, drawn on our reproduction figures and marked as the paper's.

Every number here is quoted from the paper's text (the figures themselves are plots without tables):

- section 5.1 / appendix C.2 (Gaussian mixture, Figures 1, 3, 7): RMC plateaus at 1.96-2.00x; D-GRS
  reaches 2.14x at (K, L) = (5, 3) (B = 155), 2.33x at (6, 6), 2.34x at (7, 6); the best cell at L = 2
  attains 1.876x (its K is not stated);
- section 5.2 (EDM, Figure 4): the ranges stated in the text, kept in the ``paper_range`` column of
  ``results/pixel/fig4_*.csv``;
- section 5.3 (SD3.5, Figure 5): D-GRS peaks near 1.18x at K = 6; RMC plateaus at 1.10-1.12x, kept in
  the ``paper_speedup`` column of ``results/sd3/fig5_table1.csv``.

Paper values are drawn in black: stars for single cells, hatched bands for stated ranges, dashed lines
for values whose cell is not stated; their legend entries start with "paper".
"""

from __future__ import annotations

import re

from specsamp.trees import budget

PAPER = "black"
RMC_PLATEAU = (1.96, 2.00)
DGRS_CELLS = {(5, 3): 2.14, (6, 6): 2.33, (7, 6): 2.34}
BEST_L2 = 1.876
L2_BUDGETS = (budget(2, 2), budget(7, 2))  # the L = 2 budgets of the grid, K = 2..7


def parse_range(text) -> tuple[float, float] | None:
    """``"2.2–2.6x"``, ``"≈2.0–2.2x"``, ``"1.18x (peak)"`` -> ``(lo, hi)`` (equal for one value); None if empty."""
    nums = [float(x) for x in re.findall(r"\d+(?:\.\d+)?", str(text) if text is not None else "")]
    if not nums or str(text) == "nan":
        return None
    return (min(nums), max(nums))


def band(ax, lo: float, hi: float, label: str, color=PAPER) -> None:
    """A hatched horizontal band for a range the paper states."""
    ax.axhspan(lo, hi, facecolor="none", edgecolor=color, hatch="///", lw=0.0, alpha=0.5, label=label)


def mark_fig1(fig):
    """Figure 1 (frontier, x = budget B): the D-GRS cells as stars, the RMC plateau as a band, the best
    L = 2 value as a dashed segment over the L = 2 budgets."""
    ax = fig.axes[0]
    cells = sorted(DGRS_CELLS.items(), key=lambda kv: budget(*kv[0]))
    ax.plot([budget(*c) for c, _ in cells], [v for _, v in cells], "*", color=PAPER, ms=10, label="paper: D-GRS cells")
    offsets = {(5, 3): (-8, 7, "right"), (6, 6): (-8, 7, "right"), (7, 6): (4, -14, "left")}
    for (K, L), v in cells:
        dx, dy, ha = offsets.get((K, L), (-8, 7, "right"))
        ax.annotate(
            f"({K},{L}) {v:.2f}", (budget(K, L), v), textcoords="offset points", xytext=(dx, dy), fontsize=7, ha=ha
        )
    band(ax, *RMC_PLATEAU, "paper: RMC plateau 1.96–2.00x")
    ax.hlines(BEST_L2, *L2_BUDGETS, colors=PAPER, linestyles="--", lw=1.2, label="paper: best L=2 cell, 1.876x")
    ax.legend(fontsize=7)
    return fig


PAPER_LABEL_SIZE = 8  # points: the paper's values in Figure 3's cells, as large as our own (7)


def mark_fig3(fig):
    """Figure 3 (heatmaps over (K, L)): the paper's D-GRS cells outlined with their value; the RMC
    plateau stated on the RMC panel."""
    from matplotlib.patches import Rectangle

    for ax in fig.axes:
        title = ax.get_title()
        if not ax.get_xticklabels() or not title:
            continue  # the colour bar
        Ls = [int(t.get_text()) for t in ax.get_xticklabels()]
        Ks = [int(t.get_text()) for t in ax.get_yticklabels()]
        if title.startswith("RMC"):
            ax.set_title(f"{title}\npaper: plateau at 1.96–2.00x", fontsize=10)
            continue
        for (K, L), v in DGRS_CELLS.items():
            if K in Ks and L in Ls:
                i, j = Ks.index(K), Ls.index(L)
                ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, edgecolor="red", lw=1.6))
                for t in ax.texts:  # our value moves up to make room for the paper's below it
                    if tuple(t.get_position()) == (j, i):
                        t.set_position((j, i + 0.2))
                ax.text(
                    j,
                    i - 0.22,
                    f"paper {v:.2f}",
                    ha="center",
                    va="center",
                    fontsize=PAPER_LABEL_SIZE,
                    color="red",
                    fontweight="bold",
                    bbox={"boxstyle": "round,pad=0.15", "facecolor": "white", "edgecolor": "none", "alpha": 0.85},
                )
        ax.set_title(f"{title}\nred boxes: the paper's cells; paper's best at L=2: 1.876x", fontsize=10)
    suptitle = getattr(fig, "_suptitle", None)
    if suptitle is not None:  # room for the two-line panel titles
        suptitle.set_y(1.05)
    return fig


def mark_fig7(fig):
    """Figure 7 (D-GRS speedup vs K per L): the paper's cells as stars, the RMC plateau as a band, the
    best L = 2 value as a dashed line."""
    ax = fig.axes[0]
    for (K, L), v in DGRS_CELLS.items():
        ax.plot([K], [v], "*", color=PAPER, ms=10)
        ax.annotate(f"L={L}: {v:.2f}", (K, v), textcoords="offset points", xytext=(-6, 6), fontsize=7, ha="right")
    ax.plot([], [], "*", color=PAPER, ms=10, label="paper: D-GRS cells")
    band(ax, *RMC_PLATEAU, "paper: RMC plateau")
    ax.axhline(BEST_L2, color=PAPER, ls="--", lw=1.0, label="paper: best at L=2 (1.876x)")
    ax.legend(fontsize=7, ncol=2)
    return fig


def paper_ranges(column) -> list[tuple[float, float, str]]:
    """The distinct ranges of a table column of paper values: ``(lo, hi, text as the table gives it)``."""
    out = []
    for text in column:
        r = parse_range(text)
        if r is not None and (*r, str(text)) not in out:
            out.append((*r, str(text)))
    return out


def integer_ticks(ax, values) -> None:
    """Integer tick marks (and nothing else) at ``values``."""
    values = sorted(int(v) for v in values)
    ax.set_xticks(values, [str(v) for v in values])
    ax.set_xlim(values[0] - 0.5, values[-1] + 0.5)


__all__ = [
    "BEST_L2",
    "DGRS_CELLS",
    "RMC_PLATEAU",
    "band",
    "integer_ticks",
    "mark_fig1",
    "mark_fig3",
    "mark_fig7",
    "paper_ranges",
    "parse_range",
]
