"""The Hydra callback of a sweep, and the sweep's outcome that ``run.py``'s exit status is read from.

:class:`SweepReport` is named by ``hydra.callbacks.sweep_report`` in ``conf/config.yaml``. At the end of a
sweep it prints the summary (:func:`specsamp.runner.report.print_sweep_summary`: what ran, what was skipped,
which jobs failed and why), merges complete shard groups (:func:`specsamp.runner.shards.merge`), and leaves
the outcome in :data:`SWEEP_STATE`, which :mod:`specsamp.runner.exits` and the sweeper
(``hydra_plugins/specsamp_sweeper``) read and add to.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback

from .jobs import SHARD
from .report import print_sweep_summary
from .shards import merge

# the outcome of the sweep this process launched: SweepReport.on_multirun_end fills it, exits.main reads it
SWEEP_STATE: dict[str, Any] = {}


class SweepReport(Callback):
    """Hydra callback: after a sweep, summarise it, merge finished shard groups, set the exit status.

    Args:
        merge_shards: merge complete shard groups (:func:`specsamp.runner.shards.merge`) at the end.
    """

    def __init__(self, merge_shards: bool = True) -> None:
        self.merge_shards = merge_shards

    def on_multirun_start(self, config, **kwargs: Any) -> None:
        """Remember the sweep directory (for ``run.py`` when the launcher itself fails)."""
        SWEEP_STATE.clear()
        SWEEP_STATE["sweep_dir"] = str(config.hydra.sweep.dir)

    def on_multirun_end(self, config, **kwargs: Any) -> None:
        """Print the summary; merge shards; store the failures in :data:`SWEEP_STATE`."""
        sweep_dir = Path(str(config.hydra.sweep.dir))
        try:
            s = print_sweep_summary(sweep_dir)
        except Exception as e:  # a report must never turn a finished sweep into an error
            print(f"warning: could not summarise {sweep_dir}: {e}", file=sys.stderr)
            return
        SWEEP_STATE.update(
            sweep_dir=str(sweep_dir),
            failed=s["failed"],
            config_errors_only=s["config_errors_only"],
            kinds=s["kinds"],
            killed=s["killed"],
            unfinished=s["running"] + s["pending"] + s["missing"],
        )
        if s["unlogged"]:  # a logger failed after the records were written: status 3, as for a single run
            SWEEP_STATE["infrastructure"] = True
        if self.merge_shards and any(sweep_dir.rglob(SHARD)):
            try:
                for line in merge(sweep_dir).lines():
                    print(f"  shards {line}", flush=True)
            except Exception as e:
                print(f"warning: merging shards under {sweep_dir} failed: {e}", file=sys.stderr)
