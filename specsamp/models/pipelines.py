"""A diffusers pipeline's network as a velocity model: its prompts encoded, its network called on its own state.

What both the runner's ``model=diffusers`` (:mod:`specsamp.models.diffusers_pipeline`) and the diffusers entry
point (:mod:`specsamp.integrations.diffusers`) drive: :func:`encode` (the pipeline's own ``encode_prompt``),
:func:`network_call`, :func:`velocity_model` (the network on a :class:`~specsamp.schedulers.SchedulerPlan`'s
timesteps, in its coordinates and prediction) and :func:`rows_of`. ``kind`` is ``ddpm``, ``sd`` or ``sd3``
(``DDPMPipeline``, ``StableDiffusionPipeline``, ``StableDiffusion3Pipeline``). diffusers itself is not imported.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .parametrisation import GridTimesteps, Guided, Parametrised

if TYPE_CHECKING:
    from ..schedulers import SchedulerPlan


def net_dtype_device(module) -> tuple[torch.dtype, torch.device]:
    """``(dtype, device)`` of a network module (its first parameter's where the module does not say)."""
    p = next(iter(module.parameters()))
    return getattr(module, "dtype", p.dtype), torch.device(getattr(module, "device", p.device))


@dataclass
class Conditioning:
    """A batch's encoded prompts, one row per image (``None`` where the network takes none).

    Attributes:
        embeds: ``[M, S, D]`` the conditional text states (``encoder_hidden_states``).
        negative: ``[M, S, D]`` the unconditional ones (guidance only).
        pooled, negative_pooled: ``[M, P]`` SD3's pooled projections.
    """

    embeds: torch.Tensor | None = None
    negative: torch.Tensor | None = None
    pooled: torch.Tensor | None = None
    negative_pooled: torch.Tensor | None = None


def network_call(pipe, kind: str, cond: Conditioning):
    """``net(y, t, row, guide=None)``: the pipeline's network on its own state ``y`` at timesteps ``t``, image
    ``row``'s text (the unconditional text where ``guide == 0``)."""
    if kind == "ddpm":
        unet = pipe.unet

        def net(y, t, row=None):
            return unet(y, t).sample

        return net

    def pick(pos, neg, row, guide):
        if guide is None:
            return pos[row]
        g = guide.reshape((-1,) + (1,) * (pos.ndim - 1)).bool()
        return torch.where(g, pos[row], neg[row] if neg.shape[0] != 1 else neg.expand((row.numel(),) + neg.shape[1:]))

    if kind == "sd":
        unet = pipe.unet

        def net(y, t, row, guide=None):
            return unet(y, t, encoder_hidden_states=pick(cond.embeds, cond.negative, row, guide), return_dict=False)[0]

        return net

    transformer = pipe.transformer

    def net(y, t, row, guide=None):
        return transformer(
            hidden_states=y,
            timestep=t,
            encoder_hidden_states=pick(cond.embeds, cond.negative, row, guide),
            pooled_projections=pick(cond.pooled, cond.negative_pooled, row, guide),
            return_dict=False,
        )[0]

    return net


def velocity_model(
    pipe,
    kind: str,
    plan: SchedulerPlan,
    cond: Conditioning,
    event_shape,
    guidance_scale: float,
    dtype: torch.dtype = torch.float32,
):
    """The pipeline's network as the velocity model of ``plan``: :class:`Parametrised` on the plan's timesteps,
    wrapped in :class:`Guided` when ``guidance_scale > 1`` (its calls then take ``guide [b]``: 1 on every
    row, which the guided call doubles into ``[0 (unconditional); 1 (conditional)]``). Its calls take ``row [b]``,
    the image's row of ``cond`` (none for ``ddpm``). ``model.device`` is the network's device."""
    module = pipe.unet if kind != "sd3" else pipe.transformer
    net_dtype, device = net_dtype_device(module)
    model = Parametrised(
        network_call(pipe, kind, cond),
        plan.prediction,
        plan.coords,
        event_shape,
        dtype,
        time=GridTimesteps(plan.schedule.sigmas, plan.timesteps),
        net_dtype=net_dtype,
    )
    model.device = device
    if kind != "ddpm" and guidance_scale > 1:
        model = Guided(model, guidance_scale, torch.zeros(1, dtype=torch.long, device=device), cond_key="guide")
        model.device = device
    return model


def rows_of(model, rows: torch.Tensor) -> dict:
    """The conditioning ``{"row", "guide"}`` of images whose text is row ``rows [M]`` of the model's table."""
    cond = {"row": rows.to(model.device)}
    if isinstance(model, Guided):
        cond["guide"] = torch.ones_like(cond["row"])
    return cond


def encode(
    pipe,
    kind: str,
    prompt,
    negative_prompt,
    guided: bool,
    images_per_prompt: int = 1,
    *,
    clip_skip=None,
    max_sequence_length: int = 256,
    extra: dict | None = None,
) -> Conditioning:
    """The prompts encoded by the pipeline's own ``encode_prompt`` (one row per image, prompt-major, as the
    pipeline repeats them), the negative ones when ``guided``."""
    device = pipe._execution_device
    if kind == "sd":
        embeds, negative = pipe.encode_prompt(
            prompt, device, images_per_prompt, guided, negative_prompt, clip_skip=clip_skip
        )
        return Conditioning(embeds, negative)
    extra = {"prompt_2": None, "prompt_3": None, **(extra or {})}  # None: the first prompt for every encoder
    e, n, p, np_ = pipe.encode_prompt(
        prompt=prompt,
        negative_prompt=negative_prompt,
        do_classifier_free_guidance=guided,
        device=device,
        clip_skip=clip_skip,
        num_images_per_prompt=images_per_prompt,
        max_sequence_length=max_sequence_length,
        **extra,
    )
    return Conditioning(e, n, p, np_)


__all__ = ["Conditioning", "encode", "net_dtype_device", "network_call", "rows_of", "velocity_model"]
