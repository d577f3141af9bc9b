"""Train the patches32 denoiser and write it as an NVIDIA-style persistent pickle.

``python -m experiments.train_patches`` (``make train-patches``; steps and seconds in
``results/patches32/training.json``):

1. the class-unconditional EDM denoiser (:class:`experiments.patches_net.EDMPrecond`, a small U-Net)
   with EDM's loss (Karras et al. 2022, eq. 2 and Table 1: ``ln sigma ~ N(-1.2, 1.2^2)``, weight
   ``(sigma^2 + sd^2) / (sigma sd)^2``), Adam, an exponential moving average of the weights, on random
   32x32 crops of the training regions of scikit-learn's two photographs
   (:func:`specsamp.models.patches.training_crops`); saved as ``{'ema': net, ...}`` in
   ``specsamp/data/edm-patches-32x32-uncond.pkl``;
2. its quality, judged on the held-out crops (:func:`specsamp.models.patches.held_out_crops`): the
   mean squared denoising error ``E|D(x0 + s xi; s) - x0|^2`` per pixel at a grid of noise levels,
   beside that of the best *Gaussian* denoiser (a full-covariance Gaussian fitted to 20,000 training
   crops: ``D(y) = mu + S (S + s^2 I)^-1 (y - mu)``, the posterior mean under that Gaussian), same
   noise draws.

Seeded, one thread: the same torch build on the same CPU type reproduces the weights, but not the
pickle's bytes (torch stores a random serialization id with each pickled tensor storage), so a
retrained pickle has a new SHA-256: the one printed at the end goes into
``specsamp.models.edm.CHECKPOINTS``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from experiments import edm_training
from specsamp.models.patches import (
    CHANNELS,
    DENOISER_FILE,
    RESOLUTION,
    held_out_crops,
    training_crops,
    training_pyramid,
)

SIGMA_DATA = 0.5  # EDM's default; the crops' pixel standard deviation is 0.48-0.68 (training.json: data_std)
WIDTHS = (16, 32, 64, 128)
EVAL_SIGMAS = (0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 20.0, 80.0)


def network_module():
    """``experiments/patches_net.py``, imported with the ``torch_utils`` stand-in registered (its classes are
    NVIDIA persistent classes: a pickled instance carries this file's source)."""
    return edm_training.network_module("patches_net")


def build_network():
    """A freshly initialised :class:`experiments.patches_net.EDMPrecond` of the shipped size."""
    m = network_module()
    return m.EDMPrecond(RESOLUTION, CHANNELS, sigma_data=SIGMA_DATA, widths=WIDTHS, emb_channels=64)


def train_denoiser(pyramid, *, steps: int, batch: int, lr: float, ema_decay: float, seed: int, log_every: int = 100):
    """EDM training loop (:func:`experiments.edm_training.train_edm`) on random crops of ``pyramid``
    (:func:`specsamp.models.patches.training_crops`); returns ``(ema network, per-interval mean losses)``."""
    return edm_training.train_edm(
        build_network,
        lambda gen, n: (training_crops(pyramid, n, gen), ()),
        steps=steps,
        batch=batch,
        lr=lr,
        ema_decay=ema_decay,
        seed=seed,
        sigma_data=SIGMA_DATA,
        log_every=log_every,
    )


class GaussianDenoiser:
    """Posterior mean under ``N(mu, S)`` fitted to ``crops [n, 3, 32, 32]``: ``D(y; s) = mu + S (S + s^2 I)^-1 (y - mu)``.

    Computed in float64 through the eigendecomposition ``S = U diag(lam) U^T``.
    """

    def __init__(self, crops: torch.Tensor):
        x = crops.reshape(len(crops), -1).double()
        self.mu = x.mean(0)
        cov = torch.cov((x - self.mu).T)
        self.lam, self.U = torch.linalg.eigh(cov)
        self.lam = self.lam.clamp(min=0)

    def __call__(self, y: torch.Tensor, sigma: float) -> torch.Tensor:
        z = (y.reshape(len(y), -1).double() - self.mu) @ self.U
        z = z * (self.lam / (self.lam + sigma**2))
        return (self.mu + z @ self.U.T).reshape(y.shape).float()


def denoising_table(net, gauss: GaussianDenoiser, crops: torch.Tensor, seed: int, sigmas=EVAL_SIGMAS) -> list[dict]:
    """Per-pixel MSE of the network and of the Gaussian denoiser on ``crops`` at each ``sigma`` (same noise)."""
    gen = torch.Generator().manual_seed(seed + 7)
    rows = []
    for s in sigmas:
        noise = torch.randn(crops.shape, generator=gen)
        y = crops + s * noise
        with torch.no_grad():
            d_net = torch.cat(
                [net(y[i : i + 250], torch.full((len(y[i : i + 250]),), s)) for i in range(0, len(y), 250)]
            )
        d_g = gauss(y, s)
        rows.append(
            {
                "sigma": s,
                "mse_network": float(((d_net - crops) ** 2).mean()),
                "mse_gaussian": float(((d_g - crops) ** 2).mean()),
                "mse_identity": float(
                    min(s**2, float(((crops - gauss.mu.reshape(crops.shape[1:]).float()) ** 2).mean()))
                ),
            }
        )
    return rows


def main(argv=None) -> int:
    """CLI: ``python -m experiments.train_patches [--steps N] [--seed S] [--out-dir D]``."""
    ap = argparse.ArgumentParser(
        prog="python -m experiments.train_patches",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--steps", type=int, default=3000, help="optimiser steps")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--ema", type=float, default=0.995, help="EMA decay per step")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out-dir", default=None, help="where the pickle goes (default: specsamp/data/)")
    ap.add_argument("--no-eval", action="store_true", help="skip the held-out denoising table (about a minute)")
    a = ap.parse_args(argv)
    for key in ("steps", "batch", "threads"):
        if getattr(a, key) < 1:
            print(f"error: --{key}={getattr(a, key)} is invalid: must be an integer >= 1", file=sys.stderr)
            return 2
    if not 0 <= a.ema < 1:
        print(f"error: --ema={a.ema} is invalid: must lie in [0, 1)", file=sys.stderr)
        return 2
    torch.set_num_threads(a.threads)
    out = Path(a.out_dir) if a.out_dir else DENOISER_FILE.parent
    pyramid = training_pyramid()

    t0 = time.perf_counter()
    ema, losses = train_denoiser(pyramid, steps=a.steps, batch=a.batch, lr=a.lr, ema_decay=a.ema, seed=a.seed)
    seconds = time.perf_counter() - t0
    meta = {
        "data": "sklearn.datasets.load_sample_images (china.jpg, flower.jpg), p / 127.5 - 1, 32x32 crops "
        "of columns 0-511 at scales 1 and 1/2, left-right flips",
        "sigma_data": SIGMA_DATA,
        "widths": list(WIDTHS),
        "steps": a.steps,
        "batch": a.batch,
        "lr": a.lr,
        "ema": a.ema,
        "seed": a.seed,
        "final_loss": losses[-1],
    }
    sha = edm_training.save_pickle({"ema": ema, "training_options": meta}, out / DENOISER_FILE.name)

    held = held_out_crops()
    table = None
    if not a.no_eval:
        gauss = GaussianDenoiser(training_crops(pyramid, 20000, torch.Generator().manual_seed(a.seed + 3)))
        table = denoising_table(ema, gauss, held, a.seed)
    report = {
        "denoiser": {
            "seconds": round(seconds, 1),
            "loss_every_100_steps": [round(v, 4) for v in losses],
            "parameters": sum(p.numel() for p in ema.parameters()),
            "pickle_bytes": (out / DENOISER_FILE.name).stat().st_size,
            "sha256": sha,
            **meta,
        },
        "held_out": {"crops": len(held), "data_std": float(held.std()), "denoising_mse_per_pixel": table},
        "threads": a.threads,
        "torch": torch.__version__,
    }
    if a.out_dir is None:
        edm_training.write_report(report, "patches32")
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
