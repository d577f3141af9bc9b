#!/usr/bin/env python
"""specsamp main job: `python run.py [overrides]` (Hydra).

Runs one configuration (or a sweep with `-m`), writes `result.json` into the Hydra output directory and
prints one line. A bad configuration exits with status 2 and a message naming the key, its value and
what is valid.

A sweep (`-m`, with `hydra/launcher=basic|local|slurm`) writes into `multirun/<sweep_name>/<overrides>/`,
skips jobs already done, and runs every job even when some fail; it ends with a summary and exits with
status 0 when every job succeeded, 2 when the only failures are bad per-job values, 1 otherwise.
"""

from __future__ import annotations

import os
import sys

import hydra
from omegaconf import DictConfig

_STARTED = {"task": False}


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float | None:
    """Hydra task: validate, run, record. Returns the mean speedup (for sweepers)."""
    _STARTED["task"] = True
    from specsamp.cli import run_task

    return run_task(cfg)


def _entry() -> None:
    from specsamp.report import SWEEP_STATE, launched, print_sweep_summary

    try:
        main()
    except SystemExit as e:
        sweep_dir = SWEEP_STATE.get("sweep_dir")
        if e.code == 1 and sweep_dir and launched(sweep_dir):
            # the launcher gave up after jobs had started (e.g. SLURM killed one): say where things stand
            print_sweep_summary(sweep_dir, file=sys.stderr)
            raise
        # Hydra reports config-composition errors (unknown key, unknown group option, also in one job of
        # a sweep) itself with exit status 1 before any task starts; those are user errors too: exit 2.
        if e.code == 1 and not _STARTED["task"]:
            sys.exit(2)
        raise
    failed = SWEEP_STATE.get("failed")
    if failed:
        print(f"error: {len(failed)} job(s) of the sweep failed (listed above; their failed.json has the details).", file=sys.stderr)
        sys.exit(2 if SWEEP_STATE.get("config_errors_only") else 1)


if __name__ == "__main__":
    os.environ.setdefault("WANDB_MODE", "offline")
    # submitit jobs unpickle the task in a fresh interpreter: let them import specsamp from this checkout
    _here = os.path.dirname(os.path.abspath(__file__))
    os.environ["PYTHONPATH"] = os.pathsep.join([_here, *filter(None, [os.environ.get("PYTHONPATH")])])
    from specsamp.experiment import refuse_unknown_overrides  # a typo'd key: one paragraph naming the closest key

    refuse_unknown_overrides(sys.argv[1:], os.path.join(_here, "conf"))
    _entry()
