"""Tiny, randomly initialised diffusers pipelines built offline (no hub access), in seconds.

- :func:`tiny_ddpm`: ``DDPMPipeline`` with an attention-free ``UNet2DModel`` on 3 x 8 x 8 images;
- :func:`tiny_sd`: ``StableDiffusionPipeline`` with a ``UNet2DConditionModel`` (one cross-attention block) on
  4 x 8 x 8 latents, a two-layer ``CLIPTextModel``, the hand-written CLIP tokenizer of :mod:`tiny_sd3` and an
  ``AutoencoderKL`` of factor 2 (16 x 16 images); no safety checker;
- :func:`tiny_sd3` (the SD3 pipeline of :mod:`tiny_sd3`) with the stochastic flow scheduler;
- :func:`save_pipeline`: a pipeline written as a diffusers folder, weights as safetensors only.

Random weights make a valid network at every timestep: the samplers only need some function of the state.
``python tests/tiny_diffusers.py KIND DIR`` writes one (KIND: ddpm, sd, sd3).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import torch
from tiny_sd3 import tiny_tokenizer, write_tokenizer_files

IMAGE = 8  # DDPM image side; SD latent side (image 16)
TEXT_HIDDEN = 8


def tiny_unet2d(seed: int = 0):
    """An attention-free ``UNet2DModel`` on 3 x 8 x 8 images (two levels, widths 8 and 16)."""
    from diffusers import UNet2DModel

    torch.manual_seed(seed)
    return UNet2DModel(
        sample_size=IMAGE,
        in_channels=3,
        out_channels=3,
        layers_per_block=1,
        block_out_channels=(8, 16),
        down_block_types=("DownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "UpBlock2D"),
        norm_num_groups=4,
    ).eval()


def tiny_ddpm(seed: int = 0, **scheduler):
    """``DDPMPipeline`` on :func:`tiny_unet2d` with ``DDPMScheduler(**scheduler)`` (diffusers' defaults otherwise:
    1000 training steps, linear betas, clip_sample=True)."""
    from diffusers import DDPMPipeline, DDPMScheduler

    return DDPMPipeline(unet=tiny_unet2d(seed), scheduler=DDPMScheduler(**scheduler))


def tiny_text_encoder(seed: int = 2):
    """A two-layer ``CLIPTextModel`` of width 8 over the tokenizer's vocabulary."""
    from tiny_sd3 import clip_vocab
    from transformers import CLIPTextConfig, CLIPTextModel

    vocab, _ = clip_vocab()
    cfg = CLIPTextConfig(
        vocab_size=len(vocab),
        hidden_size=TEXT_HIDDEN,
        intermediate_size=2 * TEXT_HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=77,
        hidden_act="quick_gelu",
        bos_token_id=vocab["<|startoftext|>"],
        eos_token_id=vocab["<|endoftext|>"],
        pad_token_id=vocab["<|endoftext|>"],
    )
    torch.manual_seed(seed)
    return CLIPTextModel(cfg).eval()


def tiny_unet_cond(seed: int = 0):
    """``UNet2DConditionModel`` on 4 x 8 x 8 latents, cross-attending to width-8 text states."""
    from diffusers import UNet2DConditionModel

    torch.manual_seed(seed)
    return UNet2DConditionModel(
        sample_size=IMAGE,
        in_channels=4,
        out_channels=4,
        layers_per_block=1,
        block_out_channels=(8, 16),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=TEXT_HIDDEN,
        attention_head_dim=2,
        norm_num_groups=4,
    ).eval()


def tiny_vae(seed: int = 1):
    """``AutoencoderKL`` of factor 2 with 4 latent channels and SD's scaling factor."""
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        block_out_channels=(8, 8),
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=4,
        sample_size=2 * IMAGE,
        scaling_factor=0.18215,
    ).eval()


def tiny_sd(scheduler: str = "ddpm", prediction_type: str = "epsilon", seed: int = 0):
    """``StableDiffusionPipeline`` of tiny parts under ``DDPMScheduler`` (``scheduler="ddpm"``) or
    ``EulerAncestralDiscreteScheduler`` (``"euler_ancestral"``), SD's scaled-linear betas, ``prediction_type``."""
    from diffusers import DDPMScheduler, EulerAncestralDiscreteScheduler, StableDiffusionPipeline

    cls = {"ddpm": DDPMScheduler, "euler_ancestral": EulerAncestralDiscreteScheduler}[scheduler]
    extra = {"clip_sample": False} if scheduler == "ddpm" else {}
    sch = cls(
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        prediction_type=prediction_type,
        steps_offset=1,
        timestep_spacing="leading",
        **extra,
    )
    return StableDiffusionPipeline(
        vae=tiny_vae(),
        text_encoder=tiny_text_encoder(),
        tokenizer=tiny_tokenizer(),
        unet=tiny_unet_cond(seed),
        scheduler=sch,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )


def tiny_sd3(stochastic: bool = True):
    """:func:`tiny_sd3.tiny_pipeline` with ``FlowMatchEulerDiscreteScheduler(shift=3, stochastic_sampling=...)``."""
    import tiny_sd3 as sd3
    from diffusers import FlowMatchEulerDiscreteScheduler

    pipe = sd3.tiny_pipeline()
    pipe.scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, stochastic_sampling=stochastic)
    return pipe


BUILDERS = {"ddpm": tiny_ddpm, "sd": tiny_sd, "sd3": tiny_sd3}


def save_pipeline(pipe, directory: str | Path) -> Path:
    """``pipe.save_pretrained(directory, safe_serialization=True)``: weights as ``*.safetensors`` only; the
    CLIP tokenizer folders rewritten by hand in the hub repositories' layout (:func:`tiny_sd3.write_tokenizer_files`)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    pipe.save_pretrained(directory, safe_serialization=True)
    for sub, pad in (("tokenizer", "<|endoftext|>"), ("tokenizer_2", "!")):
        if (directory / sub).is_dir():
            shutil.rmtree(directory / sub)
            write_tokenizer_files(directory / sub, pad)
    return directory


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in BUILDERS:
        sys.exit(f"usage: python tests/tiny_diffusers.py {{{','.join(BUILDERS)}}} DIR")
    print(save_pipeline(BUILDERS[sys.argv[1]](), sys.argv[2]))
