"""Sampler overhead per speculative round, the network call excluded, and how it scales.

Overhead = everything the sampler does around the batched target call: drafting (noise included),
coupling, prefetch and bookkeeping. It is measured on the ``tree`` execution (what runs on a GPU)
with a cheap proxy target of the network's event shape (``v = -x``), whose own time is measured and
subtracted, so the table does not depend on the network's acceptance behaviour or cost. The cost of
one batched network call of ``M (B + 1)`` rows is measured separately on the network (any
:class:`specsamp.models.VelocityModel`: the CIFAR-sized stand-in, a trained net), from a probe
batch of ``probe`` rows scaled linearly to the call's rows (CPU cost is linear in rows), and the
table reports overhead per round as a fraction of that call.
"""

from __future__ import annotations

import time

import torch

from benchmarks.common import LinearVelocity, best_of
from specsamp.sampler import sample_speculative
from specsamp.schedule import Schedule
from specsamp.trees import DraftTree, budget

TREES = {14: (2, 3), 62: (2, 5), 155: (5, 3), 340: (4, 4)}


class Timed:
    """Wrap a velocity model and add up the seconds spent inside its calls (``seconds``, ``rows``, ``calls``)."""

    def __init__(self, model):
        self.model, self.seconds, self.rows, self.calls = model, 0.0, 0, 0
        self.event_shape, self.dtype = model.event_shape, model.dtype
        self.device = getattr(model, "device", "cpu")
        self.label_dim = getattr(model, "label_dim", 0)

    def __call__(self, x, sigma, **cond):
        t0 = time.perf_counter()
        out = self.model(x, sigma, **cond)
        self.seconds += time.perf_counter() - t0
        self.rows += x.shape[0]
        self.calls += 1
        return out


def round_overhead(
    event_shape,
    B: int,
    trajectories: int = 1,
    execution: str = "tree",
    steps: int = 12,
    eps: float = 0.3,
    repeats: int = 2,
    dtype=torch.float32,
) -> dict:
    """Seconds of sampler work per speculative round, target time excluded.

    Args:
        event_shape: state shape (e.g. ``(3, 32, 32)``).
        B: budget, one of :data:`TREES` (uniform tree) or any int (``K=1`` chain of length B).
        trajectories: ``M`` trajectories sampled together.
        execution: ``tree`` or ``path``.
        steps: ``T`` of the schedule (``>= L + 3`` so full-depth rounds happen).
        eps: churn.
        repeats: best of this many runs.
        dtype: state dtype.

    Returns:
        dict with ``overhead_s`` per round, ``rounds``, ``target_s`` (the proxy's time) and ``rows``.
    """
    K, L = TREES.get(B, (1, B))
    tree = DraftTree.uniform(K, L)
    sch = Schedule.make(max(steps, L + 3), eps)
    out = {}

    def once(r):
        m = Timed(LinearVelocity(event_shape, dtype))
        t0 = time.perf_counter()
        res = sample_speculative(m, sch, tree, "dgrs", trajectories, execution=execution, seed=r)
        wall = time.perf_counter() - t0
        loops = int(res.rounds.max())
        out[r] = {"overhead_s": (wall - m.seconds) / loops, "rounds": loops, "target_s": m.seconds, "rows": m.rows}
        return out[r]

    once(0)  # warm-up
    best = min((once(r + 1) for r in range(repeats)), key=lambda d: d["overhead_s"])
    return {"budget": budget(K, L), "K": K, "L": L, "M": trajectories, "execution": execution, **best}


def network_call_seconds(model, rows: int, probe: int = 4, cond_for=None, repeats: int = 2) -> float:
    """Seconds of one batched call of ``rows`` rows of ``model``, from a probe of ``min(probe, rows)`` rows.

    Args:
        model: velocity model.
        rows: rows of the call to estimate.
        probe: rows actually evaluated (timed, best of ``repeats`` after one warm-up call).
        cond_for: ``n -> cond dict`` for conditional models (``None``: unconditional).
        repeats: timed repeats.

    Returns:
        estimated seconds (``probe seconds * rows / probe``).
    """
    p = min(probe, rows)
    dev = torch.device(getattr(model, "device", "cpu"))
    x = torch.randn(p, *model.event_shape, device=dev, dtype=model.dtype)
    sigma = torch.full((p,), 0.5, device=dev, dtype=torch.float64)
    cond = cond_for(p) if cond_for else {}
    with torch.no_grad():
        model(x, sigma, **cond)
        t, _ = best_of(lambda r: model(x, sigma, **cond), repeats, dev)
    return t * rows / p


def overhead_table(
    model, name: str, budgets=(14, 62, 155), trajectories: int = 1, probe: int = 4, progress=print
) -> list[dict]:
    """Overhead per round as a fraction of one batched call of ``model``, for each budget (item of ``make bench``)."""
    cond_for = None
    if getattr(model, "label_dim", 0):
        cond_for = lambda n: {"class_labels": torch.zeros(n, dtype=torch.long)}  # noqa: E731
    rows = []
    per_row = network_call_seconds(model, probe, probe, cond_for) / probe
    for B in budgets:
        r = round_overhead(model.event_shape, B, trajectories)
        call = per_row * trajectories * (B + 1)
        r.update({"network": name, "call_s": call, "fraction": r["overhead_s"] / call})
        rows.append(r)
        if progress:
            progress(
                f"  overhead {name} B={B}: {r['overhead_s'] * 1e3:.1f} ms/round vs call {call:.2f} s ({100 * r['fraction']:.3f}%)"
            )
    return rows


def scaling_table(dims=(500, 3072, 16384), budgets=(14, 340), trajectories: int = 4, progress=print) -> list[dict]:
    """Per-round sampler cost (proxy target excluded) against state dimension and budget, both executions."""
    rows = []
    for d in dims:
        for B in budgets:
            for ex in ("path", "tree"):
                r = round_overhead((d,), B, trajectories, execution=ex, repeats=1)
                r["dim"] = d
                rows.append(r)
                if progress:
                    progress(f"  scaling d={d} B={B} {ex}: {r['overhead_s'] * 1e3:.2f} ms/round")
    return rows
