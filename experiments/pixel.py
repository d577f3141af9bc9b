"""Section 5.2 (EDM CIFAR-10 and FFHQ): Figure 4 and the FID table.

Steps, on GPU hosts with the checkpoints (``model.path=...`` and ``model.sha256=...`` or
``model.trust_checkpoint=true``)::

    python run.py +experiment=fig4_cifar10          # 24 jobs: eps x (K, L) x {rmc, dgrs}, 100 images each
    python run.py +experiment=fid_cifar10           # 150 shard jobs: 50k images per rule
    python -m experiments.pixel fid --dataset cifar10 --sampler dgrs --images <merged images dir>  # -> fid.csv
    python -m experiments.pixel collect --dataset cifar10   # -> results/pixel/fig4_cifar10.csv (same for ffhq)
    python -m experiments.pixel figures

The committed tables list every cell with the paper's value beside ours; cells not run yet are empty.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import pandas as pd

from experiments.common import RESULTS, RULE_COLORS, RULE_LABELS, ok_records, plt, read_csv, save, write_csv
from specsamp.trees import budget

OUT = RESULTS / "pixel"
DATASETS = ("cifar10", "ffhq")
EPS = (0.1, 0.3, 0.6)
SHAPES = ((2, 3), (2, 5), (3, 4), (4, 4))
# FID on 50k samples at K=2, L=3, eps=0.3 (section 5.2); "standard" is EDM's published baseline.
PAPER_FID = {
    ("cifar10", "dgrs"): 1.824,
    ("cifar10", "rmc"): 1.822,
    ("cifar10", "standard"): 1.79,
    ("ffhq", "dgrs"): 2.86,
    ("ffhq", "rmc"): 2.88,
    ("ffhq", "standard"): 2.39,
}
# The paper gives Figure 4 only as a plot; its text states the ranges below.
PAPER_RANGE = {"cifar10": "2.2–2.6x", "ffhq": "≈2.0–2.2x"}


def empty_fig4(dataset: str) -> pd.DataFrame:
    """Every Figure 4 cell, values empty (to be filled by ``collect``)."""
    rows = [
        {
            "dataset": dataset,
            "sampler": s,
            "eps": e,
            "K": K,
            "L": L,
            "budget": budget(K, L),
            "speedup_mean": np.nan,
            "speedup_std": np.nan,
            "speedup_sem": np.nan,
            "n_samples": np.nan,
            "paper_range": PAPER_RANGE[dataset],
        }
        for s in ("rmc", "dgrs")
        for e in EPS
        for K, L in SHAPES
    ]
    return pd.DataFrame(rows)


def empty_fid() -> pd.DataFrame:
    """The FID table with the paper's values and empty columns for ours."""
    rows = [
        {
            "dataset": d,
            "sampler": s,
            "K": 2,
            "L": 3,
            "eps": 0.3,
            "n_images": 50000,
            "fid_paper": PAPER_FID[(d, s)],
            "fid": np.nan,
        }
        for d in DATASETS
        for s in ("standard", "rmc", "dgrs")
    ]
    return pd.DataFrame(rows)


def collect(dataset: str, sweep_dir: str | None = None) -> pd.DataFrame:
    """Fill ``results/pixel/fig4_<dataset>.csv`` from the sweep's records."""
    df = ok_records(sweep_dir or f"multirun/fig4_{dataset}", f"fig4_{dataset}")
    out = empty_fig4(dataset)
    for _, r in df.iterrows():
        sel = (
            (out["sampler"] == r["sampler"])
            & np.isclose(out["eps"], float(r["eps"]))
            & (out["K"] == int(r["K"]))
            & (out["L"] == int(r["L"]))
        )
        for c in ("speedup_mean", "speedup_std", "speedup_sem", "n_samples"):
            out.loc[sel, c] = r[c]
    write_csv(out, OUT / f"fig4_{dataset}.csv")
    print(f"wrote {OUT / f'fig4_{dataset}.csv'} ({int(out['speedup_mean'].notna().sum())} of {len(out)} cells filled)")
    return out


def model_fid_settings(dataset: str) -> tuple[str, dict]:
    """The FID reference and extractor settings of ``conf/model/<dataset>.yaml`` (``fid_ref``, ``fid_*``),
    so that this command scores exactly as ``run.py ... 'metrics=[fid]'`` does."""
    from specsamp.runner import compose, load_config

    model = load_config(compose([f"model={dataset}"]))[0].model
    return str(model.fid_ref), model.fid_settings()


def record_fid(
    dataset: str, sampler: str, images: str, reference: str | None = None, *, table_path=None, **fid_kwargs
) -> pd.DataFrame:
    """Score a rule's 50k images with torch-fidelity and write the value into ``results/pixel/fid.csv``.

    Args:
        dataset: ``cifar10`` or ``ffhq`` (its model config gives the reference and the extractor).
        sampler: the row's rule (``standard``, ``rmc``, ``dgrs``).
        images: the merged run's directory, its ``images/`` folder or ``samples.pt`` (any folder of PNGs).
        reference: overrides the model config's ``fid_ref`` (EDM's published statistics).
        table_path: the table to fill (default ``results/pixel/fid.csv``).
        **fid_kwargs: override the config's extractor settings (``feature_extractor``,
            ``weights_path``, ``device``, ...; see :func:`specsamp.metrics.fid.compute_fid`).

    Returns:
        The table, with ``fid`` (a float) filled in the ``(dataset, sampler)`` row.
    """
    from specsamp.metrics.fid import compute_fid

    ref, settings = model_fid_settings(dataset)
    path = Path(table_path) if table_path is not None else OUT / "fid.csv"
    table = read_csv(path) if path.exists() else empty_fid()
    sel = (table["dataset"] == dataset) & (table["sampler"] == sampler)
    res = compute_fid(images, reference or ref, **{**settings, **fid_kwargs})
    table.loc[sel, "fid"] = float(res["fid"])
    write_csv(table, path)
    print(table[sel].to_string(index=False))
    return table


def fig4(tables: dict[str, pd.DataFrame]):
    """Figure 4: speedup vs budget B, mean ± std over images, one panel per eps, one row per dataset,
    with the range the paper's text states for the dataset (``paper_range``) as a hatched band."""
    from experiments import paper

    fig, axes = plt.subplots(
        len(DATASETS), len(EPS), figsize=(4.2 * len(EPS), 3.6 * len(DATASETS)), squeeze=False, constrained_layout=True
    )
    for i, ds in enumerate(DATASETS):
        df = tables[ds]
        for j, eps in enumerate(EPS):
            ax = axes[i][j]
            sub = df[np.isclose(df["eps"], eps)]
            ours = False
            for rule, s in sub.groupby("sampler"):
                s = s.sort_values("budget").dropna(subset=["speedup_mean"])
                if s.empty:
                    continue
                ours = True
                ax.errorbar(
                    s["budget"],
                    s["speedup_mean"],
                    yerr=s["speedup_std"],
                    fmt="o-",
                    capsize=3,
                    color=RULE_COLORS.get(rule),
                    label=RULE_LABELS.get(rule, rule),
                )
            for lo, hi, text in paper.paper_ranges(sub["paper_range"]):
                paper.band(ax, lo, hi, f"paper's range (section 5.2 text): {text}")
            if not ours:
                ax.text(
                    0.5,
                    0.06,
                    "ours: not run yet (needs a GPU and the EDM checkpoint)",
                    ha="center",
                    va="bottom",
                    transform=ax.transAxes,
                    fontsize=7,
                    color="0.4",
                )
            ax.set_xscale("log")
            ax.set_xticks([budget(K, L) for K, L in SHAPES], [str(budget(K, L)) for K, L in SHAPES])
            ax.set_xlim(10, 450)
            ax.set_ylim(1.0, 3.0)
            ax.set_title(f"{ds}, eps={eps}")
            ax.set_xlabel("budget B")
            ax.set_ylabel("NFE speedup")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7, loc="upper left")
    return fig


def figures() -> list:
    """Draw Figure 4 from the committed tables into ``results/pixel/``."""
    fig = fig4({ds: read_csv(OUT / f"fig4_{ds}.csv") for ds in DATASETS})
    path = save(fig, OUT / "fig4_speedup_vs_budget.png")
    print(f"wrote {path}")
    return [path]


def main(argv=None) -> int:
    """CLI: ``init`` (write the empty tables), ``collect --dataset D``, ``figures``."""
    ap = argparse.ArgumentParser(
        prog="python -m experiments.pixel", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("command", choices=["init", "collect", "fid", "figures"])
    ap.add_argument("--dataset", choices=DATASETS, default="cifar10")
    ap.add_argument("--sweep", default=None)
    ap.add_argument("--sampler", choices=("standard", "rmc", "dgrs"), help="fid: the rule whose images are scored")
    ap.add_argument("--images", help="fid: the rule's merged run directory, its images/ folder or its samples.pt")
    ap.add_argument("--ref", default=None, help="fid: reference statistics (default: the model config's fid_ref)")
    ap.add_argument(
        "--weights", default=None, help="fid: local extractor weights (default: the model config's fid_weights)"
    )
    ap.add_argument("--device", default=None, help="fid: cpu | cuda (default: CUDA when available)")
    ap.add_argument("--table", default=None, help="fid: the table to fill (default: results/pixel/fid.csv)")
    a = ap.parse_args(argv)
    if a.command == "fid":
        if not (a.sampler and a.images):
            ap.error("fid needs --sampler and --images")
        extra = {k: v for k, v in (("weights_path", a.weights), ("device", a.device)) if v is not None}
        try:
            record_fid(a.dataset, a.sampler, a.images, a.ref, table_path=a.table, **extra)
        except (OSError, ValueError, KeyError, ImportError, RuntimeError) as e:
            if isinstance(e, RuntimeError) and not str(e).startswith("could not download"):
                raise  # a bug, not missing weights
            print(f"error: fid --dataset {a.dataset} --sampler {a.sampler} --images {a.images}: {e}", file=sys.stderr)
            return 2
        return 0
    if a.command == "init":
        for ds in DATASETS:
            write_csv(empty_fig4(ds), OUT / f"fig4_{ds}.csv")
        write_csv(empty_fid(), OUT / "fid.csv")
    elif a.command == "collect":
        collect(a.dataset, a.sweep)
    else:
        figures()
    return 0


if __name__ == "__main__":
    sys.exit(main())
