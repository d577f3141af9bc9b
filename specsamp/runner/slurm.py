"""What SLURM says about a sweep's jobs: the job's own identity inside a task, and the queue's view outside.

Inside an array task, :func:`job_identity` names the task the way ``squeue``/``sacct`` and submitit's
``.submitit/<array>_<task>/`` folders do (``"<array job id>_<task id>"``), with the host and SLURM's
restart count; it goes into ``running.json``, ``result.json`` and ``failed.json`` (key ``slurm``).

Outside, :func:`states` asks ``squeue`` (the live queue) and then ``sacct`` (accounting, for jobs that
left the queue) for the state and reason of a list of such ids, in one call each. A state in
:data:`ALIVE` means the scheduler still owns the task (it will run, or runs now); any other state of a
task without a record says why it has none (``OUT_OF_MEMORY``, ``TIMEOUT``, ``NODE_FAIL``,
``CANCELLED``, ``FAILED``). Without the commands, or when they fail, the answer is empty and callers use
the local view (:func:`specsamp.runner.jobs.job_liveness`). Source: SLURM's ``squeue(1)`` and ``sacct(1)``
manuals (job state codes, ``--parsable2``, array ids ``A_T`` and pending ranges ``A_[2-5%4]``).
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
from collections.abc import Iterable

SLURM_FILE = "slurm.json"  # written by the SLURM launcher into each job directory at submission

# states in which the scheduler still owns a task: do not submit it again, do not call it killed
ALIVE = frozenset(
    {
        "PENDING",
        "RUNNING",
        "REQUEUED",
        "REQUEUE_HOLD",
        "REQUEUE_FED",
        "CONFIGURING",
        "COMPLETING",
        "SUSPENDED",
        "RESIZING",
        "SIGNALING",
        "STAGE_OUT",
        "RESV_DEL_HOLD",
        "STOPPED",
    }
)
QUERY_TIMEOUT_S = 30.0


def job_identity(env: dict | None = None) -> dict | None:
    """The SLURM identity of this process, or None outside a SLURM job.

    Returns:
        ``{"job_id": "A_T" (array task) or the plain job id, "array_job_id", "array_task_id",
        "raw_job_id" (SLURM_JOB_ID, one number per task), "host", "restart_count"}``; values are strings
        (None when SLURM did not set them), ``restart_count`` an int (0 before any requeue).
    """
    env = os.environ if env is None else env
    raw = env.get("SLURM_JOB_ID")
    if not raw:
        return None
    array, task = env.get("SLURM_ARRAY_JOB_ID"), env.get("SLURM_ARRAY_TASK_ID")
    return {
        "job_id": f"{array}_{task}" if array and task else raw,
        "array_job_id": array,
        "array_task_id": task,
        "raw_job_id": raw,
        "host": env.get("SLURMD_NODENAME") or socket.gethostname(),
        "restart_count": int(env.get("SLURM_RESTART_COUNT") or 0),
    }


def available() -> bool:
    """True when ``squeue`` or ``sacct`` is on PATH."""
    return shutil.which("squeue") is not None or shutil.which("sacct") is not None


def _expand(job_id: str) -> list[str]:
    """``A_[1-3,5%4]`` -> ``["A_1", "A_2", "A_3", "A_5"]``; any other id as it is."""
    m = re.fullmatch(r"(\d+)_\[([^\]]+)\]", job_id)
    if not m:
        return [job_id]
    out = []
    for part in m.group(2).split("%")[0].split(","):
        lo, _, hi = part.partition("-")
        if lo.isdigit() and (not hi or hi.isdigit()):
            out += [f"{m.group(1)}_{t}" for t in range(int(lo), int(hi or lo) + 1)]
    return out


def _run(cmd: list[str]) -> str | None:
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=QUERY_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return p.stdout if p.returncode == 0 else None


OOM_LOG_LINES = ("exceeded job memory limit", "exceeded memory limit", "oom-kill", "out of memory")


def memory_killed(stderr_path: str | os.PathLike | None) -> bool:
    """True when a task's stderr log holds SLURM's memory-kill line (``slurmstepd: error: Exceeded job
    memory limit`` under ``JobAcctGatherParams=OverMemoryKill``, ``oom-kill`` under cgroups): polling
    enforcement records such a task as ``FAILED``, so the log is what tells it from a crash."""
    if not stderr_path:
        return False
    try:
        with open(stderr_path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 65536))
            tail = f.read().decode("utf-8", "replace").lower()
    except OSError:
        return False
    return any(line in tail for line in OOM_LOG_LINES)


def states(job_ids: Iterable[str]) -> dict[str, tuple[str, str]]:
    """``{job id: (STATE, reason)}`` for the given ``A_T`` (or plain) ids that SLURM knows.

    ``squeue`` answers for tasks still in the queue (``reason`` is its ``%r``: ``Resources``,
    ``Priority``, ``None``...); ``sacct`` for the others (``reason`` is empty, or ``ExitCode`` when not
    ``0:0``; the tasks of an array cancelled before any of them started are accounted under the bare array
    id, which then answers for them). A state with a suffix (``CANCELLED by 0``) is cut to its first word. Ids unknown to both are
    absent; so are all of them when neither command is available or answers.
    """
    wanted = {str(j) for j in job_ids if j}
    if not wanted:
        return {}
    arrays = sorted({j.split("_")[0] for j in wanted})
    out: dict[str, tuple[str, str]] = {}
    if shutil.which("squeue"):
        text = _run(["squeue", "-h", "-r", "-j", ",".join(arrays), "-o", "%i|%T|%r"]) or ""
        for line in text.splitlines():
            parts = line.strip().split("|")
            if len(parts) >= 3:
                for j in _expand(parts[0]):
                    if j in wanted:
                        out[j] = (parts[1].split()[0], parts[2])
    left = wanted - set(out)
    if left and shutil.which("sacct"):
        text = (
            _run(
                [
                    "sacct",
                    "-n",
                    "-X",
                    "-P",
                    "-j",
                    ",".join(sorted({j.split("_")[0] for j in left})),
                    "-o",
                    "JobID,State,ExitCode",
                ]
            )
            or ""
        )
        whole = {}  # an array cancelled before any task started: accounting has one line, the bare array id
        for line in text.splitlines():
            parts = line.strip().split("|")
            if len(parts) >= 3:
                state = parts[1].split()[0] if parts[1] else ""
                reason = "" if parts[2] in ("", "0:0") else f"exit code {parts[2]}"
                for j in _expand(parts[0]):
                    if j in left:
                        out[j] = (state, reason)
                if "_" not in parts[0]:
                    whole[parts[0]] = (state, reason)
        for j in left - set(out):
            if j.split("_")[0] in whole and "_" in j:
                out[j] = whole[j.split("_")[0]]
    return out
