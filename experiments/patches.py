"""Section 5.2's image experiments at CIFAR-10's dimension on the patches32 network (3x32x32, trained here).

One command regenerates everything (``make patches``)::

    python run.py +experiment=patches_fig4      # 24 jobs: eps x (K, L) x {rmc, dgrs}, 100 images each, T=100
    python -m experiments.patches collect       # -> results/patches32/fig4.csv (per-depth acceptance included)
    python -m experiments.patches two_sample    # -> two_sample.csv, samples.npz (standard twice, rmc, dgrs; --n images each)
    python -m experiments.patches levers        # -> levers.csv (x0 draft, markmax, optimal and per-step trees)
    python -m experiments.patches figures       # -> results/patches32/*.png from the committed tables

Two-sample tests (:func:`two_sample_tests`) compare two independent image sets (each arm under its own
seed): Kolmogorov-Smirnov tests of fixed random unit projections of the pixels and of four patch
statistics (mean brightness, contrast, gradient energy, colourfulness), and an energy-distance
permutation test (Szekely and Rizzo 2004) on the full 3,072-d states. A second standard run gives the
spread between two runs of the same sampler; the held-out real crops give the network's own distance
from the data on the same statistics.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
import pandas as pd

from experiments import trained
from experiments.common import RESULTS, levers_frontier, plt, read_csv, write_csv

OUT = RESULTS / "patches32"
EPS = (0.1, 0.3, 0.6)
SHAPES = ((2, 3), (2, 5), (3, 4), (4, 4))
PAPER_CIFAR10 = (
    2.2,
    2.6,
)  # paper section 5.2: D-GRS speedups on EDM CIFAR-10 from B=62 ("2.2-2.6x"), stated as a range
ARMS = {  # label: (sampler overrides, seed); independent image sets
    "standard": (["sampler=standard"], 0),
    "standard, 2nd run": (["sampler=standard"], 1),
    "rmc": (["sampler=rmc"], 2),
    "dgrs": (["sampler=dgrs"], 3),
}
PROJECTIONS = 8  # random unit directions in pixel space, seed 0
PERMUTATIONS = 200  # energy-distance permutation test
LEVER_BUDGETS = {14: (2, 3), 62: (2, 5)}
LEVERS = {  # arm: overrides (K, L, budget filled per budget), as for the digits network
    "paper RMC (chain of B)": ["sampler=rmc"],
    "paper D-GRS (uniform tree)": ["sampler=dgrs"],
    "x0 draft": ["sampler=dgrs", "draft=x0"],
    "markmax coupling": ["sampler=markmax"],
    "optimal tree": ["sampler=dgrs", "tree=optimal"],
    "x0 + optimal tree": ["sampler=dgrs", "draft=x0", "tree=optimal"],
    "x0 + optimal tree + markmax": ["sampler=markmax", "draft=x0", "tree=optimal"],
    "x0 + tree per step": ["sampler=dgrs", "draft=x0", "tree=optimal_per_step"],
    "x0 extrapolated + tree per step": ["sampler=dgrs", "draft=x0_extrap_gated", "tree=optimal_per_step"],
}


# ----------------------------------------------------------------------------------------------
# Figure 4


def collect_fig4(sweep_dir: str | None = None) -> pd.DataFrame:
    """``results/patches32/fig4.csv`` from the ``patches_fig4`` sweep: one row per (rule, eps, K, L)."""
    return trained.collect_fig4(
        sweep_dir or "multirun/patches_fig4",
        "patches_fig4",
        OUT / "fig4.csv",
        show=["sampler", "eps", "budget", "speedup_mean", "speedup_sem", "acceptance"],
    )


def _fig4():
    from experiments.paper import band

    return trained.fig4_figure(
        read_csv(OUT / "fig4.csv"),
        EPS,
        SHAPES,
        title="patches32 (trained EDM net, 3x32x32), eps={eps}",
        title_fontsize=9,
        ylabel="NFE speedup (mean ± s.e., 100 images)",
        yerr="speedup_sem",
        decorate=lambda ax: band(ax, *PAPER_CIFAR10, "paper: CIFAR-10 D-GRS from B=62, 2.2–2.6x"),
    )


# ----------------------------------------------------------------------------------------------
# two-sample tests


def patch_statistics(x: np.ndarray) -> dict[str, np.ndarray]:
    """Per-image statistics of ``x [N, 3, 32, 32]`` in ``[-1, 1]``: each ``[N]`` float64.

    ``brightness`` (pixel mean), ``contrast`` (pixel standard deviation of the grey image),
    ``gradient energy`` (mean squared horizontal and vertical neighbour difference of the grey image),
    ``colourfulness`` (mean absolute deviation of the channels from their per-pixel mean).
    """
    x = np.asarray(x, np.float64)
    grey = x.mean(1)
    gx, gy = np.diff(grey, axis=2), np.diff(grey, axis=1)
    return {
        "brightness": x.mean((1, 2, 3)),
        "contrast": grey.reshape(len(x), -1).std(1),
        "gradient energy": (gx**2).mean((1, 2)) + (gy**2).mean((1, 2)),
        "colourfulness": np.abs(x - x.mean(1, keepdims=True)).mean((1, 2, 3)),
    }


def energy_test(a: np.ndarray, b: np.ndarray, permutations: int = PERMUTATIONS, seed: int = 0) -> tuple[float, float]:
    """Energy-distance two-sample statistic of ``a [n, D]``, ``b [m, D]`` and its permutation p-value.

    ``E = 2 mean|a - b| - mean|a - a'| - mean|b - b'|`` (Euclidean; Szekely and Rizzo 2004), p-value
    ``(1 + #{E_perm >= E}) / (1 + permutations)`` over random relabellings (seeded).
    """
    z = np.concatenate([a, b]).reshape(len(a) + len(b), -1).astype(np.float64)
    sq = (z**2).sum(1)
    d = np.sqrt(np.maximum(sq[:, None] + sq[None, :] - 2 * z @ z.T, 0.0))
    n = len(a)

    def stat(idx):
        i, j = idx[:n], idx[n:]
        return 2 * d[np.ix_(i, j)].mean() - d[np.ix_(i, i)].mean() - d[np.ix_(j, j)].mean()

    rng = np.random.default_rng(seed)
    e0 = stat(np.arange(len(z)))
    perm = [stat(rng.permutation(len(z))) for _ in range(permutations)]
    return float(e0), float((1 + np.sum(np.asarray(perm) >= e0)) / (1 + permutations))


def two_sample_tests(a: np.ndarray, b: np.ndarray, comparison: str, permutations: int = PERMUTATIONS) -> list[dict]:
    """KS on :data:`PROJECTIONS` random pixel projections and on :func:`patch_statistics`, and :func:`energy_test`.

    ``a``, ``b``: ``[N, 3, 32, 32]`` float arrays of two independent image sets. The projection
    directions are drawn once from seed 0, so every comparison uses the same ones.
    """
    from scipy import stats

    dim = int(np.prod(a.shape[1:]))
    dirs = np.random.default_rng(0).standard_normal((PROJECTIONS, dim))
    dirs /= np.linalg.norm(dirs, axis=1, keepdims=True)
    pa, pb = a.reshape(len(a), -1) @ dirs.T, b.reshape(len(b), -1) @ dirs.T
    rows = []
    for k in range(PROJECTIONS):
        ks = stats.ks_2samp(pa[:, k], pb[:, k])
        rows.append(
            {
                "comparison": comparison,
                "test": f"KS, random pixel projection {k}",
                "statistic": ks.statistic,
                "p_value": ks.pvalue,
            }
        )
    sa, sb = patch_statistics(a), patch_statistics(b)
    for name in sa:
        ks = stats.ks_2samp(sa[name], sb[name])
        rows.append({"comparison": comparison, "test": f"KS, {name}", "statistic": ks.statistic, "p_value": ks.pvalue})
    e, p = energy_test(a, b, permutations)
    rows.append(
        {
            "comparison": comparison,
            "test": f"energy distance, {permutations} permutations",
            "statistic": e,
            "p_value": p,
        }
    )
    return [{**r, "n_a": len(a), "n_b": len(b)} for r in rows]


def sample_arms(n: int, *, K: int = 2, L: int = 3, eps: float = 0.3, steps: int | None = None, extra=()) -> dict:
    """Images of every arm of :data:`ARMS`: ``{arm: (images float32 [n, 3, 32, 32] in [-1, 1], record)}``."""
    import torch

    from specsamp.runner import build_target, compose, load_config, run_config, summary_line

    torch.set_num_threads(1)
    out, target = {}, None
    for arm, (ov, seed) in ARMS.items():
        cfg = compose(
            [
                "model=patches32",
                *ov,
                f"K={K}",
                f"L={L}",
                f"eps={eps}",
                f"n_samples={n}",
                f"seed={seed}",
                "execution=path",
                "progress=false",
                *([f"steps={steps}"] if steps else []),
                *extra,
            ]
        )
        target = target or build_target(load_config(cfg)[0])
        rec, res = run_config(cfg, target=target)
        print(f"{arm:20s} {summary_line(rec)}", flush=True)
        out[arm] = (target.decode(res.samples).numpy(), rec)
    return out


def collect_two_sample(n: int = 1000, permutations: int = PERMUTATIONS, out_dir=None, **kw) -> pd.DataFrame:
    """``two_sample.csv`` (every arm vs standard, standard vs held-out real crops) and ``samples.npz``."""
    from specsamp.io import atomic_write
    from specsamp.models.patches import held_out_crops

    out_dir = OUT if out_dir is None else out_dir
    arms = sample_arms(n, **kw)
    real = held_out_crops().numpy()
    base = arms["standard"][0]
    tests = []
    for arm in ("standard, 2nd run", "rmc", "dgrs"):
        tests += two_sample_tests(base, arms[arm][0], f"standard vs {arm}", permutations)
    tests += two_sample_tests(base, real, "standard vs held-out real crops", permutations)
    df = pd.DataFrame(tests)
    for arm, (_, rec) in arms.items():
        df.loc[df["comparison"] == f"standard vs {arm}", "speedup_mean"] = rec["speedup"]["mean"]
    write_csv(df, out_dir / "two_sample.csv")
    pick = np.random.default_rng(0).choice(len(real), 64, replace=False)
    to_u8 = lambda x: ((x[:64] + 1) * 127.5).round().clip(0, 255).astype(np.uint8)  # noqa: E731
    atomic_write(
        out_dir / "samples.npz",
        lambda f: np.savez_compressed(
            f, real=to_u8(real[pick]), **{a.replace(", 2nd run", "_2"): to_u8(x) for a, (x, _) in arms.items()}
        ),
    )
    print(df.to_string(index=False))
    return df


def _samples_figure():
    z = np.load(OUT / "samples.npz")
    panels = [
        ("real", "held-out real crops"),
        ("standard", "standard"),
        ("rmc", "RMC (K=2, L=3, eps=0.3)"),
        ("dgrs", "D-GRS (K=2, L=3, eps=0.3)"),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(3.4 * len(panels), 3.6), constrained_layout=True)
    for ax, (key, title) in zip(axes, panels):
        k = int(np.sqrt(min(64, len(z[key]))))
        imgs = z[key][: k * k]  # [k^2, 3, 32, 32] uint8
        grid = imgs.reshape(k, k, 3, 32, 32).transpose(0, 3, 1, 4, 2).reshape(k * 32, k * 32, 3)
        ax.imshow(grid)
        ax.set_title(title, fontsize=8)
        ax.axis("off")
    return fig


def _denoising_figure():
    import json

    rep = json.loads((OUT / "training.json").read_text())
    t = pd.DataFrame(rep["held_out"]["denoising_mse_per_pixel"])
    fig, ax = plt.subplots(figsize=(5, 3.6))
    ax.loglog(t["sigma"], t["mse_network"], "o-", label="trained network")
    ax.loglog(t["sigma"], t["mse_gaussian"], "s--", label="best Gaussian denoiser (full covariance)")
    ax.loglog(t["sigma"], t["mse_identity"], ":", color="0.5", label="min(sigma², data variance)")
    ax.set_xlabel("EDM noise level s")
    ax.set_ylabel("denoising MSE per pixel, held-out crops")
    ax.set_title("patches32: denoiser vs a Gaussian baseline", fontsize=9)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    return fig


# ----------------------------------------------------------------------------------------------
# levers beyond the paper


def levers(n_samples: int = 100, eps: float = 0.3, budgets=None, out_dir=None, extra=()) -> pd.DataFrame:
    """Every arm of :data:`LEVERS` at every budget of :data:`LEVER_BUDGETS`; ``results/patches32/levers.csv``."""
    df = trained.levers_table(
        "patches32",
        LEVERS,
        budgets or LEVER_BUDGETS,
        n_samples=n_samples,
        eps=eps,
        tail=("execution=path", "progress=false", *extra),
        arm_width=32,
    )
    write_csv(df, (OUT if out_dir is None else out_dir) / "levers.csv")
    return df


def _levers_figure():
    df = read_csv(OUT / "levers.csv")
    return levers_frontier(
        df,
        title=f"patches32 (trained EDM net, 3x32x32), eps={df['eps'].iloc[0]:g}: levers, all exact",
        ylabel="speedup (100 images, ±1 s.e.)",
        figsize=(7, 4.2),
    )


def figures() -> list:
    """Figure 4, the levers frontier, the sample grids and the denoising curve, from the committed tables (no sampling)."""
    return trained.draw_figures(
        OUT,
        (
            ("fig4_speedup_vs_budget.png", _fig4),
            ("levers_frontier.png", _levers_figure),
            ("samples.png", _samples_figure),
            ("denoising.png", _denoising_figure),
        ),
        "experiments.patches",
    )


def main(argv=None) -> int:
    """CLI: ``collect`` (Figure 4 from the sweep), ``two_sample``, ``levers``, ``figures``."""
    ap = argparse.ArgumentParser(
        prog="python -m experiments.patches", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("command", choices=["collect", "two_sample", "levers", "figures"])
    ap.add_argument("--fig4-sweep", default="multirun/patches_fig4")
    ap.add_argument("--n", type=int, default=None, help="images per arm (two_sample: 1000, levers: 100)")
    a = ap.parse_args(argv)
    if a.n is not None and a.n < 2:
        print(f"error: --n={a.n} is invalid: must be an integer >= 2", file=sys.stderr)
        return 2
    if a.command == "collect":
        collect_fig4(a.fig4_sweep)
    elif a.command == "two_sample":
        collect_two_sample(a.n or 1000)
    elif a.command == "levers":
        levers(a.n or 100)
    else:
        figures()
    return 0


if __name__ == "__main__":
    sys.exit(main())
