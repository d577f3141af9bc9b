"""What several sections of the GPU check use: the networks, their labels, one sampling run of an arm."""

from __future__ import annotations

from pathlib import Path

import torch

from benchmarks.ddpmpp import ddpmpp_cifar10
from specsamp.models.edm import CHECKPOINTS, EDMVelocity, load_edm, uniform_labels
from specsamp.sampler import sample_speculative, sample_standard
from specsamp.schedule import Schedule

ROOT = Path(__file__).resolve().parents[2]  # the repository
DIGITS = "edm-digits-8x8-cond"
EPS = 0.3  # the paper's churn for EDM (section 5.2)


def digits_velocity(device, net_dtype=None) -> EDMVelocity:
    """The shipped digits network (hash-checked pickle) behind the velocity interface."""
    ck = CHECKPOINTS[DIGITS]
    net = load_edm(ck.url, sha256=ck.sha256, download=False, map_location="cpu")
    return EDMVelocity(net, net_dtype=net_dtype, device=device)


def cifar_velocity(device, tiny: bool, net_dtype=None, seed: int = 0) -> tuple[EDMVelocity, int]:
    """EDM's CIFAR-10 network layout with random weights (:func:`benchmarks.ddpmpp.ddpmpp_cifar10`); ``(model, params)``."""
    net = ddpmpp_cifar10(seed=seed, tiny=tiny)
    return EDMVelocity(net, net_dtype=net_dtype, device=device), sum(p.numel() for p in net.parameters())


def labels_for(model, n: int, seed: int) -> dict | None:
    """Uniform class labels keyed by (seed, image id), as the runner draws them; None for unconditional nets."""
    if not getattr(model, "label_dim", 0):
        return None
    ids = torch.arange(n)
    return {"class_labels": uniform_labels(ids, seed, model.label_dim).to(model.device)}


def run_arm(model, arm: dict, schedule: Schedule, n: int, seed: int):
    """One sampling run of ``arm`` (``tree`` None: the standard sampler; else ``tree, coupling, draft``) for
    images ``0..n-1`` (labels keyed by seed and id), tree execution; the :class:`SampleResult`."""
    cond = labels_for(model, n, seed)
    if arm["tree"] is None:
        return sample_standard(model, schedule, n, seed=seed, cond=cond)
    return sample_speculative(
        model, schedule, arm["tree"], arm["coupling"], n, draft=arm["draft"], execution="tree", seed=seed, cond=cond
    )
