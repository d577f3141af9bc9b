#!/usr/bin/env python
"""specsamp main job: ``python run.py [overrides]`` (Hydra); ``-m`` for a sweep.

Runs one configuration, prints one line with the result and the path of its record, then writes
``result.json`` into the Hydra output directory (README, "The main job"). Exit statuses:
:mod:`specsamp.runner.exits`. The task itself: :func:`specsamp.runner.task.run_task`.
"""

import os

import hydra

import specsamp.runner.config  # noqa: F401  (registers the structured configs and resolvers)


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg):
    from specsamp.runner.task import run_task

    return run_task(cfg)


if __name__ == "__main__":
    from specsamp.runner.exits import main as run_main

    run_main(main, os.path.dirname(os.path.abspath(__file__)))
