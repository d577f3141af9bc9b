#!/usr/bin/env python
"""specsamp main job: `python run.py [overrides]` (Hydra).

Runs one configuration (or a sweep with `-m`), prints one line with the result and the path of its
record, then writes `result.json` into the Hydra output directory: `outputs/DATE/TIME/` for a single
run (`TIME_2`, `TIME_3`, ... when another run started in the same second), `multirun/<sweep_name>/<job>/`
for a sweep, where `<job>` is named by the job's overrides (`K=2,L=3`; a sanitised prefix and a hash
when a value holds `/`, `,`, `=` or the name is long).

A sweep (`-m`, with `hydra/launcher=basic|local|slurm`) skips jobs already done and runs every job even
when some fail, including jobs whose overrides do not compose; it ends with a summary.

Exit status (specsamp.exitcodes; the sweep's is the most serious of its jobs'):
  0    every run / job wrote its record
  1    an unexpected exception (a bug: its traceback is printed, or kept in the job's failed.json)
  2    wrong input: a bad key or value, an override that does not compose (one paragraph naming the
       key, its value and what is valid)
  3    the machine failed: disk full, output directory read-only or not creatable, `sbatch`/`srun`
       missing for hydra/launcher=slurm (one paragraph naming the path or the command)
  130  interrupted (Ctrl-C): one line, plus the sweep's summary; finished records are kept
"""

from __future__ import annotations

import os
import sys

import hydra
from omegaconf import DictConfig


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float | None:
    """Hydra task: validate, run, record. Returns the mean speedup (for sweepers)."""
    from specsamp.cli import run_task

    return run_task(cfg)


def _one_paragraph(error: BaseException) -> str:
    """Hydra's and OmegaConf's multi-line messages as one paragraph (without the config search path)."""
    text = str(error).split("\nConfig search path:")[0]
    cause = error.__cause__
    if cause is not None and str(cause) and str(cause) not in text:
        text += "\n" + str(cause)
    return " ".join(line.strip() for line in text.splitlines() if line.strip()) or type(error).__name__


def _entry() -> None:
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from specsamp import exitcodes
    from specsamp.report import SWEEP_STATE, launched, print_sweep_summary, sweep_exit_status

    full_error = os.environ.get("HYDRA_FULL_ERROR") == "1"
    # Hydra would print its own errors and exit 1 whatever they are; let them reach us to sort them out
    os.environ["HYDRA_FULL_ERROR"] = "1"

    def summary_if_swept() -> None:
        sweep_dir = SWEEP_STATE.get("sweep_dir")
        if sweep_dir and launched(sweep_dir):
            try:
                print_sweep_summary(sweep_dir, file=sys.stderr)
            except Exception as e:  # the summary must not hide the real error
                print(f"warning: could not summarise {sweep_dir}: {e}", file=sys.stderr)

    try:
        main()
    except KeyboardInterrupt:
        where = SWEEP_STATE.get("sweep_dir")
        print(f"interrupted (Ctrl-C): finished records are kept; the unfinished {'jobs rerun when the same sweep is relaunched' if where else 'run wrote no record'}.", file=sys.stderr, flush=True)
        SWEEP_STATE["interrupted"] = True
        summary_if_swept()
        sys.exit(exitcodes.INTERRUPTED)
    except SystemExit:
        raise
    except Exception as e:
        if exitcodes.is_infrastructure(e):
            print(f"error: {exitcodes.infrastructure_message(e)}", file=sys.stderr)
            summary_if_swept()
            sys.exit(exitcodes.INFRASTRUCTURE)
        import traceback

        if isinstance(e, (HydraException, OmegaConfBaseException)):
            # a config that does not compose: an unknown key or group option, a bad override (jobs of a
            # sweep record their own composition errors; this is the command line's or the whole sweep's)
            if full_error:
                traceback.print_exception(e, file=sys.stderr)
            print(f"error: {_one_paragraph(e)}", file=sys.stderr)
            summary_if_swept()
            sys.exit(exitcodes.USAGE)
        # a bug, or a launcher that gave up after jobs started (e.g. SLURM killed one): say where things stand

        traceback.print_exception(e, file=sys.stderr)
        summary_if_swept()
        sys.exit(exitcodes.BUG)
    if SWEEP_STATE.get("sweep_dir"):
        status = sweep_exit_status()
        failed = SWEEP_STATE.get("failed")
        if failed:
            print(f"error: {len(failed)} job(s) of the sweep failed (listed above; their failed.json has the details).", file=sys.stderr)
        sys.exit(status)


if __name__ == "__main__":
    os.environ.setdefault("WANDB_MODE", "offline")
    # submitit jobs unpickle the task in a fresh interpreter: let them import specsamp from this checkout
    _here = os.path.dirname(os.path.abspath(__file__))
    os.environ["PYTHONPATH"] = os.pathsep.join([_here, *filter(None, [os.environ.get("PYTHONPATH")])])
    from specsamp.experiment import refuse_unknown_overrides  # a typo'd key: one paragraph naming the closest key

    refuse_unknown_overrides(sys.argv[1:], os.path.join(_here, "conf"))
    _entry()
