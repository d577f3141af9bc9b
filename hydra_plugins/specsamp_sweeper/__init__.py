"""Hydra plugin: specsamp's sweeper (``hydra/sweeper=specsamp``, the default of ``conf/config.yaml``).

Hydra's basic sweeper (same grid syntax, same ``max_batch_size`` batches, same ``multirun.yaml``) with
one change: **a job whose overrides do not compose does not stop the sweep.** Hydra's launchers compose
each job's config themselves (the basic launcher in this process, submitit's in the job's process) and
an error there aborts the whole sweep. Here the launcher gets a config loader that, when one job fails
to compose, hands it a config holding only Hydra's settings, with the job's own directory (the one a
composed job would get, :func:`specsamp.runner.jobs.job_dirname`) and the error in an environment variable.
The job then writes ``failed.json`` (kind ``config``) like any other failed job, the others run, and the
sweep ends with its summary and exit status 2 (``run.py``).

``validate: true`` instead composes every job of a batch before launching it and refuses the whole
sweep at the first job that does not compose (Hydra's own check, exit status 2, nothing launched).

Before launching, ``hydra/launcher=slurm`` is checked for the SLURM commands, so a sweep started off a
cluster fails at once with an infrastructure error (exit status 3) naming the missing command.
"""

from __future__ import annotations

import copy
import shutil
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.plugins import Plugins
from hydra.core.utils import JobStatus
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from specsamp.runner import jobs  # also registers the specsamp.job_dir / specsamp.fresh_dir resolvers
from specsamp.runner.callback import SWEEP_STATE
from specsamp.runner.jobs import COMPOSE_ERROR_ENV, COMPOSE_ERROR_KIND_ENV


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
    valid keys: :func:`specsamp.runner.config.explain`), instead of Hydra's advice to append it with ``+``,
    or for a group option that does not exist (:func:`specsamp.runner.exits.missing_option`)."""
    try:
        from specsamp.runner.config import explain
        from specsamp.runner.exits import missing_option

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
        cfg.hydra.job.env_set[COMPOSE_ERROR_ENV] = _explained(error) or _one_paragraph(str(error)) or type(error).__name__
        cfg.hydra.job.env_set[COMPOSE_ERROR_KIND_ENV] = _kind(error)
    return cfg


class TolerantConfigLoader:
    """A Hydra config loader whose ``load_sweep_config`` turns a composition error into a failed job."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        if name == "inner" or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.inner, name)

    def load_sweep_config(self, master_config: DictConfig, sweep_overrides: List[str]) -> DictConfig:
        """Compose one job; on failure, :func:`failed_job_config` instead of raising."""
        try:
            return self.inner.load_sweep_config(master_config, sweep_overrides)
        except Exception as e:  # noqa: BLE001 (every composition failure becomes that job's failure)
            return failed_job_config(master_config, sweep_overrides, e)


def check_launcher(launcher: Any) -> None:
    """Refuse a SLURM launcher on a machine without ``sbatch``/``srun`` (an infrastructure error).

    Raises:
        specsamp.runner.exits.InfrastructureError: a SLURM command is missing.
    """
    from specsamp.runner.exits import InfrastructureError

    if not _is_slurm(launcher):
        return
    missing = [c for c in ("sbatch", "srun") if shutil.which(c) is None]
    if missing:
        raise InfrastructureError(
            f"hydra/launcher=slurm needs the SLURM command{'s' if len(missing) > 1 else ''} {' and '.join(missing)} "
            "on PATH, and this machine has none: start the sweep on a cluster's login node (with its SLURM "
            "module loaded), or run it here with hydra/launcher=local (submitit, one process per job) or "
            "hydra/launcher=basic (one job after another). Nothing was launched.")


class SpecsampSweeper(BasicSweeper):
    """Hydra's basic sweeper whose jobs fail one by one when their overrides do not compose.

    Args:
        max_batch_size: jobs launched together (Hydra's meaning; null: all).
        params: sweep parameters ``{key: "a,b,c"}`` (Hydra's meaning).
        validate: compose every job before launching its batch and abort at the first bad one.
    """

    def __init__(self, max_batch_size: Optional[int] = None, params: Optional[Dict[str, str]] = None, validate: bool = False):
        super().__init__(max_batch_size=max_batch_size, params=params)
        self.validate = validate

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:  # noqa: D102
        self.hydra_context = hydra_context  # the strict loader, for validate=true
        self.config = config
        tolerant = HydraContext(config_loader=TolerantConfigLoader(hydra_context.config_loader), callbacks=hydra_context.callbacks)
        self.launcher = Plugins.instance().instantiate_launcher(hydra_context=tolerant, task_function=task_function, config=config)

    def validate_batch_is_legal(self, batch: Sequence[Sequence[str]]) -> None:  # noqa: D102
        if self.validate:
            super().validate_batch_is_legal(batch)

    def sweep(self, arguments: List[str]) -> Any:
        """Hydra's basic sweep loop, except that a failed job stops nothing: Hydra's reads every job's
        return value after each batch and raises the first failure, which skips the later batches and the
        end-of-sweep summary. Jobs that failed on an infrastructure error are noted for the exit status."""
        from specsamp.runner.exits import is_infrastructure

        check_launcher(self.launcher)
        params_conf = self._parse_config()
        params_conf.extend(arguments)
        parser = OverridesParser.create(config_loader=self.hydra_context.config_loader)
        self.overrides = self.split_arguments(parser.parse_overrides(params_conf), self.max_batch_size)
        returns: List[Sequence[Any]] = []
        sweep_dir = Path(self.config.hydra.sweep.dir)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(self.config, sweep_dir / "multirun.yaml")
        initial_job_idx = 0
        while not self.is_done():
            batch = self.get_job_batch()
            self.validate_batch_is_legal(batch)
            results = self.launcher.launch(batch, initial_job_idx=initial_job_idx)
            for ret in results or []:
                if getattr(ret, "status", None) == JobStatus.FAILED and is_infrastructure(getattr(ret, "_return_value", None)):
                    SWEEP_STATE["infrastructure"] = True
            initial_job_idx += len(batch)
            returns.append(results)
        return returns


def _is_slurm(launcher: Any) -> bool:
    return any(c.__name__ == "SlurmLauncher" for c in type(launcher).__mro__)


from . import slurm as _slurm  # noqa: E402,F401  (registers hydra/launcher=specsamp_slurm, the base of conf/hydra/launcher/slurm*.yaml)
