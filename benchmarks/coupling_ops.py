"""ATen operations and host synchronisations per coupling call (load-free; ``python -m benchmarks.coupling_ops``).

One verification of ``n`` parents with ``K`` children in ``D = 64`` coordinates (float32 states,
``sigma = 0.37``, ``delta = 30`` so that every row is rejected and the residual is drawn), counted with
:func:`benchmarks.opcount.counting`: eagerly (value checks raise at once) and inside
:func:`specsamp.coupling.deferred_checks` (value checks flag on the device), as a sampler round runs it.
"""

from __future__ import annotations

import torch

from benchmarks.opcount import counting
from specsamp.coupling import deferred_checks, get_coupling
from specsamp.testing import make_problem

CASES = [("dgrs", 1), ("dgrs", 2), ("dgrs", 5), ("rmc", 1), ("markmax", 2), ("markmax", 4)]

COUNTED = {
    ("dgrs", 1): 236,
    ("dgrs", 2): 256,
    ("dgrs", 5): 298,
    ("rmc", 1): 61,
    ("markmax", 2): 15497,
    ("markmax", 4): 17317,
}
"""Deferred ops per call (static shapes: the same at n = 1 and 16 but for the copies of a column that one row does
not need; markmax's one-time share table is setup, not counted), as counted with torch 2.x when this table was
written; ``main`` prints today's count beside it."""


def count(name: str, n: int, K: int, dim: int = 64, deferred: bool = True) -> tuple[int, int]:
    """``(ops, syncs)`` of one ``name`` verification of ``n`` parents with ``K`` children in ``dim`` coordinates
    (one-time tables built on first use, the ``setup`` region of :func:`benchmarks.opcount.counting`, excluded)."""
    children, mean_p, mean_q, sigma, _, g = make_problem(30.0, K, torch.float32, n=n, dim=dim, seed=1)
    coupling = get_coupling(name)
    if deferred:
        with deferred_checks(), counting() as c:
            coupling(children, mean_p, mean_q, sigma, g)
    else:
        with counting() as c:
            coupling(children, mean_p, mean_q, sigma, g)
    return c.total_ops - c.ops["setup"], c.total_syncs - c.syncs["setup"]


def main() -> None:
    head = f"{'coupling':>8} {'K':>2} {'n':>3} {'ops':>6} {'syncs':>5} {'ops eager':>9} {'syncs eager':>11}"
    print(f"{head} {'table':>6}")
    for name, K in CASES:
        for i, n in enumerate((1, 16)):
            ops, syncs = count(name, n, K)
            ops_e, syncs_e = count(name, n, K, deferred=False)
            table = COUNTED[name, K]
            table = table[i] if isinstance(table, tuple) else table
            print(f"{name:>8} {K:>2} {n:>3} {ops:>6} {syncs:>5} {ops_e:>9} {syncs_e:>11} {table:>6}")


if __name__ == "__main__":
    main()
