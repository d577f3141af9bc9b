"""Hydra plugin: specsamp's sweeper (``hydra/sweeper=specsamp``, the default of ``conf/config.yaml``).

Hydra's basic sweeper (same grid syntax, same ``max_batch_size`` batches, same ``multirun.yaml``) with
one change: **a job whose overrides do not compose does not stop the sweep.** Hydra's launchers compose
each job's config themselves (the basic launcher in this process, submitit's in the job's process) and
an error there aborts the whole sweep. Here the launcher gets a config loader that, when one job fails
to compose, hands it a config holding only Hydra's settings, with the job's own directory (the one a
composed job would get, :func:`specsamp.runner.jobs.job_dirname`) and the error in an environment variable.
The job then writes ``failed.json`` (kind ``config``) like any other failed job, the others run, and the
sweep ends with its summary and exit status 2 (``run.py``).

Before launching anything, every job's config is composed and checked as its job would check it
(:func:`specsamp.runner.config.load_config`: keys, values, the device; no model is built). When no job
can run (a sweep-wide error such as ``device=cuda`` on a machine without a GPU, or a bad value in every
cell) the sweep is refused once, with one paragraph naming each distinct error and its jobs, exit status 2,
nothing launched and nothing written. When only some jobs are bad, the others run and the bad ones are
recorded as above. ``validate: true`` refuses the whole sweep as soon as one job is bad. Under the SLURM
launcher the jobs run on other machines, so what depends on the machine (the device, ``compile=true``)
is left to the jobs there.

The sweeper's own keys (:data:`SWEEPER_KEYS`) are checked when it is built: a bad value exits 2 with a
paragraph naming ``hydra.sweeper.KEY``, its value and what is valid.

Before launching, ``hydra/launcher=slurm`` is checked for a ``timeout_min`` that leaves no time before
the warning signal (exit status 2, naming ``timeout_min`` and ``signal_delay_s``) and for the SLURM
commands, so a sweep started off a cluster fails at once with an infrastructure error (exit status 3)
naming the missing command.
"""

from __future__ import annotations

import copy
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.plugins import Plugins
from hydra.core.utils import JobStatus
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from specsamp.errors import ConfigError
from specsamp.runner import jobs  # also registers the specsamp.job_dir / specsamp.fresh_dir resolvers
from specsamp.runner.callback import SWEEP_STATE
from specsamp.runner.jobs import COMPOSE_ERROR_ENV, COMPOSE_ERROR_KIND_ENV
from specsamp.runner.overrides import SWEEPER_KEYS  # the sweeper's keys and what each accepts


def _kind(error: BaseException) -> str:
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    return "config" if isinstance(error, (HydraException, OmegaConfBaseException)) else "exception"


def _one_paragraph(text: str) -> str:
    """Hydra's multi-line composition messages as one line, without the config search path."""
    text = text.split("\nConfig search path:")[0]
    return " ".join(line.strip() for line in text.splitlines() if line.strip())


def _explained(error: BaseException) -> str | None:
    """specsamp's paragraph for a key the job's config does not have (the key, its config class, the
    valid keys: :func:`specsamp.runner.explain.explain`), instead of Hydra's advice to append it with ``+``,
    or for a group option that does not exist (:func:`specsamp.runner.exits.missing_option`)."""
    try:
        from specsamp.runner.exits import missing_option
        from specsamp.runner.explain import explain

        return missing_option(error) or explain(error)
    except Exception:  # noqa: BLE001 - the plain message is still recorded
        return None


def failed_job_config(master: DictConfig, overrides: Sequence[str], error: BaseException) -> DictConfig:
    """The config a job that does not compose runs with: Hydra's settings only, its own directory, and
    the error in ``hydra.job.env_set`` (read by :func:`specsamp.runner.task.run_task`)."""
    exclude = OmegaConf.select(master, "hydra.job.config.override_dirname.exclude_keys", default=[]) or []
    subdir = jobs.job_dirname(list(overrides), [str(k) for k in exclude])
    sweep_dir = str(master.hydra.sweep.dir)  # resolved now: it may refer to task keys (sweep_name)
    cfg = copy.deepcopy(master)
    with read_write(cfg), open_dict(cfg):
        for key in [k for k in cfg.keys() if k != "hydra"]:
            del cfg[key]
        cfg.hydra.sweep.dir = sweep_dir
        cfg.hydra.sweep.subdir = subdir
        cfg.hydra.job.override_dirname = subdir
        cfg.hydra.overrides.task = [str(o) for o in overrides]
        cfg.hydra.job.env_set[COMPOSE_ERROR_ENV] = (
            _explained(error) or _one_paragraph(str(error)) or type(error).__name__
        )
        cfg.hydra.job.env_set[COMPOSE_ERROR_KIND_ENV] = _kind(error)
    return cfg


class TolerantConfigLoader:
    """A Hydra config loader whose ``load_sweep_config`` turns a composition error into a failed job.

    ``composed`` holds the configs the sweeper's pre-check composed (:meth:`SpecsampSweeper.precheck`),
    keyed by the job's overrides: the launcher takes each one once instead of composing it a second time.
    """

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.composed: dict[tuple, DictConfig] = {}

    def __getattr__(self, name: str) -> Any:
        if name == "inner" or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.inner, name)

    def load_sweep_config(self, master_config: DictConfig, sweep_overrides: list[str]) -> DictConfig:
        """Compose one job; on failure, :func:`failed_job_config` instead of raising."""
        cached = self.composed.pop(tuple(sweep_overrides), None)
        if cached is not None:
            return cached
        try:
            return self.inner.load_sweep_config(master_config, sweep_overrides)
        except Exception as e:  # noqa: BLE001 (every composition failure becomes that job's failure)
            return failed_job_config(master_config, sweep_overrides, e)


def check_launcher(launcher: Any) -> None:
    """Refuse a SLURM launcher whose ``timeout_min`` leaves no time before its warning signal (a user error,
    :func:`.slurm.check_time_limit`), or on a machine without ``sbatch``/``srun`` (an infrastructure error).

    Raises:
        specsamp.errors.ConfigError: ``hydra.launcher.timeout_min`` too short for ``signal_delay_s``.
        specsamp.runner.exits.InfrastructureError: a SLURM command is missing.
    """
    from specsamp.runner.exits import InfrastructureError

    if not _is_slurm(launcher):
        return
    if hasattr(launcher, "params"):  # a time limit that leaves no time before the warning signal (exit 2)
        from .slurm import check_time_limit

        check_time_limit(launcher.params)
    missing = [c for c in ("sbatch", "srun") if shutil.which(c) is None]
    if missing:
        raise InfrastructureError(
            f"hydra/launcher=slurm needs the SLURM command{'s' if len(missing) > 1 else ''} {' and '.join(missing)} "
            "on PATH, and this machine has none: start the sweep on a cluster's login node (with its SLURM "
            "module loaded), or run it here with hydra/launcher=local (submitit, one process per job) or "
            "hydra/launcher=basic (one job after another). Nothing was launched."
        )


KEEP_COMPOSED = 512  # composed job configs kept from the pre-check for the launcher (the rest are composed again)


def check_sweeper_keys(max_batch_size: Any, params: Any, validate: Any) -> None:
    """Refuse a sweeper setting that Hydra's sweep loop would trip on later (a ``TypeError`` or an ``assert``).

    Raises:
        specsamp.errors.ConfigError: names ``hydra.sweeper.KEY``, its value and what is valid.
    """

    def bad(key: str, value: Any) -> ConfigError:
        return ConfigError(f"hydra.sweeper.{key}={value!r} is invalid: must be {SWEEPER_KEYS[key]}.")

    if max_batch_size is not None and (
        isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int) or max_batch_size < 1
    ):
        raise bad("max_batch_size", max_batch_size)
    if params is not None and not isinstance(params, Mapping):
        raise bad("params", params)
    if not isinstance(validate, bool):
        raise bad("validate", validate)


def check_sweep_name(config: DictConfig) -> None:
    """Refuse a ``sweep_name`` that does not name a folder below ``multirun/`` (empty, ``..``, absolute, null,
    a control character: :func:`specsamp.runner.overrides.sweep_name_ok`), before anything is written.

    Raises:
        specsamp.errors.ConfigError: names the value and what is valid.
    """
    from specsamp.runner.config import SWEEP_NAME_TEXT, sweep_name_ok

    name = OmegaConf.select(config, "sweep_name", default=None)
    if not sweep_name_ok(name):
        shown = "null" if name is None else repr(name)
        raise ConfigError(f"sweep_name={shown} is invalid: must be {SWEEP_NAME_TEXT}.")


def _task_config(cfg: DictConfig) -> DictConfig:
    """A job's composed config without Hydra's node: what :func:`specsamp.runner.task.run_task` receives."""
    task = copy.deepcopy(cfg)
    with read_write(task), open_dict(task):
        del task["hydra"]
    return task


def swept_name(job: Sequence[str], every: Sequence[Sequence[str]]) -> str:
    """A job named by the overrides that vary across the sweep (``K=0,sampler=rmc``), as the user wrote them."""
    values: dict[str, set] = {}
    for other in every:
        for o in other:
            values.setdefault(jobs._key_of(o), set()).add(o)
    varying = [o for o in job if len(values.get(jobs._key_of(o), ())) > 1]
    return ",".join(varying or job) or "(no overrides)"


def refusal(problems: Sequence[tuple[str, str]], n_jobs: int, validate: bool, shown: int = 3) -> str:
    """The one paragraph of a refused sweep: how many jobs cannot run, then each distinct error once with
    the jobs it concerns (``every job``, or the first one and how many more), at most ``shown`` errors."""
    groups: dict[str, list[str]] = {}
    for job, message in problems:
        groups.setdefault(message, []).append(job)
    if len(problems) == n_jobs:
        head = f"none of the sweep's {n_jobs} job{'s' if n_jobs != 1 else ''} can run"
    else:
        head = f"{len(problems)} of the sweep's {n_jobs} jobs cannot run and hydra.sweeper.validate=true"
    parts = []
    for message, names in list(groups.items())[:shown]:
        who = (
            "every job"
            if len(names) == n_jobs and n_jobs > 1
            else f"job {names[0]}" + (f" and {len(names) - 1} more" if len(names) > 1 else "")
        )
        parts.append(f"{who}: {message.rstrip('.')}")
    rest = len(groups) - shown
    more = (
        f"; {rest} more distinct error{'s' if rest > 1 else ''} (fix these and rerun to see them)" if rest > 0 else ""
    )
    parts[0] = parts[0][:1].upper() + parts[0][1:]
    return f"{head}, so nothing was launched. " + "; ".join(parts) + more + ". Fix the command and rerun it."


class SpecsampSweeper(BasicSweeper):
    """Hydra's basic sweeper whose jobs fail one by one when their overrides do not compose.

    Args:
        max_batch_size: jobs launched together (Hydra's meaning; null: all).
        params: sweep parameters ``{key: "a,b,c"}`` (Hydra's meaning).
        validate: refuse the whole sweep, before launching anything, when one job does not compose or
            fails its config checks (false: only when no job can run).

    Raises:
        specsamp.errors.ConfigError: a key of :data:`SWEEPER_KEYS` with a value it does not accept.
    """

    def __init__(self, max_batch_size: int | None = None, params: dict[str, str] | None = None, validate: bool = False):
        check_sweeper_keys(max_batch_size, params, validate)
        super().__init__(max_batch_size=max_batch_size, params=params)
        self.validate = validate

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:  # noqa: D102
        self.hydra_context = hydra_context  # the strict loader, for validate=true
        self.config = config
        self.tolerant = TolerantConfigLoader(hydra_context.config_loader)
        tolerant = HydraContext(config_loader=self.tolerant, callbacks=hydra_context.callbacks)
        self.launcher = Plugins.instance().instantiate_launcher(
            hydra_context=tolerant, task_function=task_function, config=config
        )

    def validate_batch_is_legal(self, batch: Sequence[Sequence[str]]) -> None:  # noqa: D102
        pass  # every job was checked before the first batch (precheck)

    def job_problem(self, overrides: Sequence[str], here: bool) -> str | None:
        """The paragraph of the user error that stops this job (composition, key, value; ``here``: also the
        device and ``compile``), or None when it passes or fails for another reason (its job records that)."""
        from specsamp.runner.config import load_config

        try:
            cfg = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
        except Exception as e:  # noqa: BLE001
            if _kind(e) != "config":
                return None
            return f"its overrides do not compose: {_explained(e) or _one_paragraph(str(e)) or type(e).__name__}"
        if len(self.tolerant.composed) < KEEP_COMPOSED:
            self.tolerant.composed[tuple(overrides)] = cfg  # the launcher's, so a job is composed once
        try:
            load_config(_task_config(cfg), here=here)
        except ConfigError as e:
            return str(e)
        except Exception:  # noqa: BLE001 (anything unexpected is the job's to record, with its traceback)
            return None
        return None

    def precheck(self, batches: Sequence[Sequence[Sequence[str]]]) -> None:
        """Check every job's config before launching any (:meth:`job_problem`).

        Raises:
            specsamp.errors.ConfigError: no job can run, or (``validate=true``) one job cannot; one paragraph
                (:func:`refusal`).
        """
        here = not _is_slurm(self.launcher)
        every = [list(job) for batch in batches for job in batch]
        problems = []
        for job in every:
            problem = self.job_problem(job, here)
            if problem is not None:
                problems.append((swept_name(job, every), problem))
        if problems and (self.validate or len(problems) == len(every)):
            raise ConfigError(refusal(problems, len(every), self.validate))

    def sweep(self, arguments: list[str]) -> Any:
        """Hydra's basic sweep loop, except that a failed job stops nothing: Hydra's reads every job's
        return value after each batch and raises the first failure, which skips the later batches and the
        end-of-sweep summary. Jobs that failed on an infrastructure error are noted for the exit status."""
        from specsamp.runner.exits import is_infrastructure

        check_launcher(self.launcher)
        check_sweep_name(self.config)
        params_conf = self._parse_config()
        params_conf.extend(arguments)
        parser = OverridesParser.create(config_loader=self.hydra_context.config_loader)
        self.overrides = self.split_arguments(parser.parse_overrides(params_conf), self.max_batch_size)
        self.precheck(self.overrides)  # before the sweep directory exists: a refused sweep writes nothing
        returns: list[Sequence[Any]] = []
        sweep_dir = Path(self.config.hydra.sweep.dir)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(self.config, sweep_dir / "multirun.yaml")
        initial_job_idx = 0
        while not self.is_done():
            batch = self.get_job_batch()
            self.validate_batch_is_legal(batch)
            results = self.launcher.launch(batch, initial_job_idx=initial_job_idx)
            for ret in results or []:
                if getattr(ret, "status", None) == JobStatus.FAILED and is_infrastructure(
                    getattr(ret, "_return_value", None)
                ):
                    SWEEP_STATE["infrastructure"] = True
            initial_job_idx += len(batch)
            returns.append(results)
        return returns


def _is_slurm(launcher: Any) -> bool:
    return any(c.__name__ == "SlurmLauncher" for c in type(launcher).__mro__)


from . import slurm as _slurm  # noqa: E402,F401  (registers hydra/launcher=specsamp_slurm, the base of conf/hydra/launcher/slurm*.yaml)
