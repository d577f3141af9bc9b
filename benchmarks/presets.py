"""The samplers people run at 20-30 steps, against their original loops: calls, acceptance and one-image wall clock.

``python -m benchmarks.presets [--n 8] [--repeats 5] [--steps 20,25,30] [--targets digits,patches32,gmm]
[--pads 0,5,20] [--out results/presets.json]`` (``make bench-presets``; ``--quick`` for a minute's check).

Samplers (the k-diffusion entry points, :mod:`specsamp.integrations.k_diffusion`): Euler ancestral and DPM++ 2M SDE
(``eta = 1``, midpoint) on Karras et al.'s levels (``sigma_min = 0.002``, ``sigma_max = 80``, ``rho = 7``: "Euler a
Karras", "DPM++ 2M SDE Karras") at each of ``--steps``, and ComfyUI's flow Euler ancestral at 28 steps on SD3's
shift-3 levels (times 80/81: the first at sigma 80; the targets served as flow models:
``D_flow(x, s) = D(x / (1 - s), s / (1 - s))``). Targets: the
shipped digits network (class-conditional EDM, labels ``i mod 10``), patches32 (unconditional EDM at CIFAR-10's
dimension) and the section 5.1 mixture (d = 500, float64, its exact denoiser); and the digits network trained with
label dropout (``model=digits_cfg``) under classifier-free guidance at ``w`` = 3, 5 and 7 (``digits_cfgW``: one call
of ``2b`` rows, ``D_u + w (D_c - D_u)``), the scales people use. The original loop is the sampler as
k-diffusion (ComfyUI for the flow form) writes it, transcribed here, with ``torch.randn`` noise.

Two kinds of numbers, kept apart:

- **counts** (machine-independent; ``--n`` images, seed 0): network calls per image of the loop (``T``) and of the
  speculative sampler (``nfe_total``, endpoints included), their ratio, network rows per image, and the acceptance
  at each depth (``accepts / attempts`` over the images);
- **timings** (this machine): seconds for ONE image, the loop and each speculative arm alternating in one process
  (repeat-major, the order alternating each repeat, one warm-up each), median and range over ``--repeats``, with
  every call of the network padded to a fixed ``--pads`` milliseconds where asked (``0``: the real call; 5 and 20 ms
  stand for a GPU below its knee, where a call costs the same whatever its rows).

Nothing here is asserted; the tests run the code path at tiny sizes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks.common import cpu_model, table
from specsamp.ancestral import flow_levels
from specsamp.dpmpp import karras_levels
from specsamp.integrations import k_diffusion as kd

ARMS = {  # name -> speculative options of the entry points
    "rmc chain 4": {"coupling": "rmc", "budget": 4},
    "rmc chain 8": {"coupling": "rmc", "budget": 8},
    "rmc chain 16": {"coupling": "rmc", "budget": 16},
    "dgrs 2x3": {"coupling": "dgrs", "K": 2, "L": 3},
}
TARGETS = ("digits_cfg3", "digits_cfg5", "digits_cfg7", "digits", "patches32", "gmm")


def karras(steps: int) -> torch.Tensor:
    """Karras' variance-exploding levels (sigma_min 0.002, sigma_max 80, rho 7), then 0: ``[steps + 1]``."""
    lin = karras_levels(steps)
    ve = lin / (1.0 - lin)
    ve[-1] = 0.0
    return ve


def load_target(name: str):
    """``(denoiser(x, sigma, **labels) -> x0, event_shape, dtype)`` of a target in variance-exploding coordinates (the
    digits targets take ``class_labels``, one-hot per row: :func:`labels_of`)."""
    if name == "gmm":
        from specsamp.models.gmm import GaussianMixture

        gmm = GaussianMixture(dim=500, components=5, layout_seed=0)

        def gmm_denoiser(x, sigma, **kw):
            s = sigma.to(torch.float64).reshape(-1, 1)
            return gmm.denoise(x / (1.0 + s), (s / (1.0 + s)).reshape(-1))

        return gmm_denoiser, (500,), torch.float64
    from specsamp.models.edm import load_edm

    if name.startswith("digits_cfg"):  # the label-dropout network under classifier-free guidance at scale w
        net = load_edm("edm-digits-8x8-cfg", download=False)
        w = float(name.removeprefix("digits_cfg"))
        null = torch.zeros(1, 10)

        def guided(x, sigma, class_labels, **kw):
            b = x.shape[0]
            labels = torch.cat([null.expand(b, 10), class_labels])
            with torch.no_grad():  # one call of 2b rows: the unconditional half first
                out = net(torch.cat([x, x]), torch.cat([sigma, sigma]), class_labels=labels)
            d_u, d_c = out[:b], out[b:]
            return d_u + w * (d_c - d_u)

        return guided, (1, 8, 8), torch.float32
    if name == "digits":
        net = load_edm("edm-digits-8x8-cond", download=False)

        def digits(x, sigma, class_labels, **kw):
            with torch.no_grad():
                return net(x, sigma, class_labels=class_labels)

        return digits, (1, 8, 8), torch.float32
    net = load_edm("edm-patches-32x32-uncond", download=False)

    def patches(x, sigma, **kw):
        with torch.no_grad():
            return net(x, sigma)

    return patches, (3, 32, 32), torch.float32


def labels_of(target: str, n: int, first: int = 0) -> dict:
    """The model's keywords for images ``first .. first + n - 1``: class ``i mod 10`` one-hot for the digits targets
    (per row: k-diffusion hands each call the rows of the images it evaluates), none otherwise."""
    if not target.startswith("digits"):
        return {}
    return {"class_labels": torch.eye(10)[(torch.arange(n) + first) % 10]}


def as_flow(denoiser):
    """A variance-exploding denoiser as a flow model's: ``D(x / (1 - s), s / (1 - s))`` at flow states ``x``."""

    def flow(x, sigma, **kw):
        s = sigma.reshape((-1,) + (1,) * (x.ndim - 1))
        return denoiser(x / (1.0 - s), sigma / (1.0 - sigma), **kw)

    return flow


class Padded:
    """A denoiser whose every call lasts at least ``pad_s`` seconds; counts calls and rows."""

    def __init__(self, model, pad_s: float = 0.0):
        self.model, self.pad_s, self.calls, self.rows = model, pad_s, 0, 0

    def __call__(self, x, sigma, **kw):
        t0 = time.perf_counter()
        out = self.model(x, sigma, **kw)
        self.calls += 1
        self.rows += x.shape[0]
        if self.pad_s > 0:
            rest = self.pad_s - (time.perf_counter() - t0)
            if rest > 0:
                time.sleep(rest)
        return out


# ------------------------------------------------------------------------------------------------------------------
# the original loops, as k-diffusion and ComfyUI write them


def loop_euler_ancestral(model, x, sigmas, eta=1.0):
    for i in range(len(sigmas) - 1):
        s, s1 = sigmas[i], sigmas[i + 1]
        denoised = model(x, s * x.new_ones([x.shape[0]]))
        up = min(s1, eta * (s1**2 * (s**2 - s1**2) / s**2) ** 0.5)
        down = (s1**2 - up**2) ** 0.5
        x = x + (x - denoised) / s * (down - s)
        if s1 > 0:
            x = x + torch.randn_like(x) * up
    return x


def loop_dpmpp_2m_sde(model, x, sigmas, eta=1.0):
    old = h_last = None
    for i in range(len(sigmas) - 1):
        s, s1 = sigmas[i], sigmas[i + 1]
        denoised = model(x, s * x.new_ones([x.shape[0]]))
        if s1 == 0:
            x = denoised
        else:
            h = (s / s1).log()
            he = h * (eta + 1)
            x = s1 / s * (-h * eta).exp() * x + (-he).expm1().neg() * denoised
            if old is not None:
                x = x + 0.5 * (-he).expm1().neg() * (h / h_last) * (denoised - old)
            x = x + torch.randn_like(x) * s1 * (-2 * h * eta).expm1().neg().sqrt()
            h_last = h
        old = denoised
    return x


def loop_euler_ancestral_rf(model, x, sigmas, eta=1.0):
    for i in range(len(sigmas) - 1):
        s, s1 = sigmas[i], sigmas[i + 1]
        denoised = model(x, s * x.new_ones([x.shape[0]]))
        if s1 == 0:
            x = denoised
        else:
            down = s1 * (1 + (s1 / s - 1) * eta)
            renoise = (s1**2 - down**2 * (1 - s1) ** 2 / (1 - down) ** 2) ** 0.5
            x = (1 - s1) / (1 - down) * ((down / s) * x + (1 - down / s) * denoised)
            x = x + torch.randn_like(x) * renoise
    return x


def flow_grid(steps: int) -> torch.Tensor:
    """SD3's shift-3 flow levels (:func:`specsamp.ancestral.flow_levels`) scaled by ``80 / 81``, so that the first is
    the EDM targets' largest noise, ``sigma = 80``, where a variance-exploding denoiser is still defined."""
    return flow_levels(steps, 3.0) * (80.0 / 81.0)


def ddim_scheduler():
    """diffusers' ``DDIMScheduler`` as Stable Diffusion configures it (scaled-linear betas 0.00085 to 0.012,
    ``steps_offset = 1``, no clipping, ``set_alpha_to_one = False``)."""
    from diffusers import DDIMScheduler

    return DDIMScheduler(
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        clip_sample=False,
        set_alpha_to_one=False,
        steps_offset=1,
    )


class Velocity:
    """A variance-exploding denoiser as the velocity model :func:`specsamp.sampler.sample_speculative` takes:
    ``v = (x - D(x / (1 - s), s / (1 - s))) / s`` on the linear path."""

    def __init__(self, denoiser, shape, dtype):
        self.denoiser, self.event_shape, self.dtype = denoiser, tuple(shape), dtype

    def __call__(self, x, s, **cond):
        r = s.reshape((-1,) + (1,) * (x.ndim - 1)).to(x.dtype)
        return (x - self.denoiser(x / (1.0 - r), (s / (1.0 - s)).to(x.dtype), **cond)) / r


def run_ddim(model, x_noise, steps: int, extra: dict, seed: int, arm: dict | None, stats: dict | None = None):
    """DDIM at ``eta = 1`` for the images ``x_noise [b, ...]`` (standard normal): diffusers' own loop
    (``scheduler.step(..., eta=1, generator=...)``, the network presented as its epsilon in VP coordinates) where
    ``arm`` is None, else the ``ddim`` kernel's speculative sampler (:func:`specsamp.schedulers.from_scheduler`)."""
    from benchmarks.samplers import SchedulerNetwork
    from specsamp.sampler import sample_speculative
    from specsamp.schedulers import from_scheduler
    from specsamp.trees import DraftTree

    vel = Velocity(model, x_noise.shape[1:], x_noise.dtype)
    plan = from_scheduler(ddim_scheduler(), steps, event_ndim=x_noise.ndim - 1, eta=1.0)
    if arm is None:
        sch, net = ddim_scheduler(), SchedulerNetwork(vel, plan)
        sch.set_timesteps(steps)
        g = torch.Generator().manual_seed(seed)
        y = x_noise * sch.init_noise_sigma
        for t in sch.timesteps:
            y = sch.step(net(y, t, **extra), t, y, eta=1.0, generator=g).prev_sample
        return y
    tree = DraftTree.chain(arm["budget"]) if arm["coupling"] == "rmc" else DraftTree.uniform(arm["K"], arm["L"])
    res = sample_speculative(
        vel, plan.schedule, tree, arm["coupling"], x_noise.shape[0], draft="x0", execution="tree", seed=seed,
        cond=extra or None, init=x_noise * plan.init_scale,
    )  # fmt: skip
    if stats is not None:
        stats["result"] = res
    return res.samples


SAMPLERS = {  # name -> (entry point, loop, grid(steps), flow)
    "euler_a": (kd.sample_euler_ancestral, loop_euler_ancestral, karras, False),
    "dpmpp_2m_sde": (kd.sample_dpmpp_2m_sde, loop_dpmpp_2m_sde, karras, False),
    "euler_a_rf": (kd.sample_euler_ancestral_RF, loop_euler_ancestral_rf, flow_grid, True),
    "ddim": (None, None, None, False),  # diffusers' DDIMScheduler on its own timesteps: run_ddim
}


def cases(steps: list[int]) -> list[tuple[str, int]]:
    """``(sampler, steps)``: Euler a, DPM++ 2M SDE and DDIM at each of ``steps``, the flow form at 28."""
    return [(s, t) for s in ("euler_a", "dpmpp_2m_sde", "ddim") for t in steps] + [("euler_a_rf", 28)]


def counts(model, shape, dtype, sampler: str, steps: int, arm: dict, n: int, extra: dict) -> dict:
    """Calls, rows and per-depth acceptance per image over ``n`` images (seed 0)."""
    entry, _, grid, flow = SAMPLERS[sampler]
    info = {}
    if sampler == "ddim":
        x = torch.randn(n, *shape, generator=torch.Generator().manual_seed(0), dtype=dtype)
        run_ddim(Padded(model), x, steps, extra, 0, arm, info)
    else:
        sig = grid(steps).to(dtype)
        x = torch.randn(n, *shape, generator=torch.Generator().manual_seed(0), dtype=dtype) * sig[0]
        entry(Padded(model), x, sig, extra, disable=True, seed=0, stats=info, **arm)
    r = info["result"]
    att, acc = r.attempts.sum(0).double(), r.accepts.sum(0).double()
    depth = [round(float(a / t), 3) if t > 0 else None for a, t in zip(acc, att)]
    calls = float(r.nfe_total.double().mean())
    return {
        "calls": round(calls, 2),
        "fewer_calls": round(steps / calls, 3),
        "rows": round(float(r.target_rows.double().mean()) + float((r.nfe_total - r.nfe).double().mean()), 1),
        "acceptance": depth,
    }


def timings(model, shape, dtype, sampler: str, steps: int, arms: dict, pad_ms: float, repeats: int, extra) -> dict:
    """One image: the loop and each arm alternating, one warm-up each; seconds per arm (median, min, max)."""
    entry, loop, grid, flow = SAMPLERS[sampler]
    sig = grid(steps).to(dtype) if grid is not None else torch.ones(1, dtype=dtype)
    padded = Padded(model, pad_ms / 1e3)
    names = ["loop", *arms]

    def run(name: str, seed: int) -> float:
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(1, *shape, generator=g, dtype=dtype) * sig[0]
        t0 = time.perf_counter()
        with torch.no_grad():
            if sampler == "ddim":
                run_ddim(padded, x / sig[0], steps, extra, seed, None if name == "loop" else arms[name])
            elif name == "loop":
                torch.manual_seed(seed)
                loop(lambda y, s: padded(y, s, **extra), x, sig)
            else:
                entry(padded, x, sig, extra, disable=True, seed=seed, **arms[name])
        return time.perf_counter() - t0

    for name in names:
        run(name, 10_000)
    times: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(repeats):
        for name in names if rep % 2 == 0 else names[::-1]:
            times[name].append(run(name, rep))
    out = {}
    for name, ts in times.items():
        out[name] = {"median_s": statistics.median(ts), "min_s": min(ts), "max_s": max(ts)}
    base = out["loop"]["median_s"]
    for name in arms:
        out[name]["speedup"] = round(base / out[name]["median_s"], 3)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=8, help="images for the counts")
    ap.add_argument("--repeats", type=int, default=5, help="timed repeats per arm")
    ap.add_argument("--steps", default="20,25,30")
    ap.add_argument("--targets", default=",".join(TARGETS))
    ap.add_argument("--pads", default="0,5,20", help="milliseconds each call is padded to (0: the real call)")
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--samplers", default="euler_a,dpmpp_2m_sde,ddim,euler_a_rf", help="which of the samplers to run")
    ap.add_argument("--quick", action="store_true", help="n=2, 2 repeats, 20 steps, the mixture, no padding")
    ap.add_argument("--out", default="results/presets.json")
    a = ap.parse_args(argv)
    if a.quick:
        a.n, a.repeats, a.steps, a.targets, a.pads = 2, 2, "20", "gmm", "0"
    torch.set_num_threads(1)
    arms = {k: ARMS[k] for k in a.arms.split(",")}
    steps = [int(s) for s in a.steps.split(",")]
    pads = [float(p) for p in a.pads.split(",")]
    rows = []
    started = time.time()
    for target in a.targets.split(","):
        base, shape, dtype = load_target(target)
        for sampler, t in cases(steps):
            if sampler not in a.samplers.split(","):
                continue
            model = as_flow(base) if SAMPLERS[sampler][3] else base
            row = {"target": target, "sampler": sampler, "steps": t, "arms": {}}
            for name, arm in arms.items():
                row["arms"][name] = counts(model, shape, dtype, sampler, t, arm, a.n, labels_of(target, a.n))
            for pad in pads:
                one = labels_of(target, 1, first=3)  # the timed image: class 3
                row[f"time_pad{pad:g}ms"] = timings(model, shape, dtype, sampler, t, arms, pad, a.repeats, one)
            rows.append(row)
            print(json.dumps(row), flush=True)
    doc = {"cpu": cpu_model(), "torch": torch.__version__, "threads": 1, "n": a.n, "repeats": a.repeats}
    doc["minutes"] = round((time.time() - started) / 60, 1)
    doc["rows"] = rows
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(doc, indent=1))
    print(markdown(doc))
    return 0


def markdown(doc: dict) -> str:
    """The results table: per target, sampler and steps, the best arm by calls and each timing regime's speedup."""
    out = []
    for row in doc["rows"]:
        for name, c in row["arms"].items():
            entry = {
                "target": row["target"],
                "sampler": f"{row['sampler']} {row['steps']}",
                "arm": name,
                "calls": f"{row['steps']} → {c['calls']}",
                "fewer": f"{c['fewer_calls']:.2f}x",
                "rows": f"{c['rows']:.0f}",
                "accept": ", ".join("-" if v is None else f"{v:.2f}" for v in c["acceptance"][:4]),
            }
            for key, t in row.items():
                if key.startswith("time_pad"):
                    pad = key.removeprefix("time_pad")
                    lo, hi = t["loop"]["median_s"] / t[name]["max_s"], t["loop"]["median_s"] / t[name]["min_s"]
                    entry[f"wall {pad}"] = f"{t[name]['speedup']:.2f}x [{lo:.2f}-{hi:.2f}]"
            out.append(entry)
    if not out:
        return ""
    cols = [(k, k, "") for k in out[0]]
    return table(out, cols)


if __name__ == "__main__":
    sys.exit(main())
