"""specsamp's SLURM launcher (``hydra/launcher=slurm``, ``slurm_cpu``, ``slurm_gpu``): hydra-submitit-launcher's
:class:`SlurmLauncher`, with a sweep's bookkeeping done honestly.

What it changes (the job body, the sbatch script and the submitit folder layout stay submitit's):

* **Before submitting**, a cell whose ``result.json`` holds the same config hash (and ``shard.pt`` for a
  shard) is dropped, and so is a cell whose ``slurm.json`` names an array task that ``squeue``/``sacct``
  still report as pending or running (:data:`specsamp.runner.slurm.ALIVE`), or whose ``running.json``
  belongs to a live process; the counts are printed. Nothing is submitted when nothing is left.
* **Time limit**: a ``timeout_min`` that leaves less than a minute before the warning signal
  (``signal_delay_s``) is refused before anything is submitted (:func:`check_time_limit`, exit 2).
* **Memory**: when ``mem_gb`` is unset (``slurm``, ``slurm_cpu``), it is the largest of the cells' own
  memory estimates with a margin (:func:`specsamp.runner.memory.mem_gb_for`), printed at submission.
* **At submission** it prints the array job id, the log folder and the ``squeue``/``sacct``/``scancel``
  commands (for one cell, which submitit submits as a plain job, its own log path and ``scancel ID``),
  and writes ``slurm.json`` (job id, task id, paths) into each submitted cell's directory.
* **It waits for every task** (the queue holding none of the array's tasks: ``squeue -j ARRAY``, polled
  every ``poll_s`` seconds, printing a line when the counts change, pending tasks with SLURM's reason),
  then collects what each task left, whatever the others did. hydra-submitit-launcher reads the results
  in order and stops at the first failed task (a ``scancel``, an OOM kill), leaving the others running
  unreported. When every task left pends for a reason that waiting does not resolve (:func:`stuck_reason`:
  no node of the partition can take the request), it cancels them and exits 2 with a paragraph.
* **Ctrl-C** while waiting says that the array keeps running and prints its ``scancel`` command; the
  summary counts its cells as running or pending and says to wait before rerunning. With
  ``cancel_on_interrupt: true`` it cancels the array instead.
* **sbatch refusals** exit 2 with one paragraph naming the launcher setting (partition, account, qos,
  CPUs, memory, GPUs, time); an unreachable controller raises an infrastructure error (exit 3).
* **Inside the task**, a cell that recorded ``failed.json`` ends with a non-zero exit, so SLURM's
  accounting says FAILED (and ``--mail-type=FAIL`` fires). On submitit's signal (``USR2``,
  ``signal_delay_s`` seconds before ``timeout_min``, or a preemption) a cell that samples batch-wise
  (its finished batches are on disk, :mod:`specsamp.runner.resume`) requeues itself through submitit's
  checkpointing (:meth:`SpecsampSlurmLauncher.checkpoint`, at most ``max_num_timeout`` times for time
  limits) and the requeued attempt continues from those batches; any other cell stops and records
  ``failed.json`` of kind ``timed_out``, so a relaunch reruns it (from its finished batches, if any).

Source: hydra-submitit-launcher 1.2 (``BaseSubmititLauncher.launch``/``__call__``) and submitit 1.5
(``SlurmExecutor``, ``JobPaths``, ``JobEnvironment``; the ``--signal=USR2@signal_delay_s`` header line).
"""

from __future__ import annotations

import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.core.utils import JobReturn, JobStatus
from omegaconf import OmegaConf, open_dict, read_write

try:
    from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf, SlurmQueueConf
    from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher

    HAVE_SUBMITIT = True
except ImportError:  # the `cluster` extra is not installed: hydra/launcher=slurm does not compose
    from hydra.plugins.launcher import Launcher as SlurmLauncher

    @dataclass
    class SlurmQueueConf:  # type: ignore[no-redef]
        """Stand-in when hydra-submitit-launcher is missing."""

    BaseQueueConf = SlurmQueueConf  # type: ignore[misc]
    HAVE_SUBMITIT = False

from specsamp.runner import jobs, slurm as queue

LAUNCHER_KEYS = ("poll_s", "cancel_on_interrupt", "dry_run")


@dataclass
class SpecsampSlurmConf(SlurmQueueConf):
    """hydra-submitit-launcher's ``SlurmQueueConf`` plus this launcher's own keys."""

    _target_: str = "hydra_plugins.specsamp_sweeper.slurm.SpecsampSlurmLauncher"
    poll_s: float = 5.0  # seconds between two looks at the queue while waiting
    cancel_on_interrupt: bool = False  # Ctrl-C: false = leave the array running (print scancel), true = scancel it
    dry_run: bool = False  # print the sbatch script of the cells to submit, submit nothing


if HAVE_SUBMITIT:
    ConfigStore.instance().store(
        group="hydra/launcher", name="specsamp_slurm", node=SpecsampSlurmConf, provider="specsamp"
    )


def _gpus_for(device: Any) -> int:
    return 1 if str(device).startswith("cuda") else 0


def register_resolvers() -> None:
    """``specsamp.gpus_for:DEVICE``: 1 for ``cuda``/``cuda:N``, else 0 (the ``slurm`` option's GPU count)."""
    if not OmegaConf.has_resolver("specsamp.gpus_for"):
        OmegaConf.register_new_resolver("specsamp.gpus_for", _gpus_for)


register_resolvers()


class CellFailed(RuntimeError):
    """Raised at the end of an array task whose cell recorded ``failed.json``: the task exits non-zero."""


class CellTimedOut(RuntimeError):
    """Raised inside a cell by submitit's timeout signal: the cell records ``failed.json`` (kind ``timed_out``)."""

    record_kind = "timed_out"


# ----------------------------------------------------------------------------------------------
# sbatch refusals -> the launcher setting to change


_SETTINGS = (  # (pattern in sbatch's error, the settings it is about, what to do)
    (r"invalid partition", ("partition",), "name a partition that `sinfo -s` lists (null: the cluster's default)"),
    (
        r"invalid account",
        ("account", "partition"),
        "name an account that `sacctmgr show assoc user=$USER` lists for that partition",
    ),
    (
        r"invalid qos|qos.*not valid|invalid quality of service",
        ("qos",),
        "name a QOS of your association (`sacctmgr show assoc user=$USER format=qos`)",
    ),
    (
        r"invalid generic resource|invalid gres|gres",
        ("gpus_per_node", "gres"),
        "use hydra/launcher=slurm_cpu (gpus_per_node=0) on a partition without GPUs",
    ),
    (r"time limit", ("timeout_min",), "stay within the partition's MaxTime (`sinfo -o '%P %l'`)"),
    (r"memory", ("mem_gb",), "ask for less memory than a node has (`sinfo -N -o '%N %m'`, in MB)"),
    (
        r"more processors|cpu count|cpus",
        ("cpus_per_task",),
        "ask for at most the CPUs of one node (`sinfo -N -o '%N %c'`)",
    ),
    (
        r"requested node configuration is not available|node count|nodes",
        ("cpus_per_task", "mem_gb", "gpus_per_node", "constraint", "nodes"),
        "no node of the partition has that much: compare with `sinfo -N -o '%N %c %m %G'` (CPUs, MB, GPUs)",
    ),
)
_INFRA = re.compile(
    r"unable to contact slurm controller|socket timed out|connection refused|zero bytes were transmitted|"
    r"transport endpoint|munge|communication connection failure|slurm_persist_conn",
    re.I,
)


def _sbatch_error(text: str) -> str:
    lines = [ln.strip() for ln in str(text).splitlines() if "error" in ln.lower() and ln.strip()]
    return " ".join(lines[-2:]) if lines else " ".join(str(text).split())[:400]


def explain_refusal(error: BaseException, params: dict[str, Any]) -> tuple[int, str]:
    """``(exit status, paragraph)`` for a failed submission: 3 when the controller cannot be reached, 2
    (naming the launcher setting and its value) when sbatch refused the request.

    Args:
        error: what submitit raised (``FailedJobError``/``FailedSubmissionError`` holding sbatch's stderr).
        params: the launcher's settings (``hydra.launcher``).
    """
    from specsamp.runner.exits import INFRASTRUCTURE, USAGE

    text = str(error)
    said = _sbatch_error(text)
    if _INFRA.search(text):
        return INFRASTRUCTURE, (
            f"sbatch could not reach the SLURM controller ({said}). This is a problem of the cluster, "
            "not of the configuration: check `scontrol ping` (or ask the admins), then rerun the same "
            "command (finished cells are kept and skipped). Nothing was submitted."
        )
    for pattern, keys, what in _SETTINGS:
        if re.search(pattern, said, re.I):
            shown = ", ".join(f"hydra.launcher.{k}={params.get(k)!r}" for k in keys if k in params or k == keys[0])
            return USAGE, (
                f"sbatch refused the sweep's job array: {said} The setting{'s' if ',' in shown else ''} "
                f"involved: {shown}; {what}. Nothing was submitted."
            )
    return USAGE, (
        f"sbatch refused the sweep's job array: {said} Check the hydra.launcher settings (partition, account, "
        "qos, cpus_per_task, mem_gb, gpus_per_node, timeout_min, additional_parameters) against the cluster "
        "(`sinfo -s`); hydra.launcher.dry_run=true prints the sbatch script without submitting. Nothing was submitted."
    )


SIGNAL_SLACK_S = 60  # SLURM sends the warning signal up to about a minute early (the controller polls)


def check_time_limit(params: dict[str, Any]) -> None:
    """Refuse a ``timeout_min`` that leaves no time before submitit's warning signal.

    SLURM sends ``USR2`` ``signal_delay_s`` seconds before ``timeout_min`` (``--signal=USR2@signal_delay_s``),
    give or take :data:`SIGNAL_SLACK_S`; with ``timeout_min * 60 - signal_delay_s`` below that, every cell
    would receive its own early-warning signal within seconds of starting and stop, on every relaunch.

    Raises:
        specsamp.errors.ConfigError: names ``hydra.launcher.timeout_min`` and ``hydra.launcher.signal_delay_s``,
            their values and what is valid.
    """
    from specsamp.errors import ConfigError

    timeout, delay = params.get("timeout_min"), params.get("signal_delay_s")
    if not isinstance(timeout, int) or isinstance(timeout, bool) or timeout < 1:
        raise ConfigError(
            f"hydra.launcher.timeout_min={timeout!r} is invalid: must be a whole number of minutes >= 1 "
            "(sbatch --time)."
        )
    if delay is None:
        return
    if not isinstance(delay, int) or isinstance(delay, bool) or delay < 0:
        raise ConfigError(
            f"hydra.launcher.signal_delay_s={delay!r} is invalid: must be a whole number of seconds >= 0."
        )
    if timeout * 60 - delay >= SIGNAL_SLACK_S:
        return
    least = -(-(delay + SIGNAL_SLACK_S) // 60)
    lower = (
        f", or lower hydra.launcher.signal_delay_s to at most {timeout * 60 - SIGNAL_SLACK_S}"
        if timeout * 60 - SIGNAL_SLACK_S >= 0
        else ""
    )
    raise ConfigError(
        f"hydra.launcher.timeout_min={timeout} ({timeout * 60} s) is too short for hydra.launcher.signal_delay_s="
        f"{delay}: SLURM sends the time-limit warning signal signal_delay_s seconds before timeout_min (up to "
        f"{SIGNAL_SLACK_S} s earlier), so every cell would be stopped by its own warning as soon as it starts, "
        f"and again on every relaunch. Use hydra.launcher.timeout_min={least} or more{lower}. Nothing was submitted."
    )


# squeue's pending reasons that no wait resolves: the request exceeds every node of the partition
# (PartitionConfig, BadConstraints), the partition's node or time limits (PartitionNodeLimit,
# PartitionTimeLimit), or no node at all can take it (ReqNodeNotAvail with an empty node list)
STUCK_REASONS = frozenset({"PartitionConfig", "BadConstraints", "PartitionNodeLimit", "PartitionTimeLimit"})


def stuck_reason(reason: str) -> bool:
    """True for a pending reason that cannot resolve by waiting (:data:`STUCK_REASONS`, or
    ``ReqNodeNotAvail, UnavailableNodes:`` naming no node)."""
    reason = str(reason).strip()
    if reason.split(",")[0].strip() in STUCK_REASONS:
        return True
    if reason.startswith("ReqNodeNotAvail"):
        nodes = reason.partition("UnavailableNodes:")
        return bool(nodes[1]) and not nodes[2].strip()
    return False


@dataclass
class QueueView:
    """One ``squeue -h -r -j JOB -o '%i|%T|%r'`` answer: ``states`` {STATE: n}, ``reasons`` {pending
    reason: n}, ``stuck`` (ids of the tasks pending for a :func:`stuck_reason`)."""

    states: dict[str, int]
    reasons: dict[str, int]
    stuck: list[str]

    @property
    def left(self) -> int:
        return sum(self.states.values())

    def line(self) -> str:
        """``2 pending (PartitionConfig), 1 running``: each state with its count, pending with its reasons."""
        parts = []
        for state, n in sorted(self.states.items()):
            part = f"{n} {state.lower()}"
            if state == "PENDING" and self.reasons:
                part += (
                    " ("
                    + ", ".join(r if len(self.reasons) == 1 else f"{k} {r}" for r, k in sorted(self.reasons.items()))
                    + ")"
                )
            parts.append(part)
        return ", ".join(parts)


def queue_view(text: str) -> QueueView:
    """Parse ``squeue -h -r -o '%i|%T|%r'`` lines (one per task; a reason may hold commas)."""
    states: dict[str, int] = {}
    reasons: dict[str, int] = {}
    stuck: list[str] = []
    for line in str(text).splitlines():
        parts = line.strip().split("|", 2)
        if len(parts) < 2 or not parts[1].strip():
            continue
        job, state, reason = parts[0].strip(), parts[1].split()[0], (parts[2].strip() if len(parts) > 2 else "")
        states[state] = states.get(state, 0) + 1
        if state == "PENDING" and reason and reason != "None":
            reasons[reason] = reasons.get(reason, 0) + 1
            if stuck_reason(reason):
                stuck.append(job)
    return QueueView(states, reasons, stuck)


def _nodes_of(partition: str | None) -> str:
    """``node: 2 CPUs, 11980 MB, gres (null)`` for (at most 3 of) the partition's nodes, or '' when sinfo does not answer."""
    cmd = ["sinfo", "-h", "-N", "-o", "%N|%c|%m|%G"] + (["-p", str(partition)] if partition else [])
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=queue.QUERY_TIMEOUT_S).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""
    rows = []
    for line in dict.fromkeys(out.split()):
        f = line.split("|")
        if len(f) == 4:
            rows.append(f"{f[0]}: {f[1]} CPUs, {f[2]} MB, gres {f[3]}")
    return "; ".join(rows[:3]) + (f" (and {len(rows) - 3} more)" if len(rows) > 3 else "")


def stuck_message(job: str, view: QueueView, params: dict[str, Any], nodes: str, cancelled: bool) -> str:
    """The paragraph of a job whose tasks pend for a reason that cannot resolve (exit 2)."""
    reasons = sorted({r for r in view.reasons if stuck_reason(r)})
    asked = ", ".join(
        f"hydra.launcher.{k}={params.get(k)!r}"
        for k in ("cpus_per_task", "mem_gb", "gpus_per_node", "partition")
        if k in params
    )
    extra = params.get("additional_parameters") or {}
    if extra:
        asked += f", hydra.launcher.additional_parameters={dict(extra)!r}"
    have = (
        f"; the partition's nodes: {nodes}"
        if nodes
        else "; compare with `sinfo -N -o '%N %c %m %G'` (CPUs, MB, GPUs per node)"
    )
    done = (
        f"The {len(view.stuck)} pending task{'s were' if len(view.stuck) > 1 else ' was'} cancelled (scancel); "
        if cancelled
        else f"Cancel the pending tasks with scancel {job}; "
    )
    return (
        f"SLURM cannot run job {job}: {len(view.stuck)} task{'s pend' if len(view.stuck) > 1 else ' pends'} with reason "
        f"{', '.join(reasons)}, which waiting does not resolve (no node of the partition can take the request). "
        f"The request: {asked}{have}. Lower the request (or choose another partition or launcher preset: "
        f"hydra/launcher=slurm_cpu for a CPU partition). {done}then rerun the same command with the new settings "
        "(finished cells are kept and skipped)."
    )


# ----------------------------------------------------------------------------------------------
# the launcher


def _write_json(path: Path, data: dict) -> None:
    from specsamp.io import write_json_atomic

    write_json_atomic(path, data)


class SpecsampSlurmLauncher(SlurmLauncher):
    """:class:`SlurmLauncher` that skips done and live cells, reports the array, waits for every task.

    Args:
        poll_s: seconds between two looks at the queue while waiting (> 0).
        cancel_on_interrupt: on Ctrl-C, ``scancel`` the array (true) or leave it running (false).
        dry_run: print the sbatch script the cells left to run would be submitted with; submit nothing.
        **params: hydra-submitit-launcher's ``SlurmQueueConf`` keys, passed on unchanged.
    """

    def __init__(
        self, poll_s: float = 5.0, cancel_on_interrupt: bool = False, dry_run: bool = False, **params: Any
    ) -> None:
        super().__init__(**params)
        self.poll_s = float(poll_s)
        self.cancel_on_interrupt = bool(cancel_on_interrupt)
        self.dry_run = bool(dry_run)
        self._mem_from_estimate = self.params.get("mem_gb") is None  # mem_gb unset: derived per launch (_mem_gb)

    # -- inside the array task -------------------------------------------------------------------

    def __call__(
        self, sweep_overrides: list[str], job_dir_key: str, job_num: int, job_id: str, singleton_state: dict[type, Any]
    ) -> JobReturn:
        """Run one cell in its array task (hydra-submitit-launcher's body), with a timeout handler, and
        raise :class:`CellFailed` when it recorded a failure, so that the task's exit status is non-zero.

        On submitit's signal (``USR2``, ``signal_delay_s`` before ``timeout_min``, or a preemption): a cell
        sampling batch-wise (:func:`specsamp.runner.resume.active`; its finished batches are on disk) is
        handed to submitit's own handler, which calls :meth:`checkpoint`, requeues the task with
        ``scontrol requeue`` and exits; the requeued attempt continues from the finished batches. Each
        time-limit requeue counts against ``max_num_timeout`` (submitit counts a signal as a time limit once
        the task ran ``min(0.8 timeout_min, timeout_min - 10 min)``, a preemption before that). A cell that
        cannot resume (one batch), or is out of requeues, stops with :class:`CellTimedOut` and records
        ``failed.json`` of kind ``timed_out``; its finished batches stay for the relaunch.
        """
        import submitit

        from specsamp.runner import resume

        sig = getattr(signal, "SIG" + submitit.JobEnvironment.USR_SIG, signal.SIGUSR2)
        previous = signal.getsignal(sig)  # submitit's SignalHandler.checkpoint_and_try_requeue inside a task

        def _timed_out(signum, frame):  # noqa: ARG001
            store = resume.active()
            if store is None:
                why = (
                    "it runs as one batch, so it restarts on relaunch; raise hydra.launcher.timeout_min, or set "
                    "batch_size (or num_shards) so that it can resume"
                )
            else:
                why = "submitit's signal handler is not installed"
                if callable(previous):
                    try:
                        previous(signum, frame)  # checkpoint(), scontrol requeue, then SystemExit: the requeue resumes
                    except Exception as e:  # noqa: BLE001 (out of requeues, or scontrol refused): record timed_out
                        why = " ".join(str(e).split()) or type(e).__name__
                why = (
                    f"was not requeued ({why}); its {store.finished()} of {store.total} batches finished so far are "
                    f"kept in {store.dir} and a relaunch continues from them; raise hydra.launcher.timeout_min or "
                    "hydra.launcher.max_num_timeout"
                )
            signal.signal(sig, signal.SIG_IGN)  # once: the cell is stopping
            raise CellTimedOut(
                f"SLURM's time limit is near (signal {signal.Signals(signum).name}, sent signal_delay_s="
                f"{self.params.get('signal_delay_s')} s before timeout_min={self.params.get('timeout_min')}): the cell "
                f"stopped and {why}"
            )

        signal.signal(sig, _timed_out)
        try:
            ret = super().__call__(sweep_overrides, job_dir_key, job_num, job_id, singleton_state)
        finally:
            try:
                signal.signal(sig, previous)
            except (TypeError, ValueError):
                pass
        out_dir = Path(str(ret.hydra_cfg.hydra.runtime.output_dir)) if ret.hydra_cfg is not None else None
        failed = out_dir / jobs.FAILED if out_dir is not None else None
        if ret.status == JobStatus.FAILED or (failed is not None and failed.exists()):
            kind = (jobs._read_json(failed) or {}).get("kind") if failed is not None else None
            raise CellFailed(
                f"cell {' '.join(ret.overrides or sweep_overrides)} failed (kind {kind or 'unknown'}): see {failed}"
            )
        return ret

    def checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        """submitit's checkpoint hook (called by its signal handler inside the task): the same call again,
        for the requeued attempt, when the cell's finished batches are on disk (it resumes from them);
        None otherwise (submitit then does not requeue, and the cell records ``timed_out``)."""
        import submitit

        from specsamp.runner import resume

        if resume.active() is None:
            return None
        return submitit.helpers.DelayedSubmission(self, *args, **kwargs)

    # -- in the launching process ----------------------------------------------------------------

    def _executor(self):
        import submitit

        params = dict(self.params)
        ex = submitit.AutoExecutor(
            folder=params.pop("submitit_folder"),
            cluster="slurm",
            slurm_max_num_timeout=params.pop("max_num_timeout", 3),
        )
        base = set(OmegaConf.structured(BaseQueueConf).keys())
        ex.update_parameters(**{k if k in base else f"slurm_{k}": v for k, v in params.items()})
        return ex

    def _job_dir(self, overrides: Sequence[str]) -> Path:
        exclude = OmegaConf.select(self.config, "hydra.job.config.override_dirname.exclude_keys", default=[]) or []
        return Path(str(self.config.hydra.sweep.dir)) / jobs.job_dirname(list(overrides), [str(k) for k in exclude])

    def _done(self, overrides: Sequence[str], job_dir: Path) -> bool:
        """True when the cell's record exists with the config hash it would be run with now."""
        from specsamp.runner.loop import record_hash
        from specsamp.runner.records import existing_record

        if not (job_dir / jobs.RESULT).exists():
            return False
        try:
            cfg = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
            with read_write(cfg), open_dict(cfg):
                del cfg["hydra"]  # Hydra's runtime keys resolve only inside the job; the hash never reads them
            run, _, h = record_hash(cfg)
        except Exception:  # noqa: BLE001 (a cell that does not compose or validate runs, and records why)
            return False
        if not run.skip_existing or existing_record(job_dir, h) is None:
            return False
        return run.num_shards <= 1 or (job_dir / jobs.SHARD).exists()

    def _mem_gb(self, cells: list[tuple[Sequence[str], Path]]) -> int | None:
        """``mem_gb`` for the array when the launcher config leaves it unset: the largest
        :func:`specsamp.runner.memory.mem_gb_for` (the run's memory estimate times 1.5, in GiB) over the cells
        to submit; None when ``mem_gb`` or ``additional_parameters.mem``/``mem_per_cpu`` is set, or when no
        cell's config validates (those cells fail at once in their task, whatever memory they get)."""
        from specsamp.runner.config import load_config
        from specsamp.runner.memory import mem_gb_for

        extra = self.params.get("additional_parameters") or {}
        if not self._mem_from_estimate or "mem" in extra or "mem_per_cpu" in extra:
            return None
        sizes = []
        for overrides, _ in cells:
            try:
                cfg = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
                with read_write(cfg), open_dict(cfg):
                    del cfg["hydra"]
                sizes.append(mem_gb_for(load_config(cfg, here=False)[0]))  # device=cuda from a login node without a GPU
            except Exception:  # noqa: BLE001 (a cell that does not compose or validate records why in its task)
                continue
        return max(sizes) if sizes else None

    def _live(self, cells: list[tuple[Sequence[str], Path]]) -> dict[Path, str]:
        """The cells the scheduler (or a live process) still owns: ``{job dir: "SLURM job A_T STATE"}``."""
        ids = {}
        for _, d in cells:
            sub = jobs._read_json(d / queue.SLURM_FILE)
            if sub and not (d / jobs.RESULT).exists():
                ids[d] = str(sub.get("job_id"))
        st = queue.states(ids.values()) if ids else {}
        if ids and not st:
            print(
                f"warning: neither squeue nor sacct knows the {len(ids)} earlier SLURM task(s) of this sweep (or they do "
                "not answer): those cells are judged by their running.json",
                file=sys.stderr,
                flush=True,
            )
        live = {
            d: f"SLURM job {j} {st[j][0]}" + (f" ({st[j][1]})" if st[j][1] and st[j][1] != "None" else "")
            for d, j in ids.items()
            if j in st and st[j][0] in queue.ALIVE
        }
        for _, d in cells:
            if d in live or (d / jobs.RESULT).exists() or (d / jobs.FAILED).exists() or (d in ids and ids[d] in st):
                continue
            if (d / jobs.RUNNING).exists() and jobs.job_liveness(d) == "running":
                live[d] = "a live process (running.json)"
        return live

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        """Submit the cells that are neither done nor live as one job array, wait for all its tasks, and
        return one ``JobReturn`` per submitted cell (the cell's own, or a failed one saying why it has none)."""
        from hydra.core.singleton import Singleton

        assert self.config is not None and self.hydra_context is not None
        check_time_limit(self.params)
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        cells = [(list(o), self._job_dir(o)) for o in job_overrides]
        done = [c for c in cells if self._done(*c)]
        rest = [c for c in cells if c not in done]
        live = self._live(rest)
        todo = [(i, c) for i, c in enumerate(cells) if c not in done and c[1] not in live]
        if done:
            print(f"{len(done)} of {len(cells)} cells already done (same config hash): not submitted", flush=True)
        if live:
            print(f"{len(live)} of {len(cells)} cells still pending or running: not submitted again", flush=True)
            for d, why in list(live.items())[:10]:
                print(f"  {d.relative_to(sweep_dir) if d.is_relative_to(sweep_dir) else d}: {why}", flush=True)
        if not todo:
            print(f"nothing to submit for {sweep_dir}", flush=True)
            return []
        mem = self._mem_gb([c for _, c in todo])
        if mem is not None:
            self.params["mem_gb"] = mem
            print(
                f"mem_gb={mem} per task: the cells' own memory estimate with a margin (set hydra.launcher.mem_gb to "
                "choose it)",
                flush=True,
            )
        executor = self._executor()
        if self.dry_run:
            from specsamp.runner.callback import SWEEP_STATE

            SWEEP_STATE["dry_run"] = True  # nothing was meant to run: the cells left are not a reason for exit 75
            ex = executor._executor
            ex.parameters["map_count"] = len(todo)
            print(ex._make_submission_file_text(ex._submitit_command_str, "dry_run"), flush=True)
            print(
                f"dry run: {len(todo)} cell(s) would be submitted as the job array above; nothing was submitted",
                flush=True,
            )
            return []
        job_params = [
            (
                overrides,
                "hydra.sweep.dir",
                initial_job_idx + i,
                f"job_id_for_{initial_job_idx + i}",
                Singleton.get_state(),
            )
            for i, (overrides, _) in todo
        ]
        try:
            submitted = executor.map_array(self, *zip(*job_params))
        except Exception as e:  # noqa: BLE001 (sbatch's refusal or an unreachable controller)
            from specsamp.runner.exits import INFRASTRUCTURE, InfrastructureError

            status, message = explain_refusal(e, self.params)
            if status == INFRASTRUCTURE:
                raise InfrastructureError(message) from None
            print(f"error: {message}", file=sys.stderr, flush=True)
            sys.exit(status)
        array = str(submitted[0].job_id).split("_")[0]
        folder = Path(str(self.params["submitit_folder"]).replace("%j", array))
        for (_, (overrides, d)), job in zip(todo, submitted):
            d.mkdir(parents=True, exist_ok=True)
            _write_json(
                d / queue.SLURM_FILE,
                {
                    "job_id": str(job.job_id),
                    "array_job_id": array,
                    "array_task_id": str(job.job_id).partition("_")[2] or None,
                    "submitted": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                    "overrides": list(overrides),
                    "stdout": str(job.paths.stdout),
                    "stderr": str(job.paths.stderr),
                    "sbatch_script": str((folder / f"{array}_submission.sh").absolute()),
                },
            )
        where = f" to partition {self.params['partition']}" if self.params.get("partition") else ""
        par = self.params.get("array_parallelism")
        if len(todo) == 1:  # submitit submits one cell as a plain job: no array, no task ids
            job = submitted[0]
            print(
                f"submitted SLURM job {array}{where}: 1 task (one cell: a plain job, not an array)\n"
                f"  sbatch script: {folder / f'{array}_submission.sh'}\n"
                f"  logs:          {job.paths.stdout} (.err)\n"
                f"  watch:         squeue -j {array}      accounting: sacct -j {array} -X\n"
                f"  cancel:        scancel {array}",
                flush=True,
            )
        else:
            print(
                f"submitted SLURM array job {array}{where}: {len(todo)} tasks"
                f"{f' (at most {par} at once)' if par and par < len(todo) else ''}\n"
                f"  sbatch script: {folder / f'{array}_submission.sh'}\n"
                f"  logs:          {folder.parent}/{array}_<task>/{array}_<task>_0_log.out (.err)\n"
                f"  watch:         squeue -j {array}      accounting: sacct -j {array} -X\n"
                f"  cancel:        scancel {array}        (one task: scancel {array}_<task>)",
                flush=True,
            )
        try:
            self._wait(array, submitted)
        except KeyboardInterrupt:
            from specsamp.runner.callback import SWEEP_STATE

            what = "array job" if len(todo) > 1 else "job"
            if self.cancel_on_interrupt:
                subprocess.run(["scancel", array], check=False)
                self._settle([str(j.job_id) for j in submitted], limit_s=10.0)  # so that the summary reads CANCELLED
                print(f"interrupted: cancelled SLURM {what} {array} (scancel {array}).", file=sys.stderr, flush=True)
            else:
                SWEEP_STATE["left_running"] = array  # exits.main's Ctrl-C line: wait for it, do not rerun yet
                print(
                    f"interrupted: SLURM {what} {array} keeps running on the cluster, and its cells write their "
                    f"records as they finish (squeue -j {array}); to stop it: scancel {array}",
                    file=sys.stderr,
                    flush=True,
                )
            raise
        return [self._outcome(job, overrides) for (_, (overrides, _)), job in zip(todo, submitted)]

    def _wait(self, array: str, submitted: Sequence[Any]) -> None:
        """Until ``squeue`` holds no task of ``array``: poll every ``poll_s`` seconds, print changes (each
        state's count, the pending tasks with SLURM's reason).

        Raises:
            specsamp.errors.ConfigError: every task left pends for a reason that waiting does not resolve
                (:func:`stuck_reason`: no node can take the request); those tasks are cancelled first.
        """
        from specsamp.errors import ConfigError

        ids = [str(j.job_id) for j in submitted]
        what = "array job" if len(ids) > 1 else "job"
        last, failures = None, 0
        while True:
            text = None
            if shutil.which("squeue"):
                try:
                    p = subprocess.run(
                        ["squeue", "-h", "-r", "-j", array, "-o", "%i|%T|%r"],
                        capture_output=True,
                        text=True,
                        timeout=queue.QUERY_TIMEOUT_S,
                    )
                    text = p.stdout if p.returncode == 0 else None
                    if p.returncode != 0 and "Invalid job id" in p.stderr:
                        text = ""  # the controller forgot the array: it is over
                except (OSError, subprocess.TimeoutExpired):
                    text = None
            if text is None:
                failures += 1
                if failures == 3:
                    print(
                        f"warning: squeue does not answer; still waiting for {what} {array} (Ctrl-C leaves it running)",
                        file=sys.stderr,
                        flush=True,
                    )
                time.sleep(self.poll_s)
                continue
            failures = 0
            view = queue_view(text)
            if not view.left:
                self._settle(ids)
                return
            now = view.line()
            if now != last:
                print(f"{what} {array}: {now}; {len(ids) - view.left} of {len(ids)} finished", flush=True)
                last = now
            if view.stuck and len(view.stuck) == view.left:  # nothing left that can ever run
                try:
                    cancelled = (
                        subprocess.run(
                            ["scancel", *view.stuck], capture_output=True, text=True, timeout=queue.QUERY_TIMEOUT_S
                        ).returncode
                        == 0
                    )
                except (OSError, subprocess.TimeoutExpired):
                    cancelled = False
                if cancelled:
                    self._settle(view.stuck, limit_s=10.0)
                raise ConfigError(
                    stuck_message(array, view, self.params, _nodes_of(self.params.get("partition")), cancelled)
                )
            time.sleep(self.poll_s)

    def _settle(self, ids: Sequence[str], limit_s: float = 60.0) -> None:
        """After the queue emptied, wait (at most ``limit_s``) until ``sacct`` has every task's final state,
        so that the summary does not read a state the accounting has not caught up with yet."""
        if shutil.which("sacct") is None:
            return
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            st = queue.states(ids)
            if all(j in st and st[j][0] not in queue.ALIVE for j in ids):
                return
            time.sleep(min(self.poll_s, 1.0))

    def _outcome(self, job: Any, overrides: Sequence[str]) -> JobReturn:
        """What one finished task left: its ``JobReturn``, or a failed one naming SLURM's state."""
        from specsamp.runner.exits import InfrastructureError

        ret = JobReturn(overrides=list(overrides), status=JobStatus.FAILED)
        path = job.paths.result_pickle
        if path.exists():
            try:
                outcome, value = job._get_outcome_and_result()
            except Exception as e:  # noqa: BLE001
                ret.return_value = RuntimeError(f"could not read {path}: {e}")
                return ret
            if outcome == "success":
                return value
            ret.return_value = (InfrastructureError if "kind infrastructure" in str(value) else RuntimeError)(
                str(value).strip().splitlines()[-1]
            )
            return ret
        st = queue.states([str(job.job_id)]).get(str(job.job_id), ("UNKNOWN", ""))
        ret.return_value = RuntimeError(f"SLURM task {job.job_id} ended {st[0]} without a result ({job.paths.stderr})")
        return ret
