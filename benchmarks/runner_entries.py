"""How many times one job of ``run.py`` enters each runner module, from ``run_task`` to its written record.

``python -m benchmarks.runner_entries [OVERRIDES ...]`` runs ``python run.py OVERRIDES`` in this process
(into a temporary directory) with a profiler hook (``sys.setprofile``) on while
:func:`specsamp.runner.task.run_task` runs, and prints, per ``specsamp.runner`` module, how many Python calls
entered it from another module: ``from runner`` counts calls made by another runner module (the runner
handing the config from module to module), ``from anywhere`` adds calls from outside the runner (the core
calling back into the runner's progress bar, Hydra instantiating a structured config). A call within a
module (a helper of the same module, a comprehension) is not an entry, nor is code Python writes for a
class (a dataclass's ``__init__``). Counting is by function call, so a
number is the same on every machine; it does not time anything.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import io
import json
import runpy
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNNER = "specsamp.runner."


def count_entries(overrides: list[str], calls: list | None = None) -> tuple[dict, dict, int]:
    """``(from runner, from anywhere, exit status)`` of ``python run.py OVERRIDES``: entries per runner module;
    ``calls``, when given, gets one ``caller -> callee`` line per entry."""
    import specsamp.runner.task as task

    inner: collections.Counter = collections.Counter()
    every: collections.Counter = collections.Counter()

    def hook(frame, event, _arg):
        if event != "call":
            return
        mod = frame.f_globals.get("__name__", "")
        if not mod.startswith(RUNNER) or frame.f_code.co_filename.startswith("<"):
            return
        back = frame.f_back
        caller = back.f_globals.get("__name__", "") if back is not None else ""
        if caller == mod:
            return
        name = mod.removeprefix(RUNNER)
        every[name] += 1
        if calls is not None:
            calls.append(f"{caller}.{back.f_code.co_name if back is not None else '?'} -> {mod}.{frame.f_code.co_name}")
        if caller.startswith(RUNNER):
            inner[name] += 1

    original = task.run_task

    def traced(cfg):
        sys.setprofile(hook)
        try:
            return original(cfg)
        finally:
            sys.setprofile(None)

    code = 0
    with tempfile.TemporaryDirectory() as tmp:
        argv = sys.argv
        sys.argv = [str(ROOT / "run.py"), *overrides, f"hydra.run.dir={tmp}/run"]
        task.run_task = traced
        out, err = io.StringIO(), io.StringIO()
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                runpy.run_path(str(ROOT / "run.py"), run_name="__main__")
        except SystemExit as e:
            code = e.code or 0
        finally:
            task.run_task, sys.argv = original, argv
        if code:
            print(err.getvalue(), file=sys.stderr)
    return dict(inner), dict(every), code


def main(argv: list[str] | None = None) -> int:
    """Print the entry counts of one job as a table (or JSON with ``--json``)."""
    ap = argparse.ArgumentParser(prog="python -m benchmarks.runner_entries", description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print {from_runner, from_anywhere} as JSON")
    ap.add_argument("--calls", action="store_true", help="also list every entry, caller -> callee, in order")
    args, overrides = ap.parse_known_args(argv)
    calls: list | None = [] if args.calls else None
    inner, every, code = count_entries(overrides, calls)
    for line in calls or []:
        print(line)
    if args.json:
        print(json.dumps({"overrides": overrides, "from_runner": inner, "from_anywhere": every}, sort_keys=True))
        return code
    print(f"python run.py {' '.join(overrides)}")
    print(f"{'module':<12}{'from runner':>12}{'from anywhere':>15}")
    for name in sorted(every, key=lambda n: (-inner.get(n, 0), n)):
        print(f"{name:<12}{inner.get(name, 0):>12}{every[name]:>15}")
    return code


if __name__ == "__main__":
    sys.exit(main())
