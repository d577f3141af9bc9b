"""The runner: from a Hydra config to records, images, scores and sweep tables (outside the core).

Modules, top down: each imports (at module level or inside a function) only modules listed after it,
and the core (``tests/runner/test_runner_imports.py`` checks both this order and that there is no circle):

- :mod:`~specsamp.runner.task`: the Hydra task of one job: the stages of :func:`run_config` with the job's own
  steps (skip a run that is done, write, score, log, ``failed.json``);
- :mod:`~specsamp.runner.exits`: the exit-status policy of ``run.py`` (0, 1, 2, 3, 130);
- :mod:`~specsamp.runner.callback`: the sweep's Hydra callback (summary, shard merge) and its outcome;
- :mod:`~specsamp.runner.report`: sweep tables and the end-of-sweep summary;
- :mod:`~specsamp.runner.shards`: one run split by trajectory index, and merged back;
- :mod:`~specsamp.runner.loop`: the stages of one run (:func:`run_config`): ``prepare`` (the config loaded,
  checked and hashed once), ``build`` (every refusal), ``sample`` (the batch loop);
- :mod:`~specsamp.runner.resume`: a sweep job's finished batches, kept so that an interrupted job resumes;
- :mod:`~specsamp.runner.autorun`: ``sampler=auto``'s choice as the run's tree, coupling and record entry;
- :mod:`~specsamp.runner.build`: target, coupling, schedule and tree from the config;
- :mod:`~specsamp.runner.outputs`: images and their FID / CLIP scores, and what scoring will need;
- :mod:`~specsamp.runner.records`: the record (:func:`make_record`, the one place it is assembled, job fields
  included), statistics, provenance, config hash, resume, the printed line;
- :mod:`~specsamp.runner.config`: the typed config (Hydra structured configs) composed, and its checks;
- :mod:`~specsamp.runner.explain`: one paragraph for what Hydra refuses while it composes (unknown key, wrong type);
- :mod:`~specsamp.runner.schema`: the run's schema (:class:`RunConfig`, the sampler's and the logger's) and constants;
- :mod:`~specsamp.runner.overrides`: what a user typed, read as typed: raw command-line overrides, sweep
  names and path-like keys, the closest valid key to a mistyped one;
- :mod:`~specsamp.runner.kernelconfig`: the transition kernel's schemas (``conf/kernel/``), their checks, and which
  kernel a run uses;
- :mod:`~specsamp.runner.fields`: typed config fields, each with the rule its value must meet;
- :mod:`~specsamp.runner.treerules`: one registered rule per ``tree=`` value, with the keys it reads, and the
  searched rules' limits and checks;
- :mod:`~specsamp.runner.memory`: sizes refused before they are allocated;
- :mod:`~specsamp.runner.loggers`: optional wandb;
- :mod:`~specsamp.runner.jobs`: job directories and liveness (atomic writes: :mod:`specsamp.io`), a shard's
  block of trajectories;
- :mod:`~specsamp.runner.slurm`: a SLURM task's identity, and the queue's view of it (squeue, sacct).

Library use::

    from specsamp.runner import compose, run_config
    record, result = run_config(compose(["sampler=rmc", "K=2", "L=3"]))
"""

from ..errors import ConfigError
from .build import build_target, calibration_run
from .config import compose, load_config
from .loop import run_config
from .records import summary_line

__all__ = ["ConfigError", "build_target", "calibration_run", "compose", "load_config", "run_config", "summary_line"]
