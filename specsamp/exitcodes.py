"""Exit statuses of ``run.py`` and the specsamp command lines: the one place that defines them.

=====  ==========================================================================================
  0    every run (or every job of a sweep) wrote its record
  1    a bug: an unexpected exception (its traceback is printed; in a sweep, in ``failed.json``)
  2    the input was wrong: a config key or value, an override that does not compose, a path given
       by the user; one paragraph names the key, its value and what is valid
  3    the machine failed, not the input: the disk is full, the output directory is read-only or
       cannot be created, a launcher's command (``sbatch``/``srun``) is missing; one paragraph
       names the path or the command. Rerunning the same command once it is fixed resumes
 130   interrupted (Ctrl-C, SIGINT): one line, and for a sweep its summary; finished records stay
=====  ==========================================================================================

A sweep exits with the most serious status among its jobs: 130, then 3, then 1, then 2.
"""

from __future__ import annotations

import errno
import os

OK = 0
BUG = 1
USAGE = 2
INFRASTRUCTURE = 3
INTERRUPTED = 130

# errno values that say the machine (storage, permissions on the output side) failed, not the input
INFRA_ERRNOS = frozenset(
    getattr(errno, name)
    for name in ("ENOSPC", "EDQUOT", "EROFS", "EACCES", "EPERM", "EIO", "EFBIG", "ENFILE", "EMFILE", "ESTALE")
    if hasattr(errno, name)
)


class InfrastructureError(RuntimeError):
    """The machine cannot do what the (valid) input asks: a missing command, an unusable directory."""


def is_infrastructure(error: BaseException | None) -> bool:
    """True for :class:`InfrastructureError` and for an ``OSError`` whose errno is in :data:`INFRA_ERRNOS`
    (also when it is the cause or context of ``error``)."""
    seen = 0
    while error is not None and seen < 8:
        if isinstance(error, InfrastructureError):
            return True
        if isinstance(error, OSError) and error.errno in INFRA_ERRNOS:
            return True
        error = error.__cause__ or error.__context__
        seen += 1
    return False


def _root_oserror(error: BaseException | None) -> OSError | None:
    seen = 0
    while error is not None and seen < 8:
        if isinstance(error, OSError) and error.errno in INFRA_ERRNOS:
            return error
        error = error.__cause__ or error.__context__
        seen += 1
    return None


def infrastructure_message(error: BaseException) -> str:
    """One paragraph for an infrastructure failure: what failed, the path (or command), what to do."""
    if isinstance(error, InfrastructureError):
        return str(error)
    os_err = _root_oserror(error)
    if os_err is None:
        return str(error)
    path = os_err.filename or "(unknown path)"
    what = os.strerror(os_err.errno) if os_err.errno else str(os_err)
    if os_err.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", -1), errno.EFBIG):
        hint = "free space on that file system (or raise the quota / file-size limit)"
    elif os_err.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        hint = ("make the directory writable, or write elsewhere: hydra.run.dir=DIR for a run, "
                "hydra.sweep.dir=DIR for a sweep")
    else:
        hint = "check the file system holding it"
    return (f"could not write {path}: {what} [errno {os_err.errno}]. This is a problem of the machine, not of "
            f"the configuration: {hint}, then rerun the same command (finished records are kept and skipped).")
