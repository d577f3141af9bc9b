"""Golden compare: the same configurations run at two commits give the same bytes.

A refactor of the round, the kernel or the runner must not change one sample or one count. This runs a
fixed list of ``python run.py ... save_samples=true`` configurations (``CONFIGS``: the Gaussian mixture
with every coupling, both executions, every tree rule, markmax, both dtypes, ``refine=1``, each prefetch,
a shifted grid and every draft; the digits network with D-GRS, RMC, standard and the x0 lever; patches32)
and compares each record, minus what may differ between two runs (``VOLATILE``: wall times, versions,
output paths), and each ``samples.pt`` tensor for bitwise equality.

    python -m benchmarks.golden run DIR                 # run every configuration here, outputs in DIR/NAME/
    python -m benchmarks.golden compare DIR_A DIR_B     # exit 1 and list what differs
    python -m benchmarks.golden against REV [--keep D]  # run at git revision REV (a temporary worktree)
                                                        # and in this checkout, then compare

``--only NAME[,NAME]`` restricts ``run`` and ``against`` to some configurations. A full ``against`` takes
about 3 minutes on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

_GMM = ["model=gmm", "n_samples=8"]
_DIGITS = ["model=digits", "n_samples=4"]

#: name -> overrides of ``run.py`` (``save_samples=true`` and the output directory are added).
CONFIGS: dict[str, list[str]] = {
    "gmm_dgrs_path": [*_GMM, "sampler=dgrs"],
    "gmm_dgrs_tree": [*_GMM, "sampler=dgrs", "execution=tree"],
    "gmm_rmc_path": [*_GMM, "sampler=rmc"],
    "gmm_rmc_tree": [*_GMM, "sampler=rmc", "execution=tree"],
    "gmm_standard": [*_GMM, "sampler=standard"],
    "gmm_markmax": [*_GMM, "sampler=markmax", "execution=tree"],
    "gmm_markmax_path": [*_GMM, "sampler=markmax", "K=3", "L=2"],
    "gmm_k3l2": [*_GMM, "sampler=dgrs", "K=3", "L=2"],
    "gmm_widths": [*_GMM, "tree=widths", "widths=[3,2,1]", "execution=tree"],
    "gmm_optimal_profile": [*_GMM, "tree=optimal", "budget=20", "delta_profile=gmm_velocity"],
    "gmm_optimal_calibrated": [*_GMM, "tree=optimal", "budget=10", "execution=tree"],
    "gmm_optimal_per_step": [
        *_GMM,
        "draft=x0_extrap_gated",
        "tree=optimal_per_step",
        "budget=20",
        "delta_profile=gmm_x0_extrap_gated",
        "execution=tree",
    ],
    "gmm_float32": [*_GMM, "model.dtype=float32", "execution=tree"],
    "gmm_refine1": [*_GMM, "refine=1", "execution=tree"],
    "gmm_prefetch_parent": [*_GMM, "prefetch=parent", "execution=tree"],
    "gmm_prefetch_none_leaves": [*_GMM, "prefetch=none", "evaluate_leaves=false", "warmup=step0"],
    "gmm_shift3": [*_GMM, "model.shift=3.0", "steps=20"],
    "gmm_x0_path": [*_GMM, "draft=x0"],
    "gmm_x0_extrap_tree": [*_GMM, "draft=x0_extrap", "execution=tree", "batch_size=3"],
    "gmm_x0_affine": [*_GMM, "draft=x0_affine", "execution=tree"],
    "gmm_drift_rmc": [*_GMM, "draft=drift", "sampler=rmc", "max_batch=4", "execution=tree"],
    "digits_dgrs": [*_DIGITS, "sampler=dgrs", "execution=tree"],
    "digits_rmc14": [*_DIGITS, "sampler=rmc", "L=14", "K=1", "execution=tree"],
    "digits_standard": [*_DIGITS, "sampler=standard"],
    "digits_x0_optimal14": [
        *_DIGITS,
        "draft=x0",
        "tree=optimal",
        "budget=14",
        "delta_profile=edm-digits-8x8-cond_x0",
        "execution=tree",
    ],
    "digits_float64_path": [*_DIGITS, "model.dtype=float64", "sampler=dgrs"],
    "patches32_dgrs": ["model=patches32", "n_samples=2", "sampler=dgrs", "execution=tree"],
}

#: record keys whose values may differ between two runs of one configuration
VOLATILE = {"wall_seconds", "versions", "output_dir", "timings", "seconds", "started", "finished", "host"}


def _strip(obj):
    if isinstance(obj, dict):
        return {k: _strip(v) for k, v in obj.items() if k not in VOLATILE and not k.endswith("_seconds")}
    if isinstance(obj, list):
        return [_strip(v) for v in obj]
    return obj


def run(out: Path, names: list[str], cwd: Path = ROOT) -> None:
    """Run each named configuration with the ``run.py`` in ``cwd``; outputs in ``out/NAME/``."""
    env = dict(os.environ, PYTHONPATH=str(cwd), WANDB_MODE="offline")
    for name in names:
        target = out / name
        cmd = [
            sys.executable,
            "run.py",
            *CONFIGS[name],
            "save_samples=true",
            "progress=false",
            f"hydra.run.dir={target}",
        ]
        done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
        status = "ok" if done.returncode == 0 else f"exit {done.returncode}"
        print(f"{name:28s} {status}  {done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ''}", flush=True)
        if done.returncode != 0:
            target.mkdir(parents=True, exist_ok=True)
            (target / "stderr.txt").write_text(done.stderr)


def compare(a: Path, b: Path, names: list[str] | None = None) -> list[str]:
    """What differs between two ``run`` outputs: a list of one-line descriptions (empty: identical)."""
    names = names or sorted({p.name for p in a.iterdir() if p.is_dir()} | {p.name for p in b.iterdir() if p.is_dir()})
    diffs = []
    for name in names:
        ra, rb = a / name / "result.json", b / name / "result.json"
        if not (ra.exists() and rb.exists()):
            diffs.append(f"{name}: result.json missing in {'A' if not ra.exists() else 'B'}")
            continue
        ja, jb = _strip(json.loads(ra.read_text())), _strip(json.loads(rb.read_text()))
        if ja != jb:
            keys = sorted(k for k in set(ja) | set(jb) if ja.get(k) != jb.get(k))
            diffs.append(f"{name}: record differs in {keys}")
        sa, sb = a / name / "samples.pt", b / name / "samples.pt"
        if sa.exists() != sb.exists():
            diffs.append(f"{name}: samples.pt only in {'A' if sa.exists() else 'B'}")
        elif sa.exists():
            ta, tb = torch.load(sa, map_location="cpu"), torch.load(sb, map_location="cpu")
            if not _tensors_equal(ta, tb):
                diffs.append(f"{name}: samples.pt differs")
    return diffs


def _tensors_equal(a, b) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):  # bitwise: NaN and -0.0 included
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        return torch.equal(a.contiguous().flatten().view(torch.uint8), b.contiguous().flatten().view(torch.uint8))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_tensors_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_tensors_equal(x, y) for x, y in zip(a, b))
    return a == b


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.golden", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_run = sub.add_parser("run")
    p_run.add_argument("out", type=Path)
    p_cmp = sub.add_parser("compare")
    p_cmp.add_argument("a", type=Path)
    p_cmp.add_argument("b", type=Path)
    p_ag = sub.add_parser("against")
    p_ag.add_argument("rev")
    p_ag.add_argument("--keep", type=Path, default=None, help="keep both runs' outputs here")
    for p in (p_run, p_ag):
        p.add_argument("--only", default=None, help="comma-separated configuration names")
    args = parser.parse_args(argv)
    if args.command == "compare":
        diffs = compare(args.a, args.b)
        print("\n".join(diffs) if diffs else "identical")
        return 1 if diffs else 0
    names = args.only.split(",") if args.only else list(CONFIGS)
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        print(f"--only: unknown configuration(s) {unknown}; valid: {', '.join(CONFIGS)}", file=sys.stderr)
        return 2
    if args.command == "run":
        run(args.out, names)
        return 0
    base = args.keep or Path(tempfile.mkdtemp(prefix="golden-"))
    tree = base / "worktree"
    subprocess.run(
        ["git", "worktree", "add", "--detach", str(tree), args.rev], cwd=ROOT, check=True, capture_output=True
    )
    try:
        print(f"-- at {args.rev}", flush=True)
        run(base / "before", names, cwd=tree)
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, capture_output=True)
    print("-- this checkout", flush=True)
    run(base / "after", names)
    diffs = compare(base / "before", base / "after", names)
    print("\n".join(diffs) if diffs else f"identical: {len(names)} configurations ({base})")
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main())
