"""The patches32 target: a trained class-unconditional EDM denoiser on 32x32 colour crops of photographs.

CIFAR-10's state dimension (3x32x32 = 3,072) on a network that trains and samples on a CPU, loaded
exactly like NVIDIA's EDM checkpoints: ``python run.py model=patches32`` resolves
``edm-patches-32x32-uncond`` in :data:`specsamp.models.edm.CHECKPOINTS` to the pickle shipped in
``specsamp/data/``, checks its SHA-256, unpickles it with the ``torch_utils`` stand-in
(:mod:`specsamp.models.nvlabs_compat`) and wraps it in :class:`specsamp.models.edm.EDMVelocity`.

Data. The two photographs scikit-learn ships with its package (``sklearn.datasets.load_sample_images``:
``china.jpg`` and ``flower.jpg``, 427x640 RGB each; no download), pixels mapped to ``[-1, 1]`` by
``p / 127.5 - 1``. The right-most :data:`HELD_OUT_COLUMNS` columns of each photograph are held out:
training crops (:func:`training_crops`) come from the columns left of them only, evaluation crops
(:func:`held_out_crops`) from them only. Training augments with horizontal flips and with crops of the
photographs area-downsampled by 2 (a coarser scale of the same scenes).

The network is trained by ``experiments/train_patches.py`` (``make train-patches``); its source,
``experiments/patches_net.py``, travels inside the pickle, so loading it needs no import of it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

DATA_DIR = Path(__file__).resolve().parents[1] / "data"
NAME = "edm-patches-32x32-uncond"
DENOISER_FILE = DATA_DIR / f"{NAME}.pkl"
RESOLUTION, CHANNELS = 32, 3
HELD_OUT_COLUMNS = 128  # of 640: the right-most 20% of each photograph, never seen in training


def load_photographs() -> torch.Tensor:
    """scikit-learn's two sample photographs in ``[-1, 1]``.

    Returns:
        float32 ``[2, 3, 427, 640]`` (china, flower), ``p / 127.5 - 1`` of the uint8 pixels.

    Raises:
        ImportError: scikit-learn (or Pillow, which it reads the JPEGs with) is not installed.
    """
    try:
        from sklearn.datasets import load_sample_images
    except ImportError as err:
        raise ImportError(
            "the patches32 data need scikit-learn: pip install 'specsamp[digits]' (or scikit-learn)"
        ) from err
    imgs = np.stack(load_sample_images().images).astype(np.float32)  # [2, 427, 640, 3] uint8 values
    return torch.from_numpy(imgs / 127.5 - 1.0).permute(0, 3, 1, 2).contiguous()


def split_regions(photos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``photos [n, 3, H, W]`` -> ``(training region [n, 3, H, W - 128], held-out region [n, 3, H, 128])``."""
    return photos[..., :-HELD_OUT_COLUMNS], photos[..., -HELD_OUT_COLUMNS:]


def training_pyramid(photos: torch.Tensor | None = None) -> list[torch.Tensor]:
    """Training regions at scales 1 and 1/2 (2x2 area average): a list of ``[n, 3, h, w]`` tensors."""
    train, _ = split_regions(load_photographs() if photos is None else photos)
    return [train, torch.nn.functional.avg_pool2d(train, 2)]


def training_crops(pyramid: list[torch.Tensor], n: int, generator: torch.Generator) -> torch.Tensor:
    """``n`` random 32x32 crops, uniform over (scale, photograph, position), each flipped left-right with probability 1/2.

    Args:
        pyramid: :func:`training_pyramid`'s output.
        n: number of crops.
        generator: the torch generator all choices are drawn from (seeded training).

    Returns:
        float32 ``[n, 3, 32, 32]`` in ``[-1, 1]``.
    """
    r = RESOLUTION
    out = torch.empty(n, CHANNELS, r, r)
    scale = torch.randint(0, len(pyramid), (n,), generator=generator)
    u = torch.rand(n, 3, generator=generator)
    for i in range(n):
        img = pyramid[int(scale[i])]
        k = int(u[i, 0] * img.shape[0])
        y = int(u[i, 1] * (img.shape[2] - r + 1))
        x = int(u[i, 2] * (img.shape[3] - r + 1))
        out[i] = img[k, :, y : y + r, x : x + r]
    flip = torch.rand(n, generator=generator) < 0.5
    out[flip] = out[flip].flip(-1)
    return out


def held_out_crops(stride: int = 8, photos: torch.Tensor | None = None) -> torch.Tensor:
    """Every 32x32 crop of the held-out regions on a ``stride``-pixel grid (scale 1, no flips).

    Returns:
        float32 ``[N, 3, 32, 32]`` in ``[-1, 1]``; ``N = 2 * 50 * 13 = 1,300`` at the default stride.

    Raises:
        ValueError: ``stride < 1``.
    """
    if stride < 1:
        raise ValueError(f"stride={stride!r} is invalid: must be an integer >= 1")
    _, held = split_regions(load_photographs() if photos is None else photos)
    r = RESOLUTION
    tiles = held.unfold(2, r, stride).unfold(3, r, stride)  # [n, 3, rows, cols, r, r]
    return tiles.permute(0, 2, 3, 1, 4, 5).reshape(-1, CHANNELS, r, r).contiguous()
