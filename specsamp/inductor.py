"""Whether this machine can compile the dense round (``compile=true``), checked before anything is sampled.

A compile needs a TorchDynamo that supports this Python, a compiler for inductor's kernels (a C/C++ compiler on
the CPU, Triton on CUDA) and a cache directory that is writable, has free space and is mounted with exec
permission (inductor builds each kernel there into a ``.so`` and loads it from there). A configuration fault
(no compiler, no Triton, ``compile=true`` with the path execution) is a ``ConfigError`` (exit status 2); a cache
directory that cannot serve, before or during the compile, is a machine fault, ``InfrastructureError`` (exit 3).
Nothing here imports the round's modules.
"""

from __future__ import annotations

import errno
import shutil
import sys

import torch

from .errors import ConfigError, InfrastructureError, error_chain

COMPILERS = ("cc", "gcc", "g++", "c++", "clang", "clang++")  # any of these on PATH builds inductor's CPU kernels
CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"
CACHE_FAULT = "compile=true cannot use inductor's cache directory"  # how cache_fault's paragraph begins
PROBE_BYTES = 1 << 20  # written and removed by check_cache_dir: a compile writes kernels of this order
NOEXEC_SIGNS = ("failed to map segment from shared object", "Operation not permitted")  # dlopen on a noexec mount
# errnos that say the cache's file system refuses the compile's files (read-only, full, a file in the path, ...)
CACHE_ERRNOS = frozenset(
    getattr(errno, n)
    for n in ("EROFS", "EACCES", "EPERM", "ENOSPC", "EDQUOT", "EFBIG", "EIO", "ENOTDIR", "EEXIST", "ENOENT")
    if hasattr(errno, n)
)


def unavailable(device) -> str | None:
    """Why ``torch.compile`` cannot compile the dense round on ``device`` here, or None where it can.

    Cheap checks only (nothing is compiled): TorchDynamo supports this Python; on the CPU, inductor finds a C
    compiler (``$CXX`` or one of :data:`COMPILERS` on ``PATH``); on CUDA, Triton imports.

    Args:
        device: a ``torch.device`` or its name.

    Returns:
        None, or one sentence naming what is missing (for a cache directory TorchDynamo cannot create on import,
        :func:`cache_fault`'s paragraph, which :func:`check_compile` raises as a machine fault).
    """
    dev = torch.device(device)
    if not hasattr(torch, "compile"):
        return f"this torch ({torch.__version__}) has no torch.compile"
    try:
        from torch._dynamo.eval_frame import is_dynamo_supported

        supported = is_dynamo_supported()
    except OSError as e:  # importing TorchDynamo creates inductor's cache directory: a machine fault, not the versions
        return str(cache_fault(inductor_cache_dir(), e))
    except Exception:  # noqa: BLE001  (any failure means it cannot run)
        supported = False
    if not supported:
        return f"torch.compile does not support Python {sys.version.split()[0]} with torch {torch.__version__}"
    if dev.type == "cpu":
        import os

        cxx = os.environ.get("CXX")
        if not (cxx and shutil.which(cxx)) and not any(shutil.which(c) for c in COMPILERS):
            return (
                "inductor's CPU backend needs a C/C++ compiler on PATH (none of $CXX, "
                + ", ".join(COMPILERS)
                + " found)"
            )
        return None
    if dev.type == "cuda":
        try:
            from torch.utils._triton import has_triton

            ok = has_triton()
        except Exception:  # noqa: BLE001
            ok = False
        return None if ok else "inductor's CUDA backend needs Triton, which does not import here"
    return f"torch.compile of the dense round is supported on cpu and cuda only, not {dev.type}"


def check_compile(compile, execution: str, device, *, here: bool = True) -> bool:
    """``compile`` checked against the execution and the device: a bool, ``False`` or usable here
    (``here=False``: the device is not checked, for a run that another machine executes).

    Raises:
        ConfigError: ``compile`` not a bool; ``compile=True`` with ``execution="path"`` (whose rounds evaluate
            a varying number of nodes one by one, with nothing static to compile), or where
            :func:`unavailable` gives a reason.
        InfrastructureError: inductor's cache directory cannot serve a compile (:func:`check_cache_dir`).
    """
    if not isinstance(compile, bool):
        raise ConfigError(
            f"compile={compile!r} is invalid: must be true or false (run the dense round under torch.compile)."
        )
    if not compile:
        return False
    if execution != "tree":
        raise ConfigError(
            f"compile=true is invalid with execution={execution}: only the tree execution's round has "
            "static shapes to compile (every node of every row, one batched call); set execution=tree, "
            "or compile=false."
        )
    if here:
        check_cache_dir()
    why = unavailable(device) if here else None
    if why is not None and why.startswith(CACHE_FAULT):
        raise InfrastructureError(why)
    if why is not None:
        raise ConfigError(f"compile=true is invalid here: {why}; set compile=false (the eager round, the same law).")
    return True


def inductor_cache_dir() -> str:
    """The directory inductor compiles into and loads the compiled kernels from: ``$TORCHINDUCTOR_CACHE_DIR``, else
    ``torchinductor_<user>`` in the temporary directory (inductor's own default, computed here without importing
    TorchDynamo, whose import already creates it)."""
    import getpass
    import os
    import re
    import tempfile

    d = os.environ.get(CACHE_ENV)
    if not d:
        try:
            user = getpass.getuser()
        except (KeyError, ModuleNotFoundError, OSError):
            user = f"uid_{os.getuid()}" if hasattr(os, "getuid") else "unknown_user"
        d = os.path.join(tempfile.gettempdir(), "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user))
    return os.path.abspath(d)


def cache_fault(directory: str, why) -> InfrastructureError:
    """The one paragraph (exit status 3) for an inductor cache directory that cannot serve a compile.

    Args:
        directory: the cache directory.
        why: the ``OSError`` met there, or a sentence.
    """
    import os

    if isinstance(why, OSError) and why.errno:
        where = f" ({why.filename})" if why.filename and os.path.abspath(str(why.filename)) != directory else ""
        why = f"{os.strerror(why.errno)} [errno {why.errno}]{where}"
    return InfrastructureError(
        f"{CACHE_FAULT} {directory}: {why}. torch.compile writes the compiled "
        f"kernels there and loads them from it, so it needs a writable directory with free space on a file system "
        f"mounted with exec permission. This is a problem of the machine, not of the configuration: set "
        f"{CACHE_ENV} to such a directory (e.g. {CACHE_ENV}=$HOME/.cache/torchinductor), free space there, or run "
        f"with compile=false (the eager round, the same law)."
    )


def check_cache_dir() -> str:
    """Check, before anything is sampled, that inductor's cache directory (:func:`inductor_cache_dir`) can serve a
    compile: it can be created, a file of :data:`PROBE_BYTES` can be written there (and is removed), and its file
    system is not mounted ``noexec`` (inductor builds each kernel into a ``.so`` there and loads it with dlopen,
    which a noexec mount refuses).

    Returns:
        The directory.

    Raises:
        InfrastructureError: one paragraph naming the directory and ``TORCHINDUCTOR_CACHE_DIR``.
    """
    import os
    import tempfile

    d = inductor_cache_dir()
    try:
        os.makedirs(d, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=d, prefix=".specsamp-probe-") as f:
            f.write(b"\0" * PROBE_BYTES)
            f.flush()
            os.fsync(f.fileno())
        noexec = bool(os.statvfs(d).f_flag & getattr(os, "ST_NOEXEC", 0))
    except OSError as e:
        raise cache_fault(d, e) from None
    if noexec:
        raise cache_fault(
            d, "its file system is mounted noexec, so the compiled kernels (.so files) could be written but not loaded"
        )
    return d


def classify_compile_error(error: BaseException) -> InfrastructureError | None:
    """The machine fault behind an exception raised while compiling the round, or None (not the cache's doing).

    A fault of the cache directory: an ``OSError`` of :data:`CACHE_ERRNOS` on a file inside it (or, for a full
    disk, on no named file); a kernel library inside it that dlopen cannot map (:data:`NOEXEC_SIGNS`: a noexec
    mount); "No space left on device" in a compiler's output. Inductor wraps the original error (its
    ``InductorError`` repeats the message), so the error's cause/context chain and messages are read.
    """
    import os

    d = inductor_cache_dir()
    for e in error_chain(error):
        text = str(e)
        if any(sign in text for sign in NOEXEC_SIGNS) and (d in text or ".so" in text):
            return cache_fault(
                d,
                "a compiled kernel written there cannot be loaded (dlopen: "
                f"{' '.join(text.split())[:300]}); the usual cause is a file system mounted noexec",
            )
        if isinstance(e, OSError) and e.errno in CACHE_ERRNOS:
            name = os.path.abspath(str(e.filename)) if e.filename else None
            if (name is not None and (name == d or name.startswith(d + os.sep))) or (
                name is None and e.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", -1))
            ):
                return cache_fault(d, e)
        if "No space left on device" in text:
            return cache_fault(d, "No space left on device [errno 28] while compiling")
    return None
