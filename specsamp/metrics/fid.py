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
from .frechet import (  # noqa: F401  (the statistics and the distance, importable from here as before)
    ROUNDING_FACTOR,
    Statistics,
    feature_statistics,
    fid_rounding_bound,
    frechet_distance,
    frechet_distance_to_features,
)

INCEPTION = "inception-v3-compat"
# torch-fidelity's Inception weights (torch_fidelity.feature_extractor_inceptionv3.URL_INCEPTION_V3)
INCEPTION_URL = "https://github.com/toshas/torch-fidelity/releases/download/v0.2.0/weights-inception-2015-12-05-6726825d.pth"
# NVlabs/edm README, "Calculating FID": reference statistics of the training sets
REFERENCE_STATS = {
    "cifar10-32x32": "https://nvlabs-fi-cdn.nvidia.com/edm/fid-refs/cifar10-32x32.npz",
    "ffhq-64x64": "https://nvlabs-fi-cdn.nvidia.com/edm/fid-refs/ffhq-64x64.npz",
    # shipped: digits-classifier features of scikit-learn's 1,797 digits (specsamp.metrics.digits_features)
    "digits-8x8": (Path(__file__).resolve().parents[1] / "data" / "digits-8x8-classifier-stats.npz").as_uri(),
}


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


def run_images(path: str | os.PathLike):
    """What a path of saved samples holds, as something :func:`extract_features` reads.

    * a folder of index-named PNGs (a run's ``images/``): the folder;
    * a run's (or a merged sharded run's) directory: its ``images/`` when present, else its ``samples.pt``;
    * a ``samples.pt`` (float ``[N, C, H, W]`` in ``[-1, 1]``, what ``save_samples=true`` and
      ``python -m specsamp.runner.shards merge`` write): its tensor, clamped to ``[-1, 1]`` (the pixel
      models' decode).

    Returns:
        A folder path or a float tensor ``[N, C, H, W]``.

    Raises:
        FileNotFoundError: nothing of the above at ``path``.
        ValueError: a ``samples.pt`` that does not hold images (``[N, 1 or 3, H, W]``; latents of a
            latent model are decoded by the run, into ``images/``).
    """
    p = Path(path)
    if p.is_dir():
        if (p / "images").is_dir():
            return p / "images"
        if any(f.suffix.lower() == ".png" and f.stem.isdigit() for f in p.iterdir()):
            return p
        if (p / "samples.pt").is_file():
            p = p / "samples.pt"
        else:
            raise FileNotFoundError(f"no images at {str(path)!r}: neither index-named PNGs, an images/ folder nor a samples.pt")
    if p.suffix == ".pt" and p.is_file():
        x = torch.load(p, map_location="cpu", weights_only=True)
        if not isinstance(x, torch.Tensor) or x.ndim != 4 or x.shape[1] not in (1, 3) or not x.is_floating_point():
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"{str(p)!r} holds {shape}, not float images [N, 1 or 3, H, W] in [-1, 1]: score the run's "
                             "images/ folder instead (a latent model's samples are decoded into it by the run)")
        return x.float().clamp(-1, 1)
    if not p.exists():
        raise FileNotFoundError(f"no images at {str(path)!r}")
    return p


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


def _import_extractor(spec: str):
    """``"package.module:Name"`` -> the object it names.

    Raises:
        ValueError: the module or the attribute does not exist.
    """
    import importlib

    mod_name, _, attr = spec.partition(":")
    try:
        obj = importlib.import_module(mod_name)
    except ImportError as err:
        raise ValueError(f"feature_extractor={spec!r} is invalid: cannot import module {mod_name!r} ({err})") from None
    if not attr or not hasattr(obj, attr):
        raise ValueError(f"feature_extractor={spec!r} is invalid: module {mod_name!r} has no attribute {attr!r}")
    return getattr(obj, attr)


def registered_extractor(name: str):
    """The torch-fidelity feature extractor class registered under ``name``, or ``None`` when there is none.

    The shipped ``digits-classifier`` (:mod:`specsamp.metrics.digits_features`) is registered on first use.
    """
    from torch_fidelity.registry import FEATURE_EXTRACTORS_REGISTRY

    if name == "digits-classifier":
        from .digits_features import register

        register()
    return FEATURE_EXTRACTORS_REGISTRY.get(name)


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

    if isinstance(feature_extractor, str) and ":" in feature_extractor and feature_extractor not in FEATURE_EXTRACTORS_REGISTRY:
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
        raise ValueError(f"feature_extractor={name!r} is invalid; registered: {', '.join(sorted(FEATURE_EXTRACTORS_REGISTRY))}")
    layer = feature_layer or cls.get_default_feature_layer_for_metric("fid")
    if layer not in cls.get_provided_features_list():
        raise ValueError(f"feature_layer={layer!r} is invalid for {name}; valid: {', '.join(map(str, cls.get_provided_features_list()))}")
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
        feature_extractor, feature_layer, weights_path=weights_path, device=device,
        allow_download=allow_download, verbose=verbose,
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
    local = isinstance(reference, (str, os.PathLike)) and os.fspath(reference) not in REFERENCE_STATS and "://" not in os.fspath(reference)
    if local:  # so is a local reference that is no .npz with mu and sigma or folder of images (names: load_statistics)
        _reference_dim(reference, "reference", allow_download, cache_dir)
    ext, layer, cuda = make_extractor(
        feature_extractor, feature_layer, weights_path=weights_path, device=device,
        allow_download=allow_download, verbose=verbose,
    )
    feats = _features(ext, layer, cuda, samples, batch_size, verbose)
    if feats.shape[0] < MIN_IMAGES:
        raise ValueError(f"an FID needs at least {MIN_IMAGES} images (the covariance of one is undefined), and "
                         f"{feats.shape[0]} were given; a usable FID needs more images than feature dimensions "
                         f"({feats.shape[1]}): at least {feats.shape[1] + 1}.")
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
# what scoring needs, checked before anything is sampled

MIN_IMAGES = 2  # the sample covariance of fewer images is undefined (it divides by N - 1)


def few_images_warning(n: int, dim: int | None) -> str | None:
    """Why an FID of ``n`` images in ``dim`` feature dimensions is not a usable number, or None.

    The sample covariance of ``n`` images has rank at most ``n - 1``, so with ``n <= dim`` it is singular: the
    Gaussian fit is degenerate, and the estimate is biased far upward (its bias falls like ``1 / n`` only once
    ``n`` is well above ``dim``; 3 images of the digits network, 64 dimensions, score about 700). The minimum for a
    full-rank covariance is ``dim + 1`` images (2049 for Inception's pool3); published FIDs use 50,000, and
    FIDs are comparable only at equal ``n``.
    """
    if dim is None or n > dim:
        return None
    return (f"an FID of {n} images is not a usable number: it needs more images than its {dim} feature dimensions "
            f"(at least {dim + 1}, for a full-rank covariance; published FIDs use 50,000 and compare at equal N). "
            f"With {n} the covariance has rank {max(n - 1, 0)} < {dim} and the estimate is biased far upward.")


def _named(key: str, value) -> str:
    """``key=value`` as a config key reads, ``--flag 'value'`` as a command-line flag does."""
    return f"{key} {str(value)!r}" if key.startswith("--") else f"{key}={value!r}"


PYTHON_KEYS = {"reference": "reference", "feature_extractor": "feature_extractor", "feature_layer": "feature_layer",
               "weights_path": "weights_path"}


def _npz_shapes(path: Path) -> dict[str, tuple]:
    """The shapes of the arrays in an ``.npz``, read from their headers (no array is loaded)."""
    import zipfile

    shapes = {}
    with zipfile.ZipFile(path) as z:
        for name in z.namelist():
            if not name.endswith(".npy"):
                continue
            with z.open(name) as f:
                version = np.lib.format.read_magic(f)
                header = (np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0)
                shapes[name[:-4]] = tuple(header(f)[0])
    return shapes


def _reference_dim(reference, key: str, allow_download: bool, cache_dir) -> int | None:
    """Check a reference as :func:`compute_fid` will read it; the feature dimension of its statistics (None: images)."""
    valid = (f"valid: a name ({', '.join(sorted(REFERENCE_STATS))}), an http(s) URL of an .npz, a local .npz holding mu "
             "and sigma, or a folder of images")
    s = os.fspath(reference)
    p = Path(s).expanduser()
    if s in REFERENCE_STATS or "://" in s:
        try:
            p = resolve_path(REFERENCE_STATS.get(s, s), cache_dir=cache_dir, download=allow_download, subdir="fid-refs")
        except FileNotFoundError as e:
            raise FileNotFoundError(f"{_named(key, s)} cannot be read: {e}") from None
    elif p.is_dir():
        try:
            run_images(p)
        except (FileNotFoundError, ValueError) as e:
            raise ValueError(f"{_named(key, s)} is invalid: {e}; {valid}.") from None
        return None
    elif not p.is_file():
        raise FileNotFoundError(f"{_named(key, s)} is invalid: no such file or folder, and not a reference name; {valid}.")
    elif p.suffix != ".npz":
        if p.suffix == ".pt":  # a samples.pt of images (run_images reads it)
            return None
        raise ValueError(f"{_named(key, s)} is invalid: {str(p)!r} is neither an .npz nor a folder; {valid}.")
    try:
        shapes = _npz_shapes(p)
    except Exception as e:  # noqa: BLE001  (zipfile.BadZipFile, a truncated header: any of them means unreadable)
        raise ValueError(f"{_named(key, s)} is invalid: {str(p)!r} is not a readable .npz ({type(e).__name__}: {e}); "
                         f"{valid}.") from None
    mu, sigma = shapes.get("mu"), shapes.get("sigma")
    if mu is None or sigma is None:
        raise ValueError(f"{_named(key, s)} is invalid: {str(p)!r} lacks {[k for k in ('mu', 'sigma') if k not in shapes]} "
                         f"(keys: {sorted(shapes)}); reference statistics hold mu [F] and sigma [F, F].")
    if len(mu) != 1 or sigma != (mu[0], mu[0]):
        raise ValueError(f"{_named(key, s)} is invalid: {str(p)!r} holds mu of shape {mu} and sigma of shape {sigma}; "
                         "reference statistics hold mu [F] and sigma [F, F].")
    return int(mu[0])


def _check_weights_file(path, key: str, name: str | None) -> None:
    p = Path(os.fspath(path)).expanduser()
    if not p.is_file():
        raise FileNotFoundError(f"{_named(key, os.fspath(path))} is invalid: no such file (the extractor's weights: "
                                f"{'a torch-fidelity Inception .pth' if name and name.startswith('inception') else 'a local weights file'}, "
                                f"or null for {'the torch hub cache' if name and name.startswith('inception') else 'its default'}).")
    if p.stat().st_size == 0:
        raise ValueError(f"{_named(key, os.fspath(path))} is invalid: the file is empty.")
    if name == "digits-classifier":  # loaded only with the shipped file's hash (models.digits.load_classifier)
        from ..hub import file_sha256
        from ..models.digits import CLASSIFIER_FILE, CLASSIFIER_SHA256

        actual = file_sha256(p)
        if actual != CLASSIFIER_SHA256:
            raise ValueError(f"{_named(key, os.fspath(path))} is invalid: its SHA-256 {actual} is not that of the shipped "
                             f"digits classifier ({CLASSIFIER_SHA256}); give a copy of {CLASSIFIER_FILE.name}, or null "
                             "for the shipped file.")


def _ensure_inception_weights(key: str, allow_download: bool) -> None:
    """The Inception weights in the torch hub cache, downloaded now (before sampling) when missing and allowed."""
    cached = Path(torch.hub.get_dir()) / "checkpoints" / Path(INCEPTION_URL).name
    if cached.is_file():
        return
    why = "downloads are disabled" if not allow_download else "SPECSAMP_OFFLINE is set"
    if allow_download and not offline():
        try:
            cached.parent.mkdir(parents=True, exist_ok=True)
            torch.hub.download_url_to_file(INCEPTION_URL, os.fspath(cached), progress=False)
            return
        except Exception as e:  # noqa: BLE001  (urllib, ssl, OSError: any of them means not downloadable here)
            why = f"the download failed ({type(e).__name__}: {' '.join(str(e).split())})"
    how = f"{key} FILE" if key.startswith("--") else f"{key}=FILE"
    raise FileNotFoundError(
        f"{key} is not set and the FID's Inception weights are not in the torch hub cache ({str(cached)!r}), and "
        f"{why}. Download {INCEPTION_URL} where the network is reachable and put it at that path (or set "
        f"$TORCH_HOME), or give a local copy of that file: {how}.")


def _extractor_names() -> list[str]:
    from torch_fidelity.registry import FEATURE_EXTRACTORS_REGISTRY

    return sorted({*FEATURE_EXTRACTORS_REGISTRY, "digits-classifier"})


def check_fid_inputs(
    reference,
    *,
    feature_extractor=INCEPTION,
    feature_layer: str | None = None,
    weights_path: str | os.PathLike | None = None,
    allow_download: bool = True,
    cache_dir: str | os.PathLike | None = None,
    keys: dict | None = None,
) -> dict:
    """Check what :func:`compute_fid` will need, cheaply, before any image is made.

    The reference: a name or URL is resolved in the cache (downloaded now when missing and allowed), an
    ``.npz`` must hold ``mu [F]`` and ``sigma [F, F]`` (read from the array headers, nothing loaded), a folder
    must hold images. The extractor: a registered name, or ``package.module:Name`` that imports and resolves to
    a torch-fidelity extractor class, an instance or a callable; its layer must exist. Weights: a given file
    must exist and be non-empty (the digits classifier's must have the shipped hash); Inception's default
    weights must be in the torch hub cache or are downloaded now. No network is loaded.

    Args:
        reference, feature_extractor, feature_layer, weights_path, allow_download, cache_dir: as for
            :func:`compute_fid`.
        keys: how the caller names each argument in messages (e.g. ``{"reference": "model.fid_ref"}``;
            default: the Python names).

    Returns:
        ``{"dim": F of the reference statistics or of a numbered layer (None when unknown), "extractor": its
        name, "layer": the feature (None when the extractor does not say)}``.

    Raises:
        FileNotFoundError, ValueError: one paragraph naming the key, its value and what is valid.
    """
    from torch_fidelity.feature_extractor_base import FeatureExtractorBase
    from torch_fidelity.registry import FEATURE_EXTRACTORS_REGISTRY

    k = {**PYTHON_KEYS, **(keys or {})}
    ref_dim = _reference_dim(reference, k["reference"], allow_download, cache_dir) if isinstance(reference, (str, os.PathLike)) else None
    fe, cls, name = feature_extractor, None, None
    if isinstance(fe, str) and ":" in fe and fe not in FEATURE_EXTRACTORS_REGISTRY:
        try:
            fe = _import_extractor(fe)
        except ValueError as e:
            raise ValueError(f"{_named(k['feature_extractor'], feature_extractor)} is invalid: "
                             f"{str(e).split(' is invalid: ', 1)[-1]}; valid: a torch-fidelity extractor name "
                             f"({', '.join(_extractor_names())}), or package.module:Class.") from None
        if not (isinstance(fe, FeatureExtractorBase) or callable(fe)):
            raise ValueError(f"{_named(k['feature_extractor'], feature_extractor)} is invalid: it names a "
                             f"{type(fe).__name__}, not a torch-fidelity FeatureExtractorBase class, an instance or a callable.")
    if isinstance(fe, FeatureExtractorBase):
        cls, name = type(fe), fe.get_name()
    elif isinstance(fe, type) and issubclass(fe, FeatureExtractorBase):
        cls, name = fe, getattr(fe, "NAME", fe.__name__)
    elif isinstance(fe, str):
        cls, name = registered_extractor(fe), fe
        if cls is None:
            raise ValueError(f"{_named(k['feature_extractor'], fe)} is invalid: not a registered torch-fidelity extractor; "
                             f"valid: {', '.join(_extractor_names())}, or package.module:Class.")
    layer = None
    if cls is not None:
        layer = feature_layer or cls.get_default_feature_layer_for_metric("fid")
        provided = [str(x) for x in cls.get_provided_features_list()]
        if str(layer) not in provided:
            raise ValueError(f"{_named(k['feature_layer'], layer)} is invalid for {name}; valid: {', '.join(provided)}.")
    if weights_path is not None:
        _check_weights_file(weights_path, k["weights_path"], name)
    elif isinstance(fe, str) and name.startswith("inception-v3"):
        _ensure_inception_weights(k["weights_path"], allow_download)
    layer_dim = int(layer) if isinstance(layer, str) and layer.isdigit() else None
    if ref_dim is not None and layer_dim is not None and ref_dim != layer_dim:
        raise ValueError(f"{_named(k['reference'], os.fspath(reference))} is invalid with {name} layer {layer}: its "
                         f"statistics have {ref_dim} dimensions and the features {layer_dim}; use reference statistics "
                         f"computed with the same extractor and layer.")
    return {"dim": ref_dim or layer_dim, "extractor": name, "layer": layer}


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
    import json
    import sys

    ap = argparse.ArgumentParser(prog="python -m specsamp.metrics.fid",
                                 description="FID of saved samples against reference statistics or images.")
    ap.add_argument("path", help="a run directory, its images/ folder, a merged run's directory, or a samples.pt")
    ap.add_argument("--ref", default=None, help="reference: a name (cifar10-32x32, ffhq-64x64, digits-8x8), URL, .npz "
                                                "with mu/sigma, or a folder of images (default: the run's model.fid_ref)")
    ap.add_argument("--feature-extractor", default=None, help="torch-fidelity extractor name or package.module:Class "
                                                              "(default: the run's model.fid_extractor, else inception-v3-compat)")
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
        print(f"error: --ref is missing: {a.path!r} is not beside a run record naming model.fid_ref; give --ref "
              f"(a name of {sorted(REFERENCE_STATS)}, a URL, an .npz with mu and sigma, or a folder of images).", file=sys.stderr)
        return 2
    extractor = a.feature_extractor or model.get("fid_extractor") or INCEPTION
    layer = a.feature_layer or (model.get("fid_layer") if not a.feature_extractor else None)
    weights = a.weights or (model.get("fid_weights") if not a.feature_extractor else None)
    # each input named as it was given: the run record's key when the value came from there, else its flag
    recorded = {"reference": (ref, "fid_ref"), "feature_extractor": (extractor, "fid_extractor"),
                "feature_layer": (layer, "fid_layer"), "weights_path": (weights, "fid_weights")}
    flags = {"reference": "--ref", "feature_extractor": "--feature-extractor", "feature_layer": "--feature-layer",
             "weights_path": "--weights"}
    from_record = {arg: f"model.{key}" if value is not None and value == model.get(key) and value != getattr(a, flags[arg][2:].replace("-", "_"))
                   else flags[arg] for arg, (value, key) in recorded.items()}
    try:
        check_fid_inputs(ref, feature_extractor=extractor, feature_layer=layer, weights_path=weights,
                         allow_download=not a.offline, keys=from_record)
        res = compute_fid(a.path, ref, feature_extractor=extractor, feature_layer=layer, weights_path=weights,
                          batch_size=a.batch_size, device=a.device, allow_download=not a.offline)
    except (FileNotFoundError, ValueError, KeyError, RuntimeError) as e:  # hub.CheckpointTrustError is a ValueError
        if isinstance(e, RuntimeError) and not str(e).startswith("could not download"):
            raise
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    print(f"FID {res['fid']:.4f}  ({res['n_samples']} samples; reference {res['reference']}; extractor "
          f"{res['feature_extractor']}, layer {res['feature_layer']})"
          + ("  [too few images: see the warning]" if res.get("warning") else ""), flush=True)
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
