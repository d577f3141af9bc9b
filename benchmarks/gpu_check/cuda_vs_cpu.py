"""Section ``cuda_vs_cpu``: the same seed on the device and on the CPU, counts equal and samples close."""

from __future__ import annotations

import math

import torch

from benchmarks.gpu_check.harness import Context, section
from benchmarks.gpu_check.support import EPS, digits_velocity, run_arm
from specsamp.schedule import Schedule
from specsamp.trees import DraftTree


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


@section("cuda_vs_cpu")
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
        targets = [
            ("gmm d=500 float64", lambda d: GaussianMixture(500, 5, 0, dtype=torch.float64, device=d), 64),
            ("digits float32", lambda d: digits_velocity(d), 16),
        ]
        tree = {
            "name": "dgrs (2,3)",
            "tree": DraftTree.uniform(2, min(3, T - 2)),
            "coupling": "dgrs",
            "draft": "velocity",
        }
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
                out.append(
                    {
                        "target": name,
                        "arm": arm["name"],
                        "images": n,
                        "steps": T,
                        "counts_equal": int(same.sum()),
                        "max_abs_diff": float(diff.max()),
                        "max_abs_diff_counts_equal": float(diff[same].max()) if bool(same.any()) else None,
                        "rel": rel,
                        "probe_D": probe,
                        "probe_counts_equal": int(p_same.sum()),
                        "tol": tol,
                        "passed": bool(same.all()) and float(diff.max()) <= tol,
                    }
                )
            del m_dev, m_cpu
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = flags
    lines = [
        f"cuda_vs_cpu {r['target']} {r['arm']}: counts equal {r['counts_equal']}/{r['images']}, max |diff| "
        f"{r['max_abs_diff']:.3g} <= tol {r['tol']:.3g}: {'pass' if r['passed'] else 'FAIL'}"
        for r in out
        if "arm" in r
    ]
    return {
        "reference": "cpu",
        "device": str(dev),
        "trivial": dev.type == "cpu",
        "targets": out,
        "summary": lines,
        "passed": all(r.get("passed", False) for r in out),
    }
