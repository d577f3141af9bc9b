"""The lean round under ``torch.compile`` (``compile=true``): its tensor maths fused into kernels, the network outside.

:func:`specsamp.lean._lean_round` is compiled whole (inductor, ``dynamic=False``): the round's Python control
flow is unchanged, and TorchDynamo turns the pure tensor maths on either side of the batched target call
(drafting, verification, walk and the commit's gathers) into compiled graphs. The call itself
(:func:`specsamp.lean._network`) runs outside them: a model need not be compilable, and the number of rows it
evaluates varies from round to round, while every shape the graphs see is static per tree (every row of the
batch is kept in every round, finished rows padded). So each distinct tree (and batch size, dtype, device)
compiles once per process, and the round keeps its one host synchronisation, in the loop's test.

What is guaranteed is the law: the same as the eager round's (the law tests run with compile on). Compiled
kernels may fuse and reorder float operations (a fused multiply-add rounds once where eager rounds twice), so a
compiled run's samples equal the eager run's to rounding, not bitwise, and its counts are identical wherever
that rounding flips no verdict (``tests/core/test_compiled.py``). Inductor's buffer reuse is off
(:data:`INDUCTOR_OPTIONS`): with it, a verification split into several chunks came out wrong.
"""

from __future__ import annotations

import errno
import shutil
import sys
from collections.abc import Callable

import torch

from .errors import ConfigError, InfrastructureError, error_chain
from .lean import _lean_round, _network_outside

COMPILERS = ("cc", "gcc", "g++", "c++", "clang", "clang++")  # any of these on PATH builds inductor's CPU kernels
RECOMPILE_LIMIT = 64  # distinct (tree, batch size, dtype) entries one process may compile before eager fallback
# Inductor's buffer reuse off: with it on (torch 2.14, CPU), the graph after the network call of a round whose
# verification ran in several chunks (leantree.bind) gave wrong verdicts and residual draws: not rounding, a
# different law (the same graph without inductor, and inductor with buffer reuse off alone, were exact). Without
# reuse and in-place buffers each kernel writes a buffer of its own: freed after its last use as before, only not
# recycled within the graph (tests/core/test_compiled.py, the several-chunk tests).
INDUCTOR_OPTIONS = (("allow_buffer_reuse", False), ("inplace_buffers", False))


def unavailable(device) -> str | None:
    """Why ``torch.compile`` cannot compile the lean round on ``device`` here, or None where it can.

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
            return "inductor's CPU backend needs a C/C++ compiler on PATH (none of $CXX, " + ", ".join(COMPILERS) + " found)"
        return None
    if dev.type == "cuda":
        try:
            from torch.utils._triton import has_triton

            ok = has_triton()
        except Exception:  # noqa: BLE001
            ok = False
        return None if ok else "inductor's CUDA backend needs Triton, which does not import here"
    return f"torch.compile of the lean round is supported on cpu and cuda only, not {dev.type}"


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
        raise ConfigError(f"compile={compile!r} is invalid: must be true or false (run the lean round under torch.compile).")
    if not compile:
        return False
    if execution != "tree":
        raise ConfigError(f"compile=true is invalid with execution={execution}: only the tree execution's round has "
                          "static shapes to compile (every node of every row, one batched call); set execution=tree, "
                          "or compile=false.")
    if here:
        check_cache_dir()
    why = unavailable(device) if here else None
    if why is not None and why.startswith(CACHE_FAULT):
        raise InfrastructureError(why)
    if why is not None:
        raise ConfigError(f"compile=true is invalid here: {why}; set compile=false (the eager round, the same law).")
    return True


CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"
CACHE_FAULT = "compile=true cannot use inductor's cache directory"  # how cache_fault's paragraph begins
PROBE_BYTES = 1 << 20  # written and removed by check_cache_dir: a compile writes kernels of this order
NOEXEC_SIGNS = ("failed to map segment from shared object", "Operation not permitted")  # dlopen on a noexec mount
# errnos that say the cache's file system refuses the compile's files (read-only, full, a file in the path, ...)
CACHE_ERRNOS = frozenset(getattr(errno, n) for n in ("EROFS", "EACCES", "EPERM", "ENOSPC", "EDQUOT", "EFBIG", "EIO",
                                                     "ENOTDIR", "EEXIST", "ENOENT") if hasattr(errno, n))


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
        f"with compile=false (the eager round, the same law).")


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
        raise cache_fault(d, "its file system is mounted noexec, so the compiled kernels (.so files) could be written "
                             "but not loaded")
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
            return cache_fault(d, "a compiled kernel written there cannot be loaded (dlopen: "
                                  f"{' '.join(text.split())[:300]}); the usual cause is a file system mounted noexec")
        if isinstance(e, OSError) and e.errno in CACHE_ERRNOS:
            name = os.path.abspath(str(e.filename)) if e.filename else None
            if (name is not None and (name == d or name.startswith(d + os.sep))) or (
                    name is None and e.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", -1))):
                return cache_fault(d, e)
        if "No space left on device" in text:
            return cache_fault(d, "No space left on device [errno 28] while compiling")
    return None


def _guarded(fn: Callable) -> Callable:
    """``fn`` (the compiled round), with a machine fault of the cache raised as :func:`cache_fault`'s paragraph."""
    import functools

    @functools.wraps(fn)
    def call(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            fault = classify_compile_error(e)
            if fault is None:
                raise
            raise fault from e

    return call


TRACED_COUPLINGS = ("dgrs", "rmc")  # registered couplings whose verify asks the host nothing: traced into the graphs
_OUTSIDE: dict = {}


def for_compile(coupling):
    """``coupling`` as the compiled round calls it: D-GRS and RMC (:data:`TRACED_COUPLINGS`, whose verification
    makes no host synchronisation and has static shapes) as they are, traced into the compiled graphs; any
    other rule (markmax, sync-free with static shapes too, but its fixed-step bisections fuse into C++ kernels
    that gcc 12 fails to build, an internal compiler error after 8 minutes on the (2, 3) tree; a rule of the
    user's is unknown) with its
    ``verify`` (and ``decide``) run outside them (``torch.compiler.disable``; the drafting, walk and commit are still compiled).

    Returns:
        A :class:`specsamp.coupling.Coupling` with the same name, width limit and theory.
    """
    import dataclasses

    from .coupling import COUPLINGS

    if coupling.name in TRACED_COUPLINGS and coupling.name in COUPLINGS and COUPLINGS.get(coupling.name).verify is coupling.verify:
        return coupling
    for fn in (coupling.verify, coupling.decide):
        if fn is not None and fn not in _OUTSIDE:  # one wrapper per rule: the compiled graphs' guards hold it by identity
            _OUTSIDE[fn] = torch.compiler.disable(fn, recursive=True)
    return dataclasses.replace(coupling, verify=_OUTSIDE[coupling.verify],
                               decide=None if coupling.decide is None else _OUTSIDE[coupling.decide])


_ROUND: list[Callable] = []


class _QuietCudaHome:
    """A logging filter dropping torch's "No CUDA runtime is found, using CUDA_HOME=..." notice, which inductor's CPU
    build prints where a CUDA toolkit is installed but no GPU is: it says nothing about a CPU run."""

    def filter(self, record) -> bool:
        return not str(record.msg).startswith("No CUDA runtime is found")


def compiled_round() -> Callable:
    """:func:`specsamp.lean._lean_round` under ``torch.compile(dynamic=False)`` (inductor), built once per process.

    TorchDynamo's cache belongs to the function's code, so every run of a process shares the compiled graphs:
    a tree compiles on its first round and later runs with the same tree, batch size and dtype reuse it. The
    recompile limit is raised to :data:`RECOMPILE_LIMIT` (from torch's 8) so that a sweep over trees keeps
    compiling rather than falling back to eager.
    """
    if not _ROUND:
        import torch._dynamo

        cfg = torch._dynamo.config
        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(cfg, name):
                setattr(cfg, name, max(getattr(cfg, name), RECOMPILE_LIMIT))
        if hasattr(cfg, "accumulated_recompile_limit"):
            cfg.accumulated_recompile_limit = max(cfg.accumulated_recompile_limit, 4 * RECOMPILE_LIMIT)
        import logging

        logging.getLogger("torch.utils.cpp_extension").addFilter(_QuietCudaHome())
        _network_outside()  # wrapped here: torch.compiler.disable may not be called inside a compiled region
        _ROUND.append(torch.compile(_lean_round, dynamic=False, options=dict(INDUCTOR_OPTIONS)))
    return _guarded(_ROUND[0])
