"""The scheduler kernels against the scheduler's own loop: network calls, acceptance and wall clock for one image.

``python -m benchmarks.samplers [--n 8] [--repeats 5] [--cases ...] [--targets digits,gmm] [--out results/samplers.json]``
(``make bench-samplers``).

Cases: DDPM at 1000 and 100 steps (``DDPMScheduler``), Euler ancestral at 50
(``EulerAncestralDiscreteScheduler``, Stable Diffusion's betas) and stochastic flow matching at 28
(``FlowMatchEulerDiscreteScheduler(stochastic_sampling=True, shift=3)``, SD3's). Targets: the shipped digits
network (class-conditional EDM denoiser, valid at any noise level) and the section 5.1 mixture (d = 500, five
components, float64, its exact velocity).

The baseline is the loop a diffusers pipeline runs: ``scheduler.scale_model_input``, one network call of one
row, ``scheduler.step(..., generator=torch.Generator)`` per step, under ``torch.no_grad()``. Its network is
the target presented in the scheduler's own parametrisation (:class:`SchedulerNetwork`: epsilon in VP
coordinates for DDPM and Euler ancestral, the flow velocity for flow matching, through
:func:`specsamp.models.parametrisation.from_velocity`), called at the scheduler's timesteps. specsamp runs the
same kernel (:func:`specsamp.integrations.schedulers.from_scheduler`) on the plain velocity model, with each
speculative configuration of :data:`CONFIGS` (coupling, tree, draft, execution, prefetch).

Two kinds of numbers, kept apart in the output:

- **counts** (machine-independent, from ``--n`` images, ids ``0..n-1`` of seed 0): network calls per image of
  the loop (``T``) and of speculative sampling (``nfe_total``: the speculative rounds, warm-up and endpoint
  steps included), their ratio (the NFE speedup), network rows per image, and the acceptance at each depth
  (``accepts / attempts`` summed over the images);
- **timings** (this machine, this load): seconds for ONE image (batch 1), the loop and each speculative
  configuration run alternately in one process (one repeat = every arm once, in turn, a fresh image id each
  repeat, after one warm-up run of each), median and range over ``--repeats``, the ratio of medians
  (above 1: speculative is faster), and the share of each arm's time spent inside the network's calls.

Nothing here is asserted anywhere; the tests run the code path at tiny sizes.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from benchmarks.common import TimedModel

ROOT = Path(__file__).resolve().parents[1]

CASES = (("ddpm", 1000), ("ddpm", 100), ("euler_ancestral", 50), ("flow_stochastic", 28))
"""``(kernel, steps)``: the schedulers' step counts as their pipelines use them."""

TARGETS = ("digits", "gmm")


@dataclass(frozen=True)
class Config:
    """One speculative configuration: ``sample_speculative``'s arguments and the tree's description."""

    name: str
    coupling: str
    shape: tuple  # ("chain", L), ("uniform", K, L) or ("widths", K_1, K_2, ...) (DraftTree.from_widths)
    draft: str = "x0"
    execution: str = "tree"
    prefetch: str = "nearest"

    def tree(self):
        from specsamp.trees import DraftTree

        kind, *args = self.shape
        if kind == "chain":
            return DraftTree.chain(*args)
        return DraftTree.uniform(*args) if kind == "uniform" else DraftTree.from_widths(args)

    @property
    def budget(self) -> int:
        return len(self.tree()) - 1


CONFIGS = (
    Config("rmc chain14 x0", "rmc", ("chain", 14)),
    Config("rmc chain62 x0", "rmc", ("chain", 62)),
    Config("rmc chain62 x0_affine", "rmc", ("chain", 62), "x0_affine"),
    Config("dgrs (2,3) x0", "dgrs", ("uniform", 2, 3)),
)
"""The speculative configurations timed in every case: RMC chains at B = 14 and 62 with the frozen-``x0`` draft (the
estimate's), the chain of 62 with the ``x0_affine`` draft, and D-GRS on the paper's (2, 3) tree."""

SEARCH = (
    *(Config(f"rmc chain{L} x0", "rmc", ("chain", L)) for L in (14, 30, 45, 62)),
    *(
        Config(f"rmc chain62 {d}", "rmc", ("chain", 62), d)
        for d in ("velocity", "x0_extrap", "x0_extrap_gated", "x0_affine")
    ),
    Config("rmc chain62 x0 prefetch=parent", "rmc", ("chain", 62), prefetch="parent"),
    Config("rmc chain62 x0 prefetch=none", "rmc", ("chain", 62), prefetch="none"),
    Config("dgrs (2,3) x0", "dgrs", ("uniform", 2, 3)),
    Config("dgrs (2,5) x0", "dgrs", ("uniform", 2, 5)),
    Config("dgrs (3,3) x0", "dgrs", ("uniform", 3, 3)),
    Config("dgrs 2 then chain30 x0", "dgrs", ("widths", 2, *(1,) * 30)),
    Config("dgrs 3 then chain20 x0", "dgrs", ("widths", 3, *(1,) * 20)),
)
"""The configurations searched on DDPM at 1000 steps (counts only; ``--search``): chain lengths, drafts, prefetch
rules, D-GRS trees within B <= 63."""


def scheduler(kernel: str, target: str):
    """A fresh diffusers scheduler of ``kernel`` as the benchmark configures it.

    DDPM: the library's defaults (linear betas 1e-4..0.02, 1000 training steps), ``clip_sample`` on for the
    digits (their data lie in [-1, 1], as DDPM pipelines' configs set it) and off for the mixture (its means
    do not). Euler ancestral: Stable Diffusion's scaled-linear betas 0.00085..0.012. Flow: SD3's shift 3.
    """
    from diffusers import DDPMScheduler, EulerAncestralDiscreteScheduler, FlowMatchEulerDiscreteScheduler

    if kernel == "ddpm":
        return DDPMScheduler(clip_sample=target == "digits")
    if kernel == "euler_ancestral":
        return EulerAncestralDiscreteScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear")
    if kernel == "flow_stochastic":
        return FlowMatchEulerDiscreteScheduler(shift=3.0, stochastic_sampling=True)
    raise ValueError(f"kernel={kernel!r} is invalid: valid are ddpm, euler_ancestral, flow_stochastic")


class SchedulerNetwork:
    """A velocity model presented as the network a scheduler's loop calls: ``net(y, t, **cond)`` in the scheduler's
    coordinates and prediction (the plan's), at its timesteps ``t`` (looked up on the plan's grid)."""

    def __init__(self, velocity, plan):
        self.velocity, self.prediction, self.coords = velocity, plan.prediction, plan.coords
        self.levels = {float(t): float(s) for t, s in zip(plan.timesteps, plan.schedule.sigmas[:-1])}

    def __call__(self, y: torch.Tensor, t, **cond) -> torch.Tensor:
        from specsamp.models.parametrisation import from_velocity, level_scale

        s = torch.full((y.shape[0],), self.levels[float(t)], dtype=torch.float64)
        k = level_scale(s, self.coords).reshape((-1,) + (1,) * (y.ndim - 1))
        x = (y.to(torch.float64) / k).to(self.velocity.dtype)
        v = self.velocity(x, s, **cond)
        return from_velocity(v, x, s, self.prediction, self.coords).to(y.dtype)


def scheduler_loop(
    sch, steps: int, net, event_shape, dtype, seed: int, cond: dict | None = None, batch: int = 1
) -> torch.Tensor:
    """The pipeline's own loop (``batch`` images; one in the timings): ``set_timesteps``, initial noise from a seeded
    ``torch.Generator`` times ``init_noise_sigma`` (1 where the scheduler has none), then per step
    ``scale_model_input`` (where the scheduler has it), one network call and ``step``."""
    cond = cond or {}
    with torch.no_grad():
        sch.set_timesteps(steps)
        g = torch.Generator().manual_seed(seed)
        y = torch.randn((batch, *event_shape), generator=g, dtype=dtype) * getattr(sch, "init_noise_sigma", 1.0)
        scale = getattr(sch, "scale_model_input", None)
        for t in sch.timesteps:
            inp = scale(y, t) if scale is not None else y
            out = net(inp, t, **cond)
            y = sch.step(out, t, y, generator=g).prev_sample
    return y


@dataclass
class Target:
    name: str
    model: TimedModel
    event_ndim: int
    cond: object = None  # callable ids -> cond dict
    info: dict = field(default_factory=dict)


def make_target(name: str, tiny: bool = False) -> Target:
    """``digits``: the shipped network as ``model=digits`` builds it (labels ``id % 10``); ``gmm``: the section 5.1
    mixture (d = 500, five components, float64; ``tiny``: d = 8)."""
    if name == "digits":
        from specsamp.runner import build_target, compose, load_config

        model = build_target(load_config(compose(["model=digits"]))[0]).model
        return Target(
            name,
            TimedModel(model),
            3,
            lambda ids: {"class_labels": torch.as_tensor(ids) % 10},
            {"network": "edm-digits-8x8-cond", "event_shape": list(model.event_shape), "dtype": "float32"},
        )
    if name == "gmm":
        from specsamp.models import GaussianMixture

        d = 8 if tiny else 500
        model = GaussianMixture(dim=d, components=5, layout_seed=0, dtype=torch.float64)
        return Target(
            name,
            TimedModel(model),
            1,
            lambda ids: {},
            {
                "network": f"GaussianMixture(dim={d}, components=5, layout_seed=0)",
                "event_shape": [d],
                "dtype": "float64",
            },
        )
    raise ValueError(f"target={name!r} is invalid: valid are {', '.join(TARGETS)}")


def plan_of(kernel: str, steps: int, target: Target):
    from specsamp.integrations.schedulers import from_scheduler

    return from_scheduler(scheduler(kernel, target.name), steps, event_ndim=target.event_ndim)


def speculative(target: Target, plan, cfg: Config, ids, seed: int = 0):
    from specsamp.sampler import sample_speculative

    return sample_speculative(
        target.model,
        plan.schedule,
        cfg.tree(),
        cfg.coupling,
        indices=list(ids),
        draft=cfg.draft,
        execution=cfg.execution,
        prefetch=cfg.prefetch,
        seed=seed,
        cond=target.cond(list(ids)),
    )


def counts(target: Target, plan, cfg: Config, n: int, steps: int) -> dict:
    """Machine-independent facts of ``cfg`` over images ``0..n-1`` (seed 0): calls, rows, acceptance per depth."""
    target.model.reset()
    res = speculative(target, plan, cfg, range(n))
    calls = res.nfe_total.double()
    rows = (res.target_rows + res.nfe_total - res.nfe).double()  # endpoint steps: one row each
    att, acc = res.attempts.sum(0).double(), res.accepts.sum(0).double()
    depth = [round(float(a / t), 4) if t > 0 else None for a, t in zip(acc, att)]
    committed_per_call = float(res.committed.sum()) / float(res.nfe.sum())
    return {
        "calls_per_image": float(calls.mean()),
        "rows_per_image": float(rows.mean()),
        "nfe_speedup": steps / float(calls.mean()),
        "row_ratio": steps / float(rows.mean()),
        "speculative_calls_per_image": float(res.nfe.double().mean()),
        "steps_per_call": committed_per_call,
        "acceptance_by_depth": depth,
        "attempts_by_depth": [int(a) for a in att],
    }


def estimate(target: Target, plan, n: int, chains=(14, 62), seed: int = 0) -> dict:
    """The frozen-``x0`` RMC chain's acceptance predicted from standard trajectories (no speculation run).

    Along ``n`` standard trajectories of the kernel (``sample_standard``'s law; states ``x_m``, data predictions
    ``x0_m = clip(x_m - sigma_m v_m)``), the draft of a chain rooted at ``x_r`` that freezes ``x0_r`` misses the
    target mean of step ``m >= r`` by ``c_x0[m] |x0_m - x0_r| / std[m]`` (``delta``), and RMC accepts it with
    probability ``2 Phi(-delta / 2)``. A chain of ``L`` from root ``r`` then commits ``1 + sum_d prod_{j <= d} a_j``
    steps per call (the drafts accepted in a row, then one exact step), if the root's velocity is exact and the
    drafted states follow the standard trajectory. Returns ``{"chain L": steps per call}`` (the mean over roots of
    the speculative range and images) and ``"acceptance_by_depth"`` (the mean predicted acceptance at depth
    ``d = 1..max(chains)`` over the roots that reach it).
    """
    from specsamp import rng
    from specsamp.round import initial_state

    sch, model = plan.schedule, target.model
    ids = torch.arange(n)
    cond = target.cond(list(range(n)))
    T = sch.steps
    x = initial_state(sch, seed, ids, model.event_shape, model.dtype, None)
    keys = rng.base_key(seed, ids, "step")
    cols = sch.tables("cpu")
    x0s = []
    with torch.inference_mode():
        for m in range(T):
            mm = torch.full((n,), m, dtype=torch.long)
            v = model(x, sch.sigmas[mm], **cond).to(x.dtype)
            x0s.append(_x0(sch, x, v, mm))
            x = sch.mean(x, v, mm) + per_row_std(sch, mm, x) * rng.normal(
                rng.fold(keys, m), model.event_shape, dtype=x.dtype
            )
    x0 = torch.stack(x0s).double().reshape(T, n, -1)  # [T, n, d]
    c0, std = cols["c_x0"], cols["std"]
    Lmax = max(chains)
    first, end = 1, T - 1  # the speculative range: roots 1..T-2, steps up to T-2
    out, acc_sum, acc_cnt = {}, torch.zeros(Lmax), torch.zeros(Lmax)
    per_chain = {L: [] for L in chains}
    normal = torch.distributions.Normal(0.0, 1.0)
    for r in range(first, end):
        m = torch.arange(r, min(r + Lmax, end))
        delta = c0[m, None] * (x0[m] - x0[r]).norm(dim=-1) / std[m, None]  # [d, n]
        a = 2 * normal.cdf(-delta / 2)
        acc_sum[: len(m)] += a.mean(1)
        acc_cnt[: len(m)] += 1
        cum = torch.cumprod(a, 0)
        for L in chains:
            per_chain[L].append(1 + cum[: min(L, len(m) - 1)].sum(0).mean())  # at most the steps left, then one exact
    for L in chains:
        e = torch.stack(per_chain[L])  # [roots]: expected steps per call from each root
        out[f"chain {L}"] = round(float(e.mean()), 3)
        # the walk's own average: a call from root r covers e[r] steps, so the range takes sum_r 1 / e[r] calls
        out[f"chain {L} walk"] = round(float(len(e) / (1.0 / e).sum()), 3)
    out["acceptance_by_depth"] = [round(float(s / c), 4) for s, c in zip(acc_sum, acc_cnt) if c > 0]
    return out


def _x0(sch, x, v, n):
    """The kernel's data prediction ``clip(x - sigma v)`` (its mean with ``c_x = 0``, ``c_x0 = 1``)."""
    c = sch.kernel.coefs(n, x)
    return sch.kernel.mean(x, v, {**c, "c_x": torch.zeros_like(c["c_x"]), "c_x0": torch.ones_like(c["c_x0"])})


def per_row_std(sch, n, x):
    from specsamp.schedule import per_row

    return per_row(sch.std(n).to(x.dtype), x)


def timings(target: Target, plan, kernel: str, steps: int, configs, repeats: int, progress=None) -> dict:
    """Seconds for one image, loop and each configuration interleaved in one process (see the module docstring)."""
    net = SchedulerNetwork(target.model, plan)
    shape, dtype = target.model.event_shape, target.model.dtype

    def run(arm, i):
        target.model.reset()
        t0 = time.perf_counter()
        if arm is None:
            scheduler_loop(scheduler(kernel, target.name), steps, net, shape, dtype, seed=i, cond=target.cond([i]))
        else:
            speculative(target, plan, arm, [i])
        return time.perf_counter() - t0, target.model.network_s()

    arms = [None, *configs]
    for a in arms:  # warm-up: allocation, lazy imports, per-tree tables
        run(a, 10_000)
    wall = {a: [] for a in arms}
    net_s = {a: [] for a in arms}
    for r in range(repeats):
        for a in arms:
            w, s = run(a, 1000 + r)
            wall[a].append(w)
            net_s[a].append(s)
    ref = statistics.median(wall[None])
    out = {}
    for a in arms:
        med = statistics.median(wall[a])
        out["loop" if a is None else a.name] = {
            "median_s": med,
            "min_s": min(wall[a]),
            "max_s": max(wall[a]),
            "n": repeats,
            "network_share": statistics.median(s / w for s, w in zip(net_s[a], wall[a])),
            "wall_speedup": ref / med,
        }
        if progress:
            progress(
                f"    {'loop' if a is None else a.name}: {1e3 * med:.1f} ms [{1e3 * min(wall[a]):.1f}-"
                f"{1e3 * max(wall[a]):.1f}], {ref / med:.2f}x the loop, network {100 * out[list(out)[-1]]['network_share']:.0f}%"
            )
    return out


def commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def measure(
    cases=CASES, targets=TARGETS, configs=CONFIGS, n: int = 8, repeats: int = 5, tiny: bool = False, progress=print
) -> dict:
    """The whole benchmark as one JSON-ready dict (``counts`` and ``timings`` rows apart, keyed alike)."""
    from benchmarks.common import cpu_model

    if min(n, repeats) < 1:
        raise ValueError(f"n={n}, repeats={repeats}: each must be >= 1")
    torch.set_num_threads(1)
    load0 = _load()
    out = {
        "commit": commit(),
        "n": n,
        "repeats": repeats,
        "cpu": cpu_model(),
        "torch": torch.__version__,
        "threads": 1,
        "configs": {
            c.name: {
                "coupling": c.coupling,
                "tree": list(c.shape),
                "budget": c.budget,
                "draft": c.draft,
                "execution": c.execution,
                "prefetch": c.prefetch,
            }
            for c in configs
        },
        "counts": [],
        "timings": [],
    }
    for tname in targets:
        target = make_target(tname, tiny)
        out.setdefault("targets", {})[tname] = target.info
        for kernel, steps in cases:
            plan = plan_of(kernel, steps, target)
            case = f"{kernel} {steps}"
            if progress:
                progress(f"[{tname}] {case}")
            for cfg in configs:
                c = counts(target, plan, cfg, n, steps)
                out["counts"].append(
                    {
                        "target": tname,
                        "case": case,
                        "config": cfg.name,
                        "budget": cfg.budget,
                        "loop_calls_per_image": steps,
                        **c,
                    }
                )
                if progress:
                    progress(
                        f"    {cfg.name}: {c['calls_per_image']:.2f} calls/image ({c['nfe_speedup']:.1f}x fewer), "
                        f"{c['steps_per_call']:.1f} steps per speculative call, rows/image {c['rows_per_image']:.0f}"
                    )
            if (kernel, steps) == ("ddpm", 1000) or tiny:
                est = estimate(target, plan, n, chains=(14, 62))
                out.setdefault("estimate", []).append({"target": tname, "case": case, **est})
                if progress:
                    progress(
                        "    estimate (frozen x0, RMC): "
                        + ", ".join(f"{k} {v}" for k, v in est.items() if k.startswith("chain"))
                    )
            if repeats:
                for arm, t in timings(target, plan, kernel, steps, configs, repeats, progress).items():
                    out["timings"].append({"target": tname, "case": case, "arm": arm, **t})
    out["load_average"] = [load0, _load()]
    return out


def search(
    targets=TARGETS, configs=SEARCH, n: int = 8, steps: int = 1000, tiny: bool = False, progress=print
) -> list[dict]:
    """Counts of every configuration of ``configs`` on DDPM at ``steps`` (no timing), with the estimate beside them."""
    torch.set_num_threads(1)
    rows = []
    for tname in targets:
        target = make_target(tname, tiny)
        plan = plan_of("ddpm", steps, target)
        for cfg in configs:
            c = counts(target, plan, cfg, n, steps)
            rows.append(
                {
                    "target": tname,
                    "case": f"ddpm {steps}",
                    "config": cfg.name,
                    "coupling": cfg.coupling,
                    "tree": list(cfg.shape),
                    "budget": cfg.budget,
                    "draft": cfg.draft,
                    "execution": cfg.execution,
                    "prefetch": cfg.prefetch,
                    **c,
                }
            )
            if progress:
                progress(
                    f"  [{tname}] {cfg.name} (B={cfg.budget}): {c['nfe_speedup']:.1f}x fewer calls, "
                    f"{c['steps_per_call']:.1f} steps per speculative call"
                )
    return rows


CSV_FIELDS = (
    "target",
    "case",
    "config",
    "budget",
    "loop_calls_per_image",
    "calls_per_image",
    "nfe_speedup",
    "rows_per_image",
    "row_ratio",
    "steps_per_call",
    "loop_median_s",
    "median_s",
    "min_s",
    "max_s",
    "wall_speedup",
    "network_share",
)


def csv_rows(res: dict) -> list[dict]:
    """One row per target, case and configuration: its counts and its timing (the loop's rows carry the timing only)."""
    timed = {(t["target"], t["case"], t["arm"]): t for t in res["timings"]}
    rows = []
    for c in res["counts"]:
        t = timed.get((c["target"], c["case"], c["config"]), {})
        loop = timed.get((c["target"], c["case"], "loop"), {})
        rows.append(
            {
                **{k: c.get(k) for k in CSV_FIELDS},
                **{k: t.get(k) for k in ("median_s", "min_s", "max_s", "wall_speedup", "network_share")},
                "loop_median_s": loop.get("median_s"),
            }
        )
    return rows


def _load():
    try:
        import os

        return list(os.getloadavg())
    except OSError:
        return None


def main(argv=None) -> int:
    """CLI (see the module docstring); returns the exit status."""
    from benchmarks.common import table

    p = argparse.ArgumentParser(prog="python -m benchmarks.samplers", description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=8, help="images for the counts (ids 0..n-1)")
    p.add_argument("--repeats", type=int, default=5, help="interleaved timed repeats of one image per arm")
    p.add_argument("--cases", default=",".join(f"{k}:{s}" for k, s in CASES), help="kernel:steps, comma-separated")
    p.add_argument("--targets", default=",".join(TARGETS), help="comma-separated: digits, gmm")
    p.add_argument(
        "--search", action="store_true", help="also the counts of the searched configurations on DDPM at 1000 steps"
    )
    p.add_argument("--tiny", action="store_true", help="the mixture at d = 8 (a rehearsal of the code path)")
    p.add_argument("--out", default=None, help="JSON to write (results/samplers.json); its CSV beside it (.csv)")
    a = p.parse_args(argv)
    try:
        cases = [(k, int(s)) for k, s in (c.split(":") for c in a.cases.split(","))]
        bad = [k for k, _ in cases if k not in {c[0] for c in CASES}]
        assert not bad
    except (ValueError, AssertionError):
        print(
            f"error: --cases={a.cases!r} is invalid: use kernel:steps pairs of ddpm, euler_ancestral or flow_stochastic, "
            "e.g. ddpm:1000,euler_ancestral:50",
            file=sys.stderr,
        )
        return 2
    targets = a.targets.split(",")
    if any(t not in TARGETS for t in targets) or min(a.n, a.repeats) < 1:
        print(
            f"error: --targets={a.targets!r}, --n={a.n}, --repeats={a.repeats}: targets are {', '.join(TARGETS)}, "
            "n and repeats integers >= 1",
            file=sys.stderr,
        )
        return 2
    print(
        f"scheduler kernels vs the scheduler's own loop: torch {torch.__version__}, 1 thread, counts from {a.n} images, "
        f"one-image wall clock median of {a.repeats} interleaved repeats",
        flush=True,
    )
    log = lambda s: print(s, flush=True)  # noqa: E731
    res = measure(cases, targets, n=a.n, repeats=a.repeats, tiny=a.tiny, progress=log)
    if a.search:
        log("[search] DDPM at 1000 steps, counts only")
        res["search"] = search(targets, n=a.n, tiny=a.tiny, progress=log)
    rows = csv_rows(res)
    print(
        table(
            rows,
            [
                ("target", "target", "s"),
                ("case", "case", "s"),
                ("config", "config", "s"),
                ("budget", "B", "d"),
                ("nfe_speedup", "NFE speedup", ".1f"),
                ("steps_per_call", "steps/call", ".1f"),
                ("rows_per_image", "rows/image", ".0f"),
                ("loop_median_s", "loop s", ".3f"),
                ("median_s", "spec s", ".3f"),
                ("wall_speedup", "wall speedup", ".2f"),
            ],
        ),
        flush=True,
    )
    if a.out:
        import csv
        import io

        from specsamp.io import atomic_write, write_json_atomic

        out = Path(a.out)
        write_json_atomic(out, res)
        buf = io.StringIO()
        w = csv.DictWriter(buf, fieldnames=CSV_FIELDS)
        w.writeheader()
        for r in rows:
            w.writerow({k: (f"{v:.6g}" if isinstance(v, float) else ("" if v is None else v)) for k, v in r.items()})
        atomic_write(out.with_suffix(".csv"), lambda f: f.write(buf.getvalue()), mode="w")
        print(f"wrote {out} and {out.with_suffix('.csv')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
