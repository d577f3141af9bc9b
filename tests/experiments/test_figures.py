"""The reproduction figures draw the paper's values, marked as the paper's, from the committed tables."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import ROOT

pytest.importorskip("matplotlib")
from matplotlib.lines import Line2D
from matplotlib.patches import Rectangle

from experiments import gmm, paper, pixel, sd3
from experiments.common import plt, read_csv
from specsamp.trees import budget


def _labelled(ax, text):
    handles, labels = ax.get_legend_handles_labels()
    return [h for h, lab in zip(handles, labels) if text in lab]


def _band(ax, lo, hi, text):
    """A patch labelled ``text`` spanning [lo, hi] in y (axhspan draws a rectangle or polygon)."""
    for p in ax.patches:
        if text in (p.get_label() or ""):
            ys = (
                p.get_path().transformed(p.get_patch_transform()).vertices[:, 1]
                if isinstance(p, Rectangle)
                else p.get_xy()[:, 1]
            )
            if np.isclose(ys.min(), lo) and np.isclose(ys.max(), hi):
                return True
    return False


@pytest.fixture(scope="module")
def grid():
    return read_csv(gmm.GRID_CSV)


def test_gmm_figures_1_and_7_draw_the_papers_values(grid):
    cells = {budget(5, 3): 2.14, budget(6, 6): 2.33, budget(7, 6): 2.34}
    fig = paper.mark_fig1(gmm._frontier_fig(grid))
    ax = fig.axes[0]
    (stars,) = [h for h in _labelled(ax, "paper: D-GRS cells") if isinstance(h, Line2D)]
    assert dict(zip(stars.get_xdata(), stars.get_ydata())) == cells
    assert _band(ax, 1.96, 2.00, "paper: RMC plateau")
    (l2,) = _labelled(ax, "paper: best L=2")
    assert np.allclose(l2.get_segments()[0][:, 1], 1.876)
    plt.close(fig)

    fig = paper.mark_fig7(gmm._speedup_vs_k(grid))
    ax = fig.axes[0]
    pts = {
        (float(x), float(y))
        for line in ax.get_lines()
        if line.get_marker() == "*"
        for x, y in zip(line.get_xdata(), line.get_ydata())
    }
    assert pts == {(5.0, 2.14), (6.0, 2.33), (7.0, 2.34)}
    assert _band(ax, 1.96, 2.00, "paper: RMC plateau")
    assert any(np.allclose(line.get_ydata(), 1.876) for line in ax.get_lines())
    plt.close(fig)


def test_gmm_figure_3_outlines_the_papers_cells(grid):
    fig = paper.mark_fig3(gmm._heatmaps(grid))
    rmc_ax, dgrs_ax = fig.axes[:2]
    assert "1.96–2.00x" in rmc_ax.get_title() and "1.876x" in dgrs_ax.get_title()
    boxes = [p for p in dgrs_ax.patches if isinstance(p, Rectangle) and p.get_edgecolor()[:3] == (1.0, 0.0, 0.0)]
    Ls = [int(t.get_text()) for t in dgrs_ax.get_xticklabels()]
    Ks = [int(t.get_text()) for t in dgrs_ax.get_yticklabels()]
    at = {(Ks[round(b.get_y() + 0.5)], Ls[round(b.get_x() + 0.5)]) for b in boxes}
    assert at == {(5, 3), (6, 6), (7, 6)}
    texts = {t.get_text() for t in dgrs_ax.texts}
    assert {"paper 2.14", "paper 2.33", "paper 2.34"} <= texts
    # the paper's labels are as large as our values (they were 5.5 pt) and do not overlap them
    ours = [t for t in dgrs_ax.texts if not t.get_text().startswith("paper")]
    for t in dgrs_ax.texts:
        if t.get_text().startswith("paper"):
            assert t.get_fontsize() >= max(o.get_fontsize() for o in ours)
            x, y = t.get_position()
            above = [o for o in ours if o.get_position()[0] == x and abs(o.get_position()[1] - y) < 0.5]
            assert len(above) == 1 and above[0].get_position()[1] - y >= 0.4
    plt.close(fig)


def test_beyond_frontier_gives_the_mixture_specific_arms_their_own_panel():
    """The x0_affine arms (5-6x) on a panel of their own, so that the general levers (2-3.2x) fill theirs."""
    from experiments import beyond

    fig = beyond._frontier(read_csv(beyond.CSV))
    general, specific = [a for a in fig.axes if a.get_title()]
    names = lambda ax: {lab for lab in ax.get_legend_handles_labels()[1]}  # noqa: E731
    assert not any("affine" in n for n in names(general))
    assert {n for n in names(specific) if "affine" in n} == {
        "x0 affine + optimal tree (mixture-specific)",
        "x0 affine + tree per step (mixture-specific)",
    }
    lo, hi = general.get_ylim()
    assert hi < 3.5  # the general levers span most of their axis
    plt.close(fig)


def test_digits_sample_grid_separates_the_digits_and_titles_each_rule():
    """Each 8x8 digit is framed by grey padding (no stripes), and the standard panel names no (K, L)."""
    from experiments import digits

    imgs = np.full((100, 8, 8), 255, dtype=np.uint8)
    grid = digits.sample_grid(imgs)
    assert grid.shape == (10 * 10 - 2, 10 * 10 - 2)
    assert (grid[8:10, :] == digits.PAD_GREY).all() and (grid[:, 8:10] == digits.PAD_GREY).all()
    fig = digits._samples_figure()
    titles = [ax.get_title() for ax in fig.axes]
    assert titles[0] == "standard sampler" and "K" not in titles[0] and "B=14" in titles[1] and "(2, 3)" in titles[2]
    plt.close(fig)


def test_figure_4_draws_the_papers_ranges_without_our_runs():
    tables = {ds: read_csv(pixel.OUT / f"fig4_{ds}.csv") for ds in pixel.DATASETS}
    assert all(t["speedup_mean"].isna().all() for t in tables.values())  # committed before any GPU run
    fig = pixel.fig4(tables)
    for ax in fig.axes:
        lo, hi = (2.2, 2.6) if ax.get_title().startswith("cifar10") else (2.0, 2.2)
        assert _band(ax, lo, hi, "paper's range"), ax.get_title()
    plt.close(fig)


def test_figure_5_has_integer_K_and_the_papers_values():
    fig = sd3.fig5(read_csv(sd3.TABLE))
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["2", "3", "4", "5", "6", "7"]
    assert ax.get_xlim() == (1.5, 7.5)
    stars = [
        (float(x), float(y))
        for line in ax.get_lines()
        if line.get_marker() == "*"
        for x, y in zip(line.get_xdata(), line.get_ydata())
    ]
    assert stars == [(6.0, 1.18)]
    assert _band(ax, 1.10, 1.12, "paper: RMC")
    plt.close(fig)


def test_parse_range():
    assert paper.parse_range("2.2–2.6x") == (2.2, 2.6)
    assert paper.parse_range("≈2.0–2.2x") == (2.0, 2.2)
    assert paper.parse_range("1.18x (peak)") == (1.18, 1.18)
    assert paper.parse_range(float("nan")) is None and paper.parse_range("") is None


def test_make_figures_covers_every_experiment_module_with_figures():
    """``make figures`` (experiments.figures.MODULES) redraws every experiment module that defines ``figures()``."""
    import ast

    from experiments.figures import MODULES

    root = ROOT / "experiments"
    drawing = {
        f"experiments.{p.stem}"
        for p in root.glob("*.py")
        if any(isinstance(n, ast.FunctionDef) and n.name == "figures" for n in ast.parse(p.read_text()).body)
    }
    assert drawing <= set(MODULES), sorted(drawing - set(MODULES))
