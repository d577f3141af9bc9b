"""Train the digits target's two networks and write them as NVIDIA-style persistent pickles.

``python -m experiments.train_digits`` (``make train-digits``; about four minutes on one CPU thread):

1. the class-conditional EDM denoiser (:class:`experiments.digits_net.EDMPrecond`) with EDM's loss
   (Karras et al. 2022, eq. 2 and Table 1: ``ln sigma ~ N(-1.2, 1.2^2)``, weight
   ``(sigma^2 + sd^2) / (sigma sd)^2``), Adam, an exponential moving average of the weights;
   saved as ``{'ema': net, ...}`` in ``specsamp/data/edm-digits-8x8-cond.pkl``;
2. a conv classifier on a fixed 1,497 / 300 split (held-out accuracy printed), saved as
   ``{'classifier': net, ...}`` in ``specsamp/data/digits-classifier-8x8.pkl``;
3. the classifier's feature statistics of all 1,797 images (FID reference), in
   ``specsamp/data/digits-8x8-classifier-stats.npz``.

Seeded, one thread: the same torch build on the same CPU type reproduces the weights (the reference
``.npz`` bit for bit), but not the pickles' bytes (torch stores a random serialization id with each
pickled tensor storage), so a retrained pickle has a new SHA-256: the ones printed at the end go into
``specsamp.models.edm.CHECKPOINTS`` and ``specsamp.models.digits.CLASSIFIER_SHA256``. Training figures
go to ``results/digits/training.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from experiments import edm_training
from specsamp.metrics.fid import feature_statistics
from specsamp.models.digits import (
    CFG_DENOISER_FILE,
    CHANNELS,
    CLASSES,
    CLASSIFIER_FILE,
    DENOISER_FILE,
    REFERENCE_FILE,
    RESOLUTION,
    load_digits_data,
)

SIGMA_DATA = 0.75  # standard deviation of the digits' pixels in [-1, 1] (0.752)


def network_module():
    """``experiments/digits_net.py``, imported with the ``torch_utils`` stand-in registered (its classes are
    NVIDIA persistent classes: a pickled instance carries this file's source)."""
    return edm_training.network_module("digits_net")


def train_denoiser(
    x,
    y,
    *,
    steps: int,
    batch: int,
    lr: float,
    ema_decay: float,
    seed: int,
    label_dropout: float = 0.0,
    log_every: int = 250,
):
    """EDM training loop (:func:`experiments.edm_training.train_edm`) on random draws of the digits ``x [N, 1, 8, 8]``
    with their one-hot labels ``y``; returns ``(ema network, per-interval mean losses)``.

    ``label_dropout``: probability that a row's one-hot label is replaced by the all-zero vector (EDM's
    null class), so the network also learns the unconditional denoiser that classifier-free guidance
    needs. At 0 no extra number is drawn (the original run's stream, weights reproduced)."""
    m = network_module()
    onehot = torch.nn.functional.one_hot(y, CLASSES).float()

    def draw(gen, n):
        idx = torch.randint(0, x.shape[0], (n,), generator=gen)
        labels = onehot[idx]
        if label_dropout > 0:
            keep = torch.rand(n, generator=gen) >= label_dropout
            labels = labels * keep[:, None].float()
        return x[idx], (labels,)

    return edm_training.train_edm(
        lambda: m.EDMPrecond(
            RESOLUTION, CHANNELS, CLASSES, sigma_data=SIGMA_DATA, channels=32, blocks=4, emb_channels=64
        ),
        draw,
        steps=steps,
        batch=batch,
        lr=lr,
        ema_decay=ema_decay,
        seed=seed,
        sigma_data=SIGMA_DATA,
        log_every=log_every,
    )


def train_classifier(x, y, *, epochs: int, seed: int, held_out: int = 300):
    """Conv classifier on a seeded split, with +-1 pixel shifts; returns ``(net, held-out accuracy, loss)``."""
    m = network_module()
    gen = torch.Generator().manual_seed(seed + 1)
    torch.manual_seed(seed + 1)
    perm = torch.randperm(x.shape[0], generator=gen)
    test, train = perm[:held_out], perm[held_out:]
    net = m.DigitsClassifier(RESOLUTION, CHANNELS, CLASSES)
    opt = torch.optim.Adam(net.parameters(), lr=2e-3)
    last = float("nan")
    for _ in range(epochs):
        order = train[torch.randperm(train.numel(), generator=gen)]
        for i in range(0, order.numel(), 64):
            b = order[i : i + 64]
            xb = torch.nn.functional.pad(x[b], (1, 1, 1, 1), value=-1.0)
            dx, dy = (int(v) for v in torch.randint(0, 3, (2,), generator=gen))
            xb = xb[:, :, dy : dy + RESOLUTION, dx : dx + RESOLUTION]
            _, logits = net(xb)
            loss = torch.nn.functional.cross_entropy(logits, y[b])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            last = loss.item()
    net.eval().requires_grad_(False)
    with torch.no_grad():
        accuracy = float((net(x[test])[1].argmax(1) == y[test]).float().mean())
    return net, accuracy, last


def main(argv=None) -> int:
    """CLI: ``python -m experiments.train_digits [--steps N] [--seed S] [--out-dir D]``."""
    ap = argparse.ArgumentParser(
        prog="python -m experiments.train_digits",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--steps", type=int, default=2000, help="denoiser optimiser steps (batch 256)")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--ema", type=float, default=0.998, help="EMA decay per step")
    ap.add_argument("--classifier-epochs", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out-dir", default=None, help="where the three files go (default: specsamp/data/)")
    ap.add_argument(
        "--label-dropout",
        type=float,
        default=0.0,
        help="probability of the null (all-zero) label per training row; > 0 trains the guidance network "
        f"{CFG_DENOISER_FILE.name} only (classifier and reference statistics are not retrained)",
    )
    a = ap.parse_args(argv)
    if not 0.0 <= a.label_dropout < 1.0:
        print(f"error: --label-dropout={a.label_dropout} is invalid: must be in [0, 1)", file=sys.stderr)
        return 2
    for key in ("steps", "batch", "classifier_epochs", "threads"):
        if getattr(a, key) < 1:
            print(
                f"error: --{key.replace('_', '-')}={getattr(a, key)} is invalid: must be an integer >= 1",
                file=sys.stderr,
            )
            return 2
    torch.set_num_threads(a.threads)
    out = Path(a.out_dir) if a.out_dir else DENOISER_FILE.parent
    x, y = load_digits_data()

    t0 = time.perf_counter()
    ema, losses = train_denoiser(
        x, y, steps=a.steps, batch=a.batch, lr=a.lr, ema_decay=a.ema, seed=a.seed, label_dropout=a.label_dropout
    )
    t_denoiser = time.perf_counter() - t0
    meta = {
        "data": "sklearn.datasets.load_digits, x / 8 - 1",
        "sigma_data": SIGMA_DATA,
        "steps": a.steps,
        "batch": a.batch,
        "lr": a.lr,
        "ema": a.ema,
        "seed": a.seed,
        "final_loss": losses[-1],
    }
    if a.label_dropout > 0:
        meta["label_dropout"] = a.label_dropout
        meta["null_label"] = "all-zero one-hot"
        sha = edm_training.save_pickle({"ema": ema, "training_options": meta}, out / CFG_DENOISER_FILE.name)
        report = {
            "denoiser": {
                "seconds": round(t_denoiser, 1),
                "loss_every_250_steps": [round(v, 4) for v in losses],
                "parameters": sum(p.numel() for p in ema.parameters()),
                "sha256": sha,
                **meta,
            },
            "threads": a.threads,
            "torch": torch.__version__,
        }
        if a.out_dir is None:
            edm_training.write_report(report, "digits-cfg")
        print(json.dumps(report, indent=2))
        return 0
    sha_d = edm_training.save_pickle({"ema": ema, "training_options": meta}, out / DENOISER_FILE.name)

    t1 = time.perf_counter()
    clf, accuracy, clf_loss = train_classifier(x, y, epochs=a.classifier_epochs, seed=a.seed)
    t_classifier = time.perf_counter() - t1
    sha_c = edm_training.save_pickle(
        {
            "classifier": clf,
            "training_options": {"epochs": a.classifier_epochs, "seed": a.seed, "held_out_accuracy": accuracy},
        },
        out / CLASSIFIER_FILE.name,
    )
    with torch.no_grad():
        feats = clf(x)[0]
    stats = feature_statistics(feats)
    stats.save(out / REFERENCE_FILE.name)

    report = {
        "denoiser": {
            "seconds": round(t_denoiser, 1),
            "loss_every_250_steps": [round(v, 4) for v in losses],
            "parameters": sum(p.numel() for p in ema.parameters()),
            "sha256": sha_d,
            **meta,
        },
        "classifier": {
            "seconds": round(t_classifier, 1),
            "held_out_accuracy": accuracy,
            "final_batch_loss": clf_loss,
            "parameters": sum(p.numel() for p in clf.parameters()),
            "sha256": sha_c,
        },
        "threads": a.threads,
        "torch": torch.__version__,
    }
    if a.out_dir is None:
        edm_training.write_report(report, "digits")
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
