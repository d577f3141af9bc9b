"""The EDM training pieces the denoiser training scripts share (``experiments.train_digits``, ``experiments.train_patches``).

EDM's loss (Karras et al. 2022, eq. 2 and Table 1): noise levels ``ln sigma ~ N(P_MEAN, P_STD^2)``,
weight ``(sigma^2 + sd^2) / (sigma sd)^2``; Adam with a warm-up and a linear decay of the learning
rate, an exponential moving average of the weights, the loss curve logged as interval means; the
networks written as NVIDIA-style persistent pickles, and the training figures as a JSON file under
``results/``. Each script passes what is its own: the network, how a batch is drawn, the report.
"""

from __future__ import annotations

import copy
import json
import pickle
from pathlib import Path

import numpy as np
import torch

from specsamp.hub import file_sha256
from specsamp.io import atomic_write

ROOT = Path(__file__).resolve().parents[1]
P_MEAN, P_STD = -1.2, 1.2  # EDM's training noise distribution, ln sigma ~ N(P_MEAN, P_STD^2)


def network_module(name: str):
    """``experiments.<name>`` imported with the ``torch_utils`` stand-in registered (its classes are NVIDIA
    persistent classes: a pickled instance carries that file's source)."""
    import importlib

    from specsamp.models import nvlabs_compat

    nvlabs_compat.install()
    return importlib.import_module(f"experiments.{name}")


def train_edm(
    build, draw, *, steps: int, batch: int, lr: float, ema_decay: float, seed: int, sigma_data: float, log_every: int
):
    """EDM training loop; returns ``(ema network, per-interval mean losses)``.

    ``build()``: a fresh network ``net(x [B, C, H, W], sigma [B], *cond) -> D(x; sigma)``, called after
    ``torch.manual_seed(seed)`` (its initial weights). ``draw(gen, batch)``: ``(x0 float32 [batch, C, H, W],
    cond)`` of clean training images and the extra arguments of ``net`` (a tuple, empty when
    unconditional), drawn from ``gen`` (a ``torch.Generator`` seeded with ``seed``, which then draws
    sigma and the noise). Learning rate: linear warm-up over the first 5% of the ``steps``, linear decay
    to 0 over the last 30%. The mean loss of every ``log_every`` steps (and of the last, shorter
    interval) is printed and returned.
    """
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    net = build()
    ema = copy.deepcopy(net).eval().requires_grad_(False)
    opt = torch.optim.Adam(net.parameters(), lr=lr)
    losses, acc = [], []
    for step in range(steps):
        # warm-up over the first 5%, linear decay to 0 over the last 30%
        frac = step / steps
        scale = min(1.0, (step + 1) / (0.05 * steps)) * min(1.0, (1 - frac) / 0.3)
        for g in opt.param_groups:
            g["lr"] = lr * scale
        x0, cond = draw(gen, batch)
        sigma = (torch.randn(batch, generator=gen) * P_STD + P_MEAN).exp()
        noise = torch.randn(x0.shape, generator=gen)
        s4 = sigma[:, None, None, None]
        d = net(x0 + s4 * noise, sigma, *cond)
        weight = (s4**2 + sigma_data**2) / (s4 * sigma_data) ** 2
        loss = (weight * (d - x0) ** 2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        with torch.no_grad():
            for pe, p in zip(ema.parameters(), net.parameters()):
                pe.lerp_(p, 1 - ema_decay)
        acc.append(loss.item())
        if (step + 1) % log_every == 0 or step + 1 == steps:
            losses.append(float(np.mean(acc)))
            acc = []
            print(f"denoiser step {step + 1}/{steps}  EDM loss {losses[-1]:.4f}", flush=True)
    return ema, losses


def save_pickle(obj: dict, path: Path) -> str:
    """Pickle ``obj`` (protocol 4) to ``path`` atomically; returns the file's SHA-256 (hex)."""
    atomic_write(path, lambda f: pickle.dump(obj, f, protocol=4))
    return file_sha256(path)


def write_report(report: dict, results_dir: str) -> Path:
    """Write the training report as indented JSON to ``results/<results_dir>/training.json`` (atomically)."""
    (ROOT / "results" / results_dir).mkdir(parents=True, exist_ok=True)
    path = ROOT / "results" / results_dir / "training.json"
    atomic_write(path, lambda f: f.write(json.dumps(report, indent=2).encode()))
    return path
