"""``make figures``: rebuild every figure in ``results/`` from the committed tables (no sampling).

Each experiment module exposes ``figures()``; a module whose tables are not committed yet is reported
and skipped, never fatal.
"""

from __future__ import annotations

import importlib
import sys

MODULES = [
    "experiments.gmm",
    "experiments.pixel",
    "experiments.sd3",
    "experiments.beyond",
    "experiments.digits",
    "experiments.patches",
]


def main() -> int:
    """Run every module's ``figures()``; exit 1 only if a module with tables fails."""
    failed = []
    for name in MODULES:
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name == name:
                continue  # the artifact's module does not exist yet
            raise
        try:
            mod.figures()
        except SystemExit as e:  # a missing table: say so and go on
            print(f"{name}: skipped ({e})", file=sys.stderr)
        except Exception as e:  # noqa: BLE001
            failed.append(name)
            print(f"{name}: FAILED: {e!r}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
