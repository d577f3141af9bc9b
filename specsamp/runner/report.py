"""Sweep directories -> tidy tables, and the summary printed at the end of a sweep.

A sweep directory (``multirun/<sweep_name>/``) holds one directory per job, named by the job's
overrides (``K=2,L=3,sampler=rmc``; see :func:`specsamp.runner.jobs.job_dirname` for values with ``/``, ``,`` or ``=``), each
with Hydra's ``.hydra/``, ``running.json`` while it runs and, once finished, ``result.json`` (or
``failed.json``). :func:`collect` reads them into one pandas row per job; it works while the sweep
is running::

    python -m specsamp.runner.report collect multirun/gmm_grid            # table on stdout, CSV in the sweep dir
    python -m specsamp.runner.report collect multirun/gmm_grid --csv gmm.csv

Job status: ``ok`` (``result.json``), ``failed`` (``failed.json``: a bad per-job value, a config that
does not compose, an exception, a full disk), ``running`` (started, no record yet, its process alive),
``killed`` (started, no record, its process gone: Ctrl-C, out of memory, a time limit, a lost node; it
reruns on relaunch) and ``missing`` (planned in ``multirun.yaml``, not started yet). A job is judged
alive from its ``running.json``: by process id on the same host, by the file's heartbeat elsewhere.
A cell submitted to SLURM (``slurm.json``, :mod:`specsamp.runner.slurm`) is judged by the scheduler
where ``squeue``/``sacct`` answer: ``pending`` (queued or requeued), ``running``, or ``killed`` with
SLURM's state as its error (``OUT_OF_MEMORY``, ``TIMEOUT``, ``NODE_FAIL``, ``CANCELLED``); the ``slurm``
column shows that state and its reason.

At the end of a sweep, :class:`specsamp.runner.callback.SweepReport` (the Hydra callback) prints
:func:`print_sweep_summary`: what ran, what was skipped and which jobs failed with their errors.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from . import slurm as queue
from .jobs import FAILED, RESULT, _mtime, _read_json, job_dirname, job_liveness

STATUSES = ("ok", "failed", "running", "killed", "missing")

# Columns every table has, in this order; swept keys that are not among them follow as their own columns.
COLUMNS = [
    "job", "status", "overrides", "model", "sampler", "K", "L", "eps", "kernel", "steps", "n_samples", "seed",
    "tree", "budget", "call_rows",
    "speedup_mean", "speedup_std", "speedup_sem", "nfe_mean", "nfe_std", "nfe_sem", "nfe_total_mean",
    "target_rows_mean", "batch_speedup", "committed_per_round", "acceptance_pooled", "acceptance",
    "wall_seconds", "shard", "num_shards", "config_hash", "error",
]  # fmt: skip
_CONFIG_COLUMNS = ("K", "L", "eps", "steps", "n_samples", "seed", "shard", "num_shards")

# ----------------------------------------------------------------------------------------------
# reading a sweep directory


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
        if (
            RESULT in filenames
            or FAILED in filenames
            or queue.SLURM_FILE in filenames
            or (here / ".hydra" / "overrides.yaml").exists()
        ):
            out.append(here)
    return out


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
        return [
            str(k) for k in OmegaConf.select(cfg, "hydra.job.config.override_dirname.exclude_keys", default=[]) or []
        ]
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
        for key in ("model.name", "model.kind", "sampler.name", "kernel.name", *_CONFIG_COLUMNS):
            try:
                out[key] = OmegaConf.select(cfg, key, throw_on_resolution_failure=False)
            except Exception:
                out[key] = None
        return {
            **{k: out[k] for k in _CONFIG_COLUMNS},
            "model": {"name": out["model.name"] or out["model.kind"]},
            "sampler": {"name": out["sampler.name"]},
            **({"kernel": {"name": out["kernel.name"]}} if out["kernel.name"] else {}),
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
    if row.get("kernel") is None and cfg:
        row["kernel"] = _kernel_of(cfg)


def _kernel_of(cfg: dict) -> str | None:
    """The kernel a config names: a record's leaves out ``kernel`` for em (the default), Hydra's names it."""
    kernel = cfg.get("kernel", {"name": "em"})
    return kernel.get("name") if isinstance(kernel, dict) else kernel


def _record_columns(rec: dict) -> dict:
    row: dict[str, Any] = {
        k: rec.get(k)
        for k in ("model", "sampler", "K", "L", "eps", "steps", "n_samples", "tree", "budget", "call_rows")
    }
    row["kernel"] = rec.get("kernel") or "em"  # the kernel that ran; a record names it unless it is em (the default)
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
    submitted = _read_json(job / queue.SLURM_FILE) if rec is None else None
    if submitted is not None:
        row["_slurm_id"] = str(submitted.get("job_id"))
        row["_slurm_log"] = submitted.get("stderr")
        if overrides is None:
            overrides = submitted.get("overrides")
    _fill_from_config(row, _config_of(job, rec))
    row["overrides"] = " ".join(overrides or [])
    row["_key"] = tuple(sorted(overrides or []))
    for line in overrides or []:
        key, value = _split_override(line)
        if key not in row or row[key] is None:
            row[key] = value
    return row


_PENDING = frozenset({"PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED"})


def _apply_slurm(rows: list[dict]) -> None:
    """Judge the rows of SLURM cells without a record by the scheduler's state (one squeue and one sacct
    call for all), where the commands answer; otherwise keep the local view."""
    ids = {r["_slurm_id"] for r in rows if r.get("_slurm_id")}
    if not ids or not queue.available():
        return
    st = queue.states(ids)
    for r in rows:
        got = st.get(r.get("_slurm_id") or "")
        if got is None:
            continue
        state, reason = got
        if state in ("FAILED", "CANCELLED") and queue.memory_killed(r.get("_slurm_log")):
            state, reason = "OUT_OF_MEMORY", "task log: exceeded job memory limit"
        r["slurm"] = f"{state} ({reason})" if reason and reason != "None" else state
        if state in _PENDING:
            r["status"] = "pending"
        elif state in queue.ALIVE:
            r["status"] = "running"
        elif state != "COMPLETED":  # it left the queue without a record: SLURM says why
            r["status"] = "killed"
            r["error"] = f"SLURM {r['slurm']} (job {r['_slurm_id']}); reruns on relaunch"


def _collect(root: Path):
    """:func:`collect` plus a ``_key`` column (the sorted override tuple) used to match planned jobs."""
    import pandas as pd

    if not root.is_dir():
        raise FileNotFoundError(f"{root} is not a directory")
    rows = [job_row(j, root) for j in job_dirs(root)]
    _apply_slurm(rows)
    started = {r["_key"] for r in rows if r.get("path")}
    for job in planned_jobs(root) or []:
        key = tuple(sorted(job))
        if key in started:
            continue
        row: dict[str, Any] = {
            "job": _expected_dirname(root, job),
            "path": None,
            "status": "missing",
            "overrides": " ".join(job),
            "_key": key,
        }
        for line in job:
            k, value = _split_override(line)
            row.setdefault(k, value)
        rows.append(row)
    df = pd.DataFrame(rows, columns=None if rows else ["job", "path", "status", "overrides", "_key"])
    df = df.drop(columns=[c for c in ("_slurm_id", "_slurm_log") if c in df.columns])
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
        A ``pandas.DataFrame`` with the columns of :data:`COLUMNS` (``kernel``: the kernel that ran, ``em``
        where the record names none, as em's records do; ``speedup_mean``, ``nfe_mean``,
        ``acceptance`` as ``"a1/a2/..."`` plus ``acc_d1, acc_d2, ...``, metrics such as ``fid``), then
        one column per swept key not among them (``model.dim``, ``experiment``, ...), sorted by job.

    Raises:
        FileNotFoundError: ``sweep_dir`` is not a directory.
    """
    return _collect(Path(sweep_dir)).drop(columns="_key")


def write_csv_atomic(df, path: str | os.PathLike) -> None:
    """Write ``df`` to CSV through a temporary file and an atomic rename (:func:`specsamp.io.atomic_write`)."""
    from ..io import atomic_write

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
            "speedup": [
                f"{_fmt(m, '.3f')} ± {_fmt(s, '.3f')}" if _fmt(m, "") else ""
                for m, s in zip(df["speedup_mean"], df["speedup_sem"])
            ],
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
    if counts.get("pending", 0):  # SLURM cells still queued
        foot += f", {int(counts['pending'])} pending"
    if "slurm" in df.columns and df["slurm"].notna().any():
        show.insert(2, "slurm", df["slurm"].fillna("").astype(str))
    return show.to_string(index=False) + "\n" + foot


# ----------------------------------------------------------------------------------------------
# end-of-sweep summary (Hydra callback)


def sweep_summary(sweep_dir: str | os.PathLike) -> dict:
    """What the latest launch into ``sweep_dir`` did, judged from the files on disk.

    A job belongs to the latest launch when it is planned in ``multirun.yaml`` (basic sweeper) or,
    failing that, when Hydra wrote its ``.hydra/`` after ``multirun.yaml``. An ok job whose
    ``result.json`` is older than ``multirun.yaml`` was skipped.

    Returns:
        ``{"sweep_dir", "table" (DataFrame of this launch's jobs), "ran", "skipped", "failed"
        (list of rows), "running" (a live process, or SLURM's RUNNING), "pending" (queued or requeued on SLURM),
        "killed", "missing" (planned, not started), "config_errors_only" (bool), "kinds" (the
        ``kind`` of every failure: ``config``, ``exception``, ``infrastructure``), "unlogged" (``(path,
        logger_error)`` of the ok jobs whose logging failed)}``.
    """
    root = Path(sweep_dir)
    df = _collect(root)
    launch = _mtime(root / "multirun.yaml")
    planned = planned_jobs(root)
    if planned is not None:
        wanted = {tuple(sorted(j)) for j in planned}
        mine = df[[k in wanted for k in df["_key"]]]
    elif launch is not None:
        mine = df[
            [(p is not None and (_mtime(Path(p) / ".hydra" / "overrides.yaml") or 0) >= launch) for p in df["path"]]
        ]
    else:
        mine = df
    ok = mine[mine["status"] == "ok"]
    skipped = [p for p in ok["path"] if launch is not None and (_mtime(Path(p) / RESULT) or 0) < launch]
    failed = mine[mine["status"] == "failed"]
    kinds = [(_read_json(Path(p) / FAILED) or {}).get("kind") for p in failed["path"]]
    unlogged = [
        (p, rec["logger_error"]) for p in ok["path"] if (rec := _read_json(Path(p) / RESULT) or {}).get("logger_error")
    ]
    return {
        "unlogged": unlogged,
        "sweep_dir": str(root),
        "table": mine.drop(columns="_key"),
        "ran": len(ok) - len(skipped),
        "skipped": len(skipped),
        "failed": failed.to_dict("records"),
        "running": int((mine["status"] == "running").sum()),
        "pending": int((mine["status"] == "pending").sum()),
        "killed": int((mine["status"] == "killed").sum()),
        "missing": int((mine["status"] == "missing").sum()),
        "config_errors_only": bool(kinds) and all(k == "config" for k in kinds),
        "kinds": kinds,
    }


def resume_hint(sweep_dir: str | os.PathLike) -> str:
    """How to relaunch a sweep into ``sweep_dir``, so that its finished jobs are skipped: ``sweep_name=NAME``
    for the relative folder ``multirun/NAME`` (an ad-hoc sweep's default name is its launch time, ``DATE/TIME``, so
    rerunning the command without it starts a new folder), else ``hydra.sweep.dir=DIR``."""
    root = Path(sweep_dir)
    if (
        not root.is_absolute() and len(root.parts) > 1 and root.parts[0] == "multirun"
    ):  # conf/config.yaml's hydra.sweep.dir
        return f"rerun the same command with sweep_name={'/'.join(root.parts[1:])} (its finished jobs are skipped)"
    return f"rerun the same command with hydra.sweep.dir={root} (its finished jobs are skipped)"


def print_sweep_summary(sweep_dir: str | os.PathLike, file=None) -> dict:
    """Print :func:`sweep_summary` (failed jobs with their errors; how to resume when a job is not done) and
    return it."""
    file = file or sys.stdout
    s = sweep_summary(sweep_dir)
    n = len(s["table"])
    parts = [f"{s['ran']} ran", f"{s['skipped']} skipped (done before)", f"{len(s['failed'])} failed"]
    if s["killed"]:
        parts.append(f"{s['killed']} killed (no record; rerun on relaunch)")
    if s["running"]:
        parts.append(f"{s['running']} running")
    if s["pending"]:
        parts.append(f"{s['pending']} pending (queued)")
    if s["missing"]:
        parts.append(f"{s['missing']} not started")
    print(f"sweep {s['sweep_dir']}: {n} jobs, " + ", ".join(parts), file=file)
    for row in s["failed"]:
        print(f"  failed: {row['job'] or '.'}: {row['error']}  ({Path(row['path']) / FAILED})", file=file)
    for path, error in s["unlogged"]:  # the record is there, its logging is not: a relaunch retries it
        print(f"  not logged: {Path(path).name}: {error} (relaunch to retry)", file=file)
    alive = s["running"] + s["pending"]
    if alive:  # they write their records by themselves: a rerun now would not run them again
        print(
            f"  wait: {alive} job{'s are' if alive > 1 else ' is'} still queued or running and will write "
            f"{'their records' if alive > 1 else 'its record'}; python -m specsamp.runner.report collect "
            f"{s['sweep_dir']} shows where they stand",
            file=file,
        )
    if s["failed"] or s["killed"] or s["missing"] or s["unlogged"]:
        print(f"  resume: {'once they have ended, ' if alive else ''}{resume_hint(s['sweep_dir'])}", file=file)
    print(f"  table: python -m specsamp.runner.report collect {s['sweep_dir']}", file=file, flush=True)
    return s


def launched(sweep_dir: str | os.PathLike) -> bool:
    """True when a job of the latest launch into ``sweep_dir`` has started (its ``.hydra/`` is newer) or was
    submitted to SLURM (its ``slurm.json`` is newer)."""
    root = Path(sweep_dir)
    launch = _mtime(root / "multirun.yaml")
    if launch is None:
        return False
    return any(
        max(_mtime(j / ".hydra" / "overrides.yaml") or 0, _mtime(j / queue.SLURM_FILE) or 0) >= launch
        for j in job_dirs(root)
    )


# ----------------------------------------------------------------------------------------------
# command line


def main(argv: list[str] | None = None) -> int:
    """``python -m specsamp.runner.report collect SWEEP_DIR [--csv OUT]``: print the table, write the CSV.

    Exit status 0 (also while jobs are running or have failed: the table says so), 2 on a usage error.
    """
    ap = argparse.ArgumentParser(prog="python -m specsamp.runner.report", description="Tables from sweep directories.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("collect", help="one CSV row per job of a sweep directory")
    c.add_argument("sweep_dir", help="a sweep directory, e.g. multirun/gmm_grid")
    c.add_argument("--csv", default=None, help="output CSV (default: SWEEP_DIR/summary.csv)")
    args = ap.parse_args(argv)
    root = Path(args.sweep_dir)
    if not root.is_dir():
        print(
            f"error: SWEEP_DIR={args.sweep_dir!r} is invalid: no such directory (sweeps live in multirun/<sweep_name>).",
            file=sys.stderr,
        )
        return 2
    df = collect(root)
    out = Path(args.csv) if args.csv else root / "summary.csv"
    write_csv_atomic(df.drop(columns="path"), out)
    print(format_table(df))
    print(f"wrote {out} ({len(df)} rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
