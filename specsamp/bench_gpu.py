"""Wall-clock per image: standard sampler vs RMC (budget-matched chain) vs D-GRS, tree execution.

    python -m specsamp.bench_gpu --device cuda --batch-sizes 1,16,64,256 --csv bench.csv
    python -m specsamp.bench_gpu --device cpu --tiny          # CPU smoke run

For each batch size (images sampled together, one batched target call per round for all of them) and
each ``(K, L)`` of the paper's EDM grid {(2,3), (2,5), (3,4), (4,4)} (budgets B = 14, 62, 120, 340), it
times the standard Euler--Maruyama sampler, D-GRS on the uniform (K, L) tree and RMC on a chain of
length B (DESIGN.md ``rmc arm: match=budget``), all with ``execution="tree"`` (every drafted node in
one batched call: what runs on a GPU), and prints NFE and wall-clock speedups side by side.

Network. Without ``--network`` a stand-in of realistic size with *random weights* is used: a diffusers
``UNet2DModel`` with DDPM++-like widths (CIFAR-10 preset: 3 levels of 256 channels, 4 residual blocks
per level, self-attention at 16x16, 10-class embedding; ~59M parameters vs ~56M for EDM's DDPM++
CIFAR-10 net; FFHQ-64 preset: 128/256/256/256 channels, ~59M vs ~62M) behind EDM's preconditioning and
``EDMPrecond.forward(x, sigma, class_labels)`` signature. It measures the cost of a target call and of
the drafting/verification around it faithfully; acceptance rates (hence NFE counts) of random weights
are *not* those of a trained model. ``--network edm-cifar10-32x32-cond-vp`` (with ``--sha256`` or
``--trust-checkpoint``) times a real checkpoint instead.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import torch

from .models.edm import EDMVelocity, build_edm_model
from .sampler import sample_speculative, sample_standard
from .schedule import Schedule
from .trees import DraftTree, budget

PAPER_CONFIGS = ((2, 3), (2, 5), (3, 4), (4, 4))

STAND_INS = {
    # DDPM++-like widths for CIFAR-10 32x32 (EDM: model_channels=128, channel_mult=[2,2,2], 4 blocks, attn at 16)
    "cifar10": dict(
        sample_size=32, block_out_channels=(256, 256, 256), layers_per_block=4, label_dim=10,
        down_block_types=("DownBlock2D", "AttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "AttnUpBlock2D", "UpBlock2D"),
    ),
    # FFHQ 64x64 (EDM: channel_mult=[1,2,2,2], attn at 16)
    "ffhq64": dict(
        sample_size=64, block_out_channels=(128, 256, 256, 256), layers_per_block=4, label_dim=0,
        down_block_types=("DownBlock2D", "DownBlock2D", "AttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "AttnUpBlock2D", "UpBlock2D", "UpBlock2D"),
    ),
    "tiny": dict(
        sample_size=4, block_out_channels=(8, 8), layers_per_block=1, label_dim=10, norm_num_groups=4,
        down_block_types=("DownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "UpBlock2D"),
    ),
}


class StandInPrecond(torch.nn.Module):
    """EDM preconditioning (Karras et al. 2022, Table 1) around a diffusers ``UNet2DModel``.

    ``D(x; s) = c_skip x + c_out F(c_in x; c_noise, label)`` with ``sigma_data = 0.5``; the forward
    signature is ``EDMPrecond``'s (``x [b, C, H, W]``, ``sigma [b]``, one-hot ``class_labels [b, label_dim]``).
    """

    def __init__(self, preset: str = "cifar10", sigma_data: float = 0.5, seed: int = 0):
        super().__init__()
        from diffusers import UNet2DModel

        if preset not in STAND_INS:
            raise ValueError(f"preset={preset!r} is invalid; valid: {sorted(STAND_INS)}")
        cfg = dict(STAND_INS[preset])
        self.label_dim = int(cfg.pop("label_dim"))
        self.img_resolution = int(cfg["sample_size"])
        self.img_channels = 3
        self.sigma_data = float(sigma_data)
        torch.manual_seed(seed)
        self.unet = UNet2DModel(in_channels=3, out_channels=3, num_class_embeds=self.label_dim or None, **cfg)

    def forward(self, x, sigma, class_labels=None, **kwargs):
        x = x.to(torch.float32)
        s = sigma.to(torch.float32).reshape(-1, 1, 1, 1)
        sd = self.sigma_data
        c_skip = sd**2 / (s**2 + sd**2)
        c_out = s * sd / (s**2 + sd**2).sqrt()
        c_in = 1 / (sd**2 + s**2).sqrt()
        c_noise = s.reshape(-1).log() / 4
        labels = class_labels.argmax(1) if (self.label_dim and class_labels is not None) else None
        f = self.unet(c_in * x, c_noise, class_labels=labels).sample
        return c_skip * x + c_out * f.to(torch.float32)


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
        batch_calls, nfe_speedup, batch_speedup, rows_per_image, wall_speedup``.
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
        "calls_mean": float(res.calls.double().mean()),
        "batch_calls": int(res.batch_calls),
        "nfe_speedup": float(res.speedup.mean()),
        "batch_speedup": float(res.batch_speedup),
        "rows_per_image": float(res.target_rows.double().mean()),
        "wall_speedup": base / wall,
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


def main(argv=None) -> int:
    """Command line entry point (see the module docstring)."""
    p = argparse.ArgumentParser(prog="python -m specsamp.bench_gpu", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true", help="tiny stand-in, T=6, batches 1,2: a CPU smoke run")
    p.add_argument("--arch", default="cifar10", choices=sorted(STAND_INS), help="stand-in preset")
    p.add_argument("--network", default=None, help="real EDM checkpoint (name, URL or path) instead of the stand-in")
    p.add_argument("--sha256", default=None)
    p.add_argument("--trust-checkpoint", action="store_true")
    p.add_argument("--batch-sizes", type=_ints, default=None, help="default 1,16,64,256 (tiny: 1,2)")
    p.add_argument("--configs", type=_configs, default=None, help="KxL list, default 2x3,2x5,3x4,4x4")
    p.add_argument("--steps", type=int, default=None, help="T (default 100; tiny: 6)")
    p.add_argument("--eps", type=float, default=0.3)
    p.add_argument("--max-batch", type=int, default=None, help="rows per forward pass")
    p.add_argument("--net-dtype", default=None, help="autocast dtype of the network: bfloat16/float16")
    p.add_argument("--tf32", action="store_true", help="allow TF32 matmuls/convolutions on CUDA")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--csv", default=None, help="write the table here")
    a = p.parse_args(argv)

    dev = torch.device(a.device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            p.error("--device cuda requested but CUDA is not available; use --device cpu")
        torch.backends.cudnn.benchmark = True
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = bool(a.tf32)
    steps = a.steps or (6 if a.tiny else 100)
    batch_sizes = a.batch_sizes or ([1, 2] if a.tiny else [1, 16, 64, 256])
    configs = a.configs or list(PAPER_CONFIGS)
    if a.network:
        model = build_edm_model({"name" if not any(c in a.network for c in "/.") else "path": a.network,
                                 "sha256": a.sha256, "trust_checkpoint": a.trust_checkpoint,
                                 "device": a.device, "net_dtype": a.net_dtype})
        what = f"EDM checkpoint {a.network}"
    else:
        preset = "tiny" if a.tiny else a.arch
        net = StandInPrecond(preset, seed=a.seed)
        params = sum(q.numel() for q in net.parameters())
        model = EDMVelocity(net, net_dtype=a.net_dtype, device=dev)
        what = (f"stand-in diffusers UNet2DModel preset={preset} ({params / 1e6:.1f}M params, random weights; "
                f"NFE counts are not a trained model's)")
    print(f"# {what}; device={dev}; T={steps}; eps={a.eps}; batches={batch_sizes}; (K,L)={configs}; "
          f"max_batch={a.max_batch}; event={model.event_shape}", flush=True)
    rows = run(model, batch_sizes=batch_sizes, configs=configs, steps=steps, eps=a.eps, max_batch=a.max_batch,
               seed=a.seed, progress=lambda s: print(s, file=sys.stderr, flush=True))
    import pandas as pd

    df = pd.DataFrame(rows)
    with pd.option_context("display.width", 200, "display.max_columns", 20, "display.float_format", "{:.4g}".format):
        print(df.to_string(index=False))
    if a.csv:
        df.to_csv(a.csv, index=False)
        print(f"# wrote {a.csv}")
    return 0 if all(math.isfinite(r["wall_s"]) for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
