"""Section 5.2's image experiments on the digits network (a trained EDM denoiser that runs on any CPU).

One command regenerates everything (``make digits``, about ten minutes on one CPU core)::

    python run.py +experiment=digits_fig4     # 24 jobs: eps x (K, L) x {rmc, dgrs}, 100 images each
    python run.py +experiment=digits_fid      # standard (twice), rmc, dgrs at K=2, L=3, eps=0.3, 1,000 images each, FID
    python -m experiments.digits collect      # -> results/digits/fig4.csv, fid.csv, two_sample.csv, samples.npz
    python -m experiments.digits levers       # -> results/digits/levers.csv (x0 draft, markmax, optimal trees)
    python -m experiments.digits figures      # -> results/digits/*.png from the committed tables

The FID table gives bootstrap standard errors (resampling the generated images, reference fixed) and a
"data" row (the FID of as many real digits, drawn with replacement, against the full set: the floor at
this sample size). Every arm runs under its own seed, so the image sets are independent; a second
standard run shows the spread between two runs of the same sampler. The two-sample tests compare the
digits classifier's outputs on standard and speculative images: a chi-square test of the
predicted-class counts, and Kolmogorov-Smirnov tests of the maximum softmax probability and of the
logit of the conditioning class.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
import pandas as pd

from experiments import trained
from experiments.common import RESULTS, RULE_LABELS, levers_frontier, ok_records, plt, read_csv, write_csv

OUT = RESULTS / "digits"
EPS = (0.1, 0.3, 0.6)
SHAPES = ((2, 3), (2, 5), (3, 4), (4, 4))
RULES = ("standard", "rmc", "dgrs")
BOOTSTRAP = 200  # resamples for the FID standard errors
LEVER_BUDGETS = {14: (2, 3), 62: (2, 5)}  # the paper's (K, L) at each budget (B=120 adds ~2 min)
LEVERS = {  # arm: overrides (K, L, budget filled per budget), as in experiments.beyond on the mixture
    "paper RMC (chain of B)": ["sampler=rmc"],
    "paper D-GRS (uniform tree)": ["sampler=dgrs"],
    "x0 draft": ["sampler=dgrs", "draft=x0"],
    "markmax coupling": ["sampler=markmax"],
    "optimal tree": ["sampler=dgrs", "tree=optimal"],
    "x0 + optimal tree + markmax": ["sampler=markmax", "draft=x0", "tree=optimal"],
    "x0 + optimal tree": ["sampler=dgrs", "draft=x0", "tree=optimal"],
    "x0 + tree per step": ["sampler=dgrs", "draft=x0", "tree=optimal_per_step"],
    "x0 extrapolated + optimal tree": ["sampler=dgrs", "draft=x0_extrap_gated", "tree=optimal"],
    "x0 extrapolated + tree per step": ["sampler=dgrs", "draft=x0_extrap_gated", "tree=optimal_per_step"],
    "x0 affine + optimal tree": ["sampler=dgrs", "draft=x0_affine", "tree=optimal"],
}


# ----------------------------------------------------------------------------------------------
# Figure 4


def collect_fig4(sweep_dir: str | None = None) -> pd.DataFrame:
    """``results/digits/fig4.csv`` from the ``digits_fig4`` sweep: one row per (rule, eps, K, L)."""
    return trained.collect_fig4(sweep_dir or "multirun/digits_fig4", "digits_fig4", OUT / "fig4.csv")


def _fig4():
    return trained.fig4_figure(
        read_csv(OUT / "fig4.csv"),
        EPS,
        SHAPES,
        title="digits (trained EDM net), eps={eps}",
        ylabel="NFE speedup (mean ± std, 100 images)",
        yerr="speedup_std",
    )


# ----------------------------------------------------------------------------------------------
# FID and two-sample tests


ARMS = {  # label in the tables: (sampler, seed) of the digits_fid sweep (conf/fid_arm/)
    "standard": ("standard", 0),
    "standard, 2nd run": ("standard", 1),
    "rmc": ("rmc", 2),
    "dgrs": ("dgrs", 3),
    "lever": ("dgrs", 4),  # conf/fid_arm/lever_seed4.yaml: the best exact lever beyond the paper
}


def _job_dirs(sweep_dir: str):
    from pathlib import Path

    df = ok_records(sweep_dir, "digits_fid")
    dirs, recs = {}, {}
    for arm, (sampler, seed) in ARMS.items():
        sel = df[(df["sampler"] == sampler) & (df["seed"] == seed)]
        if sel.empty:
            print(
                f"error: {sweep_dir} has no finished job for sampler={sampler} seed={seed}; run "
                f"`python run.py +experiment=digits_fid`",
                file=sys.stderr,
            )
            raise SystemExit(2)
        dirs[arm], recs[arm] = Path(sweep_dir) / sel.iloc[0]["job"], sel.iloc[0]
    return dirs, recs


def _classifier_outputs(images: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Features ``[N, 64]`` and logits ``[N, 10]`` through the registered torch-fidelity extractor."""
    from specsamp.metrics.fid import extract_features

    kw = dict(feature_extractor="digits-classifier", device="cpu", batch_size=500)
    return extract_features(images, feature_layer="features", **kw), extract_features(
        images, feature_layer="logits", **kw
    )


def bootstrap_fid(features: np.ndarray, ref, n_boot: int = BOOTSTRAP, seed: int = 0) -> tuple[float, float]:
    """FID of ``features [N, F]`` against ``ref`` (:class:`Statistics`) and its bootstrap standard error."""
    from specsamp.metrics.fid import feature_statistics, frechet_distance

    st = feature_statistics(features)
    point = frechet_distance(st.mu, st.sigma, ref.mu, ref.sigma)
    rng = np.random.default_rng(seed)
    boots = []
    for _ in range(n_boot):
        b = feature_statistics(features[rng.integers(0, len(features), len(features))])
        boots.append(frechet_distance(b.mu, b.sigma, ref.mu, ref.sigma))
    return point, float(np.std(boots, ddof=1))


def _softmax(logits: np.ndarray) -> np.ndarray:
    p = np.exp(logits - logits.max(1, keepdims=True))
    return p / p.sum(1, keepdims=True)


def two_sample_tests(a: tuple, b: tuple, comparison: str) -> list[dict]:
    """Chi-square on predicted-class counts and on per-class accuracy, KS on max softmax probability and conditioning logit.

    ``a``, ``b``: ``(logits [N, 10], labels [N])`` of two independent image sets.
    """
    from scipy import stats

    (la, ya), (lb, yb) = a, b
    counts = np.stack([np.bincount(la.argmax(1), minlength=10), np.bincount(lb.argmax(1), minlength=10)])
    chi = stats.chi2_contingency(counts[:, counts.sum(0) > 0])
    # given the conditioning label: per-class accuracy, one 2x2 table per label, statistics summed (dof 10);
    # the plain count test above also carries the spread of the two label draws
    strata = 0.0
    dof = 0
    for c in range(10):
        tab = np.array(
            [
                [np.sum((ya == c) & (la.argmax(1) == c)), np.sum((ya == c) & (la.argmax(1) != c))],
                [np.sum((yb == c) & (lb.argmax(1) == c)), np.sum((yb == c) & (lb.argmax(1) != c))],
            ]
        )
        if tab.sum(0).min() > 0 and tab.sum(1).min() > 0:
            strata += stats.chi2_contingency(tab, correction=False).statistic
            dof += 1
    ks_max = stats.ks_2samp(_softmax(la).max(1), _softmax(lb).max(1))
    ks_logit = stats.ks_2samp(la[np.arange(len(ya)), ya], lb[np.arange(len(yb)), yb])
    return [
        {
            "comparison": comparison,
            "test": "chi-square, predicted class counts",
            "statistic": chi.statistic,
            "dof": chi.dof,
            "p_value": chi.pvalue,
        },
        {
            "comparison": comparison,
            "test": "chi-square, per-class accuracy given the label",
            "statistic": strata,
            "dof": dof,
            "p_value": float(stats.chi2.sf(strata, dof)) if dof else np.nan,
        },
        {
            "comparison": comparison,
            "test": "KS, max softmax probability",
            "statistic": ks_max.statistic,
            "dof": np.nan,
            "p_value": ks_max.pvalue,
        },
        {
            "comparison": comparison,
            "test": "KS, logit of the conditioning class",
            "statistic": ks_logit.statistic,
            "dof": np.nan,
            "p_value": ks_logit.pvalue,
        },
    ]


def collect_fid(sweep_dir: str = "multirun/digits_fid") -> tuple[pd.DataFrame, pd.DataFrame]:
    """``fid.csv`` (FID ± bootstrap s.e., label accuracy, speedup, Inception Score ± s.e. per arm),
    ``two_sample.csv``, ``samples.npz``."""
    import torch

    from specsamp.images import load_images
    from specsamp.io import atomic_write
    from specsamp.metrics.fid import load_statistics
    from specsamp.metrics.isc import isc_from_logits
    from specsamp.models.digits import load_digits_data
    from specsamp.models.edm import uniform_labels

    dirs, recs = _job_dirs(sweep_dir)
    ref = load_statistics("digits-8x8")
    rows, outs, pics = [], {}, {}
    for arm in ARMS:
        images = load_images(dirs[arm] / "images")
        n = len(images)
        feats, logits = _classifier_outputs(images)
        fid, se = bootstrap_fid(feats, ref)
        r = recs[arm]
        labels = uniform_labels(torch.arange(n), int(r["seed"]), 10).numpy()
        correct = logits.argmax(1) == labels
        outs[arm] = (logits, labels)
        pics[arm] = images[:100]
        rows.append(
            {
                "arm": arm,
                "sampler": r["sampler"],
                "seed": int(r["seed"]),
                "tree": r["tree"],
                "eps": 0.3,
                "n_images": n,
                "fid": fid,
                "fid_se": se,
                "fid_runner": r.get("fid", np.nan),
                "label_accuracy": correct.mean(),
                "label_accuracy_se": correct.std(ddof=1) / np.sqrt(n),
                "speedup_mean": r["speedup_mean"],
                "speedup_sem": r["speedup_sem"],
                "nfe_mean": r["nfe_mean"],
            }
        )
    # the floor: as many real digits (drawn with replacement), same features, same reference
    x, y = load_digits_data()
    rng = np.random.default_rng(1)
    real = (x.numpy()[:, 0] * 127.5 + 128).clip(0, 255).astype(np.uint8)[..., None]
    n = rows[0]["n_images"]
    pick = rng.integers(0, len(real), n)
    feats, logits = _classifier_outputs(real[pick])
    real_logits = logits
    fid, se = bootstrap_fid(feats, ref)
    correct = logits.argmax(1) == y.numpy()[pick]
    rows.append(
        {
            "arm": "data (real digits)",
            "n_images": n,
            "fid": fid,
            "fid_se": se,
            "label_accuracy": correct.mean(),
            "label_accuracy_se": correct.std(ddof=1) / np.sqrt(n),
        }
    )
    fid_df = pd.DataFrame(rows)
    base = fid_df.set_index("arm").loc["standard"]
    fid_df["fid_z_vs_standard"] = (fid_df["fid"] - base["fid"]) / np.sqrt(fid_df["fid_se"] ** 2 + base["fid_se"] ** 2)
    fid_df.loc[fid_df["arm"] == "standard", "fid_z_vs_standard"] = np.nan
    # the Inception Score beside the FID, from the same classifier's logits (specsamp.metrics.isc; 10 splits)
    scores = [isc_from_logits(lg) for lg in [outs[arm][0] for arm in ARMS] + [real_logits]]
    fid_df["isc"] = [sc["isc"] for sc in scores]
    fid_df["isc_se"] = [sc["isc_se"] for sc in scores]
    write_csv(fid_df, OUT / "fid.csv")

    tests = []
    for arm in ("standard, 2nd run", "rmc", "dgrs", "lever"):
        tests += two_sample_tests(outs["standard"], outs[arm], f"standard vs {arm}")
    tests_df = pd.DataFrame(tests)
    write_csv(tests_df, OUT / "two_sample.csv")
    atomic_write(OUT / "samples.npz", lambda f: np.savez_compressed(f, **{r: pics[r] for r in RULES}))
    print(fid_df.to_string(index=False))
    print(tests_df.to_string(index=False))
    return fid_df, tests_df


SAMPLE_TITLES = {  # the FID arms' settings (conf/experiment/digits_fid.yaml): eps=0.3, T=100, (K, L)=(2, 3)
    "standard": "standard sampler",
    "rmc": "RMC, chain of B=14",
    "dgrs": "D-GRS, (K, L)=(2, 3) tree, B=14",
}
TILE_PAD, PAD_GREY = 2, 96  # pixels of mid grey between the 8x8 digits, so that each reads as one image


def sample_grid(images: np.ndarray, pad: int = TILE_PAD, fill: int = PAD_GREY) -> np.ndarray:
    """Tile uint8 grey images ``[N, 8, 8]`` into a square grid ``[k (8 + pad) - pad]^2`` (``k = floor(sqrt N)``),
    separated by ``pad`` pixels of grey ``fill``."""
    k = int(np.sqrt(len(images)))
    h, w = images.shape[1:3]
    grid = np.full((k * (h + pad) - pad, k * (w + pad) - pad), fill, dtype=np.uint8)
    for i in range(k * k):
        r, c = divmod(i, k)
        grid[r * (h + pad) : r * (h + pad) + h, c * (w + pad) : c * (w + pad) + w] = images[i]
    return grid


def _samples_figure():
    z = np.load(OUT / "samples.npz")
    fig, axes = plt.subplots(1, len(RULES), figsize=(3.4 * len(RULES), 3.7), constrained_layout=True)
    for ax, rule in zip(axes, RULES):
        ax.imshow(sample_grid(z[rule][:100, :, :, 0]), cmap="gray", vmin=0, vmax=255, interpolation="nearest")
        ax.set_title(SAMPLE_TITLES.get(rule, RULE_LABELS.get(rule, rule)), fontsize=9)
        ax.axis("off")
    fig.suptitle("digits network: the first 100 of the 1,000 FID images per rule (eps=0.3, T=100)", fontsize=9)
    return fig


# ----------------------------------------------------------------------------------------------
# levers beyond the paper


def levers(n_samples: int = 100, eps: float = 0.3) -> pd.DataFrame:
    """Every arm of :data:`LEVERS` at every budget of :data:`LEVER_BUDGETS`; ``results/digits/levers.csv``."""
    df = trained.levers_table("digits", LEVERS, LEVER_BUDGETS, n_samples=n_samples, eps=eps)
    write_csv(df, OUT / "levers.csv")
    print(f"wrote {OUT / 'levers.csv'}")
    return df


def _levers_figure():
    df = read_csv(OUT / "levers.csv")
    return levers_frontier(
        df,
        title=f"digits (trained EDM net), eps={df['eps'].iloc[0]:g}: levers beyond the paper, all exact",
        ylabel="speedup (100 images, ±1 s.e.)",
        figsize=(7, 4.2),
    )


def figures() -> list:
    """Figure 4, the levers frontier and the sample grids, from the committed tables (no sampling)."""
    return trained.draw_figures(
        OUT,
        (
            ("fig4_speedup_vs_budget.png", _fig4),
            ("levers_frontier.png", _levers_figure),
            ("samples.png", _samples_figure),
        ),
        "experiments.digits",
    )


def main(argv=None) -> int:
    """CLI: ``collect`` (Figure 4 + FID tables from the sweeps), ``levers``, ``figures``."""
    ap = argparse.ArgumentParser(
        prog="python -m experiments.digits", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("command", choices=["collect", "levers", "figures"])
    ap.add_argument("--fig4-sweep", default="multirun/digits_fig4")
    ap.add_argument("--fid-sweep", default="multirun/digits_fid")
    ap.add_argument("--n", type=int, default=100, help="levers: images per cell")
    a = ap.parse_args(argv)
    if a.command == "collect":
        collect_fig4(a.fig4_sweep)
        collect_fid(a.fid_sweep)
    elif a.command == "levers":
        levers(a.n)
    else:
        figures()
    return 0


if __name__ == "__main__":
    sys.exit(main())
