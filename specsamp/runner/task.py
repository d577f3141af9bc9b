"""The Hydra task behind ``run.py``: config in, ``result.json`` and one printed line out.

Single run (``python run.py ...``): a bad configuration prints ``error: ...`` and exits with status 2;
a full disk or an unwritable output directory prints ``error: could not write PATH ...`` and exits
with status 3 (:mod:`specsamp.runner.exits`). The result line is printed, with the record's path, before
anything is written, so a write that fails loses no number.

Sweep (``python run.py -m ...``, any launcher): a job never stops the sweep. A job that fails (a bad
per-job value, an exception, a CUDA OOM) writes ``failed.json`` atomically into its directory (error,
kind ``config``, ``exception`` or ``infrastructure``, traceback, overrides, config) and returns; the
next jobs run, and :class:`specsamp.runner.callback.SweepReport` lists the failures at the end. A job whose
overrides do not compose (``hydra_plugins/specsamp_sweeper``) is recorded the same way. While it runs a
job keeps ``running.json`` (host, pid, a heartbeat) so that ``report collect`` tells a live job from a
killed one. A job whose ``result.json`` holds the same config hash is skipped; a job killed mid-run has
no ``result.json`` and runs again. A directory whose ``result.json`` is the complete record of another
config is never written into: the run (or the sweep job) is refused as a config error naming the
directory and the keys that differ, so one directory never mixes two runs' files.

A logger that fails after the record is written (``logger=wandb`` without network) leaves ``logger_error``
in the record; a relaunch into the same directory (``hydra.run.dir=DIR``; a sweep's ``sweep_name``) skips the
sampling and retries the logging (:func:`_log`).

With ``num_shards > 1`` a job runs only its block of trajectories (:mod:`specsamp.runner.shards`) and writes
``shard.pt`` before ``result.json``.

A sweep job of more than one batch keeps each finished batch in ``batches/`` until its record is written
(:mod:`specsamp.runner.resume`): a job stopped mid-run (a requeue, a kill, a relaunch) samples only the
batches it had not finished, and its record equals that of an uninterrupted run.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
import traceback
from pathlib import Path

from omegaconf import DictConfig

from ..errors import ConfigError, NonFiniteSamplesError
from ..io import torch_save_atomic, write_json_atomic
from .exits import INFRASTRUCTURE, NON_FINITE, USAGE, infrastructure_message, is_infrastructure
from .jobs import COMPOSE_ERROR_ENV, COMPOSE_ERROR_KIND_ENV, FAILED, HEARTBEAT_S, RESULT, RUNNING, SHARD, running_marker
from .loggers import log_record
from .loop import build, prepare, sample
from .outputs import MetricError, compute_metrics, save_images
from .records import Job, existing_record, make_record, refuse_other_record, scores_text, summary_line, versions
from .resume import BatchStore
from .shards import save_shard
from .slurm import job_identity


def _hydra_cfg():
    try:
        from hydra.core.hydra_config import HydraConfig

        return HydraConfig.get()
    except Exception:
        return None


def _output_dir() -> Path:
    hc = _hydra_cfg()
    return Path(hc.runtime.output_dir) if hc is not None else Path.cwd()


def is_multirun() -> bool:
    """True inside a job of a Hydra sweep (``-m``), whatever the launcher."""
    hc = _hydra_cfg()
    if hc is None:
        return False
    from hydra.types import RunMode

    return hc.mode == RunMode.MULTIRUN


def _job_overrides() -> list[str]:
    hc = _hydra_cfg()
    try:
        return list(hc.overrides.task) if hc is not None else []
    except Exception:
        return []


def fail(message: str) -> None:
    """Print a user error as one paragraph on stderr and exit with status 2 (no traceback)."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(USAGE)


def fail_infrastructure(error: BaseException) -> None:
    """Print an infrastructure failure as one paragraph on stderr and exit with status 3."""
    print(f"error: {infrastructure_message(error)}", file=sys.stderr)
    sys.exit(INFRASTRUCTURE)


def shown(path: Path) -> str:
    """``path`` relative to the working directory when it lies below it, else absolute."""
    path = Path(path).absolute()
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


HYDRA_FILES = frozenset({".hydra", "run.log", "run_task.log"})  # what Hydra writes into a run's directory itself


def discard_refused_dir(out_dir: Path) -> bool:
    """Remove the directory of a refused single run when this process created it (``specsamp.fresh_dir``,
    the default ``outputs/DATE/TIME/``) and it holds only Hydra's own files: a refused command leaves no
    empty run directory behind. The date folder above goes too when that leaves it empty. A directory the
    user named (``hydra.run.dir=DIR``) or one holding anything else is left as it is.

    Returns:
        True when the directory was removed.
    """
    import shutil

    from .jobs import _CLAIMED

    out_dir = Path(out_dir)
    if str(out_dir) not in _CLAIMED.values() and str(out_dir.absolute()) not in {
        str(Path(v).absolute()) for v in _CLAIMED.values()
    }:
        return False
    try:
        if any(p.name not in HYDRA_FILES for p in out_dir.iterdir()):
            return False
        shutil.rmtree(out_dir)
        out_dir.parent.rmdir()  # the date folder, when this was its only run
        if out_dir.parent.parent.name == "outputs":
            out_dir.parent.parent.rmdir()
    except OSError:
        pass
    return not out_dir.exists()


def _clear_failure(out_dir: Path) -> None:
    (out_dir / FAILED).unlink(missing_ok=True)


def write_failure(out_dir: Path, error: BaseException, cfg_dict: dict | None, cfg_hash: str | None) -> dict:
    """Record a failed job atomically in ``out_dir/failed.json`` and return the record."""
    kind = "config" if isinstance(error, ConfigError) else "infrastructure" if is_infrastructure(error) else "exception"
    kind = getattr(error, "record_kind", None) or kind  # e.g. timed_out (the SLURM launcher's time-limit signal)
    details = getattr(error, "details", None)  # non_finite: how many samples, which trajectories, from which step
    rec = {
        "status": "failed",
        "kind": kind,
        "error": infrastructure_message(error) if kind == "infrastructure" else (str(error) or type(error).__name__),
        "error_type": type(error).__name__,
        "traceback": None if kind in ("config", "non_finite") else "".join(traceback.format_exception(error)),
        **({"non_finite": details} if kind == "non_finite" and isinstance(details, dict) else {}),
        "overrides": _job_overrides(),
        "config_hash": cfg_hash,
        "config": cfg_dict,
        "output_dir": str(out_dir),
        "host": socket.gethostname(),
        "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
        **slurm_fields(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "versions": versions(),
    }
    write_json_atomic(out_dir / FAILED, rec)
    return rec


def slurm_fields() -> dict:
    """``{"slurm": ...}`` (:func:`specsamp.runner.slurm.job_identity`: array job id, task id, host) inside a
    SLURM job, else ``{}``; merged into ``result.json`` and ``failed.json``."""
    ident = job_identity()
    return {"slurm": ident} if ident else {}


def _execute(cfg: DictConfig, out_dir: Path, multirun: bool, state: dict) -> float | None:
    """One job: the stages of :func:`specsamp.runner.loop.run_config` (prepare, build, sample, make_record), with
    the job's own steps between them (skip a run that is done; refuse a directory that holds another config's
    record), then write, score, write and log."""
    # once, before the skip: a bad value is refused even when a record exists
    prepared = prepare(cfg, job=Job(str(out_dir), _job_overrides(), multirun=multirun, slurm=job_identity()))
    state.update(cfg=prepared.recorded, hash=prepared.config_hash)
    done = _skip_if_done(prepared, out_dir, multirun)
    if done is not None:
        return done
    _clear_failure(out_dir)
    built = build(prepared)
    # a second config's files never mix with the first's: refused once every value is checked, before sampling
    refuse_other_record(out_dir, prepared.config_hash, prepared.recorded)
    # a sweep job keeps its finished batches, so a requeue or a relaunch continues from them (specsamp.runner.resume)
    batches = BatchStore(out_dir, prepared.config_hash) if multirun and prepared.run.skip_existing else None
    sampled = sample(built, batches)
    record = make_record(prepared, sampled)
    image_dir = _write(prepared, record, sampled.result, out_dir, batches)
    metric_error = _score(prepared, record, sampled.result, image_dir, out_dir)
    logged = _log(prepared.run, prepared.recorded, record, out_dir, multirun, exit_on_failure=False)
    if metric_error is not None:
        message = (
            f"{metric_error} The samples, images and result.json are saved in {out_dir}; score the "
            "images there once the cause is fixed (FID: `python -m specsamp.metrics.fid "
            f"{out_dir}/images --ref REF`; CLIP: specsamp.metrics.clip.clip_scores on the same files)."
        )
        if metric_error.user:
            raise ConfigError(message)
        if not multirun:
            print(f"error: {message}", file=sys.stderr)
            sys.exit(1)
        raise RuntimeError(message)
    if not logged and not multirun:
        sys.exit(INFRASTRUCTURE)
    return record["speedup"]["mean"]


def _skip_if_done(prepared, out_dir: Path, multirun: bool) -> float | None:
    """The mean speedup of a run whose record is already in ``out_dir`` with the same config hash (and, for a
    shard, its ``shard.pt``), said so on stdout, its failed logging retried; None when the run is to be done."""
    run, h = prepared.run, prepared.config_hash
    if not run.skip_existing:
        return None
    rec = existing_record(out_dir, h)
    if rec is None or (run.num_shards > 1 and not (out_dir / SHARD).exists()):
        return None
    _clear_failure(out_dir)
    print(f"skipped (done, config {h}): {summary_line(rec)}  record: {shown(out_dir / RESULT)}", flush=True)
    if rec.get("logger_error") and run.logger._target_ is not None:  # the logging failed last time: retry it
        _log(run, prepared.recorded, rec, out_dir, multirun)
    return rec["speedup"]["mean"]


def _shard_tag(run) -> str:
    return f"[shard {run.shard}/{run.num_shards}] " if run.num_shards > 1 else ""


def _write(prepared, record: dict, result, out_dir: Path, batches: BatchStore | None) -> Path | None:
    """Print the result line, then write the run's files: ``shard.pt`` or ``samples.pt``, the images, and
    ``result.json`` last (before any metric is scored, so a scoring failure loses no samples).

    Returns:
        The images' directory, or None when none were saved.
    """
    run = prepared.run
    # the numbers reach the terminal before any file is written: a full disk loses no result
    print(_shard_tag(run) + summary_line(record) + f"  record: {shown(out_dir / RESULT)}", flush=True)
    if run.num_shards > 1:
        save_shard(out_dir, result, prepared.indices, record)
    elif run.save_samples:
        torch_save_atomic(out_dir / "samples.pt", result.samples.cpu())
    image_dir = save_images(result, out_dir) if run.save_samples or run.metrics else None  # a PNG per image + grid
    write_json_atomic(out_dir / RESULT, record)
    if batches is not None:
        batches.clear()  # the record holds them now
    return image_dir


def _score(prepared, record: dict, result, image_dir: Path | None, out_dir: Path) -> MetricError | None:
    """Score the saved images (``metrics``) into the record, write it again and print the scores.

    Returns:
        The scoring's :class:`~specsamp.runner.outputs.MetricError` (its values kept in the record), or None.
    """
    run = prepared.run
    if not run.metrics:
        return None
    metric_error = None
    try:
        record["metrics"] = compute_metrics(run.metrics, result, image_dir, run.device)
    except MetricError as e:  # whatever went wrong, the record keeps the samples' statistics
        metric_error = e
        record["metrics"] = e.values
        record["metrics_error"] = str(e)
    record.update({k: v for k, v in record["metrics"].items() if isinstance(v, (int, float))})
    write_json_atomic(out_dir / RESULT, record)
    if scores_text(record):  # the result line was printed before scoring: the scores get their own
        print(f"{_shard_tag(run)}{scores_text(record)}  record: {shown(out_dir / RESULT)}", flush=True)
    return metric_error


def _log(run, recorded: dict, record: dict, out_dir: Path, multirun: bool, *, exit_on_failure: bool = True) -> bool:
    """Send the record to the configured logger; on failure keep the record, say so in it and on stderr.

    A failure is recorded as ``logger_error`` in ``result.json`` (the numbers are kept as they are); the
    next launch into the same directory (the message names it) finds the record, skips the sampling and retries the logging, and a
    retry that succeeds removes ``logger_error``. A single run whose logging failed exits with status 3
    (the configuration was checked at the start: what failed is the logger's service or the network);
    a sweep job reports it and counts as done.

    Returns:
        True when the record was logged (or no logger is configured).
    """
    try:
        log_record(run.logger, recorded, record, out_dir, run.sweep_name if multirun else None)
    except Exception as e:  # noqa: BLE001 - whatever the logger raised, the record stays and says so
        record["logger_error"] = f"logger={run.logger.name} failed: {type(e).__name__}: {' '.join(str(e).split())}"
        write_json_atomic(out_dir / RESULT, record)
        again = (
            "relaunch the sweep into the same folder (its summary says how)"
            if multirun
            else f"rerun the same command with hydra.run.dir={shown(out_dir)}"
        )  # a bare rerun gets a new folder
        print(
            f"error: {record['logger_error']}. The record is saved in {shown(out_dir / RESULT)} with logger_error "
            f"set; {again} to retry the logging (the sampling is skipped).",
            file=sys.stderr,
            flush=True,
        )
        if exit_on_failure and not multirun:
            sys.exit(INFRASTRUCTURE)
        return False
    if record.pop("logger_error", None) is not None:
        write_json_atomic(out_dir / RESULT, record)
        print(f"logged (retried): logger={run.logger.name}  record: {shown(out_dir / RESULT)}", flush=True)
    return True


class _Liveness:
    """``running.json`` of a sweep job: written at its start, touched every ``HEARTBEAT_S`` seconds,
    removed when the job ends with a record, marked ``ended`` when it is interrupted."""

    def __init__(self, out_dir: Path) -> None:
        self.path = out_dir / RUNNING
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        write_json_atomic(self.path, running_marker())
        self._thread = threading.Thread(target=self._beat, name="specsamp-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                os.utime(self.path)
            except OSError:
                pass

    def stop(self) -> None:
        self._stop.set()

    def remove(self) -> None:
        self.stop()
        self.path.unlink(missing_ok=True)

    def ended(self, how: str) -> None:
        self.stop()
        try:
            write_json_atomic(self.path, {**running_marker(), "ended": how})
        except OSError:
            pass


def _compose_error() -> Exception | None:
    """The composition error of a sweep job that could not be composed (set by our sweeper), if any."""
    msg = os.environ.get(COMPOSE_ERROR_ENV)
    if not msg:
        return None
    what = f"its overrides do not compose: {msg}"
    return ConfigError(what) if os.environ.get(COMPOSE_ERROR_KIND_ENV, "config") == "config" else RuntimeError(what)


def run_task(cfg: DictConfig) -> float | None:
    """Validate and run one job; skip it when its record already exists with the same config hash.

    In a sweep, a failing job writes ``failed.json`` and returns None instead of raising or exiting, so
    that the launcher (basic or submitit) runs the other jobs; an infrastructure failure (full disk,
    read-only directory) is recorded where possible and re-raised, so that the sweep's exit status is 3.
    A single run exits with status 2 on a bad config and 3 on an infrastructure failure.

    Returns:
        The mean per-trajectory speedup (None for a failed job of a sweep).
    """
    out_dir = _output_dir()
    multirun = is_multirun()
    state: dict = {}
    live = _Liveness(out_dir) if multirun else None
    try:
        composed = _compose_error()
        if composed is not None:
            raise composed
        if live is not None:
            live.start()
        speedup = _execute(cfg, out_dir, multirun, state)
        if live is not None:
            live.remove()
        return speedup
    except KeyboardInterrupt:
        if live is not None:
            live.ended("interrupted")
        raise
    except ConfigError as e:
        if not multirun:
            discard_refused_dir(out_dir)
            fail(str(e))
        err: Exception = e
    except NonFiniteSamplesError as e:
        if not multirun:  # the run's record of it is failed.json; no result.json, no samples
            try:
                write_failure(out_dir, e, state.get("cfg"), state.get("hash"))
                see = f" Details: {shown(out_dir / FAILED)}."
            except OSError as e2:
                see = f" (its failed.json could not be written: {e2})"
            print(f"error: {e}{see}", file=sys.stderr, flush=True)
            sys.exit(NON_FINITE)
        err = e
    except Exception as e:
        if not multirun:
            if is_infrastructure(e):
                fail_infrastructure(e)
            raise
        err = e
    finally:
        if live is not None:
            live.stop()
    where = ",".join(_job_overrides()) or str(out_dir)
    try:
        write_failure(out_dir, err, state.get("cfg"), state.get("hash"))
        if live is not None:
            live.remove()
        see = f" (see {out_dir / FAILED})"
    except OSError as e2:
        if live is not None:
            live.ended("failed")
        see = f" (and its failed.json could not be written: {e2})"
    if is_infrastructure(err):
        print(f"error: job {where} failed: {infrastructure_message(err)}{see}", file=sys.stderr, flush=True)
        raise err  # the sweep's exit status becomes 3 (hydra_plugins/specsamp_sweeper)
    print(f"error: job {where} failed: {err}{see}", file=sys.stderr, flush=True)
    return None
