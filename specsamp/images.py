"""Saving generated images: uint8 conversion, a PNG grid to look at, per-image PNG files to score.

The image convention, the one used at every boundary between a target and a metric (NVlabs/edm
``generate.py``): a target's ``decode`` returns float images in ``[-1, 1]``, channels first
``[N, C, H, W]``; pixels are ``round-down(127.5 x + 128)`` clipped to ``[0, 255]``
(:func:`to_uint8`); stored arrays are channels last ``[N, H, W, C]`` uint8. Every metric
(:mod:`specsamp.metrics.fid`, :mod:`specsamp.metrics.clip`) takes either those floats or uint8
pixels and converts them with :func:`as_pixels`, so scoring images in memory and scoring the saved
PNGs give the same numbers. Floats in ``[0, 1]`` (diffusers' ``output_type="pt"``) are not this
convention: map them with ``2 x - 1`` first. Every image carries its *global index* (the trajectory id the
sampler keys its randomness by) in its file name (``000123.png``), so any subset can be regenerated
from ``(seed, index)`` and scores can be paired image by image. Files are written atomically.

Only numpy and PIL are needed here.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np

from .io import atomic_write


def to_uint8(images) -> np.ndarray:
    """Samples in ``[-1, 1]`` to uint8 pixels, channels last.

    Args:
        images: ``[N, C, H, W]`` or ``[C, H, W]`` float tensor/array (EDM convention, ``C`` in {1, 3}).

    Returns:
        ``[N, H, W, C]`` (or ``[H, W, C]``) uint8 numpy array: ``clip(127.5 x + 128, 0, 255)`` floored,
        as NVlabs/edm ``generate.py`` writes its PNGs.

    Raises:
        ValueError: wrong rank, or a channel count other than 1, 3 or 4.
    """
    arr = images.detach().float().cpu().numpy() if hasattr(images, "detach") else np.asarray(images, dtype=np.float32)
    single = arr.ndim == 3
    if single:
        arr = arr[None]
    if arr.ndim != 4:
        raise ValueError(f"images of shape {arr.shape} are invalid: expected [N, C, H, W] or [C, H, W]")
    if arr.shape[1] not in (1, 3, 4):
        raise ValueError(f"images of shape {arr.shape} are invalid: channel axis 1 must have 1, 3 or 4 entries")
    out = np.clip(np.floor(arr.astype(np.float32) * 127.5 + 128.0), 0, 255).astype(np.uint8)
    out = np.ascontiguousarray(out.transpose(0, 2, 3, 1))
    return out[0] if single else out


def _as_hwc_uint8(images) -> np.ndarray:
    arr = np.asarray(images.cpu() if hasattr(images, "cpu") else images)
    if arr.dtype != np.uint8:
        raise ValueError(f"images of dtype {arr.dtype} are invalid here: convert with to_uint8 first")
    if arr.ndim == 3:
        arr = arr[None]
    if arr.ndim != 4 or arr.shape[-1] not in (1, 3, 4):
        raise ValueError(f"images of shape {arr.shape} are invalid: expected uint8 [N, H, W, C], C in {{1, 3, 4}}")
    return arr


def _pixels(images) -> np.ndarray:
    """uint8 ``[N, H, W, C]`` from uint8 input as is, or from float ``[N, C, H, W]`` via :func:`to_uint8`."""
    if str(getattr(images, "dtype", "")) in ("uint8", "torch.uint8"):
        return _as_hwc_uint8(images)
    return _as_hwc_uint8(to_uint8(images))


def as_pixels(images) -> np.ndarray:
    """Images in the package's convention (module docstring) as uint8 ``[N, H, W, C]``: what metrics score.

    Args:
        images: uint8 ``[N, H, W, C]`` or ``[N, C, H, W]`` (``C`` in {1, 3, 4}; channels last when the
            last axis could be either; a single image without the batch axis is accepted), or float
            ``[N, C, H, W]`` / ``[C, H, W]`` in ``[-1, 1]`` (tensor or array), converted with :func:`to_uint8`.

    Returns:
        uint8 ``[N, H, W, C]`` numpy array.

    Raises:
        ValueError: floats outside ``[-1, 1]`` or not finite (e.g. ``[0, 255]`` pixels as floats, or raw
            samples not passed through the target's ``decode``), a dtype other than uint8 or float, or a
            shape without a channel axis of 1, 3 or 4 entries.
    """
    arr = images.detach().cpu().numpy() if hasattr(images, "detach") else np.asarray(images)
    if arr.dtype == np.uint8:
        if arr.ndim == 3:
            arr = arr[None]
        if arr.ndim == 4 and arr.shape[-1] not in (1, 3, 4) and arr.shape[1] in (1, 3, 4):
            arr = np.ascontiguousarray(arr.transpose(0, 2, 3, 1))
        return _as_hwc_uint8(arr)
    if not np.issubdtype(arr.dtype, np.floating):
        raise ValueError(f"images of dtype {arr.dtype} are invalid: need uint8 pixels or floats in [-1, 1]")
    if arr.size and (not np.isfinite(arr).all() or arr.min() < -1.0 or arr.max() > 1.0):
        lo, hi = (float(np.nanmin(arr)), float(np.nanmax(arr))) if np.isfinite(arr).any() else (np.nan, np.nan)
        raise ValueError(
            f"float images span [{lo:.4g}, {hi:.4g}]: the image convention is floats in [-1, 1] "
            f"(a target's decode output) or uint8 pixels; map [0, 1] floats with 2 x - 1"
        )
    return _as_hwc_uint8(to_uint8(arr))


def _pil(img: np.ndarray):
    from PIL import Image

    return Image.fromarray(img[..., 0] if img.shape[-1] == 1 else img)


def make_grid(images, nrow: int | None = None, pad: int = 0) -> np.ndarray:
    """Tile uint8 images ``[N, H, W, C]`` into one ``[rows*(H+pad)-pad, cols*(W+pad)-pad, C]`` array.

    Args:
        images: uint8 ``[N, H, W, C]``.
        nrow: images per row (default ``ceil(sqrt(N))``).
        pad: pixels of black between tiles.

    Raises:
        ValueError: not uint8 ``[N, H, W, C]``, or ``nrow < 1``.
    """
    arr = _as_hwc_uint8(images)
    n, h, w, c = arr.shape
    cols = nrow if nrow is not None else max(1, math.ceil(math.sqrt(n)))
    if cols < 1:
        raise ValueError(f"nrow={nrow!r} is invalid: must be >= 1")
    rows = math.ceil(n / cols)
    grid = np.zeros((rows * (h + pad) - pad, cols * (w + pad) - pad, c), dtype=np.uint8)
    for i in range(n):
        r, q = divmod(i, cols)
        grid[r * (h + pad) : r * (h + pad) + h, q * (w + pad) : q * (w + pad) + w] = arr[i]
    return grid


def save_grid(images, path: str | os.PathLike, nrow: int | None = None, pad: int = 0) -> Path:
    """Save a PNG grid of images for a look (``images``: uint8 ``[N, H, W, C]`` or float ``[N, C, H, W]``
    in ``[-1, 1]``). Written atomically. Returns the path."""
    grid = make_grid(_pixels(images), nrow=nrow, pad=pad)
    path = Path(path)
    atomic_write(path, lambda f: _pil(grid).save(f, format="PNG"))
    return path


def image_name(index: int) -> str:
    """File name of image ``index``: ``"{index:06d}.png"`` (more digits beyond 999999)."""
    return f"{int(index):06d}.png"


def save_images(images, directory: str | os.PathLike, start_index: int = 0, indices=None) -> list[Path]:
    """Save one PNG per image, named by its global index (``000123.png``), each written atomically.

    Args:
        images: uint8 ``[N, H, W, C]`` or float ``[N, C, H, W]`` in ``[-1, 1]``.
        directory: output folder (created).
        start_index: global index of ``images[0]`` when ``indices`` is None.
        indices: explicit global indices ``[N]``.

    Returns:
        The written paths.

    Raises:
        ValueError: bad images, or ``indices`` of the wrong length.
    """
    arr = _pixels(images)
    idx = np.arange(start_index, start_index + len(arr)) if indices is None else np.asarray(indices).reshape(-1)
    if len(idx) != len(arr):
        raise ValueError(f"indices has {len(idx)} entries for {len(arr)} images")
    directory = Path(directory)
    out = []
    for i, img in zip(idx.tolist(), arr):
        p = directory / image_name(i)
        atomic_write(p, lambda f, img=img: _pil(img).save(f, format="PNG"))
        out.append(p)
    return out


def load_images(folder: str | os.PathLike, indices=None) -> np.ndarray:
    """Load saved PNGs (:func:`save_images`) as uint8 ``[N, H, W, C]`` ordered by global index.

    Args:
        folder: a folder of PNG files named by index.
        indices: exactly these global indices, in this order (other files in the folder are ignored);
            default every index-named PNG.

    Raises:
        FileNotFoundError: no folder, no index-named PNG in it, or a PNG of ``indices`` is missing.
        ValueError: PNGs of different sizes.
    """
    p = Path(folder)
    if indices is not None:
        files = [p / image_name(int(i)) for i in indices]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{len(missing)} images are missing in {str(p)!r}: {', '.join(missing[:10])}")
        return _stack_pngs(files, p)
    if not p.is_dir():
        raise FileNotFoundError(f"no images at {str(p)!r}")
    files = sorted(
        (f for f in p.iterdir() if f.suffix.lower() == ".png" and f.stem.isdigit()), key=lambda f: int(f.stem)
    )
    if not files:
        raise FileNotFoundError(f"no index-named PNG files in {str(p)!r}")
    return _stack_pngs(files, p)


def _stack_pngs(files: list[Path], folder: Path) -> np.ndarray:
    from PIL import Image

    arrs = []
    for f in files:
        with Image.open(f) as im:
            arrs.append(np.asarray(im))
    arrs = [a[..., None] if a.ndim == 2 else a for a in arrs]
    if len({a.shape for a in arrs}) > 1:
        raise ValueError(f"PNG files in {str(folder)!r} have different shapes")
    return np.stack(arrs)
