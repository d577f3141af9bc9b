"""Atomic file writes: a temporary file in the target's directory, fsync, then ``os.replace``.

A reader (or a relaunched sweep) sees either the old file or the complete new one, never a torn write;
a crash leaves at most a hidden ``.NAME.*.tmp`` file behind.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _storage_error(error: BaseException) -> OSError | None:
    """The ``OSError`` behind ``error`` (itself, or its cause or context), if any."""
    for _ in range(8):
        if error is None:
            return None
        if isinstance(error, OSError):
            return error
        error = error.__cause__ or error.__context__
    return None


def atomic_write(path: str | os.PathLike, write: Callable[[IO], None], mode: str = "wb") -> Path:
    """Write ``path`` atomically with ``write(file)``.

    Args:
        path: destination (its directory is created).
        write: called with the open temporary file.
        mode: ``"wb"`` or ``"w"``.

    Returns:
        The destination path.

    Raises:
        OSError: the directory cannot be created or the file cannot be written (disk full, read-only
            file system, no permission); ``filename`` is the destination ``path`` whatever step failed,
            and nothing is left behind (the old file, if any, is unchanged).
    """
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as e:
        raise OSError(e.errno, e.strerror, str(path)) from e
    try:
        with os.fdopen(fd, mode) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; results are for colleagues too
        os.replace(tmp, path)
    except Exception as e:
        Path(tmp).unlink(missing_ok=True)
        cause = _storage_error(e)  # torch.save wraps a full disk in a RuntimeError
        if cause is None:
            raise
        raise OSError(cause.errno, cause.strerror, str(path)) from e
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_json_atomic(path: str | os.PathLike, obj) -> None:
    """Write ``obj`` as indented JSON to ``path`` atomically (non-JSON values via ``str``)."""
    atomic_write(path, lambda f: json.dump(obj, f, indent=2, default=str), mode="w")


def torch_save_atomic(path: str | os.PathLike, obj) -> None:
    """``torch.save(obj)`` to ``path`` atomically."""
    import torch

    atomic_write(path, lambda f: torch.save(obj, f))
