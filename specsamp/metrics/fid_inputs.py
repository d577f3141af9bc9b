"""What an FID is computed from, and the checks of it that run before anything is sampled.

The inputs: the reference statistics by name (:data:`REFERENCE_STATS`), the default extractor
(:data:`INCEPTION`) and the URL of its weights, a path of saved samples (:func:`run_images`) and an
extractor named by its torch-fidelity registry name or ``package.module:Name``
(:func:`registered_extractor`). The checks: :func:`check_fid_inputs` (reference, extractor, layer and
weights, cheaply and before any image is made, naming each key as the caller does), the least number of
images an FID takes (:data:`MIN_IMAGES`), and why an FID of few images is not a usable number
(:func:`few_images_warning`). :mod:`specsamp.metrics.fid` imports these and computes the score; its
names stay importable from there. torch-fidelity is imported lazily, as there.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from ..hub import offline, resolve_path

INCEPTION = "inception-v3-compat"
# torch-fidelity's Inception weights (torch_fidelity.feature_extractor_inceptionv3.URL_INCEPTION_V3)
INCEPTION_URL = (
    "https://github.com/toshas/torch-fidelity/releases/download/v0.2.0/weights-inception-2015-12-05-6726825d.pth"
)
# NVlabs/edm README, "Calculating FID": reference statistics of the training sets
REFERENCE_STATS = {
    "cifar10-32x32": "https://nvlabs-fi-cdn.nvidia.com/edm/fid-refs/cifar10-32x32.npz",
    "ffhq-64x64": "https://nvlabs-fi-cdn.nvidia.com/edm/fid-refs/ffhq-64x64.npz",
    # shipped: digits-classifier features of scikit-learn's 1,797 digits (specsamp.metrics.digits_features)
    "digits-8x8": (Path(__file__).resolve().parents[1] / "data" / "digits-8x8-classifier-stats.npz").as_uri(),
}


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
            raise FileNotFoundError(
                f"no images at {str(path)!r}: neither index-named PNGs, an images/ folder nor a samples.pt"
            )
    if p.suffix == ".pt" and p.is_file():
        x = torch.load(p, map_location="cpu", weights_only=True)
        if not isinstance(x, torch.Tensor) or x.ndim != 4 or x.shape[1] not in (1, 3) or not x.is_floating_point():
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(
                f"{str(p)!r} holds {shape}, not float images [N, 1 or 3, H, W] in [-1, 1]: score the run's "
                "images/ folder instead (a latent model's samples are decoded into it by the run)"
            )
        return x.float().clamp(-1, 1)
    if not p.exists():
        raise FileNotFoundError(f"no images at {str(path)!r}")
    return p


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
    return (
        f"an FID of {n} images is not a usable number: it needs more images than its {dim} feature dimensions "
        f"(at least {dim + 1}, for a full-rank covariance; published FIDs use 50,000 and compare at equal N). "
        f"With {n} the covariance has rank {max(n - 1, 0)} < {dim} and the estimate is biased far upward."
    )


def _named(key: str, value) -> str:
    """``key=value`` as a config key reads, ``--flag 'value'`` as a command-line flag does."""
    return f"{key} {str(value)!r}" if key.startswith("--") else f"{key}={value!r}"


PYTHON_KEYS = {
    "reference": "reference",
    "feature_extractor": "feature_extractor",
    "feature_layer": "feature_layer",
    "weights_path": "weights_path",
}


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
                header = (
                    np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
                )
                shapes[name[:-4]] = tuple(header(f)[0])
    return shapes


def _reference_dim(reference, key: str, allow_download: bool, cache_dir) -> int | None:
    """Check a reference as :func:`compute_fid` will read it; the feature dimension of its statistics (None: images)."""
    valid = (
        f"valid: a name ({', '.join(sorted(REFERENCE_STATS))}), an http(s) URL of an .npz, a local .npz holding mu "
        "and sigma, or a folder of images"
    )
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
        raise FileNotFoundError(
            f"{_named(key, s)} is invalid: no such file or folder, and not a reference name; {valid}."
        )
    elif p.suffix != ".npz":
        if p.suffix == ".pt":  # a samples.pt of images (run_images reads it)
            return None
        raise ValueError(f"{_named(key, s)} is invalid: {str(p)!r} is neither an .npz nor a folder; {valid}.")
    try:
        shapes = _npz_shapes(p)
    except Exception as e:  # noqa: BLE001  (zipfile.BadZipFile, a truncated header: any of them means unreadable)
        raise ValueError(
            f"{_named(key, s)} is invalid: {str(p)!r} is not a readable .npz ({type(e).__name__}: {e}); {valid}."
        ) from None
    mu, sigma = shapes.get("mu"), shapes.get("sigma")
    if mu is None or sigma is None:
        raise ValueError(
            f"{_named(key, s)} is invalid: {str(p)!r} lacks {[k for k in ('mu', 'sigma') if k not in shapes]} "
            f"(keys: {sorted(shapes)}); reference statistics hold mu [F] and sigma [F, F]."
        )
    if len(mu) != 1 or sigma != (mu[0], mu[0]):
        raise ValueError(
            f"{_named(key, s)} is invalid: {str(p)!r} holds mu of shape {mu} and sigma of shape {sigma}; "
            "reference statistics hold mu [F] and sigma [F, F]."
        )
    return int(mu[0])


def _check_weights_file(path, key: str, name: str | None) -> None:
    p = Path(os.fspath(path)).expanduser()
    if not p.is_file():
        raise FileNotFoundError(
            f"{_named(key, os.fspath(path))} is invalid: no such file (the extractor's weights: "
            f"{'a torch-fidelity Inception .pth' if name and name.startswith('inception') else 'a local weights file'}, "
            f"or null for {'the torch hub cache' if name and name.startswith('inception') else 'its default'})."
        )
    if p.stat().st_size == 0:
        raise ValueError(f"{_named(key, os.fspath(path))} is invalid: the file is empty.")
    if name == "digits-classifier":  # loaded only with the shipped file's hash (models.digits.load_classifier)
        from ..hub import file_sha256
        from ..models.digits import CLASSIFIER_FILE, CLASSIFIER_SHA256

        actual = file_sha256(p)
        if actual != CLASSIFIER_SHA256:
            raise ValueError(
                f"{_named(key, os.fspath(path))} is invalid: its SHA-256 {actual} is not that of the shipped "
                f"digits classifier ({CLASSIFIER_SHA256}); give a copy of {CLASSIFIER_FILE.name}, or null "
                "for the shipped file."
            )


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
        f"$TORCH_HOME), or give a local copy of that file: {how}."
    )


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
    ref_dim = (
        _reference_dim(reference, k["reference"], allow_download, cache_dir)
        if isinstance(reference, (str, os.PathLike))
        else None
    )
    fe, cls, name = feature_extractor, None, None
    if isinstance(fe, str) and ":" in fe and fe not in FEATURE_EXTRACTORS_REGISTRY:
        try:
            fe = _import_extractor(fe)
        except ValueError as e:
            raise ValueError(
                f"{_named(k['feature_extractor'], feature_extractor)} is invalid: "
                f"{str(e).split(' is invalid: ', 1)[-1]}; valid: a torch-fidelity extractor name "
                f"({', '.join(_extractor_names())}), or package.module:Class."
            ) from None
        if not (isinstance(fe, FeatureExtractorBase) or callable(fe)):
            raise ValueError(
                f"{_named(k['feature_extractor'], feature_extractor)} is invalid: it names a "
                f"{type(fe).__name__}, not a torch-fidelity FeatureExtractorBase class, an instance or a callable."
            )
    if isinstance(fe, FeatureExtractorBase):
        cls, name = type(fe), fe.get_name()
    elif isinstance(fe, type) and issubclass(fe, FeatureExtractorBase):
        cls, name = fe, getattr(fe, "NAME", fe.__name__)
    elif isinstance(fe, str):
        cls, name = registered_extractor(fe), fe
        if cls is None:
            raise ValueError(
                f"{_named(k['feature_extractor'], fe)} is invalid: not a registered torch-fidelity extractor; "
                f"valid: {', '.join(_extractor_names())}, or package.module:Class."
            )
    layer = None
    if cls is not None:
        layer = feature_layer or cls.get_default_feature_layer_for_metric("fid")
        provided = [str(x) for x in cls.get_provided_features_list()]
        if str(layer) not in provided:
            raise ValueError(
                f"{_named(k['feature_layer'], layer)} is invalid for {name}; valid: {', '.join(provided)}."
            )
    if weights_path is not None:
        _check_weights_file(weights_path, k["weights_path"], name)
    elif isinstance(fe, str) and name.startswith("inception-v3"):
        _ensure_inception_weights(k["weights_path"], allow_download)
    layer_dim = int(layer) if isinstance(layer, str) and layer.isdigit() else None
    if ref_dim is not None and layer_dim is not None and ref_dim != layer_dim:
        raise ValueError(
            f"{_named(k['reference'], os.fspath(reference))} is invalid with {name} layer {layer}: its "
            f"statistics have {ref_dim} dimensions and the features {layer_dim}; use reference statistics "
            f"computed with the same extractor and layer."
        )
    return {"dim": ref_dim or layer_dim, "extractor": name, "layer": layer}
