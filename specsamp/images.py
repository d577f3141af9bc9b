"""Saving generated images: uint8 conversion, a PNG grid to look at, per-image files and shards to score.

The image convention, the one used at every boundary between a target and a metric (NVlabs/edm
``generate.py``): a target's ``decode`` returns float images in ``[-1, 1]``, channels first
``[N, C, H, W]``; pixels are ``round-down(127.5 x + 128)`` clipped to ``[0, 255]``
(:func:`to_uint8`); stored arrays are channels last ``[N, H, W, C]`` uint8. Every metric
(:mod:`specsamp.metrics.fid`, :mod:`specsamp.metrics.clip`) takes either those floats or uint8
pixels and converts them with :func:`as_pixels`, so scoring images in memory and scoring the saved
PNGs give the same numbers. Floats in ``[0, 1]`` (diffusers' ``output_type="pt"``) are not this
convention: map them with ``2 x - 1`` first. Every image carries its *global index* (the trajectory id the
sampler keys its randomness by), in its file name (``000123.png``) or next to it in a shard, so any
subset can be regenerated from ``(seed, index)`` and scores can be paired image by image.

Shards (``shard_<start>_<count>.npz`` holding ``images [n, H, W, C]`` uint8 and ``indices [n]`` int64)
are written atomically (temporary file + rename), so a killed job leaves complete shards or none;
:func:`merge_shards` assembles them and names what is missing.

Only numpy and PIL are needed here.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path

import numpy as np

from .io import atomic_write

SHARD_RE = re.compile(r"^shard_(\d+)_(\d+)\.npz$")


class MissingShardsError(FileNotFoundError):
    """Some images of ``[0, total)`` have no shard; ``missing`` lists the index ranges, ``expected``
    the shard files that would cover them (when the shard size is evident)."""

    def __init__(self, message: str, missing: list[tuple[int, int]], expected: list[str]):
        super().__init__(message)
        self.missing = missing
        self.expected = expected


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
            last axis could be either; a single image without the batch axis is accepted), or float ``[N, C, H, W]`` / ``[C, H, W]`` in ``[-1, 1]`` (tensor or
            array), converted with :func:`to_uint8`.

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


def shard_name(start_index: int, count: int) -> str:
    """``shard_<start:07d>_<count:05d>.npz``: the shard holding images ``start .. start + count - 1``."""
    return f"shard_{int(start_index):07d}_{int(count):05d}.npz"


def save_shard(directory: str | os.PathLike, start_index: int, images) -> Path:
    """Write images ``start_index .. start_index + N - 1`` as one shard, atomically.

    Args:
        directory: shard folder (created).
        start_index: global index of the first image (>= 0).
        images: uint8 ``[N, H, W, C]`` or float ``[N, C, H, W]`` in ``[-1, 1]``.

    Returns:
        Path of the shard (:func:`shard_name`).

    Raises:
        ValueError: negative ``start_index``, empty or malformed images.
    """
    if isinstance(start_index, bool) or int(start_index) < 0:
        raise ValueError(f"start_index={start_index!r} is invalid: must be an integer >= 0")
    arr = _pixels(images)
    if len(arr) == 0:
        raise ValueError("images is empty: a shard holds at least one image")
    idx = np.arange(int(start_index), int(start_index) + len(arr), dtype=np.int64)
    path = Path(directory) / shard_name(start_index, len(arr))
    atomic_write(path, lambda f: np.savez(f, images=arr, indices=idx))
    return path


def list_shards(directory: str | os.PathLike) -> list[tuple[int, int, Path]]:
    """Shards in a folder as ``(start, count, path)`` sorted by start (temporary files ignored)."""
    out = []
    d = Path(directory)
    if not d.is_dir():
        return out
    for p in d.iterdir():
        m = SHARD_RE.match(p.name)
        if m:
            out.append((int(m.group(1)), int(m.group(2)), p))
    return sorted(out)


def _ranges(missing: np.ndarray) -> list[tuple[int, int]]:
    """Sorted indices -> inclusive ranges."""
    if missing.size == 0:
        return []
    breaks = np.nonzero(np.diff(missing) != 1)[0]
    starts = np.concatenate([[missing[0]], missing[breaks + 1]])
    ends = np.concatenate([missing[breaks], [missing[-1]]])
    return [(int(a), int(b)) for a, b in zip(starts, ends)]


def merge_shards(directory: str | os.PathLike, total: int, out: str | os.PathLike | None = None) -> np.ndarray:
    """Assemble images ``0 .. total - 1`` from the shards of a folder.

    Args:
        directory: shard folder.
        total: number of images expected.
        out: optional ``.npz`` to write (atomically) with ``images`` and ``indices``.

    Returns:
        uint8 ``[total, H, W, C]``.

    Raises:
        MissingShardsError: some indices have no shard; the message names the missing ranges and
            the shard files that would cover them.
        ValueError: ``total < 1``; shards disagreeing on image shape; overlapping shards with
            different pixels; a shard whose contents disagree with its name.
    """
    if isinstance(total, bool) or int(total) < 1:
        raise ValueError(f"total={total!r} is invalid: must be an integer >= 1")
    total = int(total)
    shards = list_shards(directory)
    have = np.zeros(total, dtype=bool)
    images = None
    for start, count, path in shards:
        if start >= total:
            continue
        with np.load(path) as z:
            arr, idx = z["images"], z["indices"]
        if len(arr) != count or len(idx) != count or idx[0] != start:
            raise ValueError(f"shard {path.name} holds {len(arr)} images from index {int(idx[0]) if len(idx) else '-'}; "
                             f"its name says {count} from {start}")
        if images is None:
            images = np.zeros((total, *arr.shape[1:]), dtype=np.uint8)
        elif arr.shape[1:] != images.shape[1:]:
            raise ValueError(f"shard {path.name} has images of shape {arr.shape[1:]}, others {images.shape[1:]}")
        keep = idx < total
        idx, arr = idx[keep], arr[keep]
        dup = have[idx]
        if dup.any() and not np.array_equal(images[idx[dup]], arr[dup]):
            raise ValueError(f"shard {path.name} overlaps an earlier shard with different pixels (indices {idx[dup][:5].tolist()}...)")
        images[idx] = arr
        have[idx] = True
    if not have.all():
        ranges = _ranges(np.nonzero(~have)[0])
        sizes = sorted({c for _, c, _ in shards})
        size = sizes[-1] if sizes else None
        expected = []
        if size:
            for a, b in ranges:
                first = a - a % size
                for s in range(first, b + 1, size):
                    expected.append(shard_name(s, min(size, total - s)))
        shown = ", ".join(f"{a}-{b}" if a != b else f"{a}" for a, b in ranges[:20])
        more = f" (+{len(ranges) - 20} more ranges)" if len(ranges) > 20 else ""
        files = f"; expected shard files: {', '.join(expected[:20])}{' ...' if len(expected) > 20 else ''}" if expected else ""
        raise MissingShardsError(
            f"{int((~have).sum())} of {total} images have no shard in {str(directory)!r}: indices {shown}{more}{files}",
            ranges,
            expected,
        )
    if out is not None:
        idx = np.arange(total, dtype=np.int64)
        atomic_write(Path(out), lambda f: np.savez(f, images=images, indices=idx))
    return images


def load_images(source: str | os.PathLike, total: int | None = None, indices=None) -> np.ndarray:
    """Load saved images as uint8 ``[N, H, W, C]`` ordered by global index.

    Args:
        source: a ``.npz`` with ``images`` (e.g. from :func:`merge_shards`), a folder of shards, or a
            folder of PNG files named by index (:func:`save_images`).
        total: for a shard folder, the number of images expected (default: up to the last shard).
        indices: for a PNG folder, exactly these global indices, in this order (other files in the
            folder are ignored); default every index-named PNG.

    Raises:
        FileNotFoundError: nothing there, or a PNG of ``indices`` is missing; :class:`MissingShardsError`
            for gaps in a shard folder.
        ValueError: PNGs of different sizes.
    """
    p = Path(source)
    if indices is not None:
        files = [p / image_name(int(i)) for i in indices]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{len(missing)} images are missing in {str(p)!r}: {', '.join(missing[:10])}")
        return _stack_pngs(files, p)
    if p.is_file():
        with np.load(p) as z:
            return _as_hwc_uint8(z["images"])
    if not p.is_dir():
        raise FileNotFoundError(f"no images at {str(p)!r}")
    shards = list_shards(p)
    if shards:
        n = total if total is not None else max(s + c for s, c, _ in shards)
        return merge_shards(p, n)
    files = sorted(f for f in p.iterdir() if f.suffix.lower() == ".png" and f.stem.isdigit())
    if not files:
        raise FileNotFoundError(f"no shards or index-named PNG files in {str(p)!r}")
    files.sort(key=lambda f: int(f.stem))
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
