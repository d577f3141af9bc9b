"""NVIDIA EDM denoisers behind the velocity interface, and a checked loader for their pickles.

Change of variables (paper section 5.2). EDM's denoiser works on the variance-exploding
scale ``y = x0 + s xi`` and returns ``D(y; s) = E[x0 | y]``. The linear path
``x = (1 - sigma) x0 + sigma xi`` divided by ``1 - sigma`` *is* that scale with ``s = sigma / (1 - sigma)``,
so ``D(x / (1 - sigma); s) = E[x0 | x_sigma = x]``. With ``v = d x / d sigma = xi - x0`` and
``E[xi | x] = (x - (1 - sigma) E[x0 | x]) / sigma``::

    v(x, sigma) = E[xi - x0 | x] = (x - D(x / (1 - sigma); sigma / (1 - sigma))) / sigma.

The paper prints ``v = x / t - D(x / (1 - t); t / (1 - t))``: the ``1 / t`` must divide ``D`` as well
(the printed form is not the velocity of the linear path; :mod:`tests.test_edm` checks the form used
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
import hashlib
import os
import pickle
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from . import nvlabs_compat

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
# these files and we could not establish them from a public source offline, so sha256 is None: loading
# them needs either sha256=<hash you computed from a copy you trust> or trust_checkpoint=true. Fill in
# the hash here once it has been verified.
CHECKPOINTS: dict[str, Checkpoint] = {
    "edm-cifar10-32x32-cond-vp": Checkpoint(_EDM_CDN + "edm-cifar10-32x32-cond-vp.pkl", None, 10, 32),
    "edm-ffhq-64x64-uncond-vp": Checkpoint(_EDM_CDN + "edm-ffhq-64x64-uncond-vp.pkl", None, 0, 64),
    # shipped with the package: trained on scikit-learn's digits by experiments/train_digits.py (specsamp.models.digits)
    "edm-digits-8x8-cond": Checkpoint(
        (Path(__file__).resolve().parents[1] / "data" / "edm-digits-8x8-cond.pkl").as_uri(), "ee0542d9eb229546125fbc0fa58a689dacf195454034ccd26cae8da09dd53b16", 10, 8
    ),
}


class CheckpointTrustError(ValueError):
    """A checkpoint's SHA-256 differs from the configured one, or no hash is configured."""


class CheckpointFormatError(ValueError):
    """A (trusted) checkpoint file that is not a loadable EDM network pickle: empty, truncated, a zip."""


# ----------------------------------------------------------------------------------------------
# files: cache, download, checksum (shared with specsamp.metrics.fid)


def default_cache_dir() -> Path:
    """Cache directory: ``$SPECSAMP_CACHE``, else ``$XDG_CACHE_HOME/specsamp``, else ``~/.cache/specsamp``."""
    env = os.environ.get("SPECSAMP_CACHE")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "specsamp"


def file_sha256(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    """Hex SHA-256 of a file, read in chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(chunk), b""):
            h.update(block)
    return h.hexdigest()


def _is_url(s: str) -> bool:
    return urllib.parse.urlparse(str(s)).scheme in ("http", "https", "ftp", "file")


def _offline() -> bool:
    return os.environ.get("SPECSAMP_OFFLINE", "").lower() in ("1", "true", "yes")


def _download(url: str, dest: Path, sha256: str | None, timeout: float = 60.0) -> None:
    """Stream ``url`` to ``dest`` through a temporary file and an atomic rename."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=dest.name + ".", suffix=".part")
    h = hashlib.sha256()
    try:
        with os.fdopen(fd, "wb") as out, urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310
            for block in iter(lambda: resp.read(1 << 20), b""):
                out.write(block)
                h.update(block)
        if sha256 is not None and h.hexdigest() != sha256.lower():
            raise CheckpointTrustError(
                f"download of {url} has SHA-256 {h.hexdigest()}, expected {sha256}; file discarded"
            )
        os.replace(tmp, dest)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)


def resolve_path(
    path_or_url: str | os.PathLike,
    *,
    cache_dir: str | os.PathLike | None = None,
    download: bool = True,
    sha256: str | None = None,
    subdir: str = "",
) -> Path:
    """Local file for a path or URL; a URL maps to ``<cache_dir>/<subdir>/<basename>``.

    A URL whose cache file is absent is downloaded when ``download`` is true and ``SPECSAMP_OFFLINE``
    is not set (written to a temporary file, checked against ``sha256`` when given, then renamed).

    Args:
        path_or_url: local path, or ``http(s)://`` / ``file://`` URL.
        cache_dir: cache root (default :func:`default_cache_dir`).
        download: allow a download attempt.
        sha256: expected hash, checked on download only (callers check cached files themselves).
        subdir: folder under the cache root.

    Returns:
        Path of an existing file.

    Raises:
        FileNotFoundError: the file is absent and could not be downloaded; the message gives the URL
            and the path looked in.
    """
    s = os.fspath(path_or_url)
    if not _is_url(s):
        p = Path(s).expanduser()
        if not p.is_file():
            raise FileNotFoundError(f"no file at path={str(p)!r}")
        return p
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    name = Path(urllib.parse.urlparse(s).path).name or hashlib.sha256(s.encode()).hexdigest()[:16]
    dest = root / subdir / name
    if dest.is_file():
        return dest
    if urllib.parse.urlparse(s).scheme == "file":
        p = Path(urllib.request.url2pathname(urllib.parse.urlparse(s).path))
        if p.is_file():
            return p
        raise FileNotFoundError(f"no file at {s!r}")
    why = "downloads are disabled (download=False)" if not download else "SPECSAMP_OFFLINE is set"
    if download and not _offline():
        try:
            _download(s, dest, sha256)
            return dest
        except (urllib.error.URLError, OSError, TimeoutError) as err:
            why = f"download failed: {err}"
    raise FileNotFoundError(
        f"{s} is not in the cache (looked for {str(dest)!r}) and {why}. Fetch the file on a machine with "
        f"network access and copy it to that path, or pass its local path instead of the URL (model.path=...) "
        f"(cache root: cache_dir= or $SPECSAMP_CACHE)."
    )


def verify_sha256(path: str | os.PathLike, sha256: str | None, *, trust: bool = False, what: str = "checkpoint") -> str:
    """Check a file's SHA-256 before it is used; return the actual hash.

    Args:
        path: the file.
        sha256: expected hex digest (case-insensitive), or ``None`` when unknown.
        trust: accept a mismatching or unknown hash (the user vouches for the file).
        what: noun for messages.

    Raises:
        CheckpointTrustError: hash unknown or different, and ``trust`` is false.
    """
    actual = file_sha256(path)
    if trust:
        return actual
    if sha256 is None:
        raise CheckpointTrustError(
            f"refusing to load {what} {str(path)!r}: no expected SHA-256 is configured and a pickle runs "
            f"code when loaded. Its SHA-256 is {actual}; if this copy came from a source you trust, pin it "
            f"with model.sha256={actual} (Python: sha256='{actual}'), or load it once unpinned with "
            f"model.trust_checkpoint=true (Python: trust_checkpoint=True)."
        )
    if actual != str(sha256).lower():
        raise CheckpointTrustError(
            f"refusing to load {what} {str(path)!r}: SHA-256 {actual} != expected model.sha256={sha256}. The "
            f"file is corrupt, truncated or not the one configured; nothing was unpickled. Pass "
            f"model.trust_checkpoint=true (Python: trust_checkpoint=True) only if you know where this file comes from."
        )
    return actual


# ----------------------------------------------------------------------------------------------
# loading


def _lookup(path_or_url: str) -> Checkpoint | None:
    s = os.fspath(path_or_url)
    if s in CHECKPOINTS:
        return CHECKPOINTS[s]
    base = Path(urllib.parse.urlparse(s).path).name if _is_url(s) else Path(s).name
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
        raise FileNotFoundError(f"{err}{hint}") from None
    verify_sha256(path, expected, trust=trust_checkpoint)
    obj = _unpickle(path)
    if key is not None and isinstance(obj, dict):
        if key not in obj:
            raise CheckpointFormatError(f"model.key={key!r} is not in checkpoint {str(path)!r}; its keys: {sorted(obj)}")
        obj = obj[key]
    if isinstance(obj, torch.nn.Module):
        obj = obj.eval().requires_grad_(False)
        if map_location is not None:
            obj = obj.to(map_location)
    return obj


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
            return pickle.load(f)  # noqa: S301 - checksum verified (or explicitly trusted) by the caller
    except Exception as err:  # noqa: BLE001 - a pickle can raise anything; all mean "not a loadable network"
        cause = "truncated (it ends before the pickle does)" if isinstance(err, EOFError) else "not a loadable EDM network pickle"
        raise CheckpointFormatError(
            f"{what} could not be unpickled: it is {cause} ({type(err).__name__}: {err}). Fetch the file again "
            f"and check its SHA-256 against a copy you trust."
        ) from None


# ----------------------------------------------------------------------------------------------
# the velocity adapter


def _resolve_dtype(name: str, value) -> torch.dtype | None:
    if value is None or isinstance(value, torch.dtype):
        return value
    table = {
        "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
        "float64": torch.float64, "fp64": torch.float64, "double": torch.float64,
        "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
        "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    }
    key = str(value).removeprefix("torch.").lower()
    if key in ("none", "null", ""):
        return None
    if key not in table:
        raise ValueError(f"{name}={value!r} is invalid; valid: {sorted(table)} or null")
    return table[key]


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
        self.dtype = _resolve_dtype("dtype", dtype)
        if self.dtype not in (torch.float32, torch.float64):
            raise ValueError(f"dtype={dtype!r} is invalid: sampler states must be float32 or float64")
        self.net_dtype = _resolve_dtype("net_dtype", net_dtype)
        if self.net_dtype not in (None, torch.float16, torch.bfloat16, torch.float32, torch.float64):
            raise ValueError(f"net_dtype={net_dtype!r} is invalid: use float16, bfloat16 or null")
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
        lo, hi = int(labels.min()), int(labels.max())
        if lo < 0 or hi >= self.label_dim:
            raise ValueError(f"class_labels range [{lo}, {hi}] is invalid: ids must lie in [0, {self.label_dim})")
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


BUILD_KEYS = ("name", "url", "path", "sha256", "cache_dir", "trust_checkpoint", "download", "dtype", "net_dtype",
              "device", "label_dim", "key")
"""Keys :func:`build_edm_model` reads."""


def build_edm_model(cfg: Mapping) -> EDMVelocity:
    """Build an :class:`EDMVelocity` from a config mapping (e.g. Hydra ``conf/model/cifar10.yaml``).

    Keys (all optional except one of ``name``/``url``/``path``):

    - ``name``: key of :data:`CHECKPOINTS` (gives the URL and, when known, the SHA-256).
    - ``url``: download address (overrides the table's).
    - ``path``: local file; takes precedence over the cache location of ``name``/``url``.
    - ``sha256``: expected hash (overrides the table's).
    - ``cache_dir``: cache root (default ``$SPECSAMP_CACHE`` or ``~/.cache/specsamp``).
    - ``trust_checkpoint``: load without a matching hash (default false).
    - ``download``: allow downloading a missing URL (default true).
    - ``dtype``: sampler state dtype (default ``float32``).
    - ``net_dtype``: autocast dtype of the network (``float16``/``bfloat16``/null).
    - ``device``: e.g. ``cuda`` or ``cpu`` (default: ``cuda`` when available).
    - ``label_dim``: override/check of the net's number of classes.
    - ``key``: entry of the pickled dict (default ``ema``).

    ``_target_`` and ``kind`` are ignored; any other key is refused, so that a misspelt key cannot be
    silently dropped.

    Raises:
        ValueError: an unknown key, none of ``name``/``url``/``path`` given, or an unknown ``name``.
        FileNotFoundError, CheckpointTrustError: see :func:`load_edm`.
    """
    cfg = dict(cfg)
    unknown = sorted(set(cfg) - set(BUILD_KEYS) - {"_target_", "kind"})
    if unknown:
        raise ValueError(f"model.{unknown[0]}={cfg[unknown[0]]!r} is not a key of an EDM model; valid: {', '.join(BUILD_KEYS)}")
    name, url, path = cfg.get("name"), cfg.get("url"), cfg.get("path")
    known = None
    if name is not None and (url is None and path is None):
        if name not in CHECKPOINTS:
            raise ValueError(f"model.name={name!r} is not a known EDM checkpoint; valid: {sorted(CHECKPOINTS)} "
                             f"(or give model.url / model.path)")
    if name is not None and name in CHECKPOINTS:
        known = CHECKPOINTS[name]
    source = path or url or (known.url if known else None)
    if source is None:
        raise ValueError("model config needs one of name, url or path; got none")
    sha = cfg.get("sha256") or (known.sha256 if known else None)
    device = cfg.get("device") or ("cuda" if torch.cuda.is_available() else "cpu")
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"model.device={device!r} is invalid: CUDA is not available here; use cpu")
    for flag, default in (("trust_checkpoint", False), ("download", True)):
        if not isinstance(cfg.get(flag, default), bool):
            raise ValueError(f"model.{flag}={cfg.get(flag)!r} is invalid: must be true or false")
    net = load_edm(
        source,
        sha256=sha,
        cache_dir=cfg.get("cache_dir"),
        trust_checkpoint=cfg.get("trust_checkpoint", False),
        download=cfg.get("download", True),
        key=cfg.get("key", "ema"),
        map_location=device,
    )
    return EDMVelocity(
        net,
        label_dim=cfg.get("label_dim"),
        dtype=cfg.get("dtype") or torch.float32,
        net_dtype=cfg.get("net_dtype"),
        device=device,
    )
