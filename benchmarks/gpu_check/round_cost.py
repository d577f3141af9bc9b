"""Section ``round_cost``: what a speculative round costs the host beside its network call, eager against compiled.

A round of the tree execution is one batched network call and a fixed sequence of small tensor operations around it
(drafting, verification, walk, commit). On a GPU those operations cost the host their launches, whatever their size,
so a round's cost beside the call is host time. Under ``compile=True`` the round's pieces are fused kernels, and on
CUDA replayed from captured CUDA graphs (:mod:`specsamp.round.compiled`), which is the lever this section measures.

Target: the Gaussian mixture (``dim=64``, 8 components, float32 on the device: its exact velocity is a few small
tensor operations, so the network's share is small and known). Arms: RMC on a chain of 14 (``--tiny``: 4), drafted
layer by layer and in closed form (``draft_form="closed"``), and D-GRS on the uniform (2, 3) tree,
``execution="tree"``, batches 1 and 16 (``--tiny``: 1), seed ``--seed``; each eager and compiled: one untimed run
(compiles), then ``repeats`` timed runs. Per round: the wall clock (device synchronised at
the end of the run only) over the rounds, the host seconds inside the network calls (``Velocity.__call__``, not
synchronised: the time to issue them), and their difference, the round's own host cost. Counts of eager and compiled
must agree (``counts_equal``). On the CPU (a compilation takes tens of seconds there) ``--tiny`` compiles the chain
at batch 1 only; without a C compiler (or Triton on CUDA) the compiled rows are skipped with the reason.
"""

from __future__ import annotations

import time

import torch

from benchmarks.common import fmt_stats, now, stats, sync
from benchmarks.gpu_check.harness import Context, section
from specsamp.models import GaussianMixture
from specsamp.sampler import sample_speculative
from specsamp.schedule import Schedule
from specsamp.trees import DraftTree

DIM, COMPONENTS, EPS = 64, 8, 0.3


class NetworkClock:
    """Host seconds spent inside ``Velocity.__call__`` (every network call of a run) while installed."""

    def __init__(self):
        from specsamp.round import context

        self.module, self.seconds, self.calls = context, 0.0, 0
        self.call = context.Velocity.__call__

    def __enter__(self):
        call = self.call

        def timed(v, *a, **k):
            t = time.perf_counter()
            try:
                return call(v, *a, **k)
            finally:
                self.seconds += time.perf_counter() - t
                self.calls += 1

        self.module.Velocity.__call__ = timed
        return self

    def __exit__(self, *_exc):
        self.module.Velocity.__call__ = self.call


def _arms(tiny: bool) -> list[tuple[str, str, DraftTree, str]]:
    chain = DraftTree.uniform(1, 4 if tiny else 14)
    name = f"rmc chain {len(chain) - 1}"
    return [
        (name, "rmc", chain, "loop"),
        (f"{name} closed", "rmc", chain, "closed"),
        ("dgrs (2,3)", "dgrs", DraftTree.uniform(2, 3), "loop"),
    ]


def _measure(ctx: Context, model, sched, arm: tuple, n: int, compiled: bool) -> tuple[dict, object]:
    """One untimed run of ``arm`` (``(name, coupling, tree, draft_form)``), then ``ctx.repeats`` timed ones:
    ``(row, result)``."""
    _, coupling, tree, form = arm

    def go():
        return sample_speculative(
            model, sched, tree, coupling, n, execution="tree", seed=ctx.seed, compile=compiled, draft_form=form
        )

    t = time.perf_counter()
    res = go()
    sync(ctx.device)
    first = time.perf_counter() - t
    rounds = int(res.rounds.max())
    wall, net, own = [], [], []
    for _ in range(ctx.repeats):
        with NetworkClock() as clock:
            t = now(ctx.device)
            go()
            w = now(ctx.device) - t
        wall.append(w / rounds)
        net.append(clock.seconds / rounds)
        own.append((w - clock.seconds) / rounds)
    row = {
        "rounds": rounds,
        "first_run_s": first,
        "wall_per_round_s": stats(wall),
        "network_host_per_round_s": stats(net),
    }
    row["round_host_per_round_s"] = stats(own)
    return row, res


@section("round_cost")
def round_cost(ctx: Context) -> dict:
    """The rows of the module docstring: ``{"rows": [{arm, batch, compile, rounds, first_run_s, wall_per_round_s,
    network_host_per_round_s, round_host_per_round_s, [speedup_vs_eager, counts_equal, max_abs_diff] | error}],
    "skipped": [...]}``; ``passed``: every compiled row's counts equal eager's."""
    from specsamp.inductor import unavailable

    dev = ctx.device
    model = GaussianMixture(dim=DIM, components=COMPONENTS, layout_seed=1, dtype=torch.float32, device=dev)
    sched = Schedule.make(ctx.steps, EPS)
    why = unavailable(dev)
    out, skipped, lines = [], [] if why is None else [f"compiled rounds: {why}"], []
    for spec in _arms(ctx.tiny):
        arm, coupling = spec[:2]
        for n in [1] if ctx.tiny else [1, 16]:
            if ctx.over_share(0.25):
                skipped.append(f"{arm} at batch {n}: this section's share of the budget is spent")
                continue
            eager, ref = _measure(ctx, model, sched, spec, n, False)
            out.append({"arm": arm, "batch": n, "compile": False, **eager})
            if why is not None:
                continue
            if dev.type == "cpu" and ctx.tiny and (spec[3] != "loop" or coupling != "rmc" or n != 1):
                skipped.append(f"{arm} compiled at batch {n} on the CPU: not in --tiny (tens of seconds to compile)")
                continue
            try:
                row, res = _measure(ctx, model, sched, spec, n, True)
            except Exception as e:  # noqa: BLE001  (recorded: a compile may fail on this image)
                out.append({"arm": arm, "batch": n, "compile": True, "error": f"{type(e).__name__}: {e}"[:2000]})
                continue
            row["speedup_vs_eager"] = eager["wall_per_round_s"]["median"] / row["wall_per_round_s"]["median"]
            row["counts_equal"] = bool(
                torch.equal(ref.nfe.cpu(), res.nfe.cpu()) and torch.equal(ref.accepts.cpu(), res.accepts.cpu())
            )
            row["max_abs_diff"] = float((ref.samples.float() - res.samples.float()).abs().max())
            out.append({"arm": arm, "batch": n, "compile": True, **row})
    for r in out:
        head = f"round_cost {r['arm']:<18} batch {r['batch']:>2} compile={str(r['compile']):<5}"
        if "error" in r:
            lines.append(f"{head}: {r['error'][:120]}")
            continue
        tail = f" ({r['speedup_vs_eager']:.2f}x eager, counts equal: {r['counts_equal']})" if r["compile"] else ""
        lines.append(
            f"{head}: round {fmt_stats(r['wall_per_round_s'])}, of it beside the call "
            f"{fmt_stats(r['round_host_per_round_s'])}{tail}"
        )
    passed = all(r.get("counts_equal", True) and "error" not in r for r in out)
    return {
        "target": f"gmm dim={DIM} components={COMPONENTS} float32",
        "rows": out,
        "skipped": skipped,
        "summary": lines or ["round_cost: nothing measured"],
        "passed": passed,
    }
