"""Stable Diffusion 3.5 medium as a target (paper section 5.3, appendix C.3).

- :mod:`.velocity`: :class:`SD3Velocity`, the transformer with classifier-free guidance as one velocity
  call (the change of variables is documented there).
- :mod:`.pipeline`: :func:`load_sd3` (fails fast when the gated weights are absent),
  :func:`encode_prompts` (once per prompt, up front), :func:`decode_latents` (chunked VAE decoding).
- :mod:`.prompts`: the prompt sets (COCO-2014 captions, a demo file, a text file) and the
  (prompt, noise) pairing every rule shares.
- :class:`SD3Config`: ``conf/model/sd3.yaml``'s schema and builder.

diffusers is imported lazily: importing this package needs only torch and numpy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from ...errors import ConfigError
from ..base import Target, TargetConfig, check_positive
from .pipeline import (
    DEFAULT_MODEL_ID,
    PromptEmbeddings,
    SD3UnavailableError,
    decode_latents,
    encode_prompts,
    free_text_encoders,
    load_sd3,
)
from .prompts import SOURCES, ImagePlan, image_plan, load_prompts
from .velocity import TIMESTEP_SCALE, SD3Velocity, _config_get

MAX_SEQUENCE_LENGTH = 512  # T5 tokens per prompt: the most the diffusers SD3 pipeline takes


@dataclass
class PromptsConfig:
    """``model.prompts``: which prompts (:func:`specsamp.models.sd3.prompts.load_prompts`).

    Attributes:
        source: ``coco`` (section 5.3: captions of distinct COCO-2014 val images), ``demo`` or ``file``.
        captions_json: path of ``captions_val2014.json`` (``coco``).
        n: number of prompts.
        seed: COCO selection seed.
        path: a prompt file, one per line (``file``).
    """

    source: str = "coco"
    captions_json: str | None = None
    n: int = 100
    seed: int = 0
    path: str | None = None


@dataclass
class ClipConfig:
    """``model.clip``: the CLIP model of ``metrics=[clip]`` (Table 1: ViT-L/14, OpenAI's QuickGELU weights).

    Attributes:
        model: open_clip config name, or ``local-dir:/path``.
        pretrained: open_clip tag (ignored with ``checkpoint`` or ``local-dir:``).
        checkpoint: a local weights file instead of the tag.
        quick_gelu: the activation the checkpoint was trained with, when the file does not tell.
        cache_dir: where the tag's weights are cached (null: the Hugging Face cache).
    """

    model: str = "ViT-L-14-quickgelu"
    pretrained: str | None = "openai"
    checkpoint: str | None = None
    quick_gelu: bool | None = None
    cache_dir: str | None = None

    def load_kwargs(self) -> dict:
        """Keyword arguments of :func:`specsamp.metrics.clip.load_clip` (all but ``device``)."""
        if not isinstance(self.model, str):
            raise ConfigError(
                f"model.clip.model={self.model!r} is invalid: name an open_clip model, e.g. ViT-L-14-quickgelu."
            )
        return {
            "model_name": self.model,
            "pretrained": self.pretrained,
            "checkpoint": self.checkpoint,
            "quick_gelu": self.quick_gelu,
            "cache_dir": self.cache_dir,
        }


@dataclass
class SD3Config(TargetConfig):
    """``conf/model/sd3.yaml``: SD3.5 medium through diffusers with guidance as one batched call per NFE.

    Attributes:
        model_id: hub id or a local diffusers directory.
        local_files_only: null: automatic (``HF_HUB_OFFLINE`` or an unreachable hub -> cache only).
        cache_dir: hub cache directory (null: the Hugging Face cache).
        drop_t5: load without T5-XXL (changes the prompt embeddings; not the paper's setting).
        resolution: image side, or ``[H, W]``; latent ``(16, H / 8, W / 8)``.
        guidance: classifier-free guidance scale ``w`` (7.0; 1 = none).
        negative_prompt: the unconditional prompt.
        max_sequence_length: T5 tokens.
        encode_batch: prompts per encoder call.
        free_text_encoders: drop the text encoders after encoding.
        net_dtype: dtype of the transformer, text encoders and VAE.
        max_batch: states per transformer forward (twice the rows with guidance); null: all at once.
        decode_chunk: latents per VAE call.
        images_per_prompt: images per prompt (noise ids ``0 .. n * images_per_prompt - 1``).
        prompts: :class:`PromptsConfig`.
        clip: :class:`ClipConfig`.
    """

    _target_: str = "specsamp.models.sd3.SD3Config"
    name: str = "sd3"
    model_id: str = DEFAULT_MODEL_ID
    local_files_only: bool | None = None
    cache_dir: str | None = None
    drop_t5: bool = False
    resolution: Any = 512
    guidance: float = 7.0
    negative_prompt: str = ""
    max_sequence_length: int = 256
    encode_batch: int = 16
    free_text_encoders: bool = True
    net_dtype: str = "bfloat16"
    max_batch: int | None = None
    decode_chunk: int = 4
    images_per_prompt: int = 1
    prompts: PromptsConfig = field(default_factory=PromptsConfig)
    clip: ClipConfig = field(default_factory=ClipConfig)
    shift: float = 3.0

    def rows_per_state(self) -> int:
        """Transformer rows per state: 2 under guidance (the conditional and unconditional halves of one call), 1 at
        ``guidance=1``."""
        return 1 if self.guidance == 1 else 2

    def build(self, device: str, *, pipeline=None, prompts=None) -> Target:
        """Load the pipeline, draw and encode the prompts, wrap the transformer in :class:`SD3Velocity`.

        The latent shape is ``(in_channels, H / f, W / f)`` with ``f = 2 ** (len(vae.config.block_out_channels)
        - 1)`` (16x64x64 at 512x512). Image ``i`` gets prompt ``i // images_per_prompt`` and noise id ``i``
        (:func:`image_plan`); the Target's ``indices`` are those noise ids and ``prompts_for(ids)`` their texts.

        Args:
            device: where the pipeline runs.
            pipeline: an already loaded pipeline (anything with ``transformer``, ``vae``, ``encode_prompt``).
            prompts: explicit prompt strings instead of ``prompts``.

        Raises:
            ConfigError: a bad value (named ``model.<key>=<value>``), a resolution the VAE and transformer
                cannot take.
            SD3UnavailableError: the weights cannot be loaded (:func:`load_sd3`).
            FileNotFoundError, ValueError: a missing or bad prompt source.
        """
        dtype, net_dtype = self.torch_dtype("dtype"), self.torch_dtype("net_dtype")
        res = self.resolution
        res = (
            [res, res]
            if isinstance(res, int) and not isinstance(res, bool)
            else list(res)
            if isinstance(res, (list, tuple))
            else None
        )
        if (
            res is None
            or len(res) != 2
            or not all(isinstance(r, int) and not isinstance(r, bool) and r > 0 for r in res)
        ):
            raise ConfigError(f"model.resolution={self.resolution!r} is invalid: need a positive int or [H, W].")
        check_positive("max_batch", self.max_batch, optional=True)
        for key in ("max_sequence_length", "encode_batch", "decode_chunk", "images_per_prompt"):
            check_positive(key, getattr(self, key))
        if self.max_sequence_length > MAX_SEQUENCE_LENGTH:  # the T5 prompts are padded to it: memory, not quality
            raise ConfigError(
                f"model.max_sequence_length={self.max_sequence_length} is invalid: must be an integer in "
                f"1..{MAX_SEQUENCE_LENGTH} (T5 tokens per prompt, padded to it; the diffusers SD3 pipeline "
                "takes at most 512; 256 by default)."
            )
        if (
            isinstance(self.guidance, bool)
            or not isinstance(self.guidance, (int, float))
            or not math.isfinite(self.guidance)
        ):
            raise ConfigError(
                f"model.guidance={self.guidance!r} is invalid: must be a finite number (7.0 in the paper, 1 = no guidance)."
            )
        if self.prompts.source not in SOURCES and prompts is None:
            raise ConfigError(
                f"model.prompts.source={self.prompts.source!r} is invalid: valid values are {', '.join(SOURCES)}."
            )
        clip = self.clip.load_kwargs()
        p = self.prompts
        texts = load_prompts(
            p.source, p.n, p.seed, captions_json=p.captions_json, path=p.path, prompts=prompts, n_key="n_samples"
        )  # model.prompts.n follows n_samples (conf/model/sd3.yaml)
        pipe = pipeline
        if pipe is None:
            pipe = load_sd3(
                self.model_id,
                device=device,
                dtype=net_dtype,
                local_files_only=self.local_files_only,
                cache_dir=self.cache_dir,
                drop_t5=self.drop_t5,
            )
        transformer, vae = pipe.transformer, pipe.vae
        f = 2 ** (len(vae.config.block_out_channels) - 1)
        patch = int(_config_get(transformer, "patch_size", 1) or 1)
        h, w = res
        if h % (f * patch) or w % (f * patch):
            raise ConfigError(
                f"model.resolution={res} is invalid: H and W must be multiples of {f * patch} "
                f"(VAE factor {f} x patch {patch})."
            )
        emb = encode_prompts(
            pipe,
            texts,
            self.negative_prompt,
            batch_size=self.encode_batch,
            max_sequence_length=self.max_sequence_length,
        )
        if self.free_text_encoders:
            free_text_encoders(pipe)
        model = SD3Velocity(
            transformer,
            **emb.as_kwargs(),
            guidance=float(self.guidance),
            latent_shape=(int(_config_get(transformer, "in_channels")), h // f, w // f),
            dtype=dtype,
            net_dtype=net_dtype,
            device=device,
        )
        plan = image_plan(texts, self.images_per_prompt)
        prompt_index = torch.as_tensor(plan.prompt_index, device=model.device)

        def cond_for(ids, seed):
            if int(ids.max()) >= prompt_index.numel():
                raise ConfigError(
                    f"n_samples is invalid: the prompt plan has {prompt_index.numel()} images "
                    "(model.prompts.n x model.images_per_prompt)."
                )
            return {"prompt": prompt_index[ids.to(prompt_index.device)]}

        return Target(
            model,
            cond_for=cond_for,
            decode=lambda x: decode_latents(vae, x, self.decode_chunk),
            prompts_for=lambda ids: [plan.prompts[int(plan.prompt_index[int(i)])] for i in ids],
            clip=clip,
            max_batch=self.max_batch,
            indices=torch.as_tensor(plan.noise_id),
        )


__all__ = [
    "DEFAULT_MODEL_ID",
    "TIMESTEP_SCALE",
    "ClipConfig",
    "ImagePlan",
    "PromptEmbeddings",
    "PromptsConfig",
    "SD3Config",
    "SD3UnavailableError",
    "SD3Velocity",
    "decode_latents",
    "encode_prompts",
    "free_text_encoders",
    "load_sd3",
]
