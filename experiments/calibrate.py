"""Calibrate the displacement profiles that ``tree=optimal`` and ``tree=optimal_per_step`` search with,
for any target, once, so that runs can skip their calibration (``delta_profile=<name>``).

    python -m experiments.calibrate model=gmm draft=x0                  # -> conf/profiles/gmm_x0.json
    python -m experiments.calibrate model=digits draft=x0 out=my.json
    python -m experiments.calibrate model=cifar10 device=cuda draft=x0  # pixel and SD3 targets need a GPU

Arguments are the run's config overrides (``run.py``'s), plus ``out=PATH`` (default
``conf/profiles/<model>_<draft>.json``, a name that ``delta_profile=<model>_<draft>`` then finds) and
``trajectories=N`` (default 64, what a run's own calibration uses). The calibration is the run's:
D-GRS on a uniform (2, 8) tree with the configured draft, under ``seed + CALIBRATION_SEED_OFFSET``
(:func:`specsamp.runner.build.calibrate`). The file holds ``profile`` (delta per depth), ``per_root``
(delta per root step 1..T-2 and depth), the config it was calibrated for and what it cost; the
profile is printed too.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from specsamp.errors import ConfigError
from specsamp.io import atomic_write
from specsamp.runner.build import build_target, calibrate, calibration_cost
from specsamp.runner.config import PROFILE_DIR, compose, load_config
from specsamp.schedule import Schedule


def main(argv: list[str]) -> Path:
    """Calibrate for the config ``argv`` (overrides plus ``out=``, ``trajectories=``); write and return the file."""
    out, n, overrides = None, 64, []
    for a in argv:
        if a.startswith("out="):
            out = Path(a[4:])
        elif a.startswith("trajectories="):
            value = a[len("trajectories="):]
            if not value.isdigit() or int(value) < 1:
                raise ConfigError(f"trajectories={value} is invalid: must be an integer >= 1 (default 64, what a "
                                  "run's own calibration uses).")
            n = int(value)
        else:
            overrides.append(a)
    run, _ = load_config(compose(overrides))
    if run.threads is not None:
        torch.set_num_threads(run.threads)
    out = out or PROFILE_DIR / f"{run.model.name}_{run.draft}.json"
    schedule = Schedule.make(run.steps, run.eps, shift=float(run.model.shift))
    t0 = time.perf_counter()
    profiles, r = calibrate(build_target(run), schedule, run, n=n)
    data = {"config": {"model": run.model.name, "draft": run.draft, "steps": run.steps, "eps": run.eps,
                       "seed": run.seed, "prefetch": run.prefetch, "warmup": run.warmup},
            "calibration": {**calibration_cost(r), "tree": "uniform(2, 8)", "coupling": "dgrs"},
            **profiles}  # no timings: a rerun writes the same file
    atomic_write(out, lambda f: f.write(json.dumps(data, indent=1) + "\n"), mode="w")
    print("delta_profile=[" + ",".join(f"{d:.4f}" for d in profiles["profile"]) + "]")
    print(f"per-root profiles ({len(profiles['per_root'])} root steps) and cost {data['calibration']} "
          f"({time.perf_counter() - t0:.1f} s) -> {out}")
    print(f"use: python run.py ... tree=optimal_per_step delta_profile={out.stem if out.parent == PROFILE_DIR else out}")
    return out


if __name__ == "__main__":
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from specsamp.runner.exits import composition_message

    if {"-h", "--help"} & set(sys.argv[1:]):
        print(__doc__.strip())
        sys.exit(0)
    try:
        main(sys.argv[1:])
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except (HydraException, OmegaConfBaseException) as e:  # overrides that do not compose
        print(f"error: {composition_message(e)}", file=sys.stderr)
        sys.exit(2)
