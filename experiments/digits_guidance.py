"""Does classifier-free guidance work on the label-dropout digits network? ``python -m experiments.digits_guidance``.

For each guidance scale ``w`` (0: the unconditional branch, 1: the conditional one alone, then 3, 5, 7), ``--per-class``
images of each class are drawn with k-diffusion's Euler ancestral loop (:func:`benchmarks.presets.loop_euler_a`, 25
Karras steps, seed 0) from ``model=digits_cfg`` at ``model.guidance=w`` and labelled by the shipped digits classifier;
printed and written (``--out``): the share of images classified as their class, per class and over all. Guidance
works when that share rises with ``w``.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch


def accuracy(w: float, per_class: int, steps: int = 25, seed: int = 0) -> dict:
    """``{"w", "overall", "per_class": [10]}``: classifier accuracy of guided samples against their labels."""
    from benchmarks.presets import VEDenoiser, karras_sigmas, loop_euler_a
    from specsamp.models.digits import load_classifier
    from specsamp.models.guided import one_hot_labels
    from specsamp.runner import build_target, compose, load_config

    model = build_target(load_config(compose(["model=digits_cfg", f"model.guidance={w}"]))[0]).model
    labels = torch.arange(10).repeat_interleave(per_class)
    gen = torch.Generator().manual_seed(seed)
    sigmas = karras_sigmas(steps)
    x = torch.randn((labels.numel(), 1, 8, 8), generator=gen) * float(sigmas[0])
    with torch.no_grad():
        out = loop_euler_a(VEDenoiser(model), x, sigmas.float(), {"class_labels": one_hot_labels(labels, 10)}, gen)
        pred = load_classifier()(out.clamp(-1, 1))[1].argmax(1)
    hit = (pred == labels).float()
    return {"w": w, "overall": float(hit.mean()), "per_class": [round(float(h), 3) for h in hit.view(10, -1).mean(1)]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.digits_guidance", description=__doc__.split("\n\n")[0])
    ap.add_argument("--per-class", type=int, default=50)
    ap.add_argument("--w", default="0,1,3,5,7")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    for w in (float(v) for v in a.w.split(",")):
        rows.append(accuracy(w, a.per_class))
        r = rows[-1]
        print(f"w={w:g}: accuracy {r['overall']:.3f}, per class {r['per_class']}", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(
                {"per_class_images": a.per_class, "steps": 25, "sampler": "euler_a (k-diffusion loop)", "rows": rows},
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
