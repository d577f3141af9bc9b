"""Section ``compile``: the network call under ``torch.compile`` and CUDA graphs, the sampler's round under compile.

The only module of the check that reads the round's modules beyond the sampler's entry points
(:func:`specsamp.inductor.unavailable`, imported where it is used and optional).
"""

from __future__ import annotations

import inspect
import time

import torch

from benchmarks.common import fmt_stats, now, stats, sync
from benchmarks.gpu_check.harness import Context, section
from benchmarks.gpu_check.support import DIGITS, EPS, digits_velocity, labels_for
from specsamp.sampler import sample_speculative
from specsamp.schedule import Schedule
from specsamp.trees import DraftTree


@section("compile")
def compile_check(ctx: Context) -> dict:
    """The digits network's call eager, under ``torch.compile`` (default mode, static shapes; 64 rows only) and
    replayed from a captured CUDA graph, at fixed rows (64 and 1024): median [min-max] of ``repeats`` timed calls after warm-up,
    outputs compared with eager (max |diff|). The sampler's round under compile runs only where
    ``sample_speculative`` takes a ``compile`` keyword; otherwise, and for everything on a CPU, the
    reason is recorded under ``skipped``.

    Returns:
        ``{"rows": [{variant, rows, seconds, speedup_vs_eager, max_abs_diff, compile_s}], "skipped": [...]}``.
    """
    dev = ctx.device
    skipped = []
    if dev.type != "cuda":
        skipped.append("the network under torch.compile and CUDA graphs: CUDA only (this run is on the CPU)")
    out = []
    if "compile" in inspect.signature(sample_speculative).parameters:
        why = _compile_unavailable(dev)
        if why is not None:
            skipped.append(f"sampler round under compile: {why}")
        elif dev.type != "cuda" and ctx.tiny:
            skipped.append(
                "sampler round under compile on the CPU: not in --tiny (a compilation takes tens of seconds)"
            )
        elif ctx.left() < 90:
            skipped.append("sampler round under compile: under 90 s of the soft budget left (two compilations)")
        else:
            out += _sampler_compiled(ctx)
    else:
        skipped.append(
            "sampler round under compile: sample_speculative takes no 'compile' keyword; the network call only"
        )
    if dev.type != "cuda":
        lines = [_sampler_line(r) for r in out] or ["compile: skipped on the CPU"]
        passed = all(r.get("counts_equal", True) and "error" not in r for r in out)
        return {"rows": out, "skipped": skipped, "summary": lines, "passed": passed}
    model = digits_velocity(dev)
    net = model.net
    for b in (64, 1024):
        if ctx.left() < 45:
            skipped.append(f"rows={b}: under 45 s of the soft budget left (a compilation can take that)")
            break
        g = torch.Generator().manual_seed(ctx.seed)
        x = torch.randn(b, *model.event_shape, generator=g).to(dev)
        s = torch.full((b,), 0.5, device=dev)
        lab = torch.nn.functional.one_hot(torch.zeros(b, dtype=torch.long), net.label_dim).float().to(dev)

        def timed(fn):
            times = []
            for _ in range(max(ctx.repeats, 10)):
                t = now(dev)
                fn()
                times.append(now(dev) - t)
            return stats(times)

        with torch.no_grad():
            ref = net(x, s, lab)
            net(x, s, lab)
            eager = timed(lambda x=x, s=s, lab=lab: net(x, s, lab))
            out.append({"variant": "eager", "rows": b, "seconds": eager, "speedup_vs_eager": 1.0})
            try:
                if b != 64:
                    raise _NotTried("compiled at 64 rows only (each static shape compiles anew, tens of seconds)")
                t = time.perf_counter()
                cnet = torch.compile(net, dynamic=False)
                y = cnet(x, s, lab)
                sync(dev)
                cs = time.perf_counter() - t
                st = timed(lambda cnet=cnet, x=x, s=s, lab=lab: cnet(x, s, lab))
                out.append(
                    {
                        "variant": "torch.compile",
                        "rows": b,
                        "seconds": st,
                        "compile_s": cs,
                        "speedup_vs_eager": eager["median"] / st["median"],
                        "max_abs_diff": float((y - ref).abs().max()),
                    }
                )
            except _NotTried as e:
                skipped.append(f"torch.compile at {b} rows: {e}")
            except Exception as e:  # noqa: BLE001  (recorded: compile may not work on this image)
                out.append({"variant": "torch.compile", "rows": b, "error": f"{type(e).__name__}: {e}"[:2000]})
            try:
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    for _ in range(3):
                        net(x, s, lab)
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    y = net(x, s, lab)
                graph.replay()
                sync(dev)
                st = timed(graph.replay)
                out.append(
                    {
                        "variant": "cuda graph",
                        "rows": b,
                        "seconds": st,
                        "speedup_vs_eager": eager["median"] / st["median"],
                        "max_abs_diff": float((y - ref).abs().max()),
                    }
                )
            except Exception as e:  # noqa: BLE001
                out.append({"variant": "cuda graph", "rows": b, "error": f"{type(e).__name__}: {e}"[:2000]})
    lines = [
        _sampler_line(r)
        if r["variant"].startswith("sampler")
        else f"compile {r['variant']:<13} {r['rows']:>5} rows: {fmt_stats(r['seconds'])} ({r['speedup_vs_eager']:.2f}x eager)"
        if "seconds" in r
        else f"compile {r['variant']} {r['rows']} rows: {r['error'][:120]}"
        for r in out
    ]
    return {"network": DIGITS, "rows": out, "skipped": skipped, "summary": lines, "passed": True}


def _compile_unavailable(dev) -> str | None:
    """Why the sampler's ``compile=True`` cannot run on ``dev`` here (:func:`specsamp.inductor.unavailable`), or None."""
    try:
        from specsamp.inductor import unavailable
    except ImportError:  # a tree without the compiled round: the keyword's own refusal will say why
        return None
    return unavailable(dev)


def _sampler_line(r: dict) -> str:
    """One summary line of a :func:`_sampler_compiled` row."""
    if "error" in r:
        return f"compile {r['variant']} {r['rows']} rows: {r['error'][:120]}"
    extra = (
        (
            f", first run {r['first_run_s']:.1f} s, counts equal: {r.get('counts_equal')}, samples within "
            f"{r.get('max_abs_diff', float('nan')):.2g}"
        )
        if "counts_equal" in r
        else ""
    )
    speedup = r.get("speedup_vs_eager", 1.0)
    return f"compile {r['variant']:<22} {r['rows']:>3} rows: {fmt_stats(r['seconds'])} ({speedup:.2f}x eager{extra})"


class _NotTried(Exception):
    """A variant left out on purpose (the reason is recorded under ``skipped``)."""


def _sampler_compiled(ctx: Context) -> list[dict]:
    """D-GRS (2, 3) on the digits network at batch 16 with ``sample_speculative(..., compile=True)`` against
    ``compile=False``: one untimed run each, then ``repeats`` timed ones; the counts must agree."""
    dev = ctx.device
    model = digits_velocity(dev)
    sched = Schedule.make(ctx.steps, EPS)
    n = 16
    cond = labels_for(model, n, ctx.seed)
    out, res = [], {}
    for flag in (False, True):

        def go(flag=flag):
            return sample_speculative(
                model,
                sched,
                DraftTree.uniform(2, 3),
                "dgrs",
                n,
                execution="tree",
                seed=ctx.seed,
                cond=cond,
                compile=flag,
            )

        try:
            t = time.perf_counter()
            res[flag] = go()
            sync(dev)
            first = time.perf_counter() - t
            times = []
            for _ in range(ctx.repeats):
                t = now(dev)
                go()
                times.append(now(dev) - t)
            out.append({"variant": f"sampler compile={flag}", "rows": n, "seconds": stats(times), "first_run_s": first})
        except Exception as e:  # noqa: BLE001  (recorded: the keyword is another module's)
            out.append({"variant": f"sampler compile={flag}", "rows": n, "error": f"{type(e).__name__}: {e}"[:2000]})
    if len(res) == 2 and "seconds" in out[0] and "seconds" in out[1]:
        out[1]["speedup_vs_eager"] = out[0]["seconds"]["median"] / out[1]["seconds"]["median"]
        out[0]["speedup_vs_eager"] = 1.0
        out[1]["counts_equal"] = bool(
            torch.equal(res[False].nfe.cpu(), res[True].nfe.cpu())
            and torch.equal(res[False].accepts.cpu(), res[True].accepts.cpu())
        )
        out[1]["max_abs_diff"] = float((res[False].samples.float() - res[True].samples.float()).abs().max())
    return out
