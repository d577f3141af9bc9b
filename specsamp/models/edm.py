"""NVIDIA EDM denoisers behind the velocity interface, and a checked loader for their pickles.

Change of variables (paper section 5.2). EDM's denoiser works on the variance-exploding
scale ``y = x0 + s xi`` and returns ``D(y; s) = E[x0 | y]``. The linear path
``x = (1 - sigma) x0 + sigma xi`` divided by ``1 - sigma`` *is* that scale with ``s = sigma / (1 - sigma)``,
so ``D(x / (1 - sigma); s) = E[x0 | x_sigma = x]``. With ``v = d x / d sigma = xi - x0`` and
``E[xi | x] = (x - (1 - sigma) E[x0 | x]) / sigma``::

    v(x, sigma) = E[xi - x0 | x] = (x - D(x / (1 - sigma); sigma / (1 - sigma))) / sigma.

The paper prints ``v = x / t - D(x / (1 - t); t / (1 - t))``: the ``1 / t`` must divide ``D`` as well
(the printed form is not the velocity of the linear path; ``tests/models/test_edm.py`` checks the form used
here against a Gaussian mixture's exact velocity to float64 precision).

Clipping. ``s`` is clipped to ``[1e-3, 80]`` (EDM's trained range; paper section 5.2), i.e. ``sigma``
to ``[sigma_lo, sigma_hi] = [1e-3 / 1.001, 80 / 81]``. The network input is built from the *clipped*
level, ``y = (1 + s_c) x``, so the denoiser always sees a state consistent with its noise level, and
the division uses the true ``sigma``. Inside the range this is the formula above exactly; above
``sigma_hi = 0.98765...`` (the first steps of a T=100 grid, and ``sigma = 1`` itself, where
``x / (1 - sigma)`` is infinite) it is ``(x - E_{sigma_hi}[x0 | x]) / sigma``: the posterior mean is
taken at ``sigma_hi`` instead of ``sigma``, where it is nearly the data mean anyway.

Checkpoints are pickles, which are code. :func:`load_edm` hashes the file and refuses it unless the
SHA-256 matches a configured value (or ``trust_checkpoint=True``), before anything is unpickled.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import rng
from ..errors import ConfigError
from ..hub import is_url, resolve_path, verify_sha256
from . import nvlabs_compat
from .base import Target, TargetConfig, check_positive, parse_dtype

NET_DTYPES = ("float16", "bfloat16")  # model.net_dtype: the network under torch.autocast in half precision (null: none)
SIGMA_CLIP = (1e-3, 80.0)  # EDM noise levels s the network is evaluated at (paper section 5.2)


# ----------------------------------------------------------------------------------------------
# known checkpoints


@dataclass(frozen=True)
class Checkpoint:
    """A published EDM checkpoint.

    Attributes:
        url: download address.
        sha256: expected SHA-256 of the file, or ``None`` when no public source states it.
        label_dim: number of classes (0: unconditional).
        resolution: image side in pixels.
    """

    url: str
    sha256: str | None
    label_dim: int
    resolution: int

    @property
    def filename(self) -> str:
        """Basename of the file (also its name in the cache)."""
        return Path(urllib.parse.urlparse(self.url).path).name


_EDM_CDN = "https://nvlabs-fi-cdn.nvidia.com/edm/pretrained/"

# Karras et al. (2022), NVlabs/edm README ("Pre-trained models"). NVIDIA publishes no checksums for
# these files, so sha256 is None: loading them needs either sha256=<hash of a copy you trust> or
# trust_checkpoint=true.
CHECKPOINTS: dict[str, Checkpoint] = {
    "edm-cifar10-32x32-cond-vp": Checkpoint(_EDM_CDN + "edm-cifar10-32x32-cond-vp.pkl", None, 10, 32),
    "edm-ffhq-64x64-uncond-vp": Checkpoint(_EDM_CDN + "edm-ffhq-64x64-uncond-vp.pkl", None, 0, 64),
    # shipped with the package: trained on scikit-learn's digits by experiments/train_digits.py (specsamp.models.digits)
    "edm-digits-8x8-cond": Checkpoint(
        (Path(__file__).resolve().parents[1] / "data" / "edm-digits-8x8-cond.pkl").as_uri(),
        "ee0542d9eb229546125fbc0fa58a689dacf195454034ccd26cae8da09dd53b16",
        10,
        8,
    ),
    # shipped with the package: the digits network trained with label dropout 0.1 (null class: the all-zero one-hot) by
    # experiments/train_digits.py --label-dropout 0.1, for classifier-free guidance (specsamp.models.guided)
    "edm-digits-8x8-cfg": Checkpoint(
        (Path(__file__).resolve().parents[1] / "data" / "edm-digits-8x8-cfg.pkl").as_uri(),
        "3b9b90d0378b1f6a556346a497167d8d1c3c800af8bb1eda0947097ac0cb7739",
        10,
        8,
    ),
    # shipped with the package: trained on crops of scikit-learn's two sample photographs by
    # experiments/train_patches.py (specsamp.models.patches); class-unconditional, CIFAR-10's dimension
    "edm-patches-32x32-uncond": Checkpoint(
        (Path(__file__).resolve().parents[1] / "data" / "edm-patches-32x32-uncond.pkl").as_uri(),
        "d4f51d18f91aa0f03d2eee8efc39b7b462b927d22efdc82afc30e70624402c88",
        0,
        32,
    ),
}


class CheckpointFormatError(ValueError):
    """A (trusted) checkpoint file that is not a loadable EDM network pickle: empty, truncated, a zip."""


# ----------------------------------------------------------------------------------------------
# loading


def _lookup(path_or_url: str) -> Checkpoint | None:
    s = os.fspath(path_or_url)
    if s in CHECKPOINTS:
        return CHECKPOINTS[s]
    base = Path(urllib.parse.urlparse(s).path).name if is_url(s) else Path(s).name
    for ck in CHECKPOINTS.values():
        if ck.filename == base:
            return ck
    return None


def load_edm(
    path_or_url: str | os.PathLike,
    *,
    sha256: str | None = None,
    cache_dir: str | os.PathLike | None = None,
    trust_checkpoint: bool = False,
    download: bool = True,
    key: str | None = "ema",
    map_location: str | torch.device | None = None,
):
    """Load an NVIDIA EDM network pickle (``EDMPrecond`` and friends), checksum first.

    Order of operations: resolve the file (a name of :data:`CHECKPOINTS`, a URL mapped into the cache,
    or a local path); hash it and refuse unless the hash equals ``sha256`` (or the table's hash for a
    known file) or ``trust_checkpoint``; only then unpickle it with the :mod:`nvlabs_compat` stand-ins
    for ``torch_utils`` / ``dnnlib`` (the pickle's embedded module sources run at that point).

    Args:
        path_or_url: checkpoint name (e.g. ``"edm-cifar10-32x32-cond-vp"``), URL or local path.
        sha256: expected SHA-256 (hex). ``None``: the table's value for a known file name, if any.
        cache_dir: cache root for URLs (default ``$SPECSAMP_CACHE`` or ``~/.cache/specsamp``).
        trust_checkpoint: load even when the hash is unknown or differs.
        download: allow downloading a missing URL (never attempted with ``SPECSAMP_OFFLINE=1``).
        key: entry of the pickled dict to return (EDM stores the network under ``"ema"``); ``None``
            returns the whole unpickled object. Ignored when the pickle is not a dict.
        map_location: device to move a returned ``torch.nn.Module`` to.

    Returns:
        The unpickled network (``torch.nn.Module`` in eval mode, gradients off) or object.

    Raises:
        FileNotFoundError: the file is absent (message: URL and path looked in).
        CheckpointTrustError: hash unknown or different and ``trust_checkpoint`` is false; nothing
            was unpickled.
        CheckpointFormatError: the file is empty, a zip archive (``torch.save``'s format), truncated,
            or otherwise fails to unpickle (the message names the file and the cause).
        CheckpointFormatError: also when ``key`` is missing from the pickled dict (the message lists the keys).
    """
    s = os.fspath(path_or_url)
    known = _lookup(s)
    location = known.url if (s in CHECKPOINTS and known is not None) else s
    expected = sha256 if sha256 is not None else (known.sha256 if known is not None else None)
    try:
        path = resolve_path(location, cache_dir=cache_dir, download=download, sha256=expected, subdir="edm")
    except FileNotFoundError as err:
        hint = f" Published at {known.url}." if known is not None and known.url != location else ""
        if expected is None and not trust_checkpoint:  # else the copy would meet a second refusal (verify_sha256)
            hint += (
                " Once the file is there, loading it also needs model.sha256=<its SHA-256> (`sha256sum FILE`, "
                "for a copy from a source you trust) or model.trust_checkpoint=true: no hash is published for "
                "it, and a pickle runs code when it is loaded."
            )
        raise FileNotFoundError(f"{err}{hint}") from None
    verify_sha256(path, expected, trust=trust_checkpoint)
    obj = _unpickle(path)
    if key is not None and isinstance(obj, dict):
        if key not in obj:
            raise CheckpointFormatError(
                f"model.key={key!r} is not in checkpoint {str(path)!r}; its keys: {sorted(obj)}"
            )
        obj = obj[key]
    if isinstance(obj, torch.nn.Module):
        obj = obj.eval().requires_grad_(False)
        if map_location is not None:
            obj = obj.to(map_location)
    return obj


def _load_storage_bytes(b: bytes):
    """``torch.storage._load_from_bytes`` with the storages mapped to the CPU when torch sees no CUDA device:
    a pickle saved from GPU memory tags its storages ``cuda:N``, which would otherwise refuse to load here
    (the network then moves to the run's device, ``load_edm(map_location=...)``)."""
    import io

    return torch.load(io.BytesIO(b), weights_only=False, map_location=None if torch.cuda.is_available() else "cpu")


class _CpuMappingUnpickler(pickle.Unpickler):
    """An unpickler whose tensor storages load on the CPU when no CUDA device is available (:func:`_load_storage_bytes`)."""

    def find_class(self, module: str, name: str):
        if module == "torch.storage" and name == "_load_from_bytes":
            return _load_storage_bytes
        return super().find_class(module, name)


def _unpickle(path: Path):
    """Unpickle a verified (or trusted) EDM pickle; every way it can fail becomes one CheckpointFormatError."""
    import zipfile

    size = os.path.getsize(path)
    what = f"checkpoint {str(path)!r} ({size} bytes)"
    if size == 0:
        raise CheckpointFormatError(f"{what} is empty: nothing to load. Fetch the file again.")
    if zipfile.is_zipfile(path):
        raise CheckpointFormatError(
            f"{what} is a zip archive (torch.save's format), not an NVIDIA EDM network pickle such as "
            f"edm-cifar10-32x32-cond-vp.pkl; load such a file with torch.load in your own code and pass the "
            f"network to EDMVelocity."
        )
    try:
        with nvlabs_compat.installed(), open(path, "rb") as f:
            return _CpuMappingUnpickler(f).load()  # checksum verified (or explicitly trusted) by the caller
    except Exception as err:  # noqa: BLE001 - a pickle can raise anything; all mean "not a loadable network"
        cause = (
            "truncated (it ends before the pickle does)"
            if isinstance(err, EOFError)
            else "not a loadable EDM network pickle"
        )
        raise CheckpointFormatError(
            f"{what} could not be unpickled: it is {cause} ({type(err).__name__}: {err}). Fetch the file again "
            f"and check its SHA-256 against a copy you trust."
        ) from None


# ----------------------------------------------------------------------------------------------
# the velocity adapter


def check_label_range(labels: torch.Tensor, label_dim: int) -> None:
    """Raise ``ValueError`` when integer class ids ``[b]`` fall outside ``[0, label_dim)`` -- on the host only.

    Reading the range back is free for CPU tensors; on an accelerator it would cost a host synchronisation on
    every network call, so there the check is left to ``torch.nn.functional.one_hot``, whose scatter raises a
    device-side assert for an id out of range (the runner draws its labels in range).
    """
    if labels.device.type != "cpu" or labels.numel() == 0:
        return
    lo, hi = int(labels.min()), int(labels.max())
    if lo < 0 or hi >= label_dim:
        raise ValueError(f"class_labels range [{lo}, {hi}] is invalid: ids must lie in [0, {label_dim})")


class EDMVelocity:
    """An EDM denoiser (``EDMPrecond.forward(x, sigma, class_labels=None)``) as a velocity field.

    ``v(x, sigma) = (x - D((1 + s_c) x; s_c)) / sigma`` with ``s_c = clip(sigma / (1 - sigma), 1e-3, 80)``
    (module docstring; paper section 5.2, corrected). The change of variables runs in
    at least float32 (float64 when the state is float64): ``(x - D) / sigma`` divides a cancellation
    by up to ``1 / sigma_min = 1000``.

    Args:
        net: callable ``net(x [b, *event], sigma [b], class_labels=None | [b, label_dim]) -> [b, *event]``
            returning ``D(x; sigma)`` on EDM's scale (NVIDIA ``EDMPrecond``/``VPPrecond``/...).
        label_dim: number of classes; ``None`` reads ``net.label_dim`` (0 if absent).
        dtype: dtype of the sampler's states (``float32`` or ``float64``).
        net_dtype: run the network under ``torch.autocast`` in this dtype (``float16``/``bfloat16``);
            inputs and outputs to the sampler keep ``dtype``. ``None``: no autocast.
        event_shape: state shape; ``None`` reads ``(net.img_channels, net.img_resolution,
            net.img_resolution)``.
        device: device of states; a ``torch.nn.Module`` net is moved there. ``None``: the device of
            the net's first parameter (CPU if it has none).
        sigma_clip: ``(s_min, s_max)`` range of EDM noise levels (default ``(1e-3, 80)``).

    Conditioning: pass ``class_labels`` as a cond tensor, long ``[b]`` in ``[0, label_dim)`` (one-hot
    encoded here) or float ``[b, label_dim]``. Other cond entries go to the network as keywords.

    Raises:
        ValueError: bad ``dtype``/``net_dtype``, ``label_dim`` disagreeing with ``net.label_dim``, no
            way to know ``event_shape``, or a bad ``sigma_clip``.
    """

    def __init__(
        self,
        net,
        label_dim: int | None = None,
        dtype: torch.dtype | str = torch.float32,
        net_dtype: torch.dtype | str | None = None,
        *,
        event_shape: tuple[int, ...] | None = None,
        device: str | torch.device | None = None,
        sigma_clip: tuple[float, float] = SIGMA_CLIP,
    ):
        self.dtype = parse_dtype(dtype, "dtype", ("float32", "float64"))  # sampler states
        self.net_dtype = parse_dtype(net_dtype, "net_dtype")
        net_label_dim = getattr(net, "label_dim", None)
        if label_dim is None:
            label_dim = int(net_label_dim or 0)
        elif net_label_dim is not None and int(net_label_dim) != int(label_dim):
            raise ValueError(f"label_dim={label_dim!r} disagrees with the network's label_dim={net_label_dim}")
        if isinstance(label_dim, bool) or int(label_dim) < 0:
            raise ValueError(f"label_dim={label_dim!r} is invalid: must be an integer >= 0")
        self.label_dim = int(label_dim)
        if event_shape is None:
            if not all(hasattr(net, a) for a in ("img_channels", "img_resolution")):
                raise ValueError(
                    "event_shape=None is invalid for a network without img_channels/img_resolution; "
                    "pass event_shape=(C, H, W)"
                )
            r = int(net.img_resolution)
            event_shape = (int(net.img_channels), r, r)
        self.event_shape = tuple(int(e) for e in event_shape)
        lo, hi = (float(v) for v in sigma_clip)
        if not 0 < lo < hi:
            raise ValueError(f"sigma_clip={sigma_clip!r} is invalid: need 0 < s_min < s_max")
        self.sigma_clip = (lo, hi)
        if device is None:
            params = net.parameters() if isinstance(net, torch.nn.Module) else iter(())
            first = next(params, None)
            device = first.device if first is not None else "cpu"
        self.device = torch.device(device)
        if isinstance(net, torch.nn.Module):
            net = net.to(self.device).eval()
        self.net = net

    @property
    def sigma_range(self) -> tuple[float, float]:
        """Linear-path noise levels ``[s_min / (1 + s_min), s_max / (1 + s_max)]`` evaluated unclipped."""
        lo, hi = self.sigma_clip
        return lo / (1 + lo), hi / (1 + hi)

    def one_hot(self, class_labels: torch.Tensor | None, rows: int) -> torch.Tensor | None:
        """EDM's label input ``[b, label_dim]`` float32 from integer labels ``[b]`` (or ``None``).

        Raises:
            ValueError: labels for an unconditional net, none for a conditional one, wrong shape, or
                values outside ``[0, label_dim)``.
        """
        if self.label_dim == 0:
            if class_labels is not None:
                raise ValueError(
                    "class_labels were given but the network is unconditional (label_dim=0); drop the "
                    "labels or load a conditional checkpoint"
                )
            return None
        if class_labels is None:
            raise ValueError(
                f"the network is conditional (label_dim={self.label_dim}) but no class_labels were given; "
                f"EDM's conditional nets have no null class: pass cond={{'class_labels': long [b] in "
                f"[0, {self.label_dim})}}, e.g. drawn uniformly per image"
            )
        labels = torch.as_tensor(class_labels, device=self.device)
        if labels.ndim == 2 and labels.is_floating_point():
            if tuple(labels.shape) != (rows, self.label_dim):
                raise ValueError(
                    f"class_labels of shape {tuple(labels.shape)} are invalid: one-hot labels must be "
                    f"[{rows}, {self.label_dim}]"
                )
            return labels.to(torch.float32)
        if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
            raise ValueError(f"class_labels of dtype {labels.dtype} are invalid: use integer class ids [b]")
        labels = labels.reshape(-1)
        if labels.numel() != rows:
            raise ValueError(f"class_labels with {labels.numel()} entries are invalid for a batch of {rows} rows")
        check_label_range(labels, self.label_dim)
        return torch.nn.functional.one_hot(labels.long(), self.label_dim).to(torch.float32)

    def denoise(self, x: torch.Tensor, sigma: torch.Tensor, **cond) -> torch.Tensor:
        """Posterior mean ``E[x0 | x_sigma = x]`` from the network, at the clipped level.

        Args:
            x: ``[b, *event]`` states on the linear path.
            sigma: ``[b]`` noise levels in ``(0, 1]``.
            **cond: ``class_labels`` and other network keywords.

        Returns:
            ``[b, *event]`` in the working dtype (at least float32).
        """
        wide = torch.promote_types(x.dtype, torch.float32)
        xw = x.to(self.device, wide)
        sig = sigma.to(self.device, wide).reshape(-1)
        lo, hi = self.sigma_clip
        s = (sig / (1.0 - sig)).nan_to_num(posinf=hi).clamp(lo, hi)  # sigma = 1 -> inf -> s_max
        y = xw * (1.0 + s).reshape((-1,) + (1,) * (xw.ndim - 1))
        cond = dict(cond)
        labels = self.one_hot(cond.pop("class_labels", None), xw.shape[0])
        kwargs = dict(cond)
        if self.label_dim:
            kwargs["class_labels"] = labels
        autocast = (
            torch.autocast(device_type=self.device.type, dtype=self.net_dtype)
            if self.net_dtype in (torch.float16, torch.bfloat16)
            else contextlib.nullcontext()
        )
        with torch.no_grad(), autocast:
            d = self.net(y, s, **kwargs)
        return d.to(wide)

    def __call__(self, x: torch.Tensor, sigma: torch.Tensor, **cond) -> torch.Tensor:
        """Velocity ``v(x, sigma) = (x - E[x0 | x]) / sigma`` on the linear path.

        Args:
            x: ``[b, *event]`` states (``x_sigma = (1 - sigma) x0 + sigma xi``).
            sigma: ``[b]`` noise levels in ``(0, 1]`` (``sigma = 0`` divides by zero; the samplers
                never evaluate it).
            **cond: ``class_labels`` long ``[b]`` for conditional nets; other network keywords.

        Returns:
            ``[b, *event]`` velocities in ``x``'s dtype.

        Raises:
            ValueError: missing, unexpected or out-of-range class labels.
        """
        wide = torch.promote_types(x.dtype, torch.float32)
        d = self.denoise(x, sigma, **cond)
        xw = x.to(self.device, wide)
        sig = sigma.to(self.device, wide).reshape((-1,) + (1,) * (xw.ndim - 1))
        return ((xw - d) / sig).to(x.dtype)

    def __repr__(self) -> str:
        return (
            f"EDMVelocity(net={type(self.net).__name__}, event_shape={self.event_shape}, label_dim={self.label_dim}, "
            f"dtype={self.dtype}, net_dtype={self.net_dtype}, device={self.device})"
        )


def uniform_labels(ids: torch.Tensor, seed: int, classes: int) -> torch.Tensor:
    """Class label of each image, uniform over ``classes``, keyed by ``(seed, image index)``.

    So an image keeps its label whatever the batch or shard it runs in, and every rule sees the same
    (label, noise) pairs. ``ids`` long ``[m]`` -> long ``[m]`` in ``[0, classes)``.
    """
    u = rng.uniform(rng.base_key(seed, ids, "label", device=ids.device), 1)[:, 0]
    return (u * classes).long().clamp(max=classes - 1)


@dataclass
class EDMConfig(TargetConfig):
    """``conf/model/cifar10.yaml``, ``ffhq.yaml``, ``digits.yaml``, ``patches32.yaml``: an EDM checkpoint as a target
    (section 5.2).

    Attributes:
        name: key of :data:`CHECKPOINTS` (gives the URL and, when known, the SHA-256).
        url: download address (overrides the table's).
        path: local file; takes precedence over the cache location of ``name``/``url``.
        sha256: expected hash of the pickle (overrides the table's).
        cache_dir: cache root (default ``$SPECSAMP_CACHE`` or ``~/.cache/specsamp``).
        trust_checkpoint: load without a matching hash.
        download: allow downloading a missing URL.
        key: entry of the pickled dict (``ema``).
        net_dtype: autocast dtype of the network (``float16``/``bfloat16``/null).
        label_dim: check of the net's number of classes (null: the net's).
        labels: ``uniform`` (one class per image, :func:`uniform_labels`) for a conditional net, ``none``
            for an unconditional one.
        fid_ref: FID reference statistics (a :data:`specsamp.metrics.fid_inputs.REFERENCE_STATS` name, URL or path).
        fid_extractor, fid_layer, fid_weights: :func:`specsamp.metrics.fid.compute_fid`'s
            ``feature_extractor``, ``feature_layer``, ``weights_path`` (null: its defaults).
        max_batch: rows per forward pass (null: all at once).
    """

    _target_: str = "specsamp.models.edm.EDMConfig"
    url: str | None = None
    path: str | None = None
    sha256: str | None = None
    cache_dir: str | None = None
    trust_checkpoint: bool = False
    download: bool = True
    key: str | None = "ema"
    net_dtype: str | None = None
    label_dim: int | None = None
    labels: str | None = "none"
    fid_ref: str | None = None
    fid_extractor: str | None = None
    fid_layer: str | None = None
    fid_weights: str | None = None
    max_batch: int | None = None

    def fid_settings(self) -> dict:
        """:func:`specsamp.metrics.fid.compute_fid` keyword arguments from ``fid_extractor``/``fid_layer``/``fid_weights``."""
        pairs = (
            ("feature_extractor", self.fid_extractor),
            ("feature_layer", self.fid_layer),
            ("weights_path", self.fid_weights),
        )
        return {arg: v for arg, v in pairs if v is not None}

    def build(self, device: str) -> Target:
        """Load the checkpoint (checksum first, :func:`load_edm`) and wrap it in :class:`EDMVelocity`.

        Raises:
            ConfigError: a bad ``dtype``, ``net_dtype``, ``labels`` or ``max_batch``, an unknown ``name``
                without ``url``/``path``, labels that do not fit the net.
            FileNotFoundError, CheckpointTrustError, CheckpointFormatError: see :func:`load_edm`.
        """
        if str(self.dtype).removeprefix("torch.") in ("float16", "bfloat16"):
            raise ConfigError(
                f"model.dtype={self.dtype!r} is invalid for an EDM network: model.dtype is the sampler's "
                "state dtype, float32 or float64; to run the network "
                f"itself in half precision, keep model.dtype=float32 and set model.net_dtype={self.dtype}."
            )
        dtype = self.torch_dtype("dtype", ("float32", "float64"))
        if self.net_dtype is not None and str(self.net_dtype).removeprefix("torch.") not in NET_DTYPES:
            raise ConfigError(
                f"model.net_dtype={self.net_dtype!r} is invalid: valid values are {', '.join(NET_DTYPES)} "
                "(the network under torch.autocast in half precision) or null (the network in model.dtype)."
            )
        net_dtype = self.torch_dtype("net_dtype", NET_DTYPES)
        check_positive("max_batch", self.max_batch, optional=True)
        if self.labels not in ("uniform", "none", None):
            raise ConfigError(f"model.labels={self.labels!r} is invalid: valid values are uniform, none.")
        known = CHECKPOINTS.get(self.name)
        if known is None and self.url is None and self.path is None:
            raise ConfigError(
                f"model.name={self.name!r} is not a known EDM checkpoint; valid: {', '.join(sorted(CHECKPOINTS))} "
                "(or give model.url / model.path)."
            )
        net = load_edm(
            self.path or self.url or known.url,
            sha256=self.sha256 or (known.sha256 if known else None),
            cache_dir=self.cache_dir,
            trust_checkpoint=self.trust_checkpoint,
            download=self.download,
            key=self.key,
            map_location=device,
        )
        model = EDMVelocity(net, label_dim=self.label_dim, dtype=dtype, net_dtype=net_dtype, device=device)
        cond_for = None
        if self.labels == "uniform" and not model.label_dim:
            raise ConfigError("model.labels='uniform' is invalid for an unconditional net (label_dim=0): use none.")
        if model.label_dim:
            if self.labels != "uniform":
                raise ConfigError(
                    f"model.labels={self.labels!r} is invalid for a class-conditional net "
                    f"(label_dim={model.label_dim}): use uniform."
                )
            cond_for = lambda ids, seed: {"class_labels": uniform_labels(ids, seed, model.label_dim)}  # noqa: E731
        return Target(
            model,
            cond_for=cond_for,
            decode=lambda x: x.float().clamp(-1, 1),
            fid_ref=self.fid_ref,
            fid=self.fid_settings(),
            max_batch=self.max_batch,
        )
