"""The diffusers pipelines' call arguments, checked before any network call, and their network's name for ``auto``'s
cache: what :mod:`specsamp.integrations.diffusers` reads of a call besides the loop."""

from __future__ import annotations

import torch

from .. import arguments
from ..rng import MAX_SEED


def network_name(pipe, kind: str) -> str:
    """The pipeline's network as ``auto`` caches its cost curve and profile: its class and where it was loaded from."""
    net = pipe.unet if kind != "sd3" else pipe.transformer
    where = getattr(getattr(net, "config", None), "_name_or_path", "") or ""
    return f"{type(net).__module__}.{type(net).__qualname__}({where})"


def check_call(a: dict) -> dict:
    """The call's arguments that every kind reads, checked before any network call (the kinds check their sizes)."""
    if a.get("seed") is not None:
        arguments.integer("seed", a["seed"], 0, MAX_SEED)
    g = a.get("generator")
    if not (
        g is None
        or isinstance(g, torch.Generator)
        or (isinstance(g, list) and g and all(isinstance(x, torch.Generator) for x in g))
    ):
        raise arguments.refuse("generator", g, "must be a torch.Generator, a list of them (one per image), or None")
    arguments.flag("return_dict", a.get("return_dict", True))
    valid = OUTPUT_TYPES["ddpm" if "batch_size" in a else "text"]
    if a.get("output_type") not in valid:
        raise arguments.refuse("output_type", a.get("output_type"), f"must be one of {', '.join(valid)}")
    for key in ("negative_prompt", "prompt_2", "prompt_3", "negative_prompt_2", "negative_prompt_3"):
        v = a.get(key)
        if not (v is None or isinstance(v, str) or (isinstance(v, list) and all(isinstance(x, str) for x in v))):
            raise arguments.refuse(key, v, "must be a string, a list of strings, or None")
    if a.get("clip_skip") is not None:
        arguments.integer("clip_skip", a["clip_skip"], 0)
    if a.get("mu") is not None:
        arguments.number("mu", a["mu"])
    if "max_sequence_length" in a:
        arguments.integer("max_sequence_length", a["max_sequence_length"], 1, 512)
    if "guidance_rescale" in a:
        arguments.number("guidance_rescale", a["guidance_rescale"])
    return a


OUTPUT_TYPES = {"ddpm": ("pil", "np", "pt"), "text": ("pil", "np", "pt", "latent")}
"""The ``output_type`` values each kind's pipeline returns."""
