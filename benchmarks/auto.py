"""``auto`` against what a user can run instead: the loop, the best fixed setting of a grid, and ParaDiGMS.

``python -m benchmarks.auto [--samplers ddpm:1000,...] [--targets digits,patches32,gmm] [--n 1,8]
[--regimes real,pad5,pad20,affine] [--repeats 3] [--search-repeats 2] [--out results/auto.json]`` (``make bench-auto``).

Per cell (target, sampler, images ``n``, cost regime), every arm runs in one process, interleaved (each repeat runs
every arm once, the order reversed every other repeat, a fresh seed each repeat, after a warm-up run of each):

- ``loop``: the original library's loop. DDPM, Euler ancestral and stochastic flow matching: diffusers' scheduler
  loop as :func:`benchmarks.samplers.scheduler_loop` runs it (the network in the scheduler's parametrisation,
  :class:`benchmarks.samplers.SchedulerNetwork`); DPM++ 2M SDE (Karras levels): k-diffusion's loop as
  :func:`benchmarks.presets.loop_dpmpp_2m_sde` transcribes it.
- ``paradigms`` (DDPM only): diffusers' ``DDPMParallelScheduler`` under the sliding-window Picard iteration of
  ParaDiGMS as diffusers' ``StableDiffusionParadigmsPipeline`` runs it (window 64, tolerance 0.1, noise drawn once
  per step up front), written here for this network (:func:`paradigms`). It is approximate: its samples are those of
  a Picard iteration stopped at a tolerance, not the DDPM chain's law.
- ``grid``: the fastest fixed setting of :data:`GRID` (RMC chains of 4, 8, 14, 30 and 62 drafted states, D-GRS
  ``(K, L)`` trees (2, 3), (2, 5) and (3, 3); draft ``x0``, tree execution), found per cell by timing each setting
  ``--search-repeats`` times (the shortest run), then timed with the others: the oracle a user with time to search has.
- ``auto``: :func:`specsamp.autosample.sample_auto` (the k-diffusion function with no tree for DPM++ 2M SDE), draft
  ``x0``, one fresh :class:`~specsamp.autosample.AutoCache` per cell. Its first run measures the call's cost curve,
  runs the pilot and plans; that run is untimed and its setup is reported apart (``setup_s``, the pilot's calls).
  The timed runs reuse the cache (``curve_source`` and ``profile_source`` ``cached``).

Cost regimes (:class:`Costed`, wrapping the network): ``real`` (the CPU call itself), ``pad5`` and ``pad20`` (every
call lasts at least 5 or 20 ms whatever its rows: a GPU below its knee) and ``affine`` (5 ms up to 8 rows, then
0.5 ms per row beyond: a GPU past its knee). Padding sleeps.

Reported per cell: each arm's median and range of seconds per run (of ``n`` images), its network calls per run and
rows per image, the ratios auto/loop, auto/grid and auto/paradigms (above 1: auto is faster; the range is the worst
and best pairing of the extremes), auto's plan (``choice``, the first root's option, its predicted speedup, its
predicted against realised seconds) and the grid's chosen setting. Nothing is asserted; a test runs the code path
at a tiny size.
"""

from __future__ import annotations

import argparse
import csv
import io
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks.common import cpu_model, table

SAMPLERS = ("ddpm:1000", "ddpm:100", "euler_a:50", "euler_a:30", "euler_a:20", "flow:28", "dpmpp_2m_sde:25")
"""``kernel:steps``: ``ddpm``, ``euler_a`` and ``flow`` are diffusers' schedulers (:func:`benchmarks.samplers.scheduler`),
``dpmpp_2m_sde`` k-diffusion's sampler on Karras levels."""

TARGETS = ("digits", "patches32", "gmm")

REGIMES = {  # name -> (fixed seconds per call, seconds per row beyond the knee, knee rows)
    "real": (0.0, 0.0, 0),
    "pad5": (0.005, 0.0, 0),
    "pad20": (0.020, 0.0, 0),
    "affine": (0.005, 0.0005, 8),
}

GRID = (
    *(("rmc", ("chain", L)) for L in (4, 8, 14, 30, 62)),
    *(("dgrs", ("uniform", K, L)) for K, L in ((2, 3), (2, 5), (3, 3))),
)
"""The grid searched per cell: ``(coupling, tree)``."""

WINDOW, TOLERANCE = 64, 0.1
"""ParaDiGMS' parallel window and tolerance (the pipeline's ``parallel`` and ``tolerance``)."""

SCHEDULER_KERNELS = {"ddpm": "ddpm", "euler_a": "euler_ancestral", "flow": "flow_stochastic"}


def grid_name(coupling: str, shape: tuple) -> str:
    return f"rmc chain {shape[1]}" if shape[0] == "chain" else f"dgrs ({shape[1]},{shape[2]})"


class Costed:
    """A network (velocity model or denoiser) whose every call lasts at least ``fixed + per_row * max(rows - knee,
    0)`` seconds (it sleeps for the rest); counts calls and rows. Other attributes pass through to the network."""

    def __init__(self, model, regime: str, key: str):
        self.model = model
        self.fixed, self.per_row, self.knee = REGIMES[regime]
        self.cache_key = key  # auto's cache keys: one per target and regime
        self.calls = self.rows = 0

    def __getattr__(self, name):
        if name == "model":
            raise AttributeError(name)
        return getattr(self.model, name)

    def __call__(self, x, sigma, *args, **kw):
        t0 = time.perf_counter()
        out = self.model(x, sigma, *args, **kw)
        self.calls += 1
        self.rows += int(x.shape[0])
        want = self.fixed + self.per_row * max(int(x.shape[0]) - self.knee, 0)
        if want > 0:
            rest = want - (time.perf_counter() - t0)
            if rest > 0:
                time.sleep(rest)
        return out


def velocity_target(name: str, tiny: bool = False):
    """``(velocity model, cond(ids) -> dict, event_ndim)``: the shipped digits (labels ``id % 10``) and patches32
    networks as ``model=...`` builds them, the section 5.1 mixture (d = 500, float64; ``tiny``: d = 8)."""
    if name == "gmm":
        from specsamp.models import GaussianMixture

        return GaussianMixture(dim=8 if tiny else 500, components=5, layout_seed=0, dtype=torch.float64), None, 1
    from specsamp.runner import build_target, compose, load_config

    model = build_target(load_config(compose([f"model={name}"]))[0]).model
    if name == "digits":
        return model, lambda ids: {"class_labels": torch.as_tensor(list(ids)) % 10}, 3
    return model, None, 3


class BatchedSchedulerNetwork:
    """:class:`benchmarks.samplers.SchedulerNetwork` for a call whose rows sit at different timesteps ``t [rows]``
    (ParaDiGMS' window)."""

    def __init__(self, velocity, plan):
        from benchmarks.samplers import SchedulerNetwork

        self.inner = SchedulerNetwork(velocity, plan)

    def __call__(self, y, t, **cond):
        from specsamp.models.parametrisation import from_velocity, level_scale

        inner = self.inner
        s = torch.tensor([inner.levels[float(v)] for v in t], dtype=torch.float64)
        k = level_scale(s, inner.coords).reshape((-1,) + (1,) * (y.ndim - 1))
        x = (y.to(torch.float64) / k).to(inner.velocity.dtype)
        v = inner.velocity(x, s, **cond)
        return from_velocity(v, x, s, inner.prediction, inner.coords).to(y.dtype)


def paradigms(
    sch, steps: int, net, event_shape, dtype, seed: int, cond=None, batch: int = 1, window=WINDOW, tolerance=TOLERANCE
) -> tuple:
    """ParaDiGMS' sliding-window Picard loop on ``sch`` (a ``DDPMParallelScheduler``), as diffusers' pipeline runs it
    (no guidance): ``(samples [batch, ...], sequential calls)``. ``net(y [rows, ...], t [rows], **cond)`` is the
    scheduler's network; ``cond`` values are per image ``[batch, ...]`` and repeated per window row. ``window`` and
    ``tolerance``: the pipeline's ``parallel`` and ``tolerance`` (with ``window = 1`` it is the sequential chain on the
    same noise)."""
    cond = cond or {}
    with torch.no_grad():
        sch.set_timesteps(steps)
        ts = sch.timesteps
        T = len(ts)
        g = torch.Generator().manual_seed(seed)
        x = torch.randn((batch, *event_shape), generator=g, dtype=dtype) * sch.init_noise_sigma
        buf = torch.stack([x] * (T + 1))  # [T + 1, batch, ...]: the states, all guessed as x_T
        noise = torch.zeros_like(buf)
        variance = [float(sch._get_variance(t)) for t in ts]
        for j in range(T):  # the noise of each step, drawn once
            noise[j] = variance[j] ** 0.5 * torch.randn((batch, *event_shape), generator=g, dtype=dtype)
        inv = (1.0 / torch.tensor([*variance, 0.0], dtype=torch.float64))[:, None] / x[0].numel()
        window = min(window, T)
        begin, end, calls = 0, window, 0
        while begin < T:
            n = end - begin
            block = buf[begin:end]
            t_vec = ts[begin:end, None].repeat(1, batch)
            inp = sch.scale_model_input(block, t_vec)
            out = net(
                inp.flatten(0, 1), t_vec.flatten(0, 1), **{k: v.repeat(n, *[1] * (v.ndim - 1)) for k, v in cond.items()}
            )
            calls += 1
            denoised = sch.batch_step_no_noise(
                model_output=out, timesteps=t_vec.flatten(0, 1), sample=block.flatten(0, 1)
            ).reshape(block.shape)
            new = buf[begin][None] + torch.cumsum(denoised - block, 0) + torch.cumsum(noise[begin:end], 0)
            err = torch.linalg.norm((new - buf[begin + 1 : end + 1]).reshape(n, batch, -1), dim=-1).pow(2)
            ratio = torch.nn.functional.pad(err.double() * inv[begin + 1 : end + 1], (0, 0, 0, 1), value=1e9)
            ind = int(torch.argmax(torch.max(ratio > tolerance**2, dim=1).values.int()))
            new_begin = begin + min(1 + ind, window)
            new_end = min(new_begin + window, T)
            buf[begin + 1 : end + 1] = new
            buf[end : new_end + 1] = buf[end][None]
            begin, end = new_begin, new_end
    return buf[T], calls


class Cell:
    """The arms of one cell as ``run(arm, seed) -> (seconds, calls, rows, record)``, ``record`` auto's where it ran."""

    def __init__(self, target: str, sampler: str, n: int, regime: str, tiny: bool = False):
        from specsamp.autosample import AutoCache

        self.kernel, steps = sampler.split(":")
        self.steps, self.n, self.target, self.tiny = int(steps), n, target, tiny
        self.cache = AutoCache()
        key = f"bench-auto|{target}|{regime}"
        if self.kernel in SCHEDULER_KERNELS:
            from benchmarks.samplers import SchedulerNetwork, scheduler
            from specsamp.integrations.schedulers import from_scheduler

            model, self.cond, ndim = velocity_target(target, tiny)
            self.model = Costed(model, regime, key)
            self.scheduler = lambda: scheduler(SCHEDULER_KERNELS[self.kernel], target)
            self.plan = from_scheduler(self.scheduler(), self.steps, event_ndim=ndim)
            self.net = SchedulerNetwork(self.model, self.plan)
            self.shape, self.dtype = tuple(model.event_shape), model.dtype
        elif self.kernel == "dpmpp_2m_sde":
            from benchmarks.presets import karras, labels_of, load_target

            if tiny and target == "gmm":
                from specsamp.models.gmm import GaussianMixture

                gmm = GaussianMixture(dim=8, components=5, layout_seed=0)

                def den(x, sigma, **kw):
                    s = sigma.to(torch.float64).reshape(-1, 1)
                    return gmm.denoise(x / (1.0 + s), (s / (1.0 + s)).reshape(-1))

                den, self.shape, self.dtype = den, (8,), torch.float64
            else:
                den, self.shape, self.dtype = load_target(target)
            self.model = Costed(den, regime, key)
            self.sigmas = karras(self.steps).to(self.dtype)
            self.extra = labels_of(target, n)
        else:
            raise ValueError(f"sampler={sampler!r} is invalid: valid are {', '.join(SAMPLERS)}")
        self.arms = ["loop", *(["paradigms"] if self.kernel == "ddpm" else []), "grid", "auto"]
        self.grid = None  # (coupling, shape), set by search()

    def _cond(self):
        return self.cond(range(self.n)) if self.kernel in SCHEDULER_KERNELS and self.cond else None

    def run(self, arm, seed: int) -> tuple:
        """One run of ``arm`` (``loop``, ``paradigms``, ``auto``, ``grid`` or a ``(coupling, shape)`` of the grid)."""
        from benchmarks.samplers import Config

        m, record = self.model, None
        m.calls = m.rows = 0
        setting = self.grid if arm == "grid" else arm
        t0 = time.perf_counter()
        if self.kernel in SCHEDULER_KERNELS:
            cond = self._cond()
            if arm == "loop":
                from benchmarks.samplers import scheduler_loop

                scheduler_loop(self.scheduler(), self.steps, self.net, self.shape, self.dtype, seed, cond, self.n)
            elif arm == "paradigms":
                from diffusers import DDPMParallelScheduler

                sch = DDPMParallelScheduler(clip_sample=self.target == "digits")
                net = BatchedSchedulerNetwork(self.model, self.plan)
                _, seq = paradigms(sch, self.steps, net, self.shape, self.dtype, seed, cond, self.n)
                record = {"sequential_calls": seq}
            elif arm == "auto":
                from specsamp.autosample import sample_auto

                res = sample_auto(m, self.plan.schedule, self.n, draft="x0", seed=seed, cond=cond, cache=self.cache)
                record = res.extra["auto"]
            else:
                from specsamp.sampler import sample_speculative

                tree = Config("", setting[0], setting[1]).tree()
                sample_speculative(
                    m, self.plan.schedule, tree, setting[0], self.n, draft="x0", execution="tree", seed=seed, cond=cond
                )
        else:
            from benchmarks.presets import loop_dpmpp_2m_sde
            from specsamp.integrations import k_diffusion as kd

            g = torch.Generator().manual_seed(seed)
            x = torch.randn(self.n, *self.shape, generator=g, dtype=self.dtype) * self.sigmas[0]
            with torch.no_grad():
                if arm == "loop":
                    torch.manual_seed(seed)
                    loop_dpmpp_2m_sde(lambda y, s: m(y, s, **self.extra), x, self.sigmas)
                elif arm == "auto":
                    info = {}
                    kd.sample_dpmpp_2m_sde(
                        m, x, self.sigmas, self.extra, disable=True, seed=seed, cache=self.cache, stats=info
                    )
                    record = info["auto"]
                else:
                    coupling, shape = setting
                    opts = {"budget": shape[1]} if shape[0] == "chain" else {"K": shape[1], "L": shape[2]}
                    kd.sample_dpmpp_2m_sde(
                        m, x, self.sigmas, self.extra, disable=True, seed=seed, coupling=coupling, **opts
                    )
        return time.perf_counter() - t0, m.calls, m.rows / self.n, record

    def search(self, repeats: int, progress=None) -> dict:
        """Time each setting of :data:`GRID` ``repeats`` times; keep the setting of the shortest run."""
        out = {}
        for setting in GRID:  # the fastest of the repeats: a first run's lazy set-up does not count
            out[grid_name(*setting)] = min(self.run(setting, 90_000 + r)[0] for r in range(repeats))
        best = min(out, key=out.get)
        self.grid = next(s for s in GRID if grid_name(*s) == best)
        if progress:
            progress("    grid search: " + ", ".join(f"{k} {1e3 * v:.0f}" for k, v in out.items()) + f" ms -> {best}")
        return {"best": best, "median_s": {k: round(v, 6) for k, v in out.items()}}


def measure_cell(cell: Cell, repeats: int, search_repeats: int, progress=None) -> dict:
    """Setup (auto's first run, the grid search, warm-ups), then ``repeats`` interleaved repeats of every arm."""
    first_s, _, first_calls, first = cell.run("auto", 70_000)
    first_calls_total = cell.model.calls
    setup = {
        "first_run_s": round(first_s, 4),
        "first_run_calls": first_calls_total,
        "setup_s": first["setup_seconds"],
        "curve_source": first["curve_source"],
        "profile_source": first["profile_source"],
        "pilot": first["pilot"],
    }
    search = cell.search(search_repeats, progress)
    for arm in cell.arms:  # warm-up: lazy imports, tables; auto's is a warm-cache run
        cell.run(arm, 80_000)
    wall = {a: [] for a in cell.arms}
    calls = {a: [] for a in cell.arms}
    rows = {a: [] for a in cell.arms}
    rec = {}
    for r in range(repeats):
        for arm in cell.arms if r % 2 == 0 else cell.arms[::-1]:
            s, c, w, record = cell.run(arm, 1000 + r)
            wall[arm].append(s)
            calls[arm].append(c)
            rows[arm].append(w)
            if record is not None:
                rec.setdefault(arm, []).append(record)
    arms = {}
    for a in cell.arms:
        arms[a] = {
            "median_s": statistics.median(wall[a]),
            "min_s": min(wall[a]),
            "max_s": max(wall[a]),
            "calls": statistics.mean(calls[a]),
            "rows_per_image": statistics.mean(rows[a]),
        }
    if "paradigms" in rec:
        arms["paradigms"]["sequential_calls"] = statistics.mean(x["sequential_calls"] for x in rec["paradigms"])
    last = rec["auto"][-1]
    auto = {
        "choice": last["choice"],
        "first_root": last["by_root"][0][0] if last["by_root"] else "loop",
        "by_root": last["by_root"],
        "predicted_speedup": last["predicted_speedup"],
        "predicted_s": last["predicted_seconds"],
        "realised_s": statistics.median(x["realised_seconds"] for x in rec["auto"]),
        "sources": sorted({f"{x['curve_source']}/{x['profile_source']}" for x in rec["auto"]}),
        "predicted_steps_per_round": last.get("predicted_steps_per_round"),
        "realised_steps_per_round": last.get("realised_steps_per_round"),
        "call_cost": last["call_cost"],
    }

    def ratio(other: str) -> dict:
        a, o = arms["auto"], arms[other]
        return {
            "median": o["median_s"] / a["median_s"],
            "min": o["min_s"] / a["max_s"],
            "max": o["max_s"] / a["min_s"],
        }

    ratios = {f"auto_vs_{o}": ratio(o) for o in cell.arms if o != "auto"}
    return {"arms": arms, "auto": auto, "setup": setup, "grid": search, "ratios": ratios}


def _cells(samplers, targets, ns, regimes):
    return [(t, s, n, g) for g in regimes for n in ns for t in targets for s in samplers]


COMMITTED_SAMPLERS = ("ddpm:1000", "ddpm:100", "euler_a:50", "euler_a:20", "flow:28", "dpmpp_2m_sde:25")
COMMITTED = (
    _cells(COMMITTED_SAMPLERS, ["digits", "gmm", "patches32"], [1], ["real"])
    + _cells(COMMITTED_SAMPLERS, ["digits"], [8], ["real"])
    + _cells(COMMITTED_SAMPLERS, ["digits"], [1], ["pad5", "affine", "pad20"])
)
"""The cells of ``results/auto.json`` (``--cells committed``), in the order run: the six samplers on digits, the
mixture and patches32 at one image on the real CPU, digits at eight images, then digits at one image padded."""


def measure(
    cells, repeats: int = 3, search_repeats: int = 2, tiny: bool = False, progress=print, checkpoint=None
) -> dict:
    """Every cell of ``cells`` (``(target, sampler, n, regime)``) as one JSON-ready dict (``checkpoint(doc)`` after
    each cell: a long run keeps what it has measured)."""
    from benchmarks.samplers import commit

    torch.set_num_threads(1)
    started = time.time()
    out = {
        "commit": commit(),
        "cpu": cpu_model(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "repeats": repeats,
        "search_repeats": search_repeats,
        "grid": [grid_name(*s) for s in GRID],
        "paradigms": {"window": WINDOW, "tolerance": TOLERANCE},
        "regimes_ms": {
            k: {"fixed": 1e3 * f, "per_row_beyond_knee": 1e3 * p, "knee": k_} for k, (f, p, k_) in REGIMES.items()
        },
        "cells": [],
    }
    for target, sampler, n, regime in cells:
        t0 = time.time()
        if progress:
            progress(f"[{target} {sampler} n={n} {regime}]")
        cell = Cell(target, sampler, n, regime, tiny)
        res = measure_cell(cell, repeats, search_repeats, progress)
        row = {"target": target, "sampler": sampler, "n": n, "regime": regime, **res}
        row["minutes"] = round((time.time() - t0) / 60, 2)
        out["cells"].append(row)
        if progress:
            progress("    " + summary(row))
        if checkpoint:
            checkpoint(out)
    out["minutes"] = round((time.time() - started) / 60, 1)
    return out


def summary(row: dict) -> str:
    r, a, arms = row["ratios"], row["auto"], row["arms"]
    s = (
        f"auto {1e3 * arms['auto']['median_s']:.1f} ms: {r['auto_vs_loop']['median']:.2f}x the loop, "
        f"{r['auto_vs_grid']['median']:.2f}x the grid ({row['grid']['best']}), "
    )
    if "auto_vs_paradigms" in r:
        s += f"{r['auto_vs_paradigms']['median']:.2f}x ParaDiGMS, "
    return (
        s
        + f"plan {a['choice']} ({a['first_root']}), predicted {a['predicted_s']:.3g} s, realised {a['realised_s']:.3g} s"
    )


CSV_FIELDS = (
    "target",
    "sampler",
    "n",
    "regime",
    "loop_s",
    "grid",
    "grid_s",
    "paradigms_s",
    "paradigms_sequential_calls",
    "paradigms_rows_per_image",
    "auto_s",
    "auto_vs_loop",
    "auto_vs_loop_min",
    "auto_vs_loop_max",
    "auto_vs_grid",
    "auto_vs_grid_min",
    "auto_vs_grid_max",
    "auto_vs_paradigms",
    "choice",
    "first_root",
    "predicted_s",
    "realised_s",
    "loop_calls",
    "grid_calls",
    "paradigms_calls",
    "auto_calls",
    "auto_rows_per_image",
    "setup_s",
    "pilot_calls",
)


def csv_rows(doc: dict) -> list[dict]:
    rows = []
    for c in doc["cells"]:
        arms, r, a = c["arms"], c["ratios"], c["auto"]
        p = arms.get("paradigms", {})
        rows.append(
            {
                "target": c["target"],
                "sampler": c["sampler"],
                "n": c["n"],
                "regime": c["regime"],
                "loop_s": arms["loop"]["median_s"],
                "grid": c["grid"]["best"],
                "grid_s": arms["grid"]["median_s"],
                "paradigms_s": p.get("median_s"),
                "paradigms_sequential_calls": p.get("sequential_calls"),
                "paradigms_rows_per_image": p.get("rows_per_image"),
                "auto_s": arms["auto"]["median_s"],
                "auto_vs_loop": r["auto_vs_loop"]["median"],
                "auto_vs_loop_min": r["auto_vs_loop"]["min"],
                "auto_vs_loop_max": r["auto_vs_loop"]["max"],
                "auto_vs_grid": r["auto_vs_grid"]["median"],
                "auto_vs_grid_min": r["auto_vs_grid"]["min"],
                "auto_vs_grid_max": r["auto_vs_grid"]["max"],
                "auto_vs_paradigms": r.get("auto_vs_paradigms", {}).get("median"),
                "choice": a["choice"],
                "first_root": a["first_root"],
                "predicted_s": a["predicted_s"],
                "realised_s": a["realised_s"],
                "loop_calls": arms["loop"]["calls"],
                "grid_calls": arms["grid"]["calls"],
                "paradigms_calls": p.get("calls"),
                "auto_calls": arms["auto"]["calls"],
                "auto_rows_per_image": arms["auto"]["rows_per_image"],
                "setup_s": c["setup"]["setup_s"],
                "pilot_calls": (c["setup"]["pilot"] or {}).get("calls"),
            }
        )
    return rows


def write_csv(path: Path, rows: list[dict]) -> None:
    """:func:`csv_rows` as a CSV at ``path`` (floats to 6 significant digits), written atomically."""
    from specsamp.io import atomic_write

    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=CSV_FIELDS)
    w.writeheader()
    for r in rows:
        w.writerow({k: (f"{v:.6g}" if isinstance(v, float) else ("" if v is None else v)) for k, v in r.items()})
    atomic_write(path, lambda f: f.write(buf.getvalue()), mode="w")


def markdown(doc: dict) -> str:
    """The README's table: one line per cell."""
    head = (
        "| target | sampler | n | regime | loop ms | auto ms | auto/loop [range] | grid's best | auto/grid [range] "
        "| ParaDiGMS ms (seq. calls, rows/image) | auto/ParaDiGMS | auto's plan (first root) | calls loop / grid / auto "
        "| auto setup s (pilot calls) |\n|" + "---|" * 14
    )
    lines = [head]
    for c in doc["cells"]:
        arms, r, a = c["arms"], c["ratios"], c["auto"]
        p = arms.get("paradigms")
        para = f"{1e3 * p['median_s']:.0f} ({p['sequential_calls']:.0f}, {p['rows_per_image']:,.0f})" if p else "-"
        para_ratio = f"{r['auto_vs_paradigms']['median']:.2f}x" if p else "-"
        rng = lambda k, r=r: f"{r[k]['median']:.2f}x [{r[k]['min']:.2f}-{r[k]['max']:.2f}]"  # noqa: E731
        lines.append(
            f"| {c['target']} | {c['sampler'].replace(':', ' ')} | {c['n']} | {c['regime']} "
            f"| {1e3 * arms['loop']['median_s']:.0f} | {1e3 * arms['auto']['median_s']:.0f} | {rng('auto_vs_loop')} "
            f"| {c['grid']['best']} | {rng('auto_vs_grid')} "
            f"| {para} | {para_ratio} "
            f"| {a['choice']} ({a['first_root']}) "
            f"| {arms['loop']['calls']:.0f} / {arms['grid']['calls']:.0f} / {arms['auto']['calls']:.0f} "
            f"| {c['setup']['setup_s']:.2f} ({(c['setup']['pilot'] or {}).get('calls', '-')}) |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.auto", description=__doc__.split("\n\n")[0])
    p.add_argument("--samplers", default=",".join(SAMPLERS), help="kernel:steps, comma-separated")
    p.add_argument("--targets", default=",".join(TARGETS))
    p.add_argument("--n", default="1", help="images per run, comma-separated (e.g. 1,8)")
    p.add_argument("--regimes", default=",".join(REGIMES), help="comma-separated: " + ", ".join(REGIMES))
    p.add_argument(
        "--cells",
        default=None,
        help="cells target/sampler/n/regime, ';'-separated, instead of the product; 'committed': results/auto.json's",
    )
    p.add_argument("--repeats", type=int, default=3, help="interleaved timed repeats per arm")
    p.add_argument("--search-repeats", type=int, default=2, help="timed runs per grid setting in the search")
    p.add_argument("--tiny", action="store_true", help="the mixture at d = 8 (a rehearsal of the code path)")
    p.add_argument("--out", default=None, help="JSON to write (results/auto.json); its CSV beside it")
    a = p.parse_args(argv)
    try:
        if a.cells == "committed":
            cells = list(COMMITTED)
        elif a.cells:
            cells = []
            for spec in a.cells.split(";"):
                t, s, n, g = spec.strip().split("/")
                cells.append((t, s, int(n), g))
        else:
            cells = _cells(
                a.samplers.split(","), a.targets.split(","), [int(n) for n in a.n.split(",")], a.regimes.split(",")
            )
        for t, s, n, g in cells:
            assert t in TARGETS and s.split(":")[0] in {*SCHEDULER_KERNELS, "dpmpp_2m_sde"} and g in REGIMES and n >= 1
            int(s.split(":")[1])
        assert min(a.repeats, a.search_repeats) >= 1
    except (ValueError, AssertionError, IndexError):
        print(
            f"error: a cell of --samplers/--targets/--n/--regimes/--cells is invalid: samplers are kernel:steps of "
            f"ddpm, euler_a, flow, dpmpp_2m_sde; targets {', '.join(TARGETS)}; regimes {', '.join(REGIMES)}; n, "
            "repeats >= 1",
            file=sys.stderr,
        )
        return 2
    log = lambda s: print(s, flush=True)  # noqa: E731
    keep = None
    if a.out:
        from specsamp.io import write_json_atomic

        keep = lambda doc: write_json_atomic(Path(a.out), doc)  # noqa: E731
    doc = measure(cells, a.repeats, a.search_repeats, a.tiny, log, keep)
    doc["command"] = "python -m benchmarks.auto " + " ".join(sys.argv[1:] if argv is None else argv)
    rows = csv_rows(doc)
    print(
        table(
            rows,
            [
                ("target", "target", "s"),
                ("sampler", "sampler", "s"),
                ("n", "n", "d"),
                ("regime", "regime", "s"),
                ("auto_vs_loop", "auto/loop", ".2f"),
                ("auto_vs_grid", "auto/grid", ".2f"),
                ("choice", "choice", "s"),
                ("first_root", "first root", "s"),
            ],
        )
    )
    if a.out:
        from specsamp.io import write_json_atomic

        out = Path(a.out)
        write_json_atomic(out, doc)
        write_csv(out.with_suffix(".csv"), rows)
        print(f"wrote {out} and {out.with_suffix('.csv')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
