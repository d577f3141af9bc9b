"""Files from elsewhere: the cache directory, downloads, SHA-256 checks and hub reachability probes.

Every adapter and metric that fetches weights or reference statistics goes through this module
(:mod:`specsamp.models.edm`, :mod:`specsamp.models.sd3`, :mod:`specsamp.metrics.fid`,
:mod:`specsamp.metrics.clip`). Checkpoints that are pickles run code when loaded, so the rule is:
hash the file first (:func:`verify_sha256`) and refuse it unless its SHA-256 equals a configured
value, or the user vouched for it (``trust_checkpoint=true``).

Environment: ``SPECSAMP_CACHE`` (cache root), ``SPECSAMP_OFFLINE=1`` (never download),
``HF_HUB_OFFLINE=1`` and ``HF_ENDPOINT`` (Hugging Face Hub), ``HTTPS_PROXY``/``ALL_PROXY``.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import socket
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path


class CheckpointTrustError(ValueError):
    """A file's SHA-256 differs from the configured one, or no hash is configured."""


def env_true(name: str) -> bool:
    """Whether the environment variable ``name`` is set to 1, on, yes or true (any case)."""
    return os.environ.get(name, "").strip().upper() in ("1", "ON", "YES", "TRUE")


def offline() -> bool:
    """Whether ``SPECSAMP_OFFLINE`` forbids downloads."""
    return env_true("SPECSAMP_OFFLINE")


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


def is_url(s) -> bool:
    """Whether ``s`` is an ``http(s)``, ``ftp`` or ``file`` URL."""
    return urllib.parse.urlparse(str(s)).scheme in ("http", "https", "ftp", "file")


def fetch(url: str, dest: Path, sha256: str | None, timeout: float = 60.0) -> None:
    """Stream ``url`` to ``dest`` through a temporary file, check ``sha256`` (if given), rename atomically.

    Raises:
        CheckpointTrustError: the download's hash differs from ``sha256`` (the file is discarded).
        OSError: the download failed.
    """
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=dest.name + ".", suffix=".part")
    h = hashlib.sha256()
    try:
        with os.fdopen(fd, "wb") as out, urllib.request.urlopen(url, timeout=timeout) as resp:
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
        sha256: expected hash, checked on download only (callers check cached files with
            :func:`verify_sha256`).
        subdir: folder under the cache root.

    Returns:
        Path of an existing file.

    Raises:
        FileNotFoundError: the file is absent and could not be downloaded; the message gives the URL
            and the path looked in.
    """
    s = os.fspath(path_or_url)
    if not is_url(s):
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
    if download and not offline():
        try:
            fetch(s, dest, sha256)
            return dest
        except (urllib.error.URLError, OSError, TimeoutError) as err:
            why = f"download failed: {err}"
    raise FileNotFoundError(
        f"{s} is not in the cache (looked for {str(dest)!r}) and {why}. Fetch the file where the network is "
        f"reachable and copy it to that path, or pass its local path instead of the URL (model.path=...) "
        f"(cache root: model.cache_dir=..., cache_dir= in Python, or $SPECSAMP_CACHE)."
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


def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether a TCP connection to the Hugging Face Hub (``HF_ENDPOINT``) opens within ``timeout`` seconds.

    Behind an HTTPS proxy (``HTTPS_PROXY``/``ALL_PROXY`` set) the hub is assumed reachable.
    """
    if any(os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return True
    url = urllib.parse.urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    port = url.port or (80 if url.scheme == "http" else 443)
    try:
        with socket.create_connection((url.hostname or "huggingface.co", port), timeout=timeout):
            return True
    except OSError:
        return False


def hub_offline(local_files_only: bool | None = None) -> bool:
    """Whether to stay off the Hugging Face Hub.

    Args:
        local_files_only: an explicit choice, or None for automatic.

    Returns:
        ``local_files_only`` if given, else True when ``HF_HUB_OFFLINE`` is set or :func:`hub_reachable` fails
        (so an unreachable hub gives an error in seconds rather than minutes of retries).
    """
    if local_files_only is not None:
        return bool(local_files_only)
    return env_true("HF_HUB_OFFLINE") or not hub_reachable()


def hub_offline_reason(local_files_only: bool | None) -> str:
    """Why :func:`hub_offline` said so, for messages."""
    if local_files_only:
        return "local_files_only=True"
    return "HF_HUB_OFFLINE is set" if env_true("HF_HUB_OFFLINE") else "the Hugging Face Hub is unreachable"
