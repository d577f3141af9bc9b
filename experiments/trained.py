"""What the experiments on trained image networks (``experiments.digits``, ``experiments.patches``) share.

Figure 4's table and panels (section 5.2: NFE speedup against the proposal budget ``B``, one panel per
``eps``), the levers table (every lever arm at every budget through :func:`specsamp.runner.run_config`)
and the loop that redraws a module's figures from its committed tables. Each module passes what is its
own: the sweep, the model, the titles, the overrides.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pandas as pd

from experiments.common import RULE_COLORS, RULE_LABELS, ok_records, plt, profile_text, save, write_csv
from specsamp.trees import budget

FIG4_COLUMNS = [
    "sampler",
    "eps",
    "K",
    "L",
    "budget",
    "speedup_mean",
    "speedup_std",
    "speedup_sem",
    "nfe_mean",
    "target_rows_mean",
    "acceptance_pooled",
    "acceptance",
    "n_samples",
]  # no timings: a rerun reproduces the table


def collect_fig4(sweep_dir: str, experiment: str, path: Path, show=None) -> pd.DataFrame:
    """Figure 4's table at ``path`` from the finished jobs of a ``+experiment=<experiment>`` sweep.

    One row per (rule, eps, K, L), the columns :data:`FIG4_COLUMNS`, sorted by rule, eps and budget;
    ``show``: columns to print before the line that names the file (none when ``None``). A missing
    sweep exits with status 2 (:func:`experiments.common.ok_records`).
    """
    df = ok_records(sweep_dir, experiment)
    out = df[FIG4_COLUMNS].sort_values(["sampler", "eps", "budget"]).reset_index(drop=True)
    write_csv(out, path)
    if show is not None:
        print(out[list(show)].to_string(index=False))
    print(f"wrote {path} ({len(out)} cells)")
    return out


def fig4_figure(
    df: pd.DataFrame, eps_values, shapes, *, title: str, ylabel: str, yerr: str, title_fontsize=None, decorate=None
):
    """Figure 4's panels: speedup vs budget ``B = budget(K, L)`` (log axis, ticks at ``shapes``), one line per rule.

    ``df``: a table of :func:`collect_fig4`; one panel per value of ``eps_values``; ``yerr``: the error
    bar column (``speedup_std`` or ``speedup_sem``); ``title``: a format string with ``{eps}``;
    ``decorate(ax)``: drawn first on each panel (e.g. the paper's band).
    """
    fig, axes = plt.subplots(
        1, len(eps_values), figsize=(4.2 * len(eps_values), 3.6), squeeze=False, constrained_layout=True
    )
    title_kw = {} if title_fontsize is None else {"fontsize": title_fontsize}
    for j, eps in enumerate(eps_values):
        ax = axes[0][j]
        if decorate is not None:
            decorate(ax)
        for rule, s in df[np.isclose(df["eps"], eps)].groupby("sampler"):
            s = s.sort_values("budget")
            ax.errorbar(
                s["budget"],
                s["speedup_mean"],
                yerr=s[yerr],
                fmt="o-",
                capsize=3,
                color=RULE_COLORS.get(rule),
                label=RULE_LABELS.get(rule, rule),
            )
        ax.set_xscale("log")
        ax.set_xticks([budget(K, L) for K, L in shapes], [str(budget(K, L)) for K, L in shapes])
        ax.xaxis.set_minor_formatter(plt.NullFormatter())
        ax.set_title(title.format(eps=eps), **title_kw)
        ax.set_xlabel("budget B")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return fig


def levers_table(
    model: str,
    levers: dict,
    budgets: dict,
    *,
    n_samples: int,
    eps: float,
    tail=("progress=false",),
    arm_width: int = 30,
) -> pd.DataFrame:
    """Every arm of ``levers`` (``{arm: overrides}``) at every budget of ``budgets`` (``{B: (K, L)}``), on one thread.

    Each cell composes ``model=<model>``, the arm's overrides, ``K``, ``L``, ``budget``, ``eps``,
    ``n_samples`` and then ``tail``, and runs it (:func:`specsamp.runner.run_config`; the target is built
    once). Returns one row per cell: speedup (mean, s.e.), NFE, target rows, pooled acceptance and the
    per-depth ``delta_profile``. Writes nothing.
    """
    import torch

    from specsamp.runner import build_target, compose, load_config, run_config, summary_line

    torch.set_num_threads(1)
    rows, target = [], None
    for B, (K, L) in budgets.items():
        for arm, ov in levers.items():
            cfg = compose(
                [
                    f"model={model}",
                    *ov,
                    f"K={K}",
                    f"L={L}",
                    f"budget={B}",
                    f"eps={eps}",
                    f"n_samples={n_samples}",
                    *tail,
                ]
            )
            target = target or build_target(load_config(cfg)[0])
            rec, _ = run_config(cfg, target=target)
            print(f"{arm:{arm_width}s} {summary_line(rec)}", flush=True)
            rows.append(
                {
                    "arm": arm,
                    "budget": B,
                    "eps": eps,
                    "tree": rec["tree"],
                    "sampler": rec["sampler"],
                    "draft": cfg.draft,
                    "speedup_mean": rec["speedup"]["mean"],
                    "speedup_sem": rec["speedup"]["sem"],
                    "nfe_mean": rec["nfe"]["mean"],
                    "target_rows_mean": rec["target_rows"]["mean"],
                    "acceptance_pooled": rec["acceptance_pooled"],
                    "delta_profile": profile_text(rec.get("delta_profile")),
                    "n_samples": n_samples,
                }
            )
    return pd.DataFrame(rows)


def draw_figures(out_dir: Path, draws, module: str) -> list:
    """Save each ``(file name, draw)`` of ``draws`` under ``out_dir``; returns the paths written.

    A figure whose table is not committed yet (``draw`` raises ``SystemExit`` or ``FileNotFoundError``)
    is skipped with a line on stderr naming ``module`` and the file.
    """
    out = []
    for name, draw in draws:
        try:
            out.append(save(draw(), out_dir / name))
        except (SystemExit, FileNotFoundError) as e:  # a table not committed yet
            print(f"{module}: {name} skipped ({e})", file=sys.stderr)
            continue
        print(f"wrote {out[-1]}")
    return out
