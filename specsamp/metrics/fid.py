"""Frechet Inception Distance over saved samples, with torch-fidelity's feature extractors.

Scoring is a separate step from generation (NVlabs/edm ``fid.py`` style): samples are read from what
:mod:`specsamp.images` wrote (a folder of index-named PNGs),
features come from a torch-fidelity extractor (default ``inception-v3-compat``, the 2048-d pool3
features of the TF Inception graph that TTUR and EDM use), and the reference is either precomputed
statistics (an ``.npz`` with ``mu`` and ``sigma``, e.g. EDM's ``fid-refs``) or a second image set.

    FID = ||mu_1 - mu_2||^2 + tr(S_1 + S_2 - 2 (S_1 S_2)^{1/2})     (Heusel et al. 2017, eq. 6)

Weights and reference statistics come from their usual URLs (torch hub cache for Inception; the
specsamp cache for ``.npz`` files) or from local paths. Nothing is downloaded when the files are
cached or passed as paths; offline, a missing file fails with a message naming the URL and the path
to put the file at. torch-fidelity is imported lazily: this module imports with numpy/scipy/torch.
What scoring reads (reference names, the default extractor, a run's saved samples, an extractor named by
import path) and its checks before sampling (:func:`check_fid_inputs`, :data:`MIN_IMAGES`,
:func:`few_images_warning`) live in :mod:`specsamp.metrics.fid_inputs`, importable from here too.

Note: EDM's reference ``.npz`` files were computed with NVIDIA's own Inception pickle; torch-fidelity's
``inception-v3-compat`` reimplements the same TF graph, so FIDs agree to roughly 1e-3 but are not bit
identical. Compare methods with one extractor and one reference file.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from ..hub import offline, resolve_path, verify_sha256
from .fid_inputs import (  # what scoring reads and its checks (fid_inputs), importable from here as before
    INCEPTION,
    INCEPTION_URL,
    MIN_IMAGES,
    REFERENCE_STATS,
    _import_extractor,
    _reference_dim,
    check_fid_inputs,
    few_images_warning,
    registered_extractor,
    run_images,
)
from .frechet import (  # noqa: F401  (the statistics and the distance, importable from here as before)
    ROUNDING_FACTOR,
    Statistics,
    feature_statistics,
    fid_rounding_bound,
    frechet_distance,
    frechet_distance_to_features,
)


def load_statistics(
    reference: str | os.PathLike,
    *,
    cache_dir: str | os.PathLike | None = None,
    download: bool = True,
    sha256: str | None = None,
) -> Statistics:
    """Load reference statistics from an ``.npz`` with ``mu`` and ``sigma``.

    Args:
        reference: a name of :data:`REFERENCE_STATS` (``cifar10-32x32``, ``ffhq-64x64``), a URL (cached
            under ``<cache>/fid-refs``) or a local path.
        cache_dir: cache root (default ``$SPECSAMP_CACHE`` or ``~/.cache/specsamp``).
        download: allow downloading a missing URL.
        sha256: optional expected SHA-256 of the file.

    Raises:
        FileNotFoundError: missing file (message: URL and path looked in).
        KeyError: the file lacks ``mu`` or ``sigma``.
        specsamp.hub.CheckpointTrustError: ``sha256`` given and different.
    """
    src = REFERENCE_STATS.get(os.fspath(reference), os.fspath(reference))
    path = resolve_path(src, cache_dir=cache_dir, download=download, sha256=sha256, subdir="fid-refs")
    if sha256 is not None:
        verify_sha256(path, sha256, what="reference statistics")
    with np.load(path, allow_pickle=False) as z:
        missing = [k for k in ("mu", "sigma") if k not in z.files]
        if missing:
            raise KeyError(f"reference statistics {str(path)!r} lack {missing}; keys: {z.files}")
        n = int(z["n"]) if "n" in z.files else 0
        return Statistics(mu=z["mu"].astype(np.float64), sigma=z["sigma"].astype(np.float64), n=n)


# ----------------------------------------------------------------------------------------------
# features through torch-fidelity


class _Uint8Images(torch.utils.data.Dataset):
    """uint8 ``[N, H, W, C]`` array -> items uint8 ``[3, H, W]`` (torch-fidelity's input format)."""

    def __init__(self, images: np.ndarray):
        self.images = images

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i):
        img = torch.from_numpy(np.ascontiguousarray(self.images[i])).permute(2, 0, 1)
        if img.shape[0] == 1:
            img = img.expand(3, -1, -1)
        return img[:3].contiguous()


def _as_images(images) -> np.ndarray:
    from ..images import as_pixels, load_images

    if isinstance(images, (str, os.PathLike)):
        found = run_images(images)
        return load_images(found) if isinstance(found, Path) else as_pixels(found)
    return as_pixels(images)


def _callable_extractor_class():
    from torch_fidelity.feature_extractor_base import FeatureExtractorBase

    class CallableExtractor(FeatureExtractorBase):
        """Wraps ``fn(uint8 [b, 3, H, W]) -> [b, F]`` as a torch-fidelity extractor with feature ``"out"``."""

        def __init__(self, fn):
            super().__init__("specsamp-callable", ["out"])
            self.fn = fn

        @staticmethod
        def get_provided_features_list():
            return ("out",)

        @staticmethod
        def get_default_feature_layer_for_metric(metric):
            return "out"

        @staticmethod
        def can_be_compiled():
            return False

        def forward(self, x):
            return (self.fn(x).reshape(x.shape[0], -1),)

    return CallableExtractor


def _check_inception_weights(weights_path, allow_download: bool) -> None:
    if weights_path is not None:
        if not Path(weights_path).is_file():
            raise FileNotFoundError(f"weights_path={str(weights_path)!r} does not exist (Inception weights .pth)")
        return
    cached = Path(torch.hub.get_dir()) / "checkpoints" / Path(INCEPTION_URL).name
    if not cached.is_file() and (not allow_download or offline()):
        raise FileNotFoundError(
            f"Inception weights for FID are not available offline: not in the torch hub cache "
            f"({str(cached)!r}) and downloads are disabled. Download {INCEPTION_URL} where the network is "
            f"reachable and put it at that path (or set $TORCH_HOME), or pass weights_path=<file>."
        )


def make_extractor(
    feature_extractor=INCEPTION,
    feature_layer: str | None = None,
    *,
    weights_path: str | os.PathLike | None = None,
    device: str | torch.device | None = None,
    allow_download: bool = True,
    verbose: bool = False,
):
    """A torch-fidelity feature extractor and the feature name used for FID.

    Args:
        feature_extractor: a name registered with torch-fidelity (``inception-v3-compat``,
            ``dinov2-vit-b-14``, ...), a ``FeatureExtractorBase`` subclass (registered under its
            ``NAME`` attribute or class name), an instance, any callable ``uint8 [b, 3, H, W] -> [b, F]``,
            or an import path ``"package.module:Name"`` of one of these (how a config names an
            extractor that a module of its own defines).
        feature_layer: feature name (default: the extractor's default for FID, ``2048`` for Inception).
        weights_path: local weights (torch-fidelity's ``feature_extractor_weights_path``).
        device: ``cuda``/``cpu`` (default: CUDA when available).
        allow_download: let torch-fidelity download missing Inception weights.
        verbose: torch-fidelity's progress output.

    Returns:
        ``(extractor, feature_layer, use_cuda)``.

    Raises:
        FileNotFoundError: Inception weights missing and downloads disabled or ``weights_path`` absent.
        RuntimeError: the weights download failed (message: URL, cache path, how to supply them).
        ValueError: an unknown extractor name or feature layer.
    """
    from torch_fidelity.feature_extractor_base import FeatureExtractorBase
    from torch_fidelity.registry import FEATURE_EXTRACTORS_REGISTRY, register_feature_extractor
    from torch_fidelity.utils import create_feature_extractor

    if (
        isinstance(feature_extractor, str)
        and ":" in feature_extractor
        and feature_extractor not in FEATURE_EXTRACTORS_REGISTRY
    ):
        feature_extractor = _import_extractor(feature_extractor)
    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cuda = dev.type == "cuda"
    if isinstance(feature_extractor, FeatureExtractorBase):
        ext = feature_extractor
        layer = feature_layer or ext.features_list[0]
        ext = ext.eval().requires_grad_(False).to(dev)
        return ext, layer, cuda
    if isinstance(feature_extractor, type) and issubclass(feature_extractor, FeatureExtractorBase):
        name = getattr(feature_extractor, "NAME", feature_extractor.__name__)
        if FEATURE_EXTRACTORS_REGISTRY.get(name) is not feature_extractor:
            if name in FEATURE_EXTRACTORS_REGISTRY:
                raise ValueError(f"feature_extractor name {name!r} is already registered to another class")
            register_feature_extractor(name, feature_extractor)
        feature_extractor = name
    elif callable(feature_extractor) and not isinstance(feature_extractor, str):
        ext = _callable_extractor_class()(feature_extractor).eval().to(dev)
        return ext, "out", cuda
    name = str(feature_extractor)
    cls = registered_extractor(name)
    if cls is None:
        raise ValueError(
            f"feature_extractor={name!r} is invalid; registered: {', '.join(sorted(FEATURE_EXTRACTORS_REGISTRY))}"
        )
    layer = feature_layer or cls.get_default_feature_layer_for_metric("fid")
    if layer not in cls.get_provided_features_list():
        raise ValueError(
            f"feature_layer={layer!r} is invalid for {name}; valid: {', '.join(map(str, cls.get_provided_features_list()))}"
        )
    inception = name.startswith("inception-v3")
    if inception:
        _check_inception_weights(weights_path, allow_download)
    kwargs = {"verbose": verbose}
    if weights_path is not None:
        kwargs["feature_extractor_weights_path"] = os.fspath(weights_path)
    try:
        ext = create_feature_extractor(name, [layer], cuda=cuda, **kwargs)
    except OSError as err:  # urllib.error.URLError and friends: offline or unreachable
        if not inception or weights_path is not None:
            raise
        cached = Path(torch.hub.get_dir()) / "checkpoints" / Path(INCEPTION_URL).name
        raise RuntimeError(
            f"could not download the Inception weights from {INCEPTION_URL} ({err}). Fetch the file where "
            f"the network is reachable and put it at {str(cached)!r}, or pass weights_path=<file>."
        ) from err
    return ext, layer, cuda


def extract_features(
    images,
    feature_extractor=INCEPTION,
    feature_layer: str | None = None,
    *,
    weights_path: str | os.PathLike | None = None,
    batch_size: int = 64,
    device: str | torch.device | None = None,
    allow_download: bool = True,
    verbose: bool = False,
) -> np.ndarray:
    """Per-image features, in index order (so scores can be paired image by image).

    Args:
        images: a path (:func:`run_images`: a PNG folder, a run directory or a ``samples.pt``), or images in the package's one
            convention (:func:`specsamp.images.as_pixels`: uint8 pixels, or float ``[N, C, H, W]`` in
            ``[-1, 1]``).
        feature_extractor, feature_layer, weights_path, device, allow_download, verbose: see
            :func:`make_extractor`.
        batch_size: images per forward pass.

    Returns:
        float64 ``[N, F]``.

    Raises:
        See :func:`make_extractor`; ``ValueError`` for malformed images or ``batch_size < 1``.
    """
    ext, layer, cuda = make_extractor(
        feature_extractor,
        feature_layer,
        weights_path=weights_path,
        device=device,
        allow_download=allow_download,
        verbose=verbose,
    )
    return _features(ext, layer, cuda, images, batch_size, verbose)


def _features(ext, layer: str, cuda: bool, images, batch_size: int, verbose: bool) -> np.ndarray:
    from torch_fidelity.utils import get_featuresdict_from_dataset

    if isinstance(batch_size, bool) or int(batch_size) < 1:
        raise ValueError(f"batch_size={batch_size!r} is invalid: must be an integer >= 1")
    arr = _as_images(images)
    feats = get_featuresdict_from_dataset(_Uint8Images(arr), ext, int(batch_size), cuda, True, verbose)
    return feats[layer].double().numpy()


def compute_fid(
    samples,
    reference,
    *,
    feature_extractor=INCEPTION,
    feature_layer: str | None = None,
    weights_path: str | os.PathLike | None = None,
    batch_size: int = 64,
    device: str | torch.device | None = None,
    allow_download: bool = True,
    cache_dir: str | os.PathLike | None = None,
    reference_sha256: str | None = None,
    save_features: str | os.PathLike | None = None,
    verbose: bool = False,
) -> dict:
    """FID between saved samples and a reference.

    Args:
        samples: what :func:`extract_features` accepts: images, or a path (a run's directory, its
            ``images`` folder, a merged sharded run's directory, a ``samples.pt``; :func:`run_images`).
        reference: precomputed statistics (a :data:`REFERENCE_STATS` name, URL or ``.npz`` path with
            ``mu``/``sigma``; a :class:`Statistics`; a ``(mu, sigma)`` pair), or images (a folder /
            array), whose statistics are computed with the same extractor.
        feature_extractor, feature_layer, weights_path, batch_size, device, allow_download, verbose:
            see :func:`extract_features`.
        cache_dir: cache root for reference ``.npz`` URLs.
        reference_sha256: optional expected hash of the reference ``.npz``.
        save_features: optional ``.npz`` path for the samples' per-image features (``features``).

    Returns:
        ``{"fid", "n_samples", "n_reference", "feature_extractor", "feature_layer", "reference"}``, and
        ``warning`` (:func:`few_images_warning`) with ``min_images`` (feature dimensions + 1) when there are no
        more samples than feature dimensions.

    Raises:
        FileNotFoundError: samples, reference or weights missing (messages say where to put them).
        ValueError: feature dimensions of samples and reference differ; fewer than :data:`MIN_IMAGES` samples;
            a reference that is no name, URL, ``.npz`` with ``mu`` and ``sigma``, or folder of images.
    """
    if isinstance(samples, (str, os.PathLike)):
        samples = run_images(samples)  # a missing or unreadable path is named before any weights are loaded
    local = (
        isinstance(reference, (str, os.PathLike))
        and os.fspath(reference) not in REFERENCE_STATS
        and "://" not in os.fspath(reference)
    )
    if local:  # so is a local reference that is no .npz with mu and sigma or folder of images (names: load_statistics)
        _reference_dim(reference, "reference", allow_download, cache_dir)
    ext, layer, cuda = make_extractor(
        feature_extractor,
        feature_layer,
        weights_path=weights_path,
        device=device,
        allow_download=allow_download,
        verbose=verbose,
    )
    feats = _features(ext, layer, cuda, samples, batch_size, verbose)
    if feats.shape[0] < MIN_IMAGES:
        raise ValueError(
            f"an FID needs at least {MIN_IMAGES} images (the covariance of one is undefined), and "
            f"{feats.shape[0]} were given; a usable FID needs more images than feature dimensions "
            f"({feats.shape[1]}): at least {feats.shape[1] + 1}."
        )
    if save_features is not None:
        from ..io import atomic_write as _atomic_write

        _atomic_write(Path(save_features), lambda f: np.savez(f, features=feats))
    stats = feature_statistics(feats)
    if isinstance(reference, Statistics):
        ref, ref_desc = reference, "Statistics"
    elif isinstance(reference, tuple) and len(reference) == 2:
        ref = Statistics(np.asarray(reference[0], np.float64), np.asarray(reference[1], np.float64))
        ref_desc = "(mu, sigma)"
    elif isinstance(reference, (str, os.PathLike)) and _is_stats_reference(reference):
        ref = load_statistics(reference, cache_dir=cache_dir, download=allow_download, sha256=reference_sha256)
        ref_desc = os.fspath(reference)
    else:
        ref = feature_statistics(_features(ext, layer, cuda, reference, batch_size, verbose))
        ref_desc = os.fspath(reference) if isinstance(reference, (str, os.PathLike)) else "images"
    if ref.mu.shape != stats.mu.shape:
        raise ValueError(
            f"feature dimension {stats.mu.shape[0]} of the samples differs from the reference's {ref.mu.shape[0]}: "
            f"the reference statistics were computed with another extractor or layer"
        )
    out = {
        "fid": frechet_distance_to_features(feats, ref.mu, ref.sigma),
        "n_samples": stats.n,
        "n_reference": ref.n,
        "feature_extractor": ext.get_name(),
        "feature_layer": layer,
        "reference": str(ref_desc),
    }
    warning = few_images_warning(stats.n, feats.shape[1])
    if warning is not None:
        out.update(warning=warning, min_images=feats.shape[1] + 1)
    return out


def _is_stats_reference(reference) -> bool:
    """A known name, a URL, or an existing ``.npz`` holding ``mu`` and ``sigma`` (else: images)."""
    s = os.fspath(reference)
    if s in REFERENCE_STATS or "://" in s:
        return True
    p = Path(s)
    if p.suffix != ".npz":
        return False
    if not p.is_file():
        return True  # load_statistics reports the missing file
    with np.load(p, allow_pickle=False) as z:
        return "mu" in z.files and "sigma" in z.files


# ----------------------------------------------------------------------------------------------
# command line: python -m specsamp.metrics.fid PATH --ref REF


def _run_record(path: Path) -> dict | None:
    """The ``result.json`` of the run ``path`` belongs to (``path`` itself, or the folder holding its
    ``images/`` or ``samples.pt``), or None."""
    import json

    path = Path(path)
    for d in (path, path.parent) if path.is_dir() else (path.parent,):
        f = d / "result.json"
        if f.is_file():
            try:
                rec = json.loads(f.read_text())
            except (OSError, ValueError):
                return None
            return rec if isinstance(rec, dict) else None
    return None


def main(argv: list[str] | None = None) -> int:
    """``python -m specsamp.metrics.fid PATH [--ref REF] [...]``: score saved samples, print the FID.

    ``PATH`` is a run's directory, its ``images/`` folder, a merged sharded run's directory or a
    ``samples.pt`` (:func:`run_images`). Settings not given on the command line come from the run's
    record when one is found beside ``PATH`` (``model.fid_ref``, ``model.fid_extractor``,
    ``model.fid_layer``, ``model.fid_weights``), else the defaults (Inception, pool3).

    Prints one line, ``FID 3.512  (1000 samples; reference REF; extractor NAME, layer L)``, and with
    ``--json FILE`` writes :func:`compute_fid`'s fields there. Exit status 0; 2 with one paragraph when
    an input is wrong or missing (path, reference, weights, extractor; checked by :func:`check_fid_inputs`
    before any image is read), or fewer than :data:`MIN_IMAGES` images; 3 when the output cannot be written.
    An FID of no more images than feature dimensions is printed with a warning on stderr
    (:func:`few_images_warning`).
    """
    import argparse
    import sys

    ap = argparse.ArgumentParser(
        prog="python -m specsamp.metrics.fid",
        description="FID of saved samples against reference statistics or images.",
    )
    ap.add_argument("path", help="a run directory, its images/ folder, a merged run's directory, or a samples.pt")
    ap.add_argument(
        "--ref",
        default=None,
        help="reference: a name (cifar10-32x32, ffhq-64x64, digits-8x8), URL, .npz "
        "with mu/sigma, or a folder of images (default: the run's model.fid_ref)",
    )
    ap.add_argument(
        "--feature-extractor",
        default=None,
        help="torch-fidelity extractor name or package.module:Class "
        "(default: the run's model.fid_extractor, else inception-v3-compat)",
    )
    ap.add_argument("--feature-layer", default=None, help="feature name (default: the extractor's FID feature)")
    ap.add_argument("--weights", default=None, help="local extractor weights (default: the run's model.fid_weights)")
    ap.add_argument("--device", default=None, help="cpu or cuda (default: CUDA when available)")
    ap.add_argument("--batch-size", type=int, default=64, help="images per forward pass")
    ap.add_argument("--offline", action="store_true", help="never download (weights, reference statistics)")
    ap.add_argument("--json", default=None, help="also write the result fields to this JSON file")
    a = ap.parse_args(argv)
    model = ((_run_record(Path(a.path)) or {}).get("config") or {}).get("model") or {}
    ref = a.ref or model.get("fid_ref")
    if not ref:
        print(
            f"error: --ref is missing: {a.path!r} is not beside a run record naming model.fid_ref; give --ref "
            f"(a name of {sorted(REFERENCE_STATS)}, a URL, an .npz with mu and sigma, or a folder of images).",
            file=sys.stderr,
        )
        return 2
    extractor = a.feature_extractor or model.get("fid_extractor") or INCEPTION
    layer = a.feature_layer or (model.get("fid_layer") if not a.feature_extractor else None)
    weights = a.weights or (model.get("fid_weights") if not a.feature_extractor else None)
    # each input named as it was given: the run record's key when the value came from there, else its flag
    recorded = {
        "reference": (ref, "fid_ref"),
        "feature_extractor": (extractor, "fid_extractor"),
        "feature_layer": (layer, "fid_layer"),
        "weights_path": (weights, "fid_weights"),
    }
    flags = {
        "reference": "--ref",
        "feature_extractor": "--feature-extractor",
        "feature_layer": "--feature-layer",
        "weights_path": "--weights",
    }
    from_record = {
        arg: f"model.{key}"
        if value is not None and value == model.get(key) and value != getattr(a, flags[arg][2:].replace("-", "_"))
        else flags[arg]
        for arg, (value, key) in recorded.items()
    }
    try:
        check_fid_inputs(
            ref,
            feature_extractor=extractor,
            feature_layer=layer,
            weights_path=weights,
            allow_download=not a.offline,
            keys=from_record,
        )
        res = compute_fid(
            a.path,
            ref,
            feature_extractor=extractor,
            feature_layer=layer,
            weights_path=weights,
            batch_size=a.batch_size,
            device=a.device,
            allow_download=not a.offline,
        )
    except (FileNotFoundError, ValueError, KeyError, RuntimeError) as e:  # hub.CheckpointTrustError is a ValueError
        if isinstance(e, RuntimeError) and not str(e).startswith("could not download"):
            raise
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    print(
        f"FID {res['fid']:.4f}  ({res['n_samples']} samples; reference {res['reference']}; extractor "
        f"{res['feature_extractor']}, layer {res['feature_layer']})"
        + ("  [too few images: see the warning]" if res.get("warning") else ""),
        flush=True,
    )
    if res.get("warning"):
        print(f"warning: {res['warning']}", file=sys.stderr, flush=True)
    if a.json:
        from ..io import write_json_atomic

        try:
            write_json_atomic(Path(a.json), {**res, "samples": str(a.path)})
        except OSError as e:
            print(f"error: could not write {a.json}: {e}", file=sys.stderr)
            return 3
    return 0


if __name__ == "__main__":
    import sys as _sys

    _sys.exit(main())
