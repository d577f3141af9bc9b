"""Section ``call_cost``: seconds of one network call against its rows, digits and EDM's CIFAR-10 layout."""

from __future__ import annotations

import math

import torch

from benchmarks.common import fmt_stats, now, peak_mib, peak_reset, stats
from benchmarks.gpu_check.harness import Context, section
from benchmarks.gpu_check.support import cifar_velocity, digits_velocity

SHARE = 0.2  # of --budget-s, after which the section starts no new size


def _gflop_per_row(model) -> float | None:
    """Floating-point operations of one row's call, in GFLOP (torch's operation counter: convolutions and
    matrix products, 2 per multiply-add), or None where the counter fails."""
    try:
        from torch.utils.flop_counter import FlopCounterMode

        cond = {"class_labels": torch.zeros(1, dtype=torch.long, device=model.device)} if model.label_dim else {}
        with FlopCounterMode(display=False) as counter:
            model(
                torch.randn(1, *model.event_shape).to(model.device), torch.full((1,), 0.5, device=model.device), **cond
            )
        return counter.get_total_flops() / 1e9
    except Exception:  # noqa: BLE001  (a count is a convenience, not a measurement)
        return None


@section("call_cost")
def call_cost(ctx: Context) -> dict:
    """Seconds of one call against rows ``1, 2, 4, ..., max_rows`` for both networks, float32 and bfloat16.

    Per size: two untimed calls, then ``repeats`` timed ones (host clock around a synchronised call) on
    fresh standard-normal inputs at ``sigma = 0.5``; a size that runs out of memory ends that curve.

    Returns:
        ``{"networks": {name: {params, gflop_per_row, curves: {dtype: [{rows, seconds: {median, min, max, n},
        per_row_s, peak_mib, tflop_per_s}]}}}}``; the curves are kept for the projection section.
    """
    dev = ctx.device
    sizes = [2**i for i in range(int(math.log2(ctx.max_rows)) + 1)]
    out = ctx.partial.setdefault("networks", {})
    for name in ("digits", "cifar10_ddpmpp"):
        entry = {"curves": {}}
        for dtype in ("float32", "bfloat16"):
            nd = None if dtype == "float32" else dtype
            if name == "digits":
                model = digits_velocity(dev, nd)
                entry["params"] = sum(p.numel() for p in model.net.parameters())
            else:
                model, entry["params"] = cifar_velocity(dev, ctx.tiny, nd, ctx.seed)
            if "gflop_per_row" not in entry:
                entry["gflop_per_row"] = _gflop_per_row(model)
            g = torch.Generator().manual_seed(ctx.seed)
            curve = []
            for b in sizes:
                if ctx.over_share(SHARE):
                    curve.append({"rows": b, "skipped": "the section's share of the budget is spent"})
                    break
                cond = {"class_labels": torch.zeros(b, dtype=torch.long, device=dev)} if model.label_dim else {}
                sigma = torch.full((b,), 0.5, device=dev)
                try:
                    peak_reset(dev)
                    xs = [torch.randn(b, *model.event_shape, generator=g).to(dev) for _ in range(2)]
                    for x in xs:
                        model(x, sigma, **cond)
                    times = []
                    for r in range(ctx.repeats):
                        x = xs[r % 2]
                        t = now(dev)
                        model(x, sigma, **cond)
                        times.append(now(dev) - t)
                except torch.cuda.OutOfMemoryError as e:  # noqa: PERF203
                    curve.append({"rows": b, "error": f"out of memory: {str(e).splitlines()[0]}"})
                    torch.cuda.empty_cache()
                    break
                s = stats(times)
                gf = entry["gflop_per_row"]
                curve.append(
                    {
                        "rows": b,
                        "seconds": s,
                        "per_row_s": s["median"] / b,
                        "peak_mib": peak_mib(dev),
                        "tflop_per_s": gf * b / s["median"] / 1e3 if gf else None,
                    }
                )
                del xs
            entry["curves"][dtype] = curve
            ok = [c for c in curve if "seconds" in c]
            if ok:
                ctx.log(
                    f"  call_cost {name} {dtype}: {ok[-1]['rows']} rows {fmt_stats(ok[-1]['seconds'])}, "
                    f"peak {'n/a' if ok[-1]['peak_mib'] is None else format(ok[-1]['peak_mib'], '.0f') + ' MiB'}"
                )
            del model
            if dev.type == "cuda":
                torch.cuda.empty_cache()
        out[name] = entry
    ctx.shared["call_cost"] = out
    lines = []
    for name, e in out.items():
        for dtype, curve in e["curves"].items():
            ok = [c for c in curve if "seconds" in c]
            if ok:
                rate = ok[-1]["tflop_per_s"]
                lines.append(
                    f"call_cost {name} {dtype}: 1 row {fmt_stats(ok[0]['seconds'])}, {ok[-1]['rows']} rows "
                    f"{fmt_stats(ok[-1]['seconds'])} ({ok[-1]['seconds']['median'] / ok[0]['seconds']['median']:.1f}x"
                    + (f", {rate:.3g} TFLOP/s)" if rate else ")")
                )
    return {"networks": out, "summary": lines, "passed": True}
