"""Loading SD3 through diffusers, encoding prompts once, decoding latents (paper section 5.3).

:func:`load_sd3` is ``StableDiffusion3Pipeline.from_pretrained`` that fails fast, with a clear message,
when the gated weights are absent; :func:`encode_prompts` encodes each prompt once, up front;
:func:`decode_latents` decodes in chunks with the VAE's ``scaling_factor`` and ``shift_factor``.
diffusers is imported lazily: importing this module needs only torch.
"""

from __future__ import annotations

import gc
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ...hub import hub_offline, hub_offline_reason
from ..base import parse_dtype
from .velocity import _module_dtype_device

DEFAULT_MODEL_ID = "stabilityai/stable-diffusion-3.5-medium"


class SD3UnavailableError(OSError):
    """The SD3 weights could not be loaded (gated model, no network, bad local path)."""


# ----------------------------------------------------------------------------------------------
def _looks_like_path(s: str) -> bool:
    return os.path.exists(s) or s.startswith(("/", "./", "../", "~", "\\")) or (len(s) > 1 and s[1] == ":")


def _gated_message(model_id: str) -> str:
    return (
        f"{model_id} is a gated model: accept its licence at https://huggingface.co/{model_id}, log in with "
        "`huggingface-cli login` (or `hf auth login`, or set HF_TOKEN), then run once online to fill the cache; "
        "or pass a local diffusers directory as model_id_or_path (config key model.model_id)"
    )


def _absent_components(directory: str) -> dict:
    """``{name: None}`` for the components a diffusers directory's ``model_index.json`` saves as ``[null, null]``.

    ``save_pretrained`` of a pipeline built without T5 writes ``"text_encoder_3": [null, null]``, and
    ``from_pretrained`` then refuses the directory unless those components are passed explicitly as None.
    """
    try:
        with open(os.path.join(directory, "model_index.json")) as f:
            index = json.load(f)
    except (OSError, ValueError):
        return {}
    if not isinstance(index, dict):
        return {}
    return {
        k: None
        for k, v in index.items()
        if not k.startswith("_") and isinstance(v, (list, tuple)) and len(v) == 2 and v[0] is None and v[1] is None
    }


def load_sd3(
    model_id_or_path: str = DEFAULT_MODEL_ID,
    device: str | torch.device = "cuda",
    dtype: torch.dtype | str = torch.bfloat16,
    *,
    local_files_only: bool | None = None,
    cache_dir: str | None = None,
    drop_t5: bool = False,
    token: str | None = None,
):
    """Load ``StableDiffusion3Pipeline`` from the hub cache, the hub, or a local directory, failing fast.

    Order: a local directory is loaded with ``local_files_only=True`` (components its ``model_index.json``
    saves as null, e.g. ``text_encoder_3`` of a pipeline saved without T5, load as None). A hub id is
    first looked up in the cache only; on a miss it is downloaded unless offline -- offline meaning
    ``local_files_only=True``, or (``None``) ``HF_HUB_OFFLINE=1`` or a hub that does not answer a 3 s TCP
    probe -- so an offline machine gets an error in seconds rather than minutes of retries.

    Args:
        model_id_or_path: hub id (default ``stabilityai/stable-diffusion-3.5-medium``, gated) or a local
            directory saved with ``save_pretrained`` / a clone of the hub repository.
        device: where to put the pipeline's modules.
        dtype: weights dtype (bfloat16 for SD3.5 on GPU).
        local_files_only: True = cache/local only, False = may download, None = auto (see above).
        cache_dir: hub cache directory (default: the Hugging Face cache, ``HF_HOME``).
        drop_t5: load without the T5-XXL text encoder (``text_encoder_3=None``; saves ~9 GB in bf16 but
            changes the prompt embeddings -- not the paper's setting).
        token: hub token (default: the one ``huggingface-cli login`` stored, or ``HF_TOKEN``).

    Returns:
        the ``StableDiffusion3Pipeline`` on ``device``.

    Raises:
        SD3UnavailableError: a local path that does not exist or is not a diffusers SD3 directory; weights
            absent from the cache while offline; a gated/unknown repository or any hub failure (the message
            says how to log in and accept the licence, or to pass a local directory).
    """
    dtype = parse_dtype(dtype, "dtype")
    name = os.path.expanduser(str(model_id_or_path))
    if _looks_like_path(name) and not os.path.isdir(name):  # before importing diffusers (seconds): fail fast
        raise SD3UnavailableError(
            f"model_id_or_path={model_id_or_path!r} is not a directory: pass a local diffusers SD3 directory "
            f"or a hub id such as {DEFAULT_MODEL_ID!r}. " + _gated_message(DEFAULT_MODEL_ID)
        )
    from diffusers import StableDiffusion3Pipeline

    kwargs = {"cache_dir": cache_dir}
    try:  # diffusers >= 0.36 renamed torch_dtype to dtype
        from diffusers.utils import deprecation_utils

        kwargs["dtype" if hasattr(deprecation_utils, "_resolve_dtype") else "torch_dtype"] = dtype
    except ImportError:
        kwargs["torch_dtype"] = dtype
    if drop_t5:
        kwargs.update(text_encoder_3=None, tokenizer_3=None)
    if token is not None:
        kwargs["token"] = token

    if _looks_like_path(name):
        try:
            pipe = StableDiffusion3Pipeline.from_pretrained(
                name, local_files_only=True, **{**_absent_components(name), **kwargs}
            )
        except (OSError, ValueError, KeyError) as e:
            raise SD3UnavailableError(
                f"model_id_or_path={model_id_or_path!r} is not a loadable diffusers SD3 directory "
                f"(model_index.json, transformer/, vae/, text_encoder*/ ...): {e}"
            ) from e
        return pipe.to(device)

    try:
        return StableDiffusion3Pipeline.from_pretrained(name, local_files_only=True, **kwargs).to(device)
    except (OSError, ValueError):
        pass  # not (fully) cached
    if hub_offline(local_files_only):
        why = hub_offline_reason(local_files_only)
        raise SD3UnavailableError(
            f"model_id_or_path={model_id_or_path!r} is not in the local cache (cache_dir={cache_dir!r}) and {why}. "
            + _gated_message(name)
        )
    try:
        from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError
    except ImportError:  # pragma: no cover - old huggingface_hub
        from huggingface_hub.utils import GatedRepoError, RepositoryNotFoundError
    try:
        pipe = StableDiffusion3Pipeline.from_pretrained(name, local_files_only=False, **kwargs)
    except GatedRepoError as e:
        raise SD3UnavailableError("access denied. " + _gated_message(name)) from e
    except RepositoryNotFoundError as e:
        raise SD3UnavailableError(
            f"model_id_or_path={model_id_or_path!r}: repository not found, or gated and not accessible with the "
            "current credentials. " + _gated_message(name)
        ) from e
    except (OSError, ValueError) as e:
        raise SD3UnavailableError(f"could not load {model_id_or_path!r}: {e}. " + _gated_message(name)) from e
    return pipe.to(device)


@dataclass
class PromptEmbeddings:
    """Encoded prompts: a table for :class:`SD3Velocity`.

    Attributes:
        prompt_embeds: ``[num_prompts, S, D]`` (``S = 77 + max_sequence_length``, ``D = 4096`` for SD3.5).
        pooled_prompt_embeds: ``[num_prompts, P]`` (``P = 2048``).
        negative_prompt_embeds: ``[1, S, D]`` (the shared negative prompt).
        negative_pooled_prompt_embeds: ``[1, P]``.
    """

    prompt_embeds: torch.Tensor
    pooled_prompt_embeds: torch.Tensor
    negative_prompt_embeds: torch.Tensor
    negative_pooled_prompt_embeds: torch.Tensor

    def as_kwargs(self) -> dict:
        """The four tables as keyword arguments of :class:`SD3Velocity`."""
        return {
            "prompt_embeds": self.prompt_embeds,
            "pooled_prompt_embeds": self.pooled_prompt_embeds,
            "negative_prompt_embeds": self.negative_prompt_embeds,
            "negative_pooled_prompt_embeds": self.negative_pooled_prompt_embeds,
        }


def encode_prompts(
    pipe,
    prompts: Sequence[str],
    negative_prompt: str = "",
    *,
    batch_size: int = 16,
    max_sequence_length: int = 256,
    device: str | torch.device | None = None,
) -> PromptEmbeddings:
    """Encode each prompt once, up front, with the pipeline's ``encode_prompt`` (CLIP-L, CLIP-G, T5).

    The negative prompt (default ``""``, the pipeline's default unconditional input) is encoded once and
    shared by all rows, which gives exactly the embeddings ``StableDiffusion3Pipeline.__call__`` uses.

    Args:
        pipe: a ``StableDiffusion3Pipeline`` (or anything with its ``encode_prompt``).
        prompts: prompt strings.
        negative_prompt: the unconditional prompt.
        batch_size: prompts per encoder call.
        max_sequence_length: T5 tokens (256 in the pipeline; longer prompts are truncated).
        device: encoder device (default the pipeline's execution device).

    Returns:
        :class:`PromptEmbeddings`.

    Raises:
        ValueError: no prompts or ``batch_size < 1``.
    """
    prompts = list(prompts)
    if not prompts:
        raise ValueError("prompts must be non-empty")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size={batch_size!r} is invalid: must be an integer >= 1")
    device = device if device is not None else getattr(pipe, "_execution_device", None)

    def enc(texts):
        out = pipe.encode_prompt(
            prompt=texts,
            prompt_2=None,
            prompt_3=None,
            device=device,
            num_images_per_prompt=1,
            do_classifier_free_guidance=False,
            max_sequence_length=max_sequence_length,
        )
        return out[0], out[2]

    with torch.no_grad():
        parts = [enc(prompts[i : i + batch_size]) for i in range(0, len(prompts), batch_size)]
        neg, neg_pooled = enc([negative_prompt])
    return PromptEmbeddings(
        prompt_embeds=torch.cat([p[0] for p in parts]),
        pooled_prompt_embeds=torch.cat([p[1] for p in parts]),
        negative_prompt_embeds=neg,
        negative_pooled_prompt_embeds=neg_pooled,
    )


def free_text_encoders(pipe) -> None:
    """Drop the pipeline's text encoders (after :func:`encode_prompts`) and release their memory.

    Args:
        pipe: the pipeline; ``text_encoder``, ``text_encoder_2`` and ``text_encoder_3`` become None.
    """
    for name in ("text_encoder", "text_encoder_2", "text_encoder_3"):
        if getattr(pipe, name, None) is not None:
            setattr(pipe, name, None)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def decode_latents(vae, latents: torch.Tensor, chunk: int = 4) -> torch.Tensor:
    """Decode SD3 latents to images, ``chunk`` at a time, in the package's image convention.

    ``image = vae.decode(latents / scaling_factor + shift_factor)`` (as ``StableDiffusion3Pipeline``),
    clamped to ``[-1, 1]`` (the decoder's range; :mod:`specsamp.images`).

    Args:
        vae: a diffusers ``AutoencoderKL`` (``config.scaling_factor``, ``config.shift_factor``; a missing
            shift factor counts as 0).
        latents: ``[n, C, h, w]`` sampled latents (sigma = 0), any device and float dtype.
        chunk: latents per decoder call (bounds memory: ~1.5 GB of activations per 512x512 image in bf16).

    Returns:
        float32 ``[n, 3, H, W]`` in ``[-1, 1]`` on the CPU (``H = h * vae_scale_factor``, 8 for SD3).

    Raises:
        ValueError: ``chunk < 1``, or latents that are not ``[n, C, h, w]``.
    """
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk={chunk!r} is invalid: must be an integer >= 1")
    if latents.ndim != 4:
        raise ValueError(f"latents has shape {tuple(latents.shape)}: expected [n, C, h, w]")
    scale = float(vae.config.scaling_factor)
    shift = float(getattr(vae.config, "shift_factor", None) or 0.0)
    v_dtype, v_device = _module_dtype_device(vae)
    outs = []
    with torch.no_grad():
        for i in range(0, latents.shape[0], chunk):
            z = latents[i : i + chunk].to(device=v_device, dtype=torch.float32) / scale + shift
            outs.append(vae.decode(z.to(v_dtype), return_dict=False)[0].float().clamp(-1, 1).cpu())
    return torch.cat(outs)
