"""Section ``projection``: the digits runs' calls priced at the CIFAR-10 layout's measured call cost."""

from __future__ import annotations

from benchmarks.gpu_check.harness import Context, section


def _interp(curve: list[dict], rows: int) -> float:
    """Seconds of a call of ``rows`` rows from a measured curve: linear between measured sizes, the largest
    size's per-row cost beyond it."""
    pts = [(c["rows"], c["seconds"]["median"]) for c in curve if "seconds" in c]
    if rows <= pts[0][0]:
        return pts[0][1]
    for (r0, s0), (r1, s1) in zip(pts, pts[1:]):
        if rows <= r1:
            return s0 + (s1 - s0) * (rows - r0) / (r1 - r0)
    return pts[-1][1] * rows / pts[-1][0]


@section("projection")
def projection(ctx: Context) -> dict:
    """A *projection* of the wall clock on EDM's CIFAR-10 network from the digits runs (section 3 of
    :mod:`benchmarks.gpu_check`).

    For each arm and batch: ``network_s = sum over the digits run's calls of cost_cifar(rows)`` (the
    measured call-cost curve, float32 and bfloat16), plus the digits run's measured non-network time
    (the sampler's own work, taken as independent of the network). Assumes the CIFAR-10 network's
    trees accept as the digits network's do (same calls, same rows); random weights cannot tell.

    Returns:
        ``{"rows": [{arm, batch, dtype, projected_network_s, other_s, projected_wall_s, projected_speedup}]}``.
    """
    cost = ctx.shared.get("call_cost", {}).get("cifar10_ddpmpp")
    wc = ctx.shared.get("wallclock")
    if not cost or not wc:
        raise RuntimeError("needs the call_cost and wallclock sections' results")
    out = []
    for dtype, curve in cost["curves"].items():
        if not any("seconds" in c for c in curve):
            continue
        base = {}
        for r in wc["rows"]:
            if "wall_s" not in r:
                continue
            hist = wc["calls"][(r["arm"], r["batch"])]
            net = sum(_interp(curve, rows) * k for rows, k in hist.items())
            wall = net + r["other_s"]["median"]
            if r["arm"] == "standard":
                base[r["batch"]] = wall
            out.append(
                {
                    "arm": r["arm"],
                    "batch": r["batch"],
                    "dtype": dtype,
                    "projected_network_s": net,
                    "other_s": r["other_s"]["median"],
                    "projected_wall_s": wall,
                    "projected_speedup": base[r["batch"]] / wall if r["batch"] in base else None,
                    "nfe_speedup": r["nfe_speedup"],
                    "max_rows": max(hist),
                    "beyond_measured": max(hist) > max(c["rows"] for c in curve if "seconds" in c),
                }
            )
    lines = []
    for dtype in dict.fromkeys(r["dtype"] for r in out):
        for arm in dict.fromkeys(r["arm"] for r in out if r["arm"] != "standard"):
            cells = [r for r in out if r["dtype"] == dtype and r["arm"] == arm]
            lines.append(
                f"projection (EDM CIFAR-10 layout, {dtype}) {arm:<16} projected speedup "
                + ", ".join(
                    f"x{r['batch']} {r['projected_speedup'] or float('nan'):.2f} (NFE {r['nfe_speedup']:.2f})"
                    for r in cells
                )
            )
    return {
        "what": "projection, not a measurement: digits calls priced at the CIFAR-10 layout's measured call "
        "cost, plus the digits runs' non-network time",
        "rows": out,
        "summary": lines,
        "passed": True,
    }
