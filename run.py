#!/usr/bin/env python
"""specsamp main job: `python run.py [overrides]` (Hydra).

Runs one configuration (or a sweep with `-m`), writes `result.json` into the Hydra output directory and
prints one line. A bad configuration exits with status 2 and a message naming the key, its value and
what is valid.
"""

from __future__ import annotations

import os
import sys

import hydra
from omegaconf import DictConfig, OmegaConf

_STARTED = {"task": False}


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float | None:
    """Hydra task: validate, run, record. Returns the mean speedup (for sweepers)."""
    _STARTED["task"] = True
    from specsamp.cli import run_task

    return run_task(cfg)


def _entry() -> None:
    try:
        main()
    except SystemExit as e:
        # Hydra reports config-composition errors (unknown key, unknown group option) itself with exit
        # status 1 before our task starts; those are user errors too: exit 2.
        if e.code == 1 and not _STARTED["task"]:
            sys.exit(2)
        raise


if __name__ == "__main__":
    os.environ.setdefault("WANDB_MODE", "offline")
    _entry()
