"""GPU check: per-call cost, wall clock of standard vs speculative sampling, CUDA against CPU, laws, compile.

    python3 -m benchmarks.gpu_check                      # on the GPU, from the repository root (< 5 minutes)
    python3 -m benchmarks.gpu_check --device cpu --tiny  # a rehearsal of every section in seconds
    make gpu-check [ARGS="..."]

Runs from the working tree with torch, numpy and scipy only (nothing installed, nothing downloaded).
Output folder: ``--out``, else ``$OUT``, else ``./gpu_check/``. Each section writes ``<section>.json``
(atomically) as soon as it ends, with ``status`` ``ok`` (it ran; its checks are in ``passed``),
``error`` (the traceback is recorded and the next section still runs) or ``skipped`` (no time left in
``--budget-s``); ``summary.txt`` is rewritten after every section. A SIGTERM (``timeout``) ends the
running section with what it had finished (under ``partial``) and marks the rest skipped. Exit status:
0 when every section ran, 1 otherwise, 2 for a bad argument.

Sections, in order of value:

1. ``call_cost``: seconds of one network call against its rows (1 to 4096) for the trained digits
   network (``edm-digits-8x8-cond``, shipped) and for EDM's CIFAR-10 network (the DDPM++ layout,
   55.7M parameters, random weights; :mod:`benchmarks.ddpmpp`), in float32 (TF32 as torch's defaults
   leave it) and under bfloat16 autocast; median [min-max] of the repeats, peak GPU memory.
2. ``wallclock``: standard vs speculative sampling on the digits network at the paper's EDM protocol
   (T = 100, eps = 0.3), ``execution="tree"``, batches 1, 4, 16, 64: D-GRS on the uniform (2, 3) and
   (2, 5) trees, RMC on a chain of 14, and the x0 draft with D-GRS on the optimal tree for B = 14 and
   B = 62 (searched from the shipped profile ``edm-digits-8x8-cond_x0``, as ``tree=optimal`` does).
   Every arm runs once untimed at each batch (the timed runs repeat its shapes exactly), then
   ``--repeats`` timed runs: median [min-max] seconds, the network's share (CUDA events around every
   call) and the rest, peak GPU memory, NFE and wall-clock speedups; then the host's waits on the
   device per round at batch 16, by source line (:func:`host_syncs`).
3. ``projection``: the digits runs' calls (rows of every call, recorded per arm and batch) priced at
   the CIFAR-10 network's measured call cost, plus the digits runs' non-network time: a *projected*
   wall clock and speedup for EDM's network, assuming its trees accept as the digits network's do.
4. ``cuda_vs_cpu``: the same seed on the device and on the CPU, for the GMM (float64) and the digits
   network (float32, TF32 off): every count equal, samples within a tolerance derived on the CPU
   (:func:`cuda_vs_cpu`).
5. ``laws``: every registered coupling's law on the device (KS of the output's projections), and
   speculative against standard samples of the digits network under bfloat16 autocast (two-sample KS).
6. ``compile``: the network call under ``torch.compile`` and replayed from a captured CUDA graph,
   against eager, at fixed rows (CUDA only); the sampler's round under ``compile=True`` against eager
   (D-GRS (2, 3), batch 16: times, counts, samples' largest difference), on CUDA and on a CPU with a C
   compiler (not in ``--tiny`` on the CPU: a compilation takes tens of seconds).

``--tiny`` shrinks every size (T = 8, two batches, the DDPM++ layout at 16 channels): a smoke run
whose timings measure nothing.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import platform
import signal
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run from the working tree, not installed
    sys.path.insert(0, str(ROOT))

from benchmarks.ddpmpp import ddpmpp_cifar10  # noqa: E402
from specsamp.models.edm import CHECKPOINTS, EDMVelocity, load_edm, uniform_labels  # noqa: E402
from specsamp.sampler import sample_speculative, sample_standard  # noqa: E402
from specsamp.schedule import Schedule  # noqa: E402
from specsamp.trees import DraftTree  # noqa: E402

SECTIONS = ("call_cost", "wallclock", "projection", "cuda_vs_cpu", "laws", "compile")
DIGITS = "edm-digits-8x8-cond"
PROFILE = ROOT / "conf" / "profiles" / "edm-digits-8x8-cond_x0.json"
P_MIN = 1e-4  # a law check passes when every KS p-value is above this (about 30 p-values: ~0.3% false alarms)
EPS = 0.3  # the paper's churn for EDM (section 5.2)


# ----------------------------------------------------------------------------------------------
# timing


class Clock:
    """Wall time on ``device``: host clock after a device synchronisation (CUDA work is asynchronous)."""

    def __init__(self, device: torch.device):
        self.device = device

    def sync(self) -> None:
        """Wait for the device's queued work (no-op on CPU)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def now(self) -> float:
        """Seconds (``time.perf_counter``) after :meth:`sync`."""
        self.sync()
        return time.perf_counter()


class TimedModel:
    """A velocity model that records the rows and the time of every call, without synchronising.

    On CUDA a pair of CUDA events brackets each call (their elapsed times are read by :meth:`network_s`
    after the run); on the CPU the host clock does. ``rows``: rows of each call, in order.

    Args:
        model: the velocity model (``event_shape``, ``dtype``, ``device`` are passed through).
    """

    def __init__(self, model):
        self.model = model
        self.event_shape, self.dtype = model.event_shape, model.dtype
        self.device = torch.device(getattr(model, "device", "cpu"))
        self.label_dim = getattr(model, "label_dim", 0)
        self.reset()

    def reset(self) -> None:
        """Forget the recorded calls."""
        self.rows: list[int] = []
        self._events: list = []
        self._cpu_s = 0.0

    def __call__(self, x, sigma, **cond):
        self.rows.append(int(x.shape[0]))
        if self.device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            out = self.model(x, sigma, **cond)
            b.record()
            self._events.append((a, b))
            return out
        t0 = time.perf_counter()
        out = self.model(x, sigma, **cond)
        self._cpu_s += time.perf_counter() - t0
        return out

    def network_s(self) -> float:
        """Seconds spent inside the network's calls since :meth:`reset` (synchronises first)."""
        if self.device.type != "cuda":
            return self._cpu_s
        torch.cuda.synchronize(self.device)
        return sum(a.elapsed_time(b) for a, b in self._events) / 1e3


def _stats(values) -> dict:
    """``{median, min, max, n}`` of a list of numbers."""
    v = [float(x) for x in values]
    return {"median": statistics.median(v), "min": min(v), "max": max(v), "n": len(v)}


def _fmt(s: dict, scale: float = 1e3, unit: str = "ms") -> str:
    return f"{s['median'] * scale:.3g} [{s['min'] * scale:.3g}-{s['max'] * scale:.3g}] {unit}"


def _peak_reset(device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _peak_mib(device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None


# ----------------------------------------------------------------------------------------------
# networks


def digits_velocity(device, net_dtype=None) -> EDMVelocity:
    """The shipped digits network (hash-checked pickle) behind the velocity interface."""
    ck = CHECKPOINTS[DIGITS]
    net = load_edm(ck.url, sha256=ck.sha256, download=False, map_location="cpu")
    return EDMVelocity(net, net_dtype=net_dtype, device=device)


def cifar_velocity(device, tiny: bool, net_dtype=None, seed: int = 0) -> tuple[EDMVelocity, int]:
    """EDM's CIFAR-10 network layout with random weights (:func:`benchmarks.ddpmpp.ddpmpp_cifar10`); ``(model, params)``."""
    net = ddpmpp_cifar10(seed=seed, tiny=tiny)
    return EDMVelocity(net, net_dtype=net_dtype, device=device), sum(p.numel() for p in net.parameters())


def labels_for(model, n: int, seed: int) -> dict | None:
    """Uniform class labels keyed by (seed, image id), as the runner draws them; None for unconditional nets."""
    if not getattr(model, "label_dim", 0):
        return None
    ids = torch.arange(n)
    return {"class_labels": uniform_labels(ids, seed, model.label_dim).to(model.device)}


# ----------------------------------------------------------------------------------------------
# the arms of the wall-clock section


def x0_optimal_tree(budget: int, steps: int) -> DraftTree:
    """``tree=optimal`` for the x0 draft from the shipped profile: the search ``tree=optimal`` runs (D-GRS
    positional acceptance from the per-depth profile, depth capped at ``T - 2`` and the budget, width at 32)."""
    from specsamp import treesearch

    profile = json.loads(PROFILE.read_text())["profile"]
    positional = treesearch.profile_positional(profile, "dgrs")
    return treesearch.optimal_tree(budget, positional, min(steps - 2, budget), min(32, budget))


def arms(steps: int) -> list[dict]:
    """The wall-clock section's arms: ``name, tree, coupling, draft, budget`` (standard: tree None)."""
    h = steps - 2
    return [
        {"name": "standard", "tree": None, "coupling": None, "draft": None, "budget": 0},
        {"name": "dgrs (2,3)", "tree": DraftTree.uniform(2, min(3, h)), "coupling": "dgrs", "draft": "velocity", "budget": 14},
        {"name": "dgrs (2,5)", "tree": DraftTree.uniform(2, min(5, h)), "coupling": "dgrs", "draft": "velocity", "budget": 62},
        {"name": "rmc chain 14", "tree": DraftTree.chain(min(14, h)), "coupling": "rmc", "draft": "velocity", "budget": 14},
        {"name": "x0+optimal B=14", "tree": x0_optimal_tree(14, steps), "coupling": "dgrs", "draft": "x0", "budget": 14},
        {"name": "x0+optimal B=62", "tree": x0_optimal_tree(62, steps), "coupling": "dgrs", "draft": "x0", "budget": 62},
    ]


def run_arm(model, arm: dict, schedule: Schedule, n: int, seed: int):
    """One sampling run of ``arm`` for images ``0..n-1`` (labels keyed by seed and id); the :class:`SampleResult`."""
    cond = labels_for(model, n, seed)
    if arm["tree"] is None:
        return sample_standard(model, schedule, n, seed=seed, cond=cond)
    return sample_speculative(model, schedule, arm["tree"], arm["coupling"], n, draft=arm["draft"],
                              execution="tree", seed=seed, cond=cond)


# ----------------------------------------------------------------------------------------------
# sections


class Context:
    """What the sections share: device, sizes, the soft deadline and results later sections use."""

    def __init__(self, a: argparse.Namespace):
        self.device = torch.device(a.device)
        self.tiny = a.tiny
        self.seed = a.seed
        self.repeats = a.repeats or (2 if a.tiny else 5)
        self.steps = 8 if a.tiny else 100
        self.batches = a.batches or ([1, 2] if a.tiny else [1, 4, 16, 64])
        self.max_rows = 8 if a.tiny else 4096
        self.t0 = time.perf_counter()
        self.deadline = self.t0 + a.budget_s
        self.clock = Clock(self.device)
        self.shared: dict = {}
        self.budget_s = a.budget_s
        self.section_t0 = self.t0
        self.partial: dict = {}  # what the running section has finished (kept if the run is terminated)
        self.quiet = False

    def left(self) -> float:
        """Seconds left in the soft budget."""
        return self.deadline - time.perf_counter()

    def over_share(self, share: float) -> bool:
        """True once the current section has used ``share`` of the whole budget (or the budget is spent):
        it then starts no new measurement, so the sections after it keep their time."""
        return self.left() < 0 or time.perf_counter() - self.section_t0 > share * self.budget_s

    def log(self, line: str) -> None:
        """A progress line on stdout at once (the device's log keeps what a timeout would cut)."""
        if not self.quiet:
            print(line, flush=True)


def _gflop_per_row(model) -> float | None:
    """Floating-point operations of one row's call, in GFLOP (torch's operation counter: convolutions and
    matrix products, 2 per multiply-add), or None where the counter fails."""
    try:
        from torch.utils.flop_counter import FlopCounterMode

        cond = {"class_labels": torch.zeros(1, dtype=torch.long, device=model.device)} if model.label_dim else {}
        with FlopCounterMode(display=False) as counter:
            model(torch.randn(1, *model.event_shape).to(model.device), torch.full((1,), 0.5, device=model.device), **cond)
        return counter.get_total_flops() / 1e9
    except Exception:  # noqa: BLE001  (a count is a convenience, not a measurement)
        return None


def call_cost(ctx: Context) -> dict:
    """Seconds of one call against rows ``1, 2, 4, ..., max_rows`` for both networks, float32 and bfloat16.

    Per size: two untimed calls, then ``repeats`` timed ones (host clock around a synchronised call) on
    fresh standard-normal inputs at ``sigma = 0.5``; a size that runs out of memory ends that curve.

    Returns:
        ``{"networks": {name: {params, gflop_per_row, curves: {dtype: [{rows, seconds: {median, min, max, n},
        per_row_s, peak_mib, tflop_per_s}]}}}}``; the curves are kept for the projection section.
    """
    dev, clock = ctx.device, ctx.clock
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
                if ctx.over_share(SHARES["call_cost"]):
                    curve.append({"rows": b, "skipped": "the section's share of the budget is spent"})
                    break
                cond = {"class_labels": torch.zeros(b, dtype=torch.long, device=dev)} if model.label_dim else {}
                sigma = torch.full((b,), 0.5, device=dev)
                try:
                    _peak_reset(dev)
                    xs = [torch.randn(b, *model.event_shape, generator=g).to(dev) for _ in range(2)]
                    for x in xs:
                        model(x, sigma, **cond)
                    times = []
                    for r in range(ctx.repeats):
                        x = xs[r % 2]
                        t = clock.now()
                        model(x, sigma, **cond)
                        times.append(clock.now() - t)
                except torch.cuda.OutOfMemoryError as e:  # noqa: PERF203
                    curve.append({"rows": b, "error": f"out of memory: {str(e).splitlines()[0]}"})
                    torch.cuda.empty_cache()
                    break
                s = _stats(times)
                gf = entry["gflop_per_row"]
                curve.append({"rows": b, "seconds": s, "per_row_s": s["median"] / b, "peak_mib": _peak_mib(dev),
                              "tflop_per_s": gf * b / s["median"] / 1e3 if gf else None})
                del xs
            entry["curves"][dtype] = curve
            ok = [c for c in curve if "seconds" in c]
            if ok:
                ctx.log(f"  call_cost {name} {dtype}: {ok[-1]['rows']} rows {_fmt(ok[-1]['seconds'])}, "
                        f"peak {'n/a' if ok[-1]['peak_mib'] is None else format(ok[-1]['peak_mib'], '.0f') + ' MiB'}")
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
                lines.append(f"call_cost {name} {dtype}: 1 row {_fmt(ok[0]['seconds'])}, {ok[-1]['rows']} rows "
                             f"{_fmt(ok[-1]['seconds'])} ({ok[-1]['seconds']['median'] / ok[0]['seconds']['median']:.1f}x"
                             + (f", {rate:.3g} TFLOP/s)" if rate else ")"))
    return {"networks": out, "summary": lines, "passed": True}


def wallclock(ctx: Context) -> dict:
    """Wall clock of every arm (:func:`arms`) at every batch on the digits network (module docstring, section 2).

    Returns:
        ``{"rows": [{arm, batch, budget, wall_s, network_s, other_s (median [min-max]), per_image_s,
        wall_speedup (standard median / arm median), nfe_speedup (mean over images), batch_nfe,
        rounds_mean, rows_per_image, peak_mib, calls: {rows: count}}], "trees": {arm: parent list}}``.
    """
    dev, clock = ctx.device, ctx.clock
    model = TimedModel(digits_velocity(dev))
    schedule = Schedule.make(ctx.steps, EPS)
    t = time.perf_counter()
    the_arms = arms(ctx.steps)
    search_s = time.perf_counter() - t
    rows, calls = ctx.partial.setdefault("rows", []), {}
    for n in ctx.batches:
        base = None
        for arm in the_arms:
            if ctx.over_share(SHARES["wallclock"]):
                rows.append({"arm": arm["name"], "batch": n, "skipped": "the section's share of the budget is spent"})
                continue
            model.reset()
            res = run_arm(model, arm, schedule, n, ctx.seed)  # warm-up: the same shapes as the timed runs
            call_rows = list(model.rows)
            walls, nets, differ = [], [], 0
            _peak_reset(dev)
            for _ in range(ctx.repeats):
                model.reset()
                t = clock.now()
                res = run_arm(model, arm, schedule, n, ctx.seed)
                walls.append(clock.now() - t)
                nets.append(model.network_s())
                differ += model.rows != call_rows  # same seed, same calls, unless the device's arithmetic varies
            w = _stats(walls)
            base = w["median"] if arm["tree"] is None else base
            hist = {}
            for r in call_rows:
                hist[r] = hist.get(r, 0) + 1
            calls[(arm["name"], n)] = hist
            rows.append({
                "arm": arm["name"], "batch": n, "budget": arm["budget"], "wall_s": w, "network_s": _stats(nets),
                "other_s": _stats([a - b for a, b in zip(walls, nets)]), "per_image_s": w["median"] / n,
                "wall_speedup": (base / w["median"]) if base else None,
                "nfe_speedup": float(res.speedup.double().mean()) if arm["tree"] is not None else 1.0,
                "batch_nfe": int(res.batch_nfe), "rounds_mean": float(res.rounds.double().mean()),
                "rows_per_image": float(res.target_rows.double().mean()), "peak_mib": _peak_mib(dev),
                "calls": {str(k): v for k, v in sorted(hist.items())}, "runs_with_other_calls": differ,
            })
            ctx.log(f"  wallclock {arm['name']:<16} x{n:<3}: {_fmt(w)}, NFE speedup {rows[-1]['nfe_speedup']:.2f}")
    syncs = {}
    n_sync = 16 if 16 in ctx.batches else max(ctx.batches)
    for arm in the_arms:
        if dev.type != "cuda" or ctx.over_share(SHARES["wallclock"]):
            break
        syncs[arm["name"]] = host_syncs(model, arm, schedule, n_sync, ctx.seed)
        ctx.log(f"  host syncs {arm['name']:<16} x{n_sync}: {syncs[arm['name']]['total']} "
                f"({syncs[arm['name']]['per_round']:.1f} per round)")
    ctx.shared["wallclock"] = {"rows": rows, "calls": calls}
    lines = [f"wallclock {r['arm']:<16} x{r['batch']:<3}: {_fmt(r['wall_s'])} (network {_fmt(r['network_s'])}), "
             f"NFE speedup {r['nfe_speedup']:.2f}, wall speedup {r['wall_speedup'] or float('nan'):.2f}"
             for r in rows if "wall_s" in r]
    trees = {a["name"]: (a["tree"].parent.tolist() if a["tree"] is not None else None) for a in the_arms}
    lines += [f"host syncs {k:<16} x{n_sync}: {v['total']} in all, {v['per_round']:.1f} per round; most at "
              + ", ".join(f"{w} ({c})" for w, c in v["where"][:3]) for k, v in syncs.items()]
    return {"network": DIGITS, "steps": ctx.steps, "eps": EPS, "execution": "tree", "repeats": ctx.repeats,
            "tree_search_s": search_s, "trees": trees, "rows": rows, "host_syncs": syncs,
            "host_syncs_batch": n_sync if syncs else None, "summary": lines, "passed": True}


def host_syncs(model, arm: dict, schedule: Schedule, n: int, seed: int) -> dict:
    """Synchronising CUDA operations (the host waiting on the device) in one run of ``arm``, by source line.

    Counted with ``torch.cuda.set_sync_debug_mode("warn")``, whose warning names the Python line that
    asked; a round that is a fixed dataflow with no host round-trips has none.

    Returns:
        ``{"total", "per_round" (over the run's rounds, the slowest image's), "where": [[file:line, count], ...]}``
        (most frequent first, at most 20).
    """
    import warnings

    counts: dict[str, int] = {}
    before = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            res = run_arm(model, arm, schedule, n, seed)
        finally:
            torch.cuda.set_sync_debug_mode(before)
    for w in caught:
        if "synchroniz" not in str(w.message):
            continue
        try:
            where = f"{Path(w.filename).resolve().relative_to(ROOT)}:{w.lineno}"
        except ValueError:
            where = f"{Path(w.filename).name}:{w.lineno}"
        counts[where] = counts.get(where, 0) + 1
    total = sum(counts.values())
    rounds = max(int(res.rounds.max()), 1) if arm["tree"] is not None else schedule.steps
    return {"total": total, "per_round": total / rounds,
            "where": sorted(([k, v] for k, v in counts.items()), key=lambda kv: -kv[1])[:20]}


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


def projection(ctx: Context) -> dict:
    """A *projection* of the wall clock on EDM's CIFAR-10 network from the digits runs (section 3).

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
            out.append({"arm": r["arm"], "batch": r["batch"], "dtype": dtype, "projected_network_s": net,
                        "other_s": r["other_s"]["median"], "projected_wall_s": wall,
                        "projected_speedup": base[r["batch"]] / wall if r["batch"] in base else None,
                        "nfe_speedup": r["nfe_speedup"], "max_rows": max(hist),
                        "beyond_measured": max(hist) > max(c["rows"] for c in curve if "seconds" in c)})
    lines = []
    for dtype in dict.fromkeys(r["dtype"] for r in out):
        for arm in dict.fromkeys(r["arm"] for r in out if r["arm"] != "standard"):
            cells = [r for r in out if r["dtype"] == dtype and r["arm"] == arm]
            lines.append(f"projection (EDM CIFAR-10 layout, {dtype}) {arm:<16} projected speedup "
                         + ", ".join(f"x{r['batch']} {r['projected_speedup'] or float('nan'):.2f} (NFE {r['nfe_speedup']:.2f})"
                                     for r in cells))
    return {"what": "projection, not a measurement: digits calls priced at the CIFAR-10 layout's measured call "
                    "cost, plus the digits runs' non-network time", "rows": out, "summary": lines, "passed": True}


class _Scaled:
    """``model``'s velocity times ``1 + eps``: a relative error of ``eps`` on every call (sensitivity probe)."""

    def __init__(self, model, eps: float):
        self.model, self.eps = model, eps
        self.event_shape, self.dtype, self.device = model.event_shape, model.dtype, model.device
        self.label_dim = getattr(model, "label_dim", 0)

    def __call__(self, x, sigma, **cond):
        return self.model(x, sigma, **cond) * (1 + self.eps)


def _counts(res) -> dict:
    return {k: getattr(res, k).cpu() for k in ("nfe", "rounds", "committed", "attempts", "accepts")}


def _compare(a, b) -> tuple[torch.Tensor, torch.Tensor]:
    """Per image: counts equal (bool ``[n]``) and max |sample difference| (``[n]``, float64)."""
    ca, cb = _counts(a), _counts(b)
    same = torch.ones(a.samples.shape[0], dtype=torch.bool)
    for k in ca:
        x, y = ca[k], cb[k]
        same &= (x == y).reshape(x.shape[0], -1).all(1)
    diff = (a.samples.double().cpu() - b.samples.double().cpu()).reshape(same.shape[0], -1).abs().amax(1)
    return same, diff


def cuda_vs_cpu(ctx: Context) -> dict:
    """The same seed on the device and on the CPU: counts equal, samples within a derived tolerance.

    Targets: the GMM of section 5.1 (d = 500, float64; 64 images, T = 100) and the digits network
    (float32; 16 images, T = 100; TF32 off on CUDA for this section), each with the standard sampler and
    D-GRS on the uniform (2, 3) tree (tree execution). The keyed random streams are the same numbers
    on every device, so only the arithmetic differs: the order of floating-point sums (reductions,
    convolution algorithms), a relative error per network call of about ``sqrt(n) u`` for sums of ``n``
    terms (``u`` the unit roundoff), and the transform-based convolutions (Winograd) cuDNN may pick, of
    order 1e-5 in float32. ``rel = 4096 u`` (2.4e-4 in float32) bounds both.

    Tolerance: on the CPU the same run is repeated with every velocity scaled by ``1 + rel`` (a
    systematic relative error of that size on every call, worse than rounding's scattered signs); the
    largest sample displacement ``D`` it causes over the images whose counts it leaves unchanged is how
    far such errors carry through the sampler. The device must match the CPU within ``tol = 10 D``
    (floor: ``64 u`` times the samples' largest magnitude). Counts must be equal image by image: a
    verification decided on the other side of its threshold would change them (possible in principle
    when ``u`` lands within ``rel`` of it; reported image by image).

    Returns:
        ``{"targets": [{target, arm, images, counts_equal, max_abs_diff, tol, rel, probe_D, passed}]}``.
    """
    from specsamp.models.gmm import GaussianMixture

    dev = ctx.device
    cpu = torch.device("cpu")
    T = ctx.steps
    flags = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    out = []
    try:
        targets = [("gmm d=500 float64", lambda d: GaussianMixture(500, 5, 0, dtype=torch.float64, device=d), 64),
                   ("digits float32", lambda d: digits_velocity(d), 16)]
        tree = {"name": "dgrs (2,3)", "tree": DraftTree.uniform(2, min(3, T - 2)), "coupling": "dgrs", "draft": "velocity"}
        for name, make, n in targets:
            if ctx.left() < 0:
                out.append({"target": name, "skipped": "soft budget spent"})
                continue
            m_dev, m_cpu = make(dev), make(cpu)
            u = torch.finfo(m_cpu.dtype).eps / 2
            rel = 4096 * u
            sched = Schedule.make(T, EPS)
            for arm in ({"name": "standard", "tree": None}, tree):
                r_dev = run_arm(m_dev, arm, sched, n, ctx.seed)
                r_cpu = run_arm(m_cpu, arm, sched, n, ctx.seed)
                r_probe = run_arm(_Scaled(m_cpu, rel), arm, sched, n, ctx.seed)
                same, diff = _compare(r_dev, r_cpu)
                p_same, p_diff = _compare(r_probe, r_cpu)
                probe = float(p_diff[p_same].max()) if bool(p_same.any()) else float("nan")
                floor = 64 * u * float(r_cpu.samples.double().abs().max())
                tol = max(10 * probe, floor) if math.isfinite(probe) else floor
                out.append({"target": name, "arm": arm["name"], "images": n, "steps": T,
                            "counts_equal": int(same.sum()), "max_abs_diff": float(diff.max()),
                            "max_abs_diff_counts_equal": float(diff[same].max()) if bool(same.any()) else None,
                            "rel": rel, "probe_D": probe, "probe_counts_equal": int(p_same.sum()), "tol": tol,
                            "passed": bool(same.all()) and float(diff.max()) <= tol})
            del m_dev, m_cpu
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = flags
    lines = [f"cuda_vs_cpu {r['target']} {r['arm']}: counts equal {r['counts_equal']}/{r['images']}, max |diff| "
             f"{r['max_abs_diff']:.3g} <= tol {r['tol']:.3g}: {'pass' if r['passed'] else 'FAIL'}" for r in out if "arm" in r]
    return {"reference": "cpu", "device": str(dev), "trivial": dev.type == "cpu", "targets": out, "summary": lines,
            "passed": all(r.get("passed", False) for r in out)}


def laws(ctx: Context) -> dict:
    """Laws on the device, kept short: each registered coupling's output law, and the sampler under bfloat16.

    Couplings: ``n`` parent nodes in ``dim`` coordinates (20000 x 3072; tiny 2000 x 48), K = 1 for one-child
    rules and 4 otherwise, displacement ``delta`` in {0.5, 2}; the output standardised about the target mean
    must be N(0, 1) along the displacement and along a fixed orthogonal direction (KS). Inputs are drawn on
    the CPU, so every device sees the same problem. Sampler: D-GRS (2, 3) and RMC chain 14 on the digits
    network under bfloat16 autocast against the standard sampler on the same network (512 images, T = 8;
    tiny 120), two-sample KS on three fixed random projections: the couplings stay exact for whatever
    target the bfloat16 network defines. The repository's law tests need the runner's configuration
    (Hydra), which the device lacks; these are the same checks on the device.

    Returns:
        ``{"couplings": [{rule, K, delta, p_parallel, p_orthogonal, acceptance}], "bf16": [{arm, n, p_values,
        min_p}], "p_min": 1e-4, "passed"}``.
    """
    from scipy import stats

    from specsamp import rng
    from specsamp.coupling import COUPLINGS

    dev = ctx.device
    n, dim = (2000, 48) if ctx.tiny else (20000, 3072)
    g = torch.Generator().manual_seed(ctx.seed)
    e = torch.randn(dim, generator=g, dtype=torch.float64)
    e /= e.norm()
    w = torch.randn(dim, generator=g, dtype=torch.float64)
    w -= (w @ e) * e
    w /= w.norm()
    sigma = 0.05
    coup = []
    for name in COUPLINGS:
        fn = COUPLINGS[name]
        K = 1 if fn.max_children == 1 else 4
        for delta in (0.5, 2.0):
            mean_p = torch.randn(n, dim, generator=g)
            mean_q = mean_p + float(sigma * delta) * e.float()
            kids = mean_p[:, None] + sigma * torch.randn(n, K, dim, generator=g)
            keys = rng.base_key(ctx.seed, torch.arange(n), "verify").to(dev)
            v = fn(kids.to(dev), mean_p.to(dev), mean_q.to(dev), sigma, rng.KeyedRows(keys))
            z = (v.sample.double().cpu() - mean_q.double()) / sigma
            coup.append({"rule": name, "K": K, "delta": delta,
                         "p_parallel": float(stats.kstest((z @ e).numpy(), "norm").pvalue),
                         "p_orthogonal": float(stats.kstest((z @ w).numpy(), "norm").pvalue),
                         "acceptance": float(v.accepted.float().mean())})
            del kids, v
    m = 120 if ctx.tiny else 512
    model = digits_velocity(dev, "bfloat16")
    sched = Schedule.make(6 if ctx.tiny else 8, EPS)
    ref = run_arm(model, {"tree": None}, sched, m, ctx.seed + 1).samples.double().cpu().reshape(m, -1)
    bf = []
    for arm in ({"name": "dgrs (2,3)", "tree": DraftTree.uniform(2, 3), "coupling": "dgrs", "draft": "velocity"},
                {"name": "rmc chain 14", "tree": DraftTree.chain(min(14, sched.steps - 2)), "coupling": "rmc",
                 "draft": "velocity"}):
        x = run_arm(model, arm, sched, m, ctx.seed + 2).samples.double().cpu().reshape(m, -1)
        gp = torch.Generator().manual_seed(ctx.seed)
        ps = []
        for _ in range(3):
            u = torch.randn(x.shape[1], generator=gp, dtype=torch.float64)
            ps.append(float(stats.ks_2samp((x @ u).numpy(), (ref @ u).numpy()).pvalue))
        bf.append({"arm": arm["name"], "n": m, "p_values": ps, "min_p": min(ps)})
    passed = all(min(r["p_parallel"], r["p_orthogonal"]) > P_MIN for r in coup) and all(r["min_p"] > P_MIN for r in bf)
    lines = [f"laws: {len(coup)} coupling checks, smallest KS p "
             f"{min(min(r['p_parallel'], r['p_orthogonal']) for r in coup):.3g}; bfloat16 sampler smallest p "
             f"{min(r['min_p'] for r in bf):.3g}; {'pass' if passed else 'FAIL'} (p > {P_MIN:g})"]
    return {"couplings": coup, "bf16": bf, "p_min": P_MIN, "summary": lines, "passed": passed}


def compile_check(ctx: Context) -> dict:
    """The digits network's call eager, under ``torch.compile`` (default mode, static shapes; 64 rows only) and
    replayed from a captured CUDA graph, at fixed rows (64 and 1024): median [min-max] of ``repeats`` timed calls after warm-up,
    outputs compared with eager (max |diff|). The sampler's round under compile runs only where
    ``sample_speculative`` takes a ``compile`` keyword; otherwise, and for everything on a CPU, the
    reason is recorded under ``skipped``.

    Returns:
        ``{"rows": [{variant, rows, seconds, speedup_vs_eager, max_abs_diff, compile_s}], "skipped": [...]}``.
    """
    dev, clock = ctx.device, ctx.clock
    skipped = []
    if dev.type != "cuda":
        skipped.append("the network under torch.compile and CUDA graphs: CUDA only (this run is on the CPU)")
    out = []
    if "compile" in inspect.signature(sample_speculative).parameters:
        why = _compile_unavailable(dev)
        if why is not None:
            skipped.append(f"sampler round under compile: {why}")
        elif dev.type != "cuda" and ctx.tiny:
            skipped.append("sampler round under compile on the CPU: not in --tiny (a compilation takes tens of seconds)")
        elif ctx.left() < 90:
            skipped.append("sampler round under compile: under 90 s of the soft budget left (two compilations)")
        else:
            out += _sampler_compiled(ctx)
    else:
        skipped.append("sampler round under compile: sample_speculative takes no 'compile' keyword; "
                       "the network call only")
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
                t = clock.now()
                fn()
                times.append(clock.now() - t)
            return _stats(times)

        with torch.no_grad():
            ref = net(x, s, lab)
            net(x, s, lab)
            eager = timed(lambda: net(x, s, lab))
            out.append({"variant": "eager", "rows": b, "seconds": eager, "speedup_vs_eager": 1.0})
            try:
                if b != 64:
                    raise _NotTried("compiled at 64 rows only (each static shape compiles anew, tens of seconds)")
                t = time.perf_counter()
                cnet = torch.compile(net, dynamic=False)
                y = cnet(x, s, lab)
                clock.sync()
                cs = time.perf_counter() - t
                st = timed(lambda: cnet(x, s, lab))
                out.append({"variant": "torch.compile", "rows": b, "seconds": st, "compile_s": cs,
                            "speedup_vs_eager": eager["median"] / st["median"],
                            "max_abs_diff": float((y - ref).abs().max())})
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
                clock.sync()
                st = timed(graph.replay)
                out.append({"variant": "cuda graph", "rows": b, "seconds": st,
                            "speedup_vs_eager": eager["median"] / st["median"],
                            "max_abs_diff": float((y - ref).abs().max())})
            except Exception as e:  # noqa: BLE001
                out.append({"variant": "cuda graph", "rows": b, "error": f"{type(e).__name__}: {e}"[:2000]})
    lines = [_sampler_line(r) if r["variant"].startswith("sampler") else
             f"compile {r['variant']:<13} {r['rows']:>5} rows: {_fmt(r['seconds'])} ({r['speedup_vs_eager']:.2f}x eager)"
             if "seconds" in r else f"compile {r['variant']} {r['rows']} rows: {r['error'][:120]}" for r in out]
    return {"network": DIGITS, "rows": out, "skipped": skipped, "summary": lines, "passed": True}


# the share of --budget-s after which a section starts no new measurement (the others need far less)
SHARES = {"call_cost": 0.2, "wallclock": 0.45}

def _compile_unavailable(dev) -> str | None:
    """Why the sampler's ``compile=True`` cannot run on ``dev`` here (:func:`specsamp.compiled.unavailable`), or None."""
    try:
        from specsamp.compiled import unavailable
    except ImportError:  # a tree without the compiled round: the keyword's own refusal will say why
        return None
    return unavailable(dev)


def _sampler_line(r: dict) -> str:
    """One summary line of a :func:`_sampler_compiled` row."""
    if "error" in r:
        return f"compile {r['variant']} {r['rows']} rows: {r['error'][:120]}"
    extra = (f", first run {r['first_run_s']:.1f} s, counts equal: {r.get('counts_equal')}, samples within "
             f"{r.get('max_abs_diff', float('nan')):.2g}") if "counts_equal" in r else ""
    return f"compile {r['variant']:<22} {r['rows']:>3} rows: {_fmt(r['seconds'])} ({r.get('speedup_vs_eager', 1.0):.2f}x eager{extra})"


class _NotTried(Exception):
    """A variant left out on purpose (the reason is recorded under ``skipped``)."""


def _sampler_compiled(ctx: Context) -> list[dict]:
    """D-GRS (2, 3) on the digits network at batch 16 with ``sample_speculative(..., compile=True)`` against
    ``compile=False``: one untimed run each, then ``repeats`` timed ones; the counts must agree."""
    dev, clock = ctx.device, ctx.clock
    model = digits_velocity(dev)
    sched = Schedule.make(ctx.steps, EPS)
    n = 16
    cond = labels_for(model, n, ctx.seed)
    out, res = [], {}
    for flag in (False, True):
        def go():
            return sample_speculative(model, sched, DraftTree.uniform(2, 3), "dgrs", n, execution="tree",
                                      seed=ctx.seed, cond=cond, compile=flag)
        try:
            t = time.perf_counter()
            res[flag] = go()
            clock.sync()
            first = time.perf_counter() - t
            times = []
            for _ in range(ctx.repeats):
                t = clock.now()
                go()
                times.append(clock.now() - t)
            out.append({"variant": f"sampler compile={flag}", "rows": n, "seconds": _stats(times), "first_run_s": first})
        except Exception as e:  # noqa: BLE001  (recorded: the keyword is another module's)
            out.append({"variant": f"sampler compile={flag}", "rows": n, "error": f"{type(e).__name__}: {e}"[:2000]})
    if len(res) == 2 and "seconds" in out[0] and "seconds" in out[1]:
        out[1]["speedup_vs_eager"] = out[0]["seconds"]["median"] / out[1]["seconds"]["median"]
        out[0]["speedup_vs_eager"] = 1.0
        out[1]["counts_equal"] = bool(torch.equal(res[False].nfe.cpu(), res[True].nfe.cpu())
                                      and torch.equal(res[False].accepts.cpu(), res[True].accepts.cpu()))
        out[1]["max_abs_diff"] = float((res[False].samples.float() - res[True].samples.float()).abs().max())
    return out


SECTION_FNS = {"call_cost": call_cost, "wallclock": wallclock, "projection": projection,
               "cuda_vs_cpu": cuda_vs_cpu, "laws": laws, "compile": compile_check}


# ----------------------------------------------------------------------------------------------
# output


def _json_default(o):
    if isinstance(o, torch.Tensor):
        return o.tolist()
    if isinstance(o, tuple):
        return list(o)
    return str(o)


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename (a crash leaves no half file)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def environment(device: torch.device) -> dict:
    """Device, versions and the numerics flags the timings ran under."""
    env = {"device": str(device), "torch": torch.__version__, "python": platform.python_version(),
           "cpu_threads": torch.get_num_threads(), "cuda": torch.version.cuda,
           "cudnn_benchmark": torch.backends.cudnn.benchmark, "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32,
           "matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32,
           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["gpu_memory_gib"] = torch.cuda.get_device_properties(device).total_memory / 2**30
    return env


def _args(argv):
    p = argparse.ArgumentParser(prog="python3 -m benchmarks.gpu_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    p.add_argument("--tiny", action="store_true", help="tiny sizes: a rehearsal of every section")
    p.add_argument("--out", default=None, help="output folder (default $OUT, else ./gpu_check)")
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {','.join(SECTIONS)}")
    p.add_argument("--repeats", type=int, default=None, help="timed repeats per measurement (default 5; tiny 2)")
    p.add_argument("--batches", default=None, help="images sampled together, e.g. 1,4,16,64 (the default)")
    p.add_argument("--budget-s", type=float, default=270.0,
                   help="soft time budget in seconds: sections not begun by then are skipped (default 270)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    a.device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if a.device not in ("cuda", "cpu") and not a.device.startswith("cuda:"):
        p.error(f"--device={a.device!r} is invalid: valid values are cuda, cuda:N and cpu.")
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        p.error(f"--device={a.device!r} is invalid here: torch sees no CUDA device; use --device cpu.")
    sections = [s.strip() for s in a.sections.split(",") if s.strip()]
    bad = [s for s in sections if s not in SECTIONS]
    if bad or not sections:
        p.error(f"--sections={a.sections!r} is invalid: valid sections are {', '.join(SECTIONS)} (comma-separated).")
    a.sections = sections
    if a.repeats is not None and a.repeats < 1:
        p.error(f"--repeats={a.repeats!r} is invalid: need an integer >= 1.")
    if a.batches is not None:
        try:
            a.batches = [int(b) for b in a.batches.split(",") if b.strip()]
            assert a.batches and min(a.batches) >= 1
        except (ValueError, AssertionError):
            p.error(f"--batches={a.batches!r} is invalid: need comma-separated integers >= 1, e.g. 1,4,16,64.")
    if not a.budget_s > 0:
        p.error(f"--budget-s={a.budget_s!r} is invalid: need a number of seconds > 0.")
    return a


class Terminated(BaseException):
    """SIGTERM arrived (``timeout`` ending the run); not an ``Exception``, so no section swallows it."""


def _on_sigterm(signum, frame):
    raise Terminated()


def main(argv=None) -> int:
    """Command line entry (module docstring): 0 when every section ran, 1 otherwise, 2 for a bad argument."""
    a = _args(argv)
    out = Path(a.out or os.environ.get("OUT") or "gpu_check")
    out.mkdir(parents=True, exist_ok=True)
    ctx = Context(a)
    env = environment(ctx.device)
    head = (f"# specsamp GPU check on {env.get('gpu', 'CPU')} ({env['device']}), torch {env['torch']}, "
            f"{'tiny rehearsal' if a.tiny else 'full sizes'}, {env['date']}")
    summary = [head]
    print(head, flush=True)
    statuses = {}
    terminated = None
    previous = signal.signal(signal.SIGTERM, _on_sigterm)  # `timeout` ends the run: record what it cut
    try:
        for name in a.sections:
            t = ctx.section_t0 = time.perf_counter()
            record = {"section": name, "env": env, "tiny": a.tiny, "seed": a.seed}
            ctx.partial = {}
            if terminated or ctx.left() < 0:
                why = terminated or f"soft budget of {a.budget_s:g} s spent before it began"
                record.update(status="skipped", reason=why)
                lines = [f"{name}: skipped ({why})"]
            else:
                try:
                    result = SECTION_FNS[name](ctx)
                    lines = result.pop("summary", [])
                    record.update(status="ok", passed=bool(result.get("passed", True)), result=result)
                except Exception as e:  # noqa: BLE001  (recorded; the next section still runs)
                    record.update(status="error", error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
                    lines = [f"{name}: ERROR {type(e).__name__}: {str(e)[:300]}"]
                except Terminated:
                    terminated = "terminated (SIGTERM) before it began"
                    record.update(status="error", error="terminated (SIGTERM) while it ran", partial=ctx.partial)
                    lines = [f"{name}: terminated while it ran; its finished measurements are under 'partial'"]
                if ctx.device.type == "cuda":
                    torch.cuda.empty_cache()
            record["seconds"] = time.perf_counter() - t
            record["elapsed_s"] = time.perf_counter() - ctx.t0
            statuses[name] = record["status"] + ("" if record.get("passed", True) else " (check failed)")
            write_atomic(out / f"{name}.json", json.dumps(record, indent=1, default=_json_default))
            tail = f"## {name}: {statuses[name]} in {record['seconds']:.1f} s; elapsed {record['elapsed_s']:.1f} s"
            summary += lines + [tail]
            print("\n".join(lines + [tail]), flush=True)
            write_atomic(out / "summary.txt", "\n".join(summary) + "\n")
    finally:
        signal.signal(signal.SIGTERM, previous)
    ran = all(s.startswith("ok") for s in statuses.values())
    final = f"# {'every section ran' if ran else 'some sections did not run'}: " + ", ".join(
        f"{k} {v}" for k, v in statuses.items())
    summary.append(final)
    print(final, flush=True)
    write_atomic(out / "summary.txt", "\n".join(summary) + "\n")
    return 0 if ran else 1


if __name__ == "__main__":
    raise SystemExit(main())
