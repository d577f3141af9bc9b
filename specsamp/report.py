"""Sweep directories -> tidy tables, and the summary printed at the end of a sweep.

A sweep directory (``multirun/<sweep_name>/``) holds one directory per job, named by the job's
overrides (``K=2,L=3,sampler=rmc``; see :func:`job_dirname` for values with ``/``, ``,`` or ``=``), each
with Hydra's ``.hydra/``, ``running.json`` while it runs and, once finished, ``result.json`` (or
``failed.json``). :func:`collect` reads them into one pandas row per job; it works while the sweep
is running::

    python -m specsamp.report collect multirun/gmm_grid            # table on stdout, CSV in the sweep dir
    python -m specsamp.report collect multirun/gmm_grid --csv gmm.csv

Job status: ``ok`` (``result.json``), ``failed`` (``failed.json``: a bad per-job value, a config that
does not compose, an exception, a full disk), ``running`` (started, no record yet, its process alive),
``killed`` (started, no record, its process gone: Ctrl-C, out of memory, a time limit, a lost node; it
reruns on relaunch) and ``missing`` (planned in ``multirun.yaml``, not started yet). A job is judged
alive from its ``running.json``: by process id on the same host, by the file's heartbeat elsewhere.

:class:`SweepReport` is a Hydra callback (``hydra.callbacks.sweep_report`` in ``conf/config.yaml``):
at the end of a sweep it prints what ran, what was skipped and which jobs failed with their errors,
merges complete shard groups, and leaves the outcome in :data:`SWEEP_STATE` for ``run.py``'s exit status.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import socket
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback

RESULT, FAILED, SHARD, RUNNING = "result.json", "failed.json", "shard.pt", "running.json"
STATUSES = ("ok", "failed", "running", "killed", "missing")
HEARTBEAT_S = 30.0  # a running job touches its running.json this often
STALE_S = 150.0  # a running.json untouched this long, written on another host, belongs to a dead job

# Columns every table has, in this order; swept keys that are not among them follow as their own columns.
COLUMNS = [
    "job", "status", "overrides", "model", "sampler", "K", "L", "eps", "steps", "n_samples", "seed",
    "tree", "budget", "verification_rows",
    "speedup_mean", "speedup_std", "speedup_sem", "nfe_mean", "nfe_std", "nfe_sem", "nfe_total_mean",
    "target_rows_mean", "batch_speedup", "committed_per_round", "acceptance_pooled", "acceptance",
    "wall_seconds", "shard", "num_shards", "config_hash", "error",
]  # fmt: skip
_CONFIG_COLUMNS = ("K", "L", "eps", "steps", "n_samples", "seed", "shard", "num_shards")

# A sweep job whose overrides do not compose runs with only Hydra's settings and its error in these
# environment variables (hydra_plugins/specsamp_sweeper); specsamp.cli.run_task records it as failed.
COMPOSE_ERROR_ENV = "SPECSAMP_COMPOSE_ERROR"
COMPOSE_ERROR_KIND_ENV = "SPECSAMP_COMPOSE_ERROR_KIND"

# Filled by SweepReport.on_multirun_end; read by run.py to set the exit status.
SWEEP_STATE: dict[str, Any] = {}


# ----------------------------------------------------------------------------------------------
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
    :func:`planned_jobs`/:func:`collect` and :mod:`specsamp.shards` use it to find a job's directory,
    so a relaunch finds every finished job again.

    Args:
        overrides: the job's task overrides (``hydra.overrides.task``), e.g. ``["K=2", "model.path=../x.pkl"]``.
        exclude_keys: keys that do not name the directory (``hydra.job.config.override_dirname.exclude_keys``).

    Returns:
        A non-empty name without ``/``, not starting with ``.``, or ``""`` when no override is left
        (the job runs in the sweep directory itself, as with Hydra's default).
    """
    exclude = {str(k) for k in exclude_keys or ()}
    items = sorted(str(o) for o in overrides if _key_of(str(o)) not in exclude and not _key_of(str(o)).startswith("hydra"))
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


def register_resolvers() -> None:
    """Register ``specsamp.job_dir`` (:func:`job_dirname`) and ``specsamp.fresh_dir`` (:func:`fresh_dir`)
    with OmegaConf; idempotent. Importing this module calls it."""
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver("specsamp.job_dir"):
        OmegaConf.register_new_resolver(
            "specsamp.job_dir", lambda overrides, exclude=(): job_dirname(list(overrides or []), list(exclude or [])))
    if not OmegaConf.has_resolver("specsamp.fresh_dir"):
        OmegaConf.register_new_resolver("specsamp.fresh_dir", fresh_dir, use_cache=True)


register_resolvers()


# ----------------------------------------------------------------------------------------------
# reading a sweep directory


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _read_overrides(job: Path) -> list[str] | None:
    p = job / ".hydra" / "overrides.yaml"
    if not p.exists():
        return None
    from omegaconf import OmegaConf

    try:
        return [str(x) for x in OmegaConf.to_container(OmegaConf.load(p))]
    except Exception:
        return None


def job_dirs(sweep_dir: str | os.PathLike) -> list[Path]:
    """Every job directory under ``sweep_dir``: one holding ``.hydra/``, ``result.json`` or ``failed.json``.

    Hidden directories (``.submitit``, ``.hydra``) and ``wandb`` run folders are not searched.
    """
    root = Path(sweep_dir)
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d != "wandb")
        here = Path(dirpath)
        if RESULT in filenames or FAILED in filenames or (here / ".hydra" / "overrides.yaml").exists():
            out.append(here)
    return out


def _process_start(pid: int) -> str | None:
    """The start time of process ``pid`` (field 22 of ``/proc/PID/stat``), or None where unreadable."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
        return text.rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def running_marker() -> dict:
    """What a job writes to ``running.json`` when it starts: host, pid, process start time, SLURM id."""
    pid = os.getpid()
    return {"host": socket.gethostname(), "pid": pid, "pid_start": _process_start(pid),
            "slurm_job_id": os.environ.get("SLURM_JOB_ID"), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "heartbeat_s": HEARTBEAT_S}


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


def _split_override(line: str) -> tuple[str, str]:
    key, _, value = line.partition("=")
    return key.lstrip("+~"), value


def planned_jobs(sweep_dir: str | os.PathLike) -> list[list[str]] | None:
    """The jobs (override lists) of the latest launch into ``sweep_dir``, from its ``multirun.yaml``.

    Hydra's basic sweeper and ours (``hydra/sweeper=specsamp``, the default) are expanded; for another
    sweeper (or when Hydra cannot expand it here, e.g. a ``glob`` over a config group) returns None.
    """
    p = Path(sweep_dir) / "multirun.yaml"
    if not p.exists():
        return None
    try:
        from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
        from hydra.core.override_parser.overrides_parser import OverridesParser
        from omegaconf import OmegaConf

        cfg = OmegaConf.load(p)
        target = str(OmegaConf.select(cfg, "hydra.sweeper._target_", default=""))
        if not target.endswith(("basic_sweeper.BasicSweeper", "specsamp_sweeper.SpecsampSweeper")):
            return None
        params = OmegaConf.select(cfg, "hydra.sweeper.params")
        params = OmegaConf.to_container(params, resolve=False) if params is not None else {}
        args = [f"{k}={v}" for k, v in params.items()]
        args += [str(x) for x in OmegaConf.to_container(cfg.hydra.overrides.task, resolve=False)]
        parsed = OverridesParser.create().parse_overrides(args)
        return [list(job) for batch in BasicSweeper.split_arguments(parsed, None) for job in batch]
    except Exception:
        return None


def exclude_keys_of(sweep_dir: str | os.PathLike) -> list[str]:
    """``hydra.job.config.override_dirname.exclude_keys`` of the latest launch into ``sweep_dir``."""
    try:
        from omegaconf import OmegaConf

        cfg = OmegaConf.load(Path(sweep_dir) / "multirun.yaml")
        return [str(k) for k in OmegaConf.select(cfg, "hydra.job.config.override_dirname.exclude_keys", default=[]) or []]
    except Exception:
        return []


def _expected_dirname(sweep_dir: Path, overrides: Sequence[str]) -> str:
    """The directory name of a planned job (:func:`job_dirname`, as ``hydra.sweep.subdir`` computes it)."""
    return job_dirname(overrides, exclude_keys_of(sweep_dir))


def _config_of(job: Path, rec: dict | None) -> dict:
    if rec and isinstance(rec.get("config"), dict):
        return rec["config"]
    p = job / ".hydra" / "config.yaml"
    if p.exists():
        from omegaconf import OmegaConf

        try:
            cfg = OmegaConf.load(p)
        except Exception:
            return {}
        out = {}
        for key in ("model.name", "model.kind", "sampler.name", *_CONFIG_COLUMNS):
            try:
                out[key] = OmegaConf.select(cfg, key, throw_on_resolution_failure=False)
            except Exception:
                out[key] = None
        return {
            **{k: out[k] for k in _CONFIG_COLUMNS},
            "model": {"name": out["model.name"] or out["model.kind"]},
            "sampler": {"name": out["sampler.name"]},
        }
    return {}


def _fill_from_config(row: dict, cfg: dict) -> None:
    for k in _CONFIG_COLUMNS:
        if row.get(k) is None and cfg.get(k) is not None:
            row[k] = cfg[k]
    model, sampler = cfg.get("model") or {}, cfg.get("sampler") or {}
    if row.get("model") is None and isinstance(model, dict):
        row["model"] = model.get("name") or model.get("kind")
    if row.get("sampler") is None and isinstance(sampler, dict):
        row["sampler"] = sampler.get("name")


def _record_columns(rec: dict) -> dict:
    row: dict[str, Any] = {k: rec.get(k) for k in ("model", "sampler", "K", "L", "eps", "steps", "n_samples", "tree", "budget", "verification_rows")}
    for name in ("speedup", "nfe"):
        for s in ("mean", "std", "sem"):
            row[f"{name}_{s}"] = (rec.get(name) or {}).get(s)
    for name in ("nfe_total", "target_rows"):  # calls incl. endpoints; states evaluated (per trajectory)
        v = rec.get(name)
        row[f"{name}_mean"] = v.get("mean") if isinstance(v, dict) else v
    for name in ("batch_speedup", "committed_per_round", "acceptance_pooled"):
        row[name] = rec.get(name)
    acc = rec.get("acceptance_per_depth") or []
    row["acceptance"] = "/".join(f"{a:.4f}" for a in acc)
    for i, a in enumerate(acc):
        row[f"acc_d{i + 1}"] = a
    metrics = dict(rec.get("metrics") or {})
    for k in ("fid", "clip_score"):
        if k in rec and k not in metrics:
            metrics[k] = rec[k]
    for k, v in metrics.items():
        if isinstance(v, (int, float)) or v is None:
            row[k] = v
        elif isinstance(v, dict) and "mean" in v:
            row[k] = v["mean"]
    row["wall_seconds"] = rec.get("wall_seconds")
    row["config_hash"] = rec.get("config_hash")
    for k in ("shard", "num_shards"):
        if k in rec:
            row[k] = rec[k]
    if rec.get("merged_from"):  # a whole run merged from its shards
        row["num_shards"] = len(rec["merged_from"])
    return row


def job_row(job: Path, sweep_dir: Path) -> dict:
    """One table row for one job directory (see :data:`COLUMNS`)."""
    rel = job.relative_to(sweep_dir).as_posix()
    overrides = _read_overrides(job)
    row: dict[str, Any] = {"job": rel, "path": str(job)}
    result, failed = _read_json(job / RESULT), _read_json(job / FAILED)
    rec = None
    if failed is not None:  # a run that succeeds deletes failed.json, so this is the latest outcome
        row.update(status="failed", error=failed.get("error"), config_hash=failed.get("config_hash"))
        rec = failed
    elif result is not None and result.get("status") == "ok":
        row.update(status="ok", **_record_columns(result))
        rec = result
    else:
        row["status"] = job_liveness(job)
    if overrides is None and rec is not None:
        overrides = rec.get("overrides")
    _fill_from_config(row, _config_of(job, rec))
    row["overrides"] = " ".join(overrides or [])
    row["_key"] = tuple(sorted(overrides or []))
    for line in overrides or []:
        key, value = _split_override(line)
        if key not in row or row[key] is None:
            row[key] = value
    return row


def _collect(root: Path):
    """:func:`collect` plus a ``_key`` column (the sorted override tuple) used to match planned jobs."""
    import pandas as pd

    if not root.is_dir():
        raise FileNotFoundError(f"{root} is not a directory")
    rows = [job_row(j, root) for j in job_dirs(root)]
    started = {r["_key"] for r in rows if r.get("path")}
    for job in planned_jobs(root) or []:
        key = tuple(sorted(job))
        if key in started:
            continue
        row: dict[str, Any] = {"job": _expected_dirname(root, job), "path": None, "status": "missing", "overrides": " ".join(job), "_key": key}
        for line in job:
            k, value = _split_override(line)
            row.setdefault(k, value)
        rows.append(row)
    df = pd.DataFrame(rows, columns=None if rows else ["job", "path", "status", "overrides", "_key"])
    extra = [c for c in df.columns if c not in COLUMNS and c not in ("path", "_key") and not c.startswith("acc_d")]
    acc = sorted((c for c in df.columns if c.startswith("acc_d")), key=lambda c: int(c[5:]))
    for c in COLUMNS:
        if c not in df.columns:
            df[c] = None
    df = df[COLUMNS[:-5] + acc + COLUMNS[-5:] + extra + ["path", "_key"]]
    return df.sort_values("job", kind="stable").reset_index(drop=True)


def collect(sweep_dir: str | os.PathLike):
    """Read a sweep directory into a tidy table, one row per job (finished, failed, running or planned).

    Args:
        sweep_dir: a Hydra sweep directory (``multirun/<sweep_name>``) or any directory of job dirs.

    Returns:
        A ``pandas.DataFrame`` with the columns of :data:`COLUMNS` (``speedup_mean``, ``nfe_mean``,
        ``acceptance`` as ``"a1/a2/..."`` plus ``acc_d1, acc_d2, ...``, metrics such as ``fid``), then
        one column per swept key not among them (``model.dim``, ``experiment``, ...), sorted by job.

    Raises:
        FileNotFoundError: ``sweep_dir`` is not a directory.
    """
    return _collect(Path(sweep_dir)).drop(columns="_key")


def write_csv_atomic(df, path: str | os.PathLike) -> None:
    """Write ``df`` to CSV through a temporary file and an atomic rename (:func:`specsamp.io.atomic_write`)."""
    from .io import atomic_write

    atomic_write(path, lambda f: df.to_csv(f, index=False), mode="w")

def _fmt(v, spec: str) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return ""
    try:
        return format(float(v), spec)
    except (TypeError, ValueError):
        return str(v)


def _short_acceptance(a, depths: int = 4) -> str:
    if not isinstance(a, str) or not a:
        return ""
    parts = a.split("/")
    return "/".join(f"{float(x):.2f}" for x in parts[:depths]) + ("/..." if len(parts) > depths else "")


def format_table(df) -> str:
    """A compact text table: job, status, B, speedup ± sem, NFE, acceptance, wall time (or the error)."""
    import pandas as pd

    if df.empty:
        return "(no jobs)"
    show = pd.DataFrame(
        {
            "job": df["job"].replace("", "."),
            "status": df["status"],
            "B": [_fmt(v, ".0f") for v in df["budget"]],
            "speedup": [f"{_fmt(m, '.3f')} ± {_fmt(s, '.3f')}" if _fmt(m, "") else "" for m, s in zip(df["speedup_mean"], df["speedup_sem"])],
            "NFE": [_fmt(v, ".1f") for v in df["nfe_mean"]],
            "acceptance": [_short_acceptance(a) for a in df["acceptance"]],
            "wall_s": [_fmt(v, ".1f") for v in df["wall_seconds"]],
            "error": df["error"].fillna("").astype(str).str.slice(0, 80),
        }
    )
    if not show["error"].str.len().any():
        show = show.drop(columns="error")
    counts = df["status"].value_counts()
    foot = f"{len(df)} jobs: " + ", ".join(f"{int(counts.get(s, 0))} {s}" for s in STATUSES)
    return show.to_string(index=False) + "\n" + foot


# ----------------------------------------------------------------------------------------------
# end-of-sweep summary (Hydra callback)


def _mtime(p: Path) -> float | None:
    try:
        return p.stat().st_mtime
    except OSError:
        return None


def sweep_summary(sweep_dir: str | os.PathLike) -> dict:
    """What the latest launch into ``sweep_dir`` did, judged from the files on disk.

    A job belongs to the latest launch when it is planned in ``multirun.yaml`` (basic sweeper) or,
    failing that, when Hydra wrote its ``.hydra/`` after ``multirun.yaml``. An ok job whose
    ``result.json`` is older than ``multirun.yaml`` was skipped.

    Returns:
        ``{"sweep_dir", "table" (DataFrame of this launch's jobs), "ran", "skipped", "failed"
        (list of rows), "running", "killed", "missing", "config_errors_only" (bool), "kinds" (the
        ``kind`` of every failure: ``config``, ``exception``, ``infrastructure``)}``.
    """
    root = Path(sweep_dir)
    df = _collect(root)
    launch = _mtime(root / "multirun.yaml")
    planned = planned_jobs(root)
    if planned is not None:
        wanted = {tuple(sorted(j)) for j in planned}
        mine = df[[k in wanted for k in df["_key"]]]
    elif launch is not None:
        mine = df[[(p is not None and (_mtime(Path(p) / ".hydra" / "overrides.yaml") or 0) >= launch) for p in df["path"]]]
    else:
        mine = df
    ok = mine[mine["status"] == "ok"]
    skipped = [p for p in ok["path"] if launch is not None and (_mtime(Path(p) / RESULT) or 0) < launch]
    failed = mine[mine["status"] == "failed"]
    kinds = [(_read_json(Path(p) / FAILED) or {}).get("kind") for p in failed["path"]]
    return {
        "sweep_dir": str(root),
        "table": mine.drop(columns="_key"),
        "ran": len(ok) - len(skipped),
        "skipped": len(skipped),
        "failed": failed.to_dict("records"),
        "running": int((mine["status"] == "running").sum()),
        "killed": int((mine["status"] == "killed").sum()),
        "missing": int((mine["status"] == "missing").sum()),
        "config_errors_only": bool(kinds) and all(k == "config" for k in kinds),
        "kinds": kinds,
    }


def print_sweep_summary(sweep_dir: str | os.PathLike, file=None) -> dict:
    """Print :func:`sweep_summary` (failed jobs with their errors) and return it."""
    file = file or sys.stdout
    s = sweep_summary(sweep_dir)
    n = len(s["table"])
    parts = [f"{s['ran']} ran", f"{s['skipped']} skipped (done before)", f"{len(s['failed'])} failed"]
    if s["killed"]:
        parts.append(f"{s['killed']} killed (no record; rerun on relaunch)")
    if s["running"] or s["missing"]:
        parts.append(f"{s['running'] + s['missing']} not finished")
    print(f"sweep {s['sweep_dir']}: {n} jobs, " + ", ".join(parts), file=file)
    for row in s["failed"]:
        print(f"  failed: {row['job'] or '.'}: {row['error']}  ({Path(row['path']) / FAILED})", file=file)
    print(f"  table: python -m specsamp.report collect {s['sweep_dir']}", file=file, flush=True)
    return s


class SweepReport(Callback):
    """Hydra callback: after a sweep, summarise it, merge finished shard groups, set the exit status.

    Args:
        merge_shards: merge complete shard groups (:func:`specsamp.shards.merge`) at the end.
    """

    def __init__(self, merge_shards: bool = True) -> None:
        self.merge_shards = merge_shards

    def on_multirun_start(self, config, **kwargs: Any) -> None:
        """Remember the sweep directory (for ``run.py`` when the launcher itself fails)."""
        SWEEP_STATE.clear()
        SWEEP_STATE["sweep_dir"] = str(config.hydra.sweep.dir)

    def on_multirun_end(self, config, **kwargs: Any) -> None:
        """Print the summary; merge shards; store the failures in :data:`SWEEP_STATE`."""
        sweep_dir = Path(str(config.hydra.sweep.dir))
        try:
            s = print_sweep_summary(sweep_dir)
        except Exception as e:  # a report must never turn a finished sweep into an error
            print(f"warning: could not summarise {sweep_dir}: {e}", file=sys.stderr)
            return
        SWEEP_STATE.update(sweep_dir=str(sweep_dir), failed=s["failed"], config_errors_only=s["config_errors_only"],
                           kinds=s["kinds"], killed=s["killed"])
        if self.merge_shards and any(sweep_dir.rglob(SHARD)):
            from .shards import merge

            try:
                for line in merge(sweep_dir).lines():
                    print(f"  shards {line}", flush=True)
            except Exception as e:
                print(f"warning: merging shards under {sweep_dir} failed: {e}", file=sys.stderr)


def sweep_exit_status(state: dict | None = None) -> int:
    """The exit status of a finished sweep (:mod:`specsamp.exitcodes`): the most serious of its jobs.

    130 when it was interrupted; 3 when a job met an infrastructure failure (``failed.json`` of kind
    ``infrastructure``, or a job that could not even write that); 1 when a job raised an unexpected
    exception or was killed; 2 when the only failures are bad per-job values or configs that do not
    compose; 0 otherwise.
    """
    from . import exitcodes

    state = SWEEP_STATE if state is None else state
    kinds = list(state.get("kinds") or [])
    if state.get("interrupted"):
        return exitcodes.INTERRUPTED
    if state.get("infrastructure") or "infrastructure" in kinds:
        return exitcodes.INFRASTRUCTURE
    if "exception" in kinds or state.get("killed"):
        return exitcodes.BUG
    if kinds or state.get("failed"):
        return exitcodes.USAGE
    return exitcodes.OK


def launched(sweep_dir: str | os.PathLike) -> bool:
    """True when a job of the latest launch into ``sweep_dir`` has started (its ``.hydra/`` is newer)."""
    root = Path(sweep_dir)
    launch = _mtime(root / "multirun.yaml")
    if launch is None:
        return False
    return any((_mtime(j / ".hydra" / "overrides.yaml") or 0) >= launch for j in job_dirs(root))


# ----------------------------------------------------------------------------------------------
# command line


def main(argv: list[str] | None = None) -> int:
    """``python -m specsamp.report collect SWEEP_DIR [--csv OUT]``: print the table, write the CSV.

    Exit status 0 (also while jobs are running or have failed: the table says so), 2 on a usage error.
    """
    ap = argparse.ArgumentParser(prog="python -m specsamp.report", description="Tables from sweep directories.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("collect", help="one CSV row per job of a sweep directory")
    c.add_argument("sweep_dir", help="a sweep directory, e.g. multirun/gmm_grid")
    c.add_argument("--csv", default=None, help="output CSV (default: SWEEP_DIR/summary.csv)")
    args = ap.parse_args(argv)
    root = Path(args.sweep_dir)
    if not root.is_dir():
        print(f"error: SWEEP_DIR={args.sweep_dir!r} is invalid: no such directory (sweeps live in multirun/<sweep_name>).", file=sys.stderr)
        return 2
    df = collect(root)
    out = Path(args.csv) if args.csv else root / "summary.csv"
    write_csv_atomic(df.drop(columns="path"), out)
    print(format_table(df))
    print(f"wrote {out} ({len(df)} rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
