"""Calibrate the displacement profiles that ``tree=optimal`` and ``tree=optimal_per_step`` search with,
for any target, once, so that runs can skip their calibration (``delta_profile=<name or path>``).

    python -m experiments.calibrate model=gmm draft=x0                  # -> outputs/DATE/TIME/gmm_x0.json
    python -m experiments.calibrate model=digits draft=x0 out=my.json
    python -m experiments.calibrate model=cifar10 device=cuda draft=x0  # pixel and SD3 targets need a GPU
    python -m experiments.calibrate model=gmm draft=x0 out=conf/profiles/gmm_x0.json overwrite=true

Arguments are the run's config overrides (``run.py``'s), plus:

  out=PATH        where the profile goes (default ``outputs/DATE/TIME/<model>_<draft>.json``, a fresh
                  directory as a single run's, claimed when the file is written; the last printed line
                  names it). A file in conf/profiles/ is found by its name (``delta_profile=<model>_<draft>``),
                  any other by its path (``delta_profile=PATH``).
  overwrite=BOOL  true: let ``out=`` replace a profile shipped in conf/profiles/ (default false: such an
                  ``out=`` is refused before anything is computed, so a rerun never dirties the shipped files).
  trajectories=N  default 64, what a run's own calibration uses.

The calibration is the run's: D-GRS on a uniform (2, 8) tree with the configured draft, under
``seed + CALIBRATION_SEED_OFFSET`` (:func:`specsamp.runner.build.calibrate`). The file holds ``profile``
(delta per depth), ``per_root`` (delta per root step 1..T-2 and depth), the config it was calibrated for
and what it cost; the profile is printed too. Exit status as ``run.py``'s: 2 for a bad argument (one
paragraph naming it), 3 when the file cannot be written (one paragraph naming the path).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from specsamp.errors import ConfigError
from specsamp.io import atomic_write
from specsamp.runner.build import build_schedule, build_target, calibrate, calibration_cost
from specsamp.runner.config import PROFILE_DIR, compose, kernel_name, load_config, path_problem
from specsamp.runner.jobs import fresh_dir


def main(argv: list[str]) -> Path:
    """Calibrate for the config ``argv`` (overrides plus ``out=``, ``trajectories=``); write and return the file."""
    out, n, overwrite, overrides = None, 64, False, []
    for a in argv:
        if a.startswith("out="):
            problem = path_problem(a[4:])
            if problem:
                raise ConfigError(f"out={a[4:]!r} is invalid: {problem}; must be the path of the .json file to write.")
            out = Path(a[4:]).expanduser()
        elif a.startswith("overwrite="):
            value = a[len("overwrite=") :]
            if value.lower() not in ("true", "false"):
                raise ConfigError(
                    f"overwrite={value} is invalid: must be true (let out= replace a profile shipped in "
                    "conf/profiles/) or false (the default: refuse to)."
                )
            overwrite = value.lower() == "true"
        elif a.startswith("trajectories="):
            value = a[len("trajectories=") :]
            if not value.isdigit() or int(value) < 1:
                raise ConfigError(
                    f"trajectories={value} is invalid: must be an integer >= 1 (default 64, what a "
                    "run's own calibration uses)."
                )
            n = int(value)
        else:
            overrides.append(a)
    run, _ = load_config(compose(overrides))
    if run.threads is not None:
        torch.set_num_threads(run.threads)
    name = f"{run.model.name}_{run.draft}.json"
    if out is not None:
        refuse_shipped(out, overwrite)
    schedule, plan = build_schedule(run)  # the run's kernel: em's grid, or a scheduler's
    t0 = time.perf_counter()
    profiles, r = calibrate(build_target(run, plan), schedule, run, n=n)
    kernel = kernel_name(run)
    where = {"eps": run.eps} if kernel == "em" else {"kernel": schedule.kernel_name}  # em's profiles as they were
    data = {
        "config": {
            "model": run.model.name,
            "draft": run.draft,
            "steps": run.steps,
            **where,
            "seed": run.seed,
            "prefetch": run.prefetch,
            "warmup": run.warmup,
        },
        "calibration": {**calibration_cost(r), "tree": "uniform(2, 8)", "coupling": "dgrs"},
        **profiles,
    }  # no timings: a rerun writes the same file
    if out is None:  # claimed only now: a failed calibration leaves no empty directory
        out = Path(fresh_dir(time.strftime("outputs/%Y-%m-%d/%H-%M-%S"))) / name
    atomic_write(out, lambda f: f.write(json.dumps(data, indent=1) + "\n"), mode="w")
    print("delta_profile=[" + ",".join(f"{d:.4f}" for d in profiles["profile"]) + "]")
    print(
        f"per-root profiles ({len(profiles['per_root'])} root steps) and cost {data['calibration']} "
        f"({time.perf_counter() - t0:.1f} s) -> {out}"
    )
    shipped = out.resolve().parent == PROFILE_DIR.resolve()
    print(f"use: python run.py ... tree=optimal_per_step delta_profile={out.stem if shipped else out}")
    return out


def refuse_shipped(out: Path, overwrite: bool) -> None:
    """Refuse ``out=`` naming a profile shipped in conf/profiles/ unless ``overwrite=true``.

    Raises:
        ConfigError: names ``out``, the shipped profile and the two ways on.
    """
    if overwrite or not out.is_file() or out.resolve().parent != PROFILE_DIR.resolve():
        return
    raise ConfigError(
        f"out={out} is invalid: it is the shipped profile delta_profile={out.stem} (conf/profiles/), "
        "which a new calibration would replace (its floats differ in the last bits from one machine or "
        "torch version to another); add overwrite=true to replace it, or give another out=PATH (default: "
        "outputs/DATE/TIME/)."
    )


if __name__ == "__main__":
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from specsamp.runner.exits import (
        INFRASTRUCTURE,
        USAGE,
        composition_message,
        infrastructure_message,
        is_infrastructure,
    )

    if {"-h", "--help"} & set(sys.argv[1:]):
        print(__doc__.strip())
        sys.exit(0)
    try:
        main(sys.argv[1:])
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(USAGE)
    except (HydraException, OmegaConfBaseException) as e:  # overrides that do not compose
        print(f"error: {composition_message(e)}", file=sys.stderr)
        sys.exit(USAGE)
    except OSError as e:
        if not is_infrastructure(e):
            raise
        print(
            f"error: {infrastructure_message(e, elsewhere='out=PATH', then='rerun the same command')}", file=sys.stderr
        )
        sys.exit(INFRASTRUCTURE)
