"""Where a job lives and whether it is alive: directory names, single-run directories, ``running.json``,
and a shard job's block of trajectories (:func:`shard_indices`).

A sweep job's directory is named by its overrides (:func:`job_dirname`); a single run gets a directory of
its own (:func:`fresh_dir`). Both are OmegaConf resolvers used by ``conf/config.yaml``
(``specsamp.job_dir``, ``specsamp.fresh_dir``), registered on import. While a sweep job runs it keeps
``running.json`` (host, pid, process start time, a heartbeat), so that a reader tells a live job from a
killed one (:func:`job_liveness`).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import socket
import time
from collections.abc import Sequence
from pathlib import Path

RESULT, FAILED, SHARD, RUNNING = "result.json", "failed.json", "shard.pt", "running.json"
HEARTBEAT_S = 30.0  # a running job touches its running.json this often
STALE_S = 150.0  # a running.json untouched this long, written on another host, belongs to a dead job

# A sweep job whose overrides do not compose runs with only Hydra's settings and its error in these
# environment variables (hydra_plugins/specsamp_sweeper); specsamp.runner.task.run_task records it as failed.
COMPOSE_ERROR_ENV = "SPECSAMP_COMPOSE_ERROR"
COMPOSE_ERROR_KIND_ENV = "SPECSAMP_COMPOSE_ERROR_KIND"


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _mtime(p: Path) -> float | None:
    try:
        return p.stat().st_mtime
    except OSError:
        return None


# job directory names (Hydra's ``hydra.sweep.subdir`` and single-run ``hydra.run.dir``)

# an override that names a directory as it is: key=value of plain characters, no '/', ',', '=' in the
# value, nothing hidden ('.', '..'); any other list of overrides gets a sanitised prefix and a hash
_PLAIN = re.compile(r"[+~]{0,2}[A-Za-z_][A-Za-z0-9_.\-]*(=[A-Za-z0-9_+\-][A-Za-z0-9_.+\-]*)?")
_UNSAFE = re.compile(r"[^A-Za-z0-9_.,=+\-]+")
MAX_PLAIN_NAME = 120  # longer plain names are shortened to PREFIX_CHARS + "@" + a hash
PREFIX_CHARS = 80
HASH_CHARS = 10


def _key_of(line: str) -> str:
    return line.partition("=")[0].lstrip("+~")


def job_dirname(overrides: Sequence[str], exclude_keys: Sequence[str] = ()) -> str:
    """The directory name of one sweep job: unique per override list, one path component, bounded length.

    The overrides whose key is in ``exclude_keys`` (and ``hydra.*`` ones) are dropped and the rest sorted,
    as Hydra's ``override_dirname`` does. When every remaining override is plain (``key=value`` of
    letters, digits and ``_ . + -``, the value not starting with ``.``) and the joined name is at most
    :data:`MAX_PLAIN_NAME` characters, the name is Hydra's: ``K=2,L=3,sampler=rmc``. Otherwise (values
    with ``/``, ``..``, ``,``, ``=``, quotes, spaces, or a long list) it is a readable prefix with every
    other character replaced by ``_``, cut at :data:`PREFIX_CHARS`, then ``@`` and the first
    :data:`HASH_CHARS` hex digits of the SHA-256 of the sorted overrides:
    ``model.path=.._.._tiny.pkl,L=2@3f0c...``. A plain name never contains ``@``, so the two forms
    cannot collide, and plain names are unique because they can be split back into their overrides.

    ``conf/config.yaml`` sets ``hydra.sweep.subdir`` to this (resolver ``specsamp.job_dir``), and
    :func:`planned_jobs`/:func:`collect` and :mod:`specsamp.runner.shards` use it to find a job's directory,
    so a relaunch finds every finished job again.

    Args:
        overrides: the job's task overrides (``hydra.overrides.task``), e.g. ``["K=2", "model.path=../x.pkl"]``.
        exclude_keys: keys that do not name the directory (``hydra.job.config.override_dirname.exclude_keys``).

    Returns:
        A non-empty name without ``/``, not starting with ``.``, or ``""`` when no override is left
        (the job runs in the sweep directory itself, as with Hydra's default).
    """
    exclude = {str(k) for k in exclude_keys or ()}
    items = sorted(
        str(o) for o in overrides if _key_of(str(o)) not in exclude and not _key_of(str(o)).startswith("hydra")
    )
    plain = ",".join(items)
    if all(_PLAIN.fullmatch(o) for o in items) and len(plain) <= MAX_PLAIN_NAME:
        return plain
    digest = hashlib.sha256("\n".join(items).encode()).hexdigest()[:HASH_CHARS]
    prefix = _UNSAFE.sub("_", plain).lstrip(".")[:PREFIX_CHARS]
    return f"{prefix}@{digest}"


_CLAIMED: dict[str, str] = {}


def fresh_dir(base: str) -> str:
    """A directory for one single run that no other run uses: ``base`` if it can be created now, else
    ``base_2``, ``base_3``, ... (resolver ``specsamp.fresh_dir`` of ``hydra.run.dir``).

    The directory is created with an exclusive ``mkdir``, so two runs started in the same second (even
    on two hosts sharing the file system) get two directories. Within one process the same ``base``
    always gives the same answer. When ``base`` cannot be created for another reason (read-only, no
    space), ``base`` is returned and Hydra's own ``mkdir`` reports the error.
    """
    if base in _CLAIMED:
        return _CLAIMED[base]
    path = Path(base)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        n = 1
        while True:
            cand = path if n == 1 else path.with_name(f"{path.name}_{n}")
            try:
                cand.mkdir()
                break
            except FileExistsError:
                n += 1
    except OSError:
        return base
    _CLAIMED[base] = str(cand)
    return str(cand)


def shard_indices(n_samples: int, shard: int, num_shards: int, batch_size: int | None = None) -> range:
    """Trajectory ids of one shard: a contiguous block, cut at batch boundaries when batching.

    With ``batch_size`` set, the ``ceil(n_samples / batch_size)`` batches of the unsharded run are dealt
    out in contiguous runs, so every shard runs exactly the unsharded run's batches (and reproduces its
    samples bitwise). Otherwise trajectories are split as evenly as possible.

    Args:
        n_samples: trajectories of the whole run.
        shard: this shard, in ``0 .. num_shards - 1``.
        num_shards: number of shards, at most the number of batches (or of trajectories).
        batch_size: trajectories per batch, or None for one batch per job.

    Returns:
        ``range(start, stop)`` of trajectory ids; the shards partition ``range(n_samples)`` in order.
    """
    if batch_size:
        units = math.ceil(n_samples / batch_size)
        lo, hi = shard * units // num_shards, (shard + 1) * units // num_shards
        return range(lo * batch_size, min(hi * batch_size, n_samples))
    return range(shard * n_samples // num_shards, (shard + 1) * n_samples // num_shards)


def register_resolvers() -> None:
    """Register ``specsamp.job_dir`` (:func:`job_dirname`) and ``specsamp.fresh_dir`` (:func:`fresh_dir`)
    with OmegaConf; idempotent. Importing this module calls it."""
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver("specsamp.job_dir"):
        OmegaConf.register_new_resolver(
            "specsamp.job_dir", lambda overrides, exclude=(): job_dirname(list(overrides or []), list(exclude or []))
        )
    if not OmegaConf.has_resolver("specsamp.fresh_dir"):
        OmegaConf.register_new_resolver("specsamp.fresh_dir", fresh_dir, use_cache=True)


register_resolvers()


def _process_start(pid: int) -> str | None:
    """The start time of process ``pid`` (field 22 of ``/proc/PID/stat``), or None where unreadable."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
        return text.rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def running_marker() -> dict:
    """What a job writes to ``running.json`` when it starts: host, pid, process start time, SLURM id (and,
    inside a SLURM job, ``slurm``: :func:`specsamp.runner.slurm.job_identity`)."""
    from .slurm import job_identity

    pid = os.getpid()
    marker = {
        "host": socket.gethostname(),
        "pid": pid,
        "pid_start": _process_start(pid),
        "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "heartbeat_s": HEARTBEAT_S,
    }
    ident = job_identity()
    if ident:
        marker["slurm"] = ident
    return marker


def _pid_alive(pid, pid_start) -> bool:
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process with that id: alive
    except (TypeError, ValueError, OSError):
        return False
    now = _process_start(int(pid))
    return pid_start is None or now is None or now == pid_start  # same id, other process: the job is gone


def job_liveness(job: str | os.PathLike, now: float | None = None) -> str:
    """``running`` or ``killed`` for a started job without a record, judged from its ``running.json``.

    On the host that wrote it: alive when its process id still names the same process (same start
    time). On another host: alive while the file's modification time (touched every
    :data:`HEARTBEAT_S` seconds by the job) is younger than :data:`STALE_S`. A marker that says the
    job ended (Ctrl-C) means killed. No marker (the instant between Hydra creating the directory and the
    job starting, or a job of an older version): running.
    """
    path = Path(job) / RUNNING
    marker = _read_json(path)
    if marker is None:
        return "running"
    if marker.get("ended"):
        return "killed"
    if marker.get("host") == socket.gethostname():
        return "running" if _pid_alive(marker.get("pid"), marker.get("pid_start")) else "killed"
    age = (now if now is not None else time.time()) - (_mtime(path) or 0.0)
    return "running" if age < STALE_S else "killed"
