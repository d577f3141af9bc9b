"""GPU check: wall clock per image, realised speedup, batched-call cost and CUDA exactness, in one run.

    python -m benchmarks.gpu_check                      # on the GPU (about 5 minutes on one large GPU)
    python -m benchmarks.gpu_check --tiny --device cpu  # seconds: what the default test run checks
    make gpu-check [ARGS="..."]

It prints one table and writes JSON (``--json``, default ``gpu_check.json``) with four sections:

1. ``wallclock``: per-image wall clock of the standard sampler, RMC (chain of length B, the paper's
   budget-matched arm) and D-GRS on the uniform (K, L) tree at the paper's CIFAR-10 settings (T = 100,
   eps = 0.3, (K, L) in {(2,3), (2,5), (3,4), (4,4)}), ``execution="tree"``, for each batch of images,
   with the NFE speedup, the wall-clock speedup and their ratio (the realised fraction of the NFE
   speedup);
2. ``batch_cost``: one batched network call's time against its rows, 1 to 340 (relative to 1 row);
3. ``exactness_f32``: each registered coupling on the device in float32 (KS p-value of the output's
   projection against N(delta, 1) and of an orthogonal projection against N(0, 1));
4. ``exactness_bf16``: speculative (D-GRS and RMC) against standard samples of the same network run
   under bfloat16 autocast (two-sample KS on fixed projections), the network's outputs being what
   they are in bfloat16: the couplings stay exact for whatever target the network defines.

Network. Without ``--network`` a stand-in of realistic size with *random weights* is used
(:mod:`benchmarks.stand_in`, DDPM++-like widths, ~59M parameters); ``--network`` with an EDM checkpoint
(``--sha256`` or ``--trust-checkpoint``) times a real one. The acceptance rates of random weights are not
a trained model's, so the NFE speedups here are not the paper's; the realised fraction is what to read.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

import torch

from benchmarks.stand_in import STAND_INS, StandInPrecond  # noqa: F401  (re-exported for callers)
from specsamp.models.edm import CHECKPOINTS, EDMVelocity, load_edm
from specsamp.sampler import sample_speculative, sample_standard
from specsamp.schedule import Schedule
from specsamp.trees import DraftTree, budget

PAPER_CONFIGS = ((2, 3), (2, 5), (3, 4), (4, 4))
P_MIN = 1e-4  # an exactness check passes when every KS p-value is above this

def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device):
    _sync(device)
    t0 = time.perf_counter()
    out = fn()
    _sync(device)
    return out, time.perf_counter() - t0


def run(
    model,
    *,
    batch_sizes=(1, 16, 64, 256),
    configs=PAPER_CONFIGS,
    steps: int = 100,
    eps: float = 0.3,
    max_batch: int | None = None,
    seed: int = 0,
    warmup: bool = True,
    progress=None,
) -> list[dict]:
    """Time standard, D-GRS and RMC (chain of length B) sampling for every batch size and ``(K, L)``.

    Args:
        model: velocity model (e.g. :class:`~specsamp.models.edm.EDMVelocity`).
        batch_sizes: numbers of images sampled together.
        configs: ``(K, L)`` pairs; RMC runs on ``DraftTree.chain(K + ... + K^L)``.
        steps: ``T``; eps: churn.
        max_batch: rows per forward pass (splits a batched call; NFE unchanged).
        seed: run seed (class labels drawn uniformly from it).
        warmup: one untimed standard run at the smallest batch first (kernel selection, allocator).
        progress: optional ``callable(str)`` for a line per measurement.

    Returns:
        One dict per measurement: ``method, K, L, budget, batch, wall_s, s_per_image, calls_mean,
        batch_nfe, nfe_speedup, batch_speedup, rows_per_image, wall_speedup``.
    """
    dev = torch.device(getattr(model, "device", "cpu"))
    sched = Schedule.make(steps, eps)
    rows = []

    def cond_for(n):
        if getattr(model, "label_dim", 0):
            g = torch.Generator().manual_seed(seed + 1)
            return {"class_labels": torch.randint(model.label_dim, (n,), generator=g).to(dev)}
        return None

    if warmup:
        n0 = min(batch_sizes)
        sample_standard(model, Schedule.make(3, eps), n0, seed=seed, cond=cond_for(n0), max_batch=max_batch)
    for n in batch_sizes:
        cond = cond_for(n)
        res, wall = _timed(lambda: sample_standard(model, sched, n, seed=seed, cond=cond, max_batch=max_batch), dev)
        base = wall
        rows.append(_row("standard", 1, 1, 1, n, wall, res, base))
        if progress:
            progress(_fmt(rows[-1]))
        for K, L in configs:
            B = budget(K, L)
            arms = (("dgrs", DraftTree.uniform(K, L), "dgrs"), ("rmc", DraftTree.chain(B), "rmc"))
            for name, tree, coupling in arms:
                res, wall = _timed(
                    lambda: sample_speculative(model, sched, tree, coupling, n, execution="tree", seed=seed,
                                               cond=cond, max_batch=max_batch),
                    dev,
                )
                rows.append(_row(name, K, L, B, n, wall, res, base))
                if progress:
                    progress(_fmt(rows[-1]))
    return rows


def _row(method, K, L, B, n, wall, res, base) -> dict:
    return {
        "method": method,
        "K": K,
        "L": L,
        "budget": B,
        "batch": n,
        "wall_s": wall,
        "s_per_image": wall / n,
        "calls_mean": float(res.nfe.double().mean()),
        "batch_nfe": int(res.batch_nfe),
        "nfe_speedup": float(res.speedup.mean()),
        "batch_speedup": float(res.batch_speedup),
        "rows_per_image": float(res.target_rows.double().mean()),
        "wall_speedup": base / wall,
        "realised_fraction": (base / wall) / max(float(res.batch_speedup), 1e-12),
    }


def _fmt(r: dict) -> str:
    return (f"{r['method']:>8} K={r['K']} L={r['L']} B={r['budget']:>3} batch={r['batch']:>3}: "
            f"{r['s_per_image']:.4f} s/image, NFE speedup {r['nfe_speedup']:.2f}, wall speedup {r['wall_speedup']:.2f}")


def _ints(text: str) -> list[int]:
    try:
        out = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is invalid: expected comma-separated integers") from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is invalid: need integers >= 1")
    return out


def _configs(text: str) -> list[tuple[int, int]]:
    out = []
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        try:
            k, l = (int(v) for v in part.lower().split("x"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"--configs entry {part!r} is invalid: write KxL, e.g. 2x3,4x4") from None
        if k < 1 or l < 1:
            raise argparse.ArgumentTypeError(f"--configs entry {part!r} is invalid: K, L >= 1")
        out.append((k, l))
    return out


def batch_cost(model, sizes=(1, 2, 4, 8, 16, 32, 64, 128, 256, 340), repeats: int = 3, seed: int = 0) -> list[dict]:
    """Seconds of one batched call of ``model`` against its rows; ``relative`` = time / time at 1 row.

    Args:
        model: velocity model; conditional models get class 0 for every row.
        sizes: rows per call.
        repeats: best of this many timed calls (after one warm-up call per size).
        seed: input seed.

    Returns:
        one dict per size: ``rows, seconds, per_row, relative``.
    """
    dev = torch.device(getattr(model, "device", "cpu"))
    g = torch.Generator().manual_seed(seed)
    out = []
    for b in sizes:
        x = torch.randn(b, *model.event_shape, generator=g, dtype=model.dtype).to(dev)
        sigma = torch.full((b,), 0.5, dtype=torch.float64, device=dev)
        cond = {"class_labels": torch.zeros(b, dtype=torch.long, device=dev)} if getattr(model, "label_dim", 0) else {}
        with torch.no_grad():
            model(x, sigma, **cond)
            best = min(_timed(lambda: model(x, sigma, **cond), dev)[1] for _ in range(repeats))
        out.append({"rows": b, "seconds": best, "per_row": best / b})
    for r in out:
        r["relative"] = r["seconds"] / out[0]["seconds"]
    return out


def exactness_f32(device, n: int = 20000, dim: int = 3072, deltas=(0.5, 2.0), seed: int = 0) -> list[dict]:
    """Law check of every registered coupling on ``device`` in float32 (the coupling tests' KS checks).

    ``n`` parent nodes in ``dim`` coordinates with K = 1 (rules limited to one child) or 4 children;
    the output's projection on the displacement direction, standardised, against N(delta, 1), and a
    fixed orthogonal projection against N(0, 1). Inputs are drawn on the CPU, so every device sees the
    same problem.

    Returns:
        one dict per (rule, delta): ``rule, K, delta, p_parallel, p_orthogonal, acceptance``.
    """
    from scipy import stats

    from specsamp import rng
    from specsamp.coupling import COUPLINGS

    dev = torch.device(device)
    out = []
    g = torch.Generator().manual_seed(seed)
    e = torch.randn(dim, generator=g, dtype=torch.float64)
    e /= e.norm()
    w = torch.randn(dim, generator=g, dtype=torch.float64)
    w -= (w @ e) * e
    w /= w.norm()
    sigma = 0.05
    for name in COUPLINGS:
        fn = COUPLINGS[name]
        K = 1 if fn.max_children == 1 else 4
        for delta in deltas:
            mean_p = torch.randn(n, dim, generator=g)
            mean_q = mean_p + float(sigma * delta) * e.float()
            kids = mean_p[:, None] + sigma * torch.randn(n, K, dim, generator=g)
            keys = rng.base_key(seed, torch.arange(n), "verify").to(dev)
            v = fn(kids.to(dev), mean_p.to(dev), mean_q.to(dev), sigma, rng.KeyedRows(keys))
            z = (v.sample.double().cpu() - mean_q.double()) / sigma
            out.append({
                "rule": name, "K": K, "delta": delta,
                "p_parallel": float(stats.kstest((z @ e).numpy(), "norm").pvalue),
                "p_orthogonal": float(stats.kstest((z @ w).numpy(), "norm").pvalue),
                "acceptance": float(v.accepted.float().mean()),
            })
            del kids, v
    return out


def exactness_bf16(model, n: int = 512, steps: int = 8, eps: float = 0.3, seed: int = 0) -> list[dict]:
    """Speculative against standard samples of ``model`` (run it under bfloat16 autocast), same labels.

    Two-sample KS p-values on three fixed random projections (the sampler tests' check), for D-GRS on
    the uniform (2, 3) tree and RMC on a chain of 14. The two arms use different seeds, so the samples
    are independent.

    Returns:
        one dict per arm: ``arm, n, min_p, p_values``.
    """
    from scipy import stats

    dev = torch.device(getattr(model, "device", "cpu"))
    sched = Schedule.make(steps, eps)
    cond = {"class_labels": torch.zeros(n, dtype=torch.long, device=dev)} if getattr(model, "label_dim", 0) else None
    with torch.no_grad():
        ref = sample_standard(model, sched, n, seed=seed + 1, cond=cond).samples.double().cpu().reshape(n, -1)
        out = []
        for arm, tree, rule in (("dgrs (2,3)", DraftTree.uniform(2, 3), "dgrs"), ("rmc chain(14)", DraftTree.chain(14), "rmc")):
            x = sample_speculative(model, sched, tree, rule, n, execution="tree", seed=seed + 2, cond=cond).samples
            x = x.double().cpu().reshape(n, -1)
            g = torch.Generator().manual_seed(seed)
            ps = []
            for _ in range(3):
                u = torch.randn(x.shape[1], generator=g, dtype=torch.float64)
                ps.append(float(stats.ks_2samp((x @ u).numpy(), (ref @ u).numpy()).pvalue))
            out.append({"arm": arm, "n": n, "min_p": min(ps), "p_values": ps})
    return out


def _print_table(report: dict) -> None:
    """The one table of the check: a section column, then that section's columns."""
    lines = [f"# {report['what']}; device={report['device']}; {report['hardware']}"]
    lines.append(f"{'section':<15} {'setting':<34} {'value':>12}  detail")
    for r in report["wallclock"]:
        setting = f"{r['method']} K={r['K']} L={r['L']} B={r['budget']} x{r['batch']}"
        lines.append(f"{'wallclock':<15} {setting:<34} {r['s_per_image']:>10.4f} s  per image; NFE speedup "
                     f"{r['nfe_speedup']:.2f} (batch {r['batch_speedup']:.2f}), wall {r['wall_speedup']:.2f}, "
                     f"realised {r['realised_fraction']:.2f}")
    for r in report["batch_cost"]:
        lines.append(f"{'batch_cost':<15} {str(r['rows']) + ' rows':<34} {r['seconds'] * 1e3:>9.2f} ms  "
                     f"{r['relative']:.2f}x the 1-row call, {r['per_row'] * 1e3:.3f} ms/row")
    for r in report["exactness_f32"]:
        lines.append(f"{'exactness_f32':<15} {r['rule'] + ' K=' + str(r['K']) + ' delta=' + str(r['delta']):<34} "
                     f"{min(r['p_parallel'], r['p_orthogonal']):>12.3g}  min KS p (parallel {r['p_parallel']:.3g}, "
                     f"orthogonal {r['p_orthogonal']:.3g}); acceptance {r['acceptance']:.3f}; "
                     f"{'pass' if min(r['p_parallel'], r['p_orthogonal']) > P_MIN else 'FAIL'} (p > {P_MIN:g})")
    for r in report["exactness_bf16"]:
        lines.append(f"{'exactness_bf16':<15} {r['arm'] + ' n=' + str(r['n']):<34} {r['min_p']:>12.3g}  "
                     f"min two-sample KS p vs the standard sampler; {'pass' if r['min_p'] > P_MIN else 'FAIL'} (p > {P_MIN:g})")
    if report.get("tiny"):
        lines.append("# tiny mode: a smoke run of every section; its timings are too short to measure anything")
    print("\n".join(lines), flush=True)


def main(argv=None) -> int:
    """Command line entry point (see the module docstring); returns 0 when every check ran and passed (p > 1e-4)."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true", help="tiny stand-in and sizes: a CPU smoke run of every section")
    p.add_argument("--arch", default="cifar10", choices=sorted(STAND_INS), help="stand-in preset")
    p.add_argument("--network", default=None, help="real EDM checkpoint (name, URL or path) instead of the stand-in")
    p.add_argument("--sha256", default=None)
    p.add_argument("--trust-checkpoint", action="store_true")
    p.add_argument("--batch-sizes", type=_ints, default=None, help="images sampled together (default 1; tiny: 1,2)")
    p.add_argument("--configs", type=_configs, default=None, help="KxL list, default 2x3,2x5,3x4,4x4")
    p.add_argument("--steps", type=int, default=None, help="T (default 100; tiny: 6)")
    p.add_argument("--eps", type=float, default=0.3)
    p.add_argument("--max-batch", type=int, default=None, help="rows per forward pass")
    p.add_argument("--net-dtype", default=None, help="autocast dtype of the network for the wall-clock section")
    p.add_argument("--tf32", action="store_true", help="allow TF32 matmuls/convolutions on CUDA")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default="gpu_check.json", help="write the report here (default gpu_check.json)")
    p.add_argument("--csv", default=None, help="also write the wall-clock rows as CSV")
    a = p.parse_args(argv)

    dev = torch.device(a.device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            p.error("--device cuda requested but CUDA is not available; use --device cpu")
        torch.backends.cudnn.benchmark = True
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = bool(a.tf32)
    t_start = time.perf_counter()
    steps = a.steps or (6 if a.tiny else 100)
    batch_sizes = a.batch_sizes or [1] + ([2] if a.tiny else [])  # one image: a (4,4) round already holds 341 rows
    configs = a.configs or ([(2, 3)] if a.tiny else list(PAPER_CONFIGS))
    preset = "tiny" if a.tiny else a.arch
    if a.network:
        known = CHECKPOINTS.get(a.network)
        net = load_edm(known.url if known else a.network, sha256=a.sha256 or (known.sha256 if known else None),
                       trust_checkpoint=a.trust_checkpoint, map_location=a.device)
        model = EDMVelocity(net, net_dtype=a.net_dtype, device=a.device)
        what = f"EDM checkpoint {a.network}"
        net = model.net if hasattr(model, "net") else None
    else:
        net = StandInPrecond(preset, seed=a.seed).eval().to(dev)
        params = sum(q.numel() for q in net.parameters())
        model = EDMVelocity(net, net_dtype=a.net_dtype, device=dev)
        what = (f"stand-in diffusers UNet2DModel preset={preset} ({params / 1e6:.1f}M params, random weights; "
                f"NFE counts are not a trained model's)")
    hardware = torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    log(f"# {what}; T={steps}; eps={a.eps}; batches={batch_sizes}; (K,L)={configs}; event={model.event_shape}")
    report = {"what": what, "device": str(dev), "hardware": hardware, "torch": torch.__version__,
              "date": time.strftime("%Y-%m-%d", time.gmtime()), "steps": steps, "eps": a.eps, "tiny": a.tiny}
    with torch.no_grad():
        report["wallclock"] = run(model, batch_sizes=batch_sizes, configs=configs, steps=steps, eps=a.eps,
                                  max_batch=a.max_batch, seed=a.seed, progress=log)
    log("# batched-call cost")
    sizes = (1, 2, 4, 8) if a.tiny else (1, 2, 4, 8, 16, 32, 64, 128, 256, 340)
    report["batch_cost"] = batch_cost(model, sizes)
    log("# exactness in float32")
    report["exactness_f32"] = exactness_f32(dev, n=2000 if a.tiny else 20000, dim=48 if a.tiny else 3072, seed=a.seed)
    log("# exactness under bfloat16 autocast")
    bf16 = EDMVelocity(net, net_dtype="bfloat16", device=dev) if net is not None else model
    report["exactness_bf16"] = exactness_bf16(bf16, n=120 if a.tiny else 512, steps=6 if a.tiny else 8, seed=a.seed)
    report["seconds"] = time.perf_counter() - t_start
    _print_table(report)
    with open(a.json, "w") as f:
        json.dump(report, f, indent=2)
    print(f"# wrote {a.json} ({report['seconds']:.0f} s)")
    if a.csv:
        import pandas as pd

        pd.DataFrame(report["wallclock"]).to_csv(a.csv, index=False)
    ok = all(math.isfinite(r["wall_s"]) for r in report["wallclock"])
    ok &= all(min(r["p_parallel"], r["p_orthogonal"]) > P_MIN for r in report["exactness_f32"])
    ok &= all(r["min_p"] > P_MIN for r in report["exactness_bf16"])
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
