"""Section ``laws``: every registered coupling's law on the device, and the sampler under bfloat16 autocast."""

from __future__ import annotations

import torch

from benchmarks.gpu_check.harness import Context, section
from benchmarks.gpu_check.support import EPS, digits_velocity, run_arm
from specsamp.schedule import Schedule
from specsamp.trees import DraftTree

P_MIN = 1e-4  # a law check passes when every KS p-value is above this (about 30 p-values: ~0.3% false alarms)


@section("laws")
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
            coup.append(
                {
                    "rule": name,
                    "K": K,
                    "delta": delta,
                    "p_parallel": float(stats.kstest((z @ e).numpy(), "norm").pvalue),
                    "p_orthogonal": float(stats.kstest((z @ w).numpy(), "norm").pvalue),
                    "acceptance": float(v.accepted.float().mean()),
                }
            )
            del kids, v
    m = 120 if ctx.tiny else 512
    model = digits_velocity(dev, "bfloat16")
    sched = Schedule.make(6 if ctx.tiny else 8, EPS)
    ref = run_arm(model, {"tree": None}, sched, m, ctx.seed + 1).samples.double().cpu().reshape(m, -1)
    bf = []
    for arm in (
        {"name": "dgrs (2,3)", "tree": DraftTree.uniform(2, 3), "coupling": "dgrs", "draft": "velocity"},
        {
            "name": "rmc chain 14",
            "tree": DraftTree.chain(min(14, sched.steps - 2)),
            "coupling": "rmc",
            "draft": "velocity",
        },
    ):
        x = run_arm(model, arm, sched, m, ctx.seed + 2).samples.double().cpu().reshape(m, -1)
        gp = torch.Generator().manual_seed(ctx.seed)
        ps = []
        for _ in range(3):
            u = torch.randn(x.shape[1], generator=gp, dtype=torch.float64)
            ps.append(float(stats.ks_2samp((x @ u).numpy(), (ref @ u).numpy()).pvalue))
        bf.append({"arm": arm["name"], "n": m, "p_values": ps, "min_p": min(ps)})
    passed = all(min(r["p_parallel"], r["p_orthogonal"]) > P_MIN for r in coup) and all(r["min_p"] > P_MIN for r in bf)
    lines = [
        f"laws: {len(coup)} coupling checks, smallest KS p "
        f"{min(min(r['p_parallel'], r['p_orthogonal']) for r in coup):.3g}; bfloat16 sampler smallest p "
        f"{min(r['min_p'] for r in bf):.3g}; {'pass' if passed else 'FAIL'} (p > {P_MIN:g})"
    ]
    return {"couplings": coup, "bf16": bf, "p_min": P_MIN, "summary": lines, "passed": passed}
