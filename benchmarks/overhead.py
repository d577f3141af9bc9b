"""``python -m benchmarks.overhead [--preset P] [--json F]``: the overhead and scaling sections of ``make bench``.

The measurement (sampler work per speculative round, the network call excluded, and how it scales) lives in
:mod:`benchmarks.overhead_tables`, which :mod:`benchmarks.bench` imports; its names stay importable from
here. This module holds only the command, which runs :func:`benchmarks.bench.main` with
``--only overhead,scaling``, so that no benchmark module imports one that imports it.
"""

from __future__ import annotations

import sys

from benchmarks.overhead_tables import (  # noqa: F401  (importable from here as before)
    TREES,
    Timed,
    network_call_seconds,
    overhead_table,
    round_overhead,
    scaling_table,
)


def main(argv=None) -> int:
    """The command (see the module docstring); returns the exit status of :func:`benchmarks.bench.main`."""
    from benchmarks.bench import main as bench_main

    argv = list(argv if argv is not None else sys.argv[1:])
    return bench_main(["--only", "overhead,scaling", *argv])


if __name__ == "__main__":
    sys.exit(main())
