"""Stable Diffusion 3(.5) behind the velocity interface (paper section 5.3, appendix C.3).

SD3 is a rectified-flow model on the same linear path as this package,
``x_sigma = (1 - sigma) x0 + sigma xi``, and its transformer predicts the path velocity
``d x_sigma / d sigma = xi - x0`` ("noise minus data"), which is exactly our ``v``: diffusers'
``FlowMatchEulerDiscreteScheduler.step`` computes ``x + (sigma_next - sigma) * model_output``, our Euler
step. The transformer takes its time as ``timestep = sigma * 1000`` (``num_train_timesteps``; the
pipeline feeds it ``scheduler.timesteps = sigmas * 1000``). Classifier-free guidance follows
``StableDiffusion3Pipeline``: the batch is ``[uncond; cond]`` and the guided velocity is
``v_u + w (v_c - v_u)``; here the two halves go through the transformer as ONE batched call, so one
NFE of the sampler is one transformer call of ``2b`` rows.

The noise grid does not come from diffusers' scheduler (whose default shifts its last sigma twice) but
from :meth:`specsamp.schedule.Schedule.make` (``T = 50``, ``eps = 0.8``, ``shift = 3.0`` for the paper):
the adapter evaluates the velocity at whatever ``sigma`` the sampler asks for.

Pieces:
- :class:`SD3Velocity` -- the adapter (per-row prompts by index into an embedding table, or per-row
  embeddings; shared or per-prompt negative embeddings).
- :func:`load_sd3` -- ``StableDiffusion3Pipeline.from_pretrained`` that fails fast, with a clear message,
  when the gated weights are absent; :func:`encode_prompts` -- prompt encoding, once per prompt, up front;
  :func:`decode_latents` -- chunked VAE decoding with the model's ``scaling_factor`` and ``shift_factor``.
- :func:`build_sd3_model` -- all of the above from a config mapping (``conf/model/sd3.yaml``).

diffusers is imported lazily: importing this module needs only torch.
"""

from __future__ import annotations

import gc
import json
import math
import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from urllib.parse import urlparse

import torch

from ..prompts import ImagePlan, image_plan, load_prompts

DEFAULT_MODEL_ID = "stabilityai/stable-diffusion-3.5-medium"
TIMESTEP_SCALE = 1000.0
"""``timestep = sigma * TIMESTEP_SCALE`` (``FlowMatchEulerDiscreteScheduler.num_train_timesteps``)."""

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float64": torch.float64,
    "fp64": torch.float64,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


class SD3UnavailableError(OSError):
    """The SD3 weights could not be loaded (gated model, offline machine, bad local path)."""


def parse_dtype(value, name: str = "dtype") -> torch.dtype:
    """A ``torch.dtype`` from a dtype or its name (``float32``, ``bfloat16``, ``float16``, ``float64``).

    Args:
        value: a ``torch.dtype`` or a name (``torch.`` prefix allowed, ``fp32``-style aliases too).
        name: the argument or config key, for the error message.

    Returns:
        the dtype.

    Raises:
        ValueError: an unknown name.
    """
    if isinstance(value, torch.dtype):
        return value
    key = str(value).removeprefix("torch.")
    if key not in _DTYPES:
        raise ValueError(f"{name}={value!r} is invalid; valid: {sorted(set(_DTYPES))}")
    return _DTYPES[key]


def _config_get(transformer, key: str, default=None):
    cfg = getattr(transformer, "config", None)
    if cfg is None:
        return default
    if isinstance(cfg, Mapping):
        return cfg.get(key, default)
    return getattr(cfg, key, default)


def _module_dtype_device(module) -> tuple[torch.dtype, torch.device]:
    dtype = getattr(module, "dtype", None)
    device = getattr(module, "device", None)
    if dtype is None or device is None:
        p = next(iter(module.parameters()), None) if hasattr(module, "parameters") else None
        dtype = dtype or (p.dtype if p is not None else torch.float32)
        device = device or (p.device if p is not None else torch.device("cpu"))
    return dtype, torch.device(device)


# ----------------------------------------------------------------------------------------------
# The adapter


class SD3Velocity:
    """An ``SD3Transformer2DModel`` as a guided velocity field ``v(x, sigma, prompt=...)``.

    ``v = v_u + w (v_c - v_u)`` with ``v_c``, ``v_u`` the transformer's outputs on the prompt's and on
    the negative (unconditional) embeddings, computed as ONE transformer call over ``[uncond; cond]``
    (``2b`` rows; ``b`` rows when ``w == 1``). ``timestep = 1000 * sigma``.

    Conditioning per row, either
    - ``prompt [b]`` (int64): indices into the embedding table given at construction (memory-light: the
      tree execution evaluates thousands of states per round, and gathering ``[rows, 333, 4096]``
      embeddings per row in the sampler would cost gigabytes), or
    - ``prompt_embeds [b, S, D]`` and ``pooled_prompt_embeds [b, P]`` (and optionally
      ``negative_prompt_embeds``, ``negative_pooled_prompt_embeds`` of the same shapes).
    Negative embeddings default to the table's: ``[1, ...]`` (shared, e.g. the empty prompt) or one per
    prompt ``[num_prompts, ...]``.

    Args:
        transformer: a diffusers ``SD3Transformer2DModel`` (or any module with its call signature
            ``(hidden_states, encoder_hidden_states, pooled_projections, timestep, return_dict)`` and a
            ``config`` with ``in_channels``, ``patch_size``, ``sample_size``).
        prompt_embeds: ``[num_prompts, S, D]`` table (``D = joint_attention_dim``; ``S = 333``, ``D = 4096``
            for SD3.5 with T5), or None when every call passes per-row embeddings.
        pooled_prompt_embeds: ``[num_prompts, P]`` (``P = pooled_projection_dim``, 2048 for SD3.5).
        negative_prompt_embeds: ``[1 or num_prompts, S, D]``; required when ``guidance != 1`` unless every
            call passes per-row negative embeddings.
        negative_pooled_prompt_embeds: ``[1 or num_prompts, P]``.
        guidance: classifier-free guidance scale ``w`` (7.0 in the paper; 1 = no guidance, one half-size
            call). Unlike ``StableDiffusion3Pipeline``, which drops guidance for every ``w <= 1``, any
            ``w != 1`` is applied as written.
        latent_shape: ``(C, H, W)`` of a latent (16x64x64 at 512x512 for SD3.5); default
            ``(in_channels, sample_size, sample_size)`` of the transformer config.
        dtype: dtype of the sampler's states and of the returned velocity (the kernel and the coupling run
            in it); the guidance combination is computed in it too.
        net_dtype: dtype of the transformer's inputs; default the transformer's own. If it differs from
            the transformer's parameters, the transformer is cast (in place) to it.
        device: device of states and embeddings; default the transformer's.

    Attributes:
        event_shape: ``latent_shape``.
        dtype: ``dtype``.
        device: ``device``.
        guidance: ``w``.
        calls: number of transformer forward passes made so far (one per batched call / chunk).

    Raises:
        ValueError: shapes that do not match each other or the transformer config, a latent shape the
            transformer cannot take, a non-finite guidance, missing negative embeddings.
    """

    def __init__(
        self,
        transformer,
        prompt_embeds: torch.Tensor | None = None,
        pooled_prompt_embeds: torch.Tensor | None = None,
        negative_prompt_embeds: torch.Tensor | None = None,
        negative_pooled_prompt_embeds: torch.Tensor | None = None,
        *,
        guidance: float = 7.0,
        latent_shape: Sequence[int] | None = None,
        dtype: torch.dtype | str = torch.float32,
        net_dtype: torch.dtype | str | None = None,
        device: str | torch.device | None = None,
    ):
        if isinstance(guidance, bool) or not isinstance(guidance, (int, float)) or not math.isfinite(guidance):
            raise ValueError(f"guidance={guidance!r} is invalid: must be a finite number (7.0 in the paper, 1 = no guidance)")
        self.transformer = transformer
        self.guidance = float(guidance)
        self.dtype = parse_dtype(dtype, "dtype")
        t_dtype, t_device = _module_dtype_device(transformer)
        self.net_dtype = t_dtype if net_dtype is None else parse_dtype(net_dtype, "net_dtype")
        if self.net_dtype != t_dtype and hasattr(transformer, "to"):
            transformer.to(dtype=self.net_dtype)
        self.device = t_device if device is None else torch.device(device)
        self.event_shape = self._check_latent_shape(latent_shape)
        self._joint_dim = _config_get(transformer, "joint_attention_dim")
        self._pooled_dim = _config_get(transformer, "pooled_projection_dim")

        def table(t, name, ndim):
            if t is None:
                return None
            t = torch.as_tensor(t)
            if t.ndim != ndim or t.shape[0] < 1:
                raise ValueError(f"{name} has shape {tuple(t.shape)}: expected {ndim} dims with at least one row")
            self._check_dim(t, name)
            return t.to(device=self.device, dtype=self.net_dtype)

        self.prompt_embeds = table(prompt_embeds, "prompt_embeds", 3)
        self.pooled_prompt_embeds = table(pooled_prompt_embeds, "pooled_prompt_embeds", 2)
        self.negative_prompt_embeds = table(negative_prompt_embeds, "negative_prompt_embeds", 3)
        self.negative_pooled_prompt_embeds = table(negative_pooled_prompt_embeds, "negative_pooled_prompt_embeds", 2)
        if (self.prompt_embeds is None) != (self.pooled_prompt_embeds is None):
            raise ValueError("prompt_embeds and pooled_prompt_embeds must be given together")
        if (self.negative_prompt_embeds is None) != (self.negative_pooled_prompt_embeds is None):
            raise ValueError("negative_prompt_embeds and negative_pooled_prompt_embeds must be given together")
        p = self.num_prompts
        if self.prompt_embeds is not None and self.pooled_prompt_embeds.shape[0] != p:
            raise ValueError(
                f"pooled_prompt_embeds has {self.pooled_prompt_embeds.shape[0]} rows but prompt_embeds has {p}"
            )
        if self.negative_prompt_embeds is not None:
            rows = {self.negative_prompt_embeds.shape[0], self.negative_pooled_prompt_embeds.shape[0]}
            valid = {1} if p is None else {1, p}
            if len(rows) != 1 or not rows <= valid:
                raise ValueError(
                    f"negative embeddings have {sorted(rows)} rows: need 1 (shared) or num_prompts={p}, the same for both"
                )
            if self.prompt_embeds is not None and self.negative_prompt_embeds.shape[2] != self.prompt_embeds.shape[2]:
                raise ValueError("negative_prompt_embeds and prompt_embeds differ in embedding width")
        self.calls = 0

    # --- validation ----------------------------------------------------------------------------
    def _check_latent_shape(self, latent_shape) -> tuple[int, int, int]:
        c = _config_get(self.transformer, "in_channels")
        patch = int(_config_get(self.transformer, "patch_size", 1) or 1)
        if latent_shape is None:
            size = _config_get(self.transformer, "sample_size")
            if c is None or size is None:
                raise ValueError("latent_shape is required: the transformer config has no in_channels/sample_size")
            latent_shape = (c, size, size)
        shape = tuple(int(s) for s in latent_shape)
        if len(shape) != 3 or min(shape) < 1:
            raise ValueError(f"latent_shape={tuple(latent_shape)!r} is invalid: need (C, H, W) with positive sizes")
        if c is not None and shape[0] != int(c):
            raise ValueError(f"latent_shape={shape!r} is invalid: the transformer takes in_channels={c}")
        if shape[1] % patch or shape[2] % patch:
            raise ValueError(f"latent_shape={shape!r} is invalid: H and W must be multiples of patch_size={patch}")
        max_patches = _config_get(self.transformer, "pos_embed_max_size")
        if max_patches is not None and max(shape[1], shape[2]) // patch > int(max_patches):
            raise ValueError(
                f"latent_shape={shape!r} is invalid: at most pos_embed_max_size={max_patches} patches of "
                f"{patch} per side ({int(max_patches) * patch} latent pixels)"
            )
        return shape

    def _check_dim(self, t: torch.Tensor, name: str) -> None:
        want = self._pooled_dim if "pooled" in name else self._joint_dim
        if want is not None and t.shape[-1] != int(want):
            key = "pooled_projection_dim" if "pooled" in name else "joint_attention_dim"
            raise ValueError(f"{name} has width {t.shape[-1]} but the transformer's {key} is {want}")

    @property
    def num_prompts(self) -> int | None:
        """Rows of the prompt embedding table (None without a table)."""
        return None if self.prompt_embeds is None else int(self.prompt_embeds.shape[0])

    # --- conditioning --------------------------------------------------------------------------
    def _lookup(self, tbl: torch.Tensor, prompt: torch.Tensor, b: int) -> torch.Tensor:
        if tbl.shape[0] == 1:
            return tbl.expand(b, *tbl.shape[1:])
        return tbl[prompt]

    def _conditioning(self, b: int, prompt, embeds: dict) -> tuple[torch.Tensor, ...]:
        """``(cond, cond_pooled, uncond, uncond_pooled)``, each ``[b, ...]`` in ``net_dtype`` (uncond None if unused)."""
        unknown = set(embeds) - {
            "prompt_embeds",
            "pooled_prompt_embeds",
            "negative_prompt_embeds",
            "negative_pooled_prompt_embeds",
        }
        if unknown:
            raise ValueError(
                f"unknown conditioning {sorted(unknown)}; valid: prompt, prompt_embeds, pooled_prompt_embeds, "
                "negative_prompt_embeds, negative_pooled_prompt_embeds"
            )

        def row(name):
            t = embeds.get(name)
            if t is None:
                return None
            if t.shape[0] != b:
                raise ValueError(f"{name} has {t.shape[0]} rows for a batch of {b}")
            self._check_dim(t, name)
            return t.to(device=self.device, dtype=self.net_dtype)

        if prompt is not None:
            if self.prompt_embeds is None:
                raise ValueError("cond 'prompt' needs an embedding table: construct SD3Velocity with prompt_embeds")
            prompt = torch.as_tensor(prompt, device=self.device).long().reshape(-1)
            if prompt.numel() != b:
                raise ValueError(f"prompt has {prompt.numel()} rows for a batch of {b}")
            if prompt.numel() and (int(prompt.min()) < 0 or int(prompt.max()) >= self.num_prompts):
                raise ValueError(f"prompt indices must lie in [0, {self.num_prompts}); got {prompt.min()}..{prompt.max()}")
        c, cp = row("prompt_embeds"), row("pooled_prompt_embeds")
        if (c is None) != (cp is None):
            raise ValueError("prompt_embeds and pooled_prompt_embeds must be passed together")
        if c is None:
            if prompt is None:
                raise ValueError("SD3Velocity needs conditioning: pass prompt=[b] indices or prompt_embeds/pooled_prompt_embeds")
            c = self.prompt_embeds[prompt]
            cp = self.pooled_prompt_embeds[prompt]
        if self.guidance == 1.0:
            return c, cp, None, None
        u, up = row("negative_prompt_embeds"), row("negative_pooled_prompt_embeds")
        if (u is None) != (up is None):
            raise ValueError("negative_prompt_embeds and negative_pooled_prompt_embeds must be passed together")
        if u is None:
            if self.negative_prompt_embeds is None:
                raise ValueError(
                    f"guidance={self.guidance} needs unconditional embeddings: construct SD3Velocity with "
                    "negative_prompt_embeds/negative_pooled_prompt_embeds or pass them per row"
                )
            if self.negative_prompt_embeds.shape[0] > 1 and prompt is None:
                raise ValueError("per-prompt negative embeddings need cond 'prompt' indices")
            u = self._lookup(self.negative_prompt_embeds, prompt, b)
            up = self._lookup(self.negative_pooled_prompt_embeds, prompt, b)
        if u.shape[1:] != c.shape[1:]:
            raise ValueError(f"unconditional embeddings {tuple(u.shape[1:])} and conditional {tuple(c.shape[1:])} differ in shape")
        return c, cp, u, up

    # --- the velocity --------------------------------------------------------------------------
    def raw(self, x: torch.Tensor, sigma: torch.Tensor, embeds: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        """One transformer call: the unguided velocity ``[b, C, H, W]`` in :attr:`dtype`.

        Args:
            x: ``[b, C, H, W]`` latents at noise level ``sigma``.
            sigma: ``[b]`` noise levels in ``[0, 1]``; the transformer gets ``timestep = 1000 sigma`` (float32).
            embeds: ``[b, S, D]`` text embeddings.
            pooled: ``[b, P]`` pooled text embeddings.

        Returns:
            ``[b, C, H, W]`` transformer output (the velocity ``xi - x0``), cast to :attr:`dtype`.
        """
        timestep = sigma.to(device=self.device, dtype=torch.float32) * TIMESTEP_SCALE
        with torch.no_grad():
            out = self.transformer(
                hidden_states=x.to(device=self.device, dtype=self.net_dtype),
                encoder_hidden_states=embeds,
                pooled_projections=pooled,
                timestep=timestep,
                return_dict=False,
            )[0]
        self.calls += 1
        return out.to(self.dtype)

    def __call__(
        self,
        x: torch.Tensor,
        sigma: torch.Tensor,
        prompt: torch.Tensor | None = None,
        **embeds: torch.Tensor,
    ) -> torch.Tensor:
        """Guided velocity ``v_u + w (v_c - v_u)`` from one batched transformer call.

        Args:
            x: ``[b, C, H, W]`` latents (``event_shape``), any float dtype.
            sigma: ``[b]`` (or scalar) noise levels in ``[0, 1]``.
            prompt: ``[b]`` int64 rows of the embedding table.
            **embeds: per-row ``prompt_embeds [b, S, D]``, ``pooled_prompt_embeds [b, P]`` and optionally
                ``negative_prompt_embeds``, ``negative_pooled_prompt_embeds`` (override the table).

        Returns:
            ``[b, C, H, W]`` velocities in :attr:`dtype` on :attr:`device`.

        Raises:
            ValueError: a latent of the wrong shape, missing or mis-shaped conditioning.
        """
        if tuple(x.shape[1:]) != self.event_shape:
            raise ValueError(f"x has shape {tuple(x.shape)}: expected [b, *{self.event_shape}]")
        b = x.shape[0]
        sigma = torch.as_tensor(sigma, device=self.device).reshape(-1)
        if sigma.numel() == 1:
            sigma = sigma.expand(b)
        if sigma.numel() != b:
            raise ValueError(f"sigma has {sigma.numel()} entries for a batch of {b}")
        c, cp, u, up = self._conditioning(b, prompt, embeds)
        if u is None:  # guidance == 1: the conditional velocity alone
            return self.raw(x, sigma, c, cp)
        out = self.raw(torch.cat([x, x]), torch.cat([sigma, sigma]), torch.cat([u, c]), torch.cat([up, cp]))
        v_u, v_c = out[:b], out[b:]
        return v_u + self.guidance * (v_c - v_u)


# ----------------------------------------------------------------------------------------------
# Loading, prompt encoding, decoding


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().upper() in ("1", "ON", "YES", "TRUE")


def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether a TCP connection to the Hugging Face Hub (``HF_ENDPOINT``) opens within ``timeout`` seconds.

    Behind an HTTPS proxy (``HTTPS_PROXY``/``ALL_PROXY`` set) the hub is assumed reachable.

    Args:
        timeout: seconds to wait for the connection.

    Returns:
        True if reachable (or behind a proxy).
    """
    if any(os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return True
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    host = url.hostname or "huggingface.co"
    port = url.port or (80 if url.scheme == "http" else 443)
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def resolve_offline(local_files_only: bool | None) -> bool:
    """Whether to stay off the network.

    Args:
        local_files_only: an explicit choice, or None for auto.

    Returns:
        ``local_files_only`` if given, else True when ``HF_HUB_OFFLINE`` is set or :func:`hub_reachable` fails.
    """
    if local_files_only is not None:
        return bool(local_files_only)
    return _env_true("HF_HUB_OFFLINE") or not hub_reachable()


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
            pipe = StableDiffusion3Pipeline.from_pretrained(name, local_files_only=True, **{**_absent_components(name), **kwargs})
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
    if resolve_offline(local_files_only):
        why = "local_files_only=True" if local_files_only else (
            "HF_HUB_OFFLINE is set" if _env_true("HF_HUB_OFFLINE") else "the Hugging Face Hub is unreachable"
        )
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


def to_uint8(images: torch.Tensor) -> torch.Tensor:
    """``[0, 1]`` floats to uint8 as diffusers' ``numpy_to_pil`` does: ``round(255 x)``.

    Args:
        images: float tensor in ``[0, 1]``, any shape.

    Returns:
        uint8 tensor of the same shape.
    """
    return (images.float() * 255).round().clamp(0, 255).to(torch.uint8)


def decode_latents(vae, latents: torch.Tensor, chunk: int = 4, output: str = "float") -> torch.Tensor:
    """Decode SD3 latents to images, ``chunk`` at a time.

    ``image = vae.decode(latents / scaling_factor + shift_factor)`` (as ``StableDiffusion3Pipeline``),
    clamped to ``[-1, 1]`` and mapped to ``[0, 1]``.

    Args:
        vae: a diffusers ``AutoencoderKL`` (``config.scaling_factor``, ``config.shift_factor``; a missing
            shift factor counts as 0).
        latents: ``[n, C, h, w]`` sampled latents (sigma = 0), any device and float dtype.
        chunk: latents per decoder call (bounds memory: ~1.5 GB of activations per 512x512 image in bf16).
        output: ``float`` (float32 in ``[0, 1]``), ``uint8`` (``round(255 x)``, as diffusers saves
            images) or ``signed`` (float32 in ``[-1, 1]``, the decoder's range and the convention of
            :mod:`specsamp.images`).

    Returns:
        ``[n, 3, H, W]`` on the CPU (``H = h * vae_scale_factor``, 8 for SD3).

    Raises:
        ValueError: ``chunk < 1``, an unknown ``output``, or latents that are not ``[n, C, h, w]``.
    """
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk={chunk!r} is invalid: must be an integer >= 1")
    if output not in ("float", "uint8", "signed"):
        raise ValueError(f"output={output!r} is invalid; valid: ['float', 'uint8', 'signed']")
    if latents.ndim != 4:
        raise ValueError(f"latents has shape {tuple(latents.shape)}: expected [n, C, h, w]")
    scale = float(vae.config.scaling_factor)
    shift = float(getattr(vae.config, "shift_factor", None) or 0.0)
    v_dtype, v_device = _module_dtype_device(vae)
    outs = []
    with torch.no_grad():
        for i in range(0, latents.shape[0], chunk):
            z = latents[i : i + chunk].to(device=v_device, dtype=torch.float32) / scale + shift
            img = vae.decode(z.to(v_dtype), return_dict=False)[0]
            img = (img.float() * 0.5 + 0.5).clamp(0, 1).cpu()
            outs.append(to_uint8(img) if output == "uint8" else img * 2 - 1 if output == "signed" else img)
    return torch.cat(outs)


# ----------------------------------------------------------------------------------------------
# From a config


CONFIG_DEFAULTS: dict = {
    "model_id": DEFAULT_MODEL_ID,  # hub id or local diffusers directory
    "local_files_only": None,  # None: auto (HF_HUB_OFFLINE or unreachable hub -> cache only)
    "cache_dir": None,
    "drop_t5": False,
    "device": "cuda",
    "resolution": 512,  # int or [H, W]; latent = (16, H/8, W/8)
    "guidance": 7.0,
    "negative_prompt": "",
    "max_sequence_length": 256,
    "encode_batch": 16,
    "free_text_encoders": True,
    "dtype": "float32",  # states, kernel, coupling
    "net_dtype": "bfloat16",  # transformer, text encoders, VAE weights
    "decode_chunk": 4,
    "images_per_prompt": 1,
    "max_batch": None,  # states per transformer forward (2x rows with guidance); for the sampler
    "prompts": {"source": "coco", "n": 100, "seed": 0, "captions_json": None, "path": None},
}
"""Keys read by :func:`build_sd3_model` and their defaults (paper section 5.3)."""

PASSTHROUGH_KEYS = frozenset({"name", "_target_", "kind", "steps", "eps", "shift", "sigma_min", "K", "L", "branching", "lookahead"})
"""Keys a model config may carry for other layers (schedule, tree, registry); ignored here."""


@dataclass
class SD3Target:
    """What :func:`build_sd3_model` returns: the velocity model and everything a run needs around it.

    Attributes:
        model: the :class:`SD3Velocity`.
        vae: the pipeline's VAE (for :meth:`decode`).
        plan: which prompt and noise id each image gets (:class:`specsamp.prompts.ImagePlan`).
        cond: sampler conditioning ``{"prompt": int64 [N]}`` on the model's device.
        indices: int64 ``[N]`` trajectory ids for the sampler (``plan.noise_id``).
        max_batch: states per forward pass, for the sampler's ``max_batch``.
        decode_chunk: latents per VAE call.
        pipeline: the loaded pipeline (None when built from parts), kept so callers can free it.
        config: the resolved config.
    """

    model: SD3Velocity
    vae: object
    plan: ImagePlan
    cond: dict
    indices: torch.Tensor
    max_batch: int | None = None
    decode_chunk: int = 4
    pipeline: object = None
    config: dict = field(default_factory=dict)

    @property
    def prompts(self) -> tuple[str, ...]:
        """The prompt strings."""
        return self.plan.prompts

    def sampler_kwargs(self) -> dict:
        """``indices``, ``cond`` and ``max_batch`` for :func:`specsamp.sampler.sample_speculative` / ``sample_standard``."""
        return {"indices": self.indices, "cond": self.cond, "max_batch": self.max_batch}

    def decode(self, latents: torch.Tensor, output: str = "float") -> torch.Tensor:
        """Images ``[N, 3, H, W]`` from latents (:func:`decode_latents`)."""
        return decode_latents(self.vae, latents, self.decode_chunk, output)


def _resolve_config(cfg: Mapping) -> dict:
    if not isinstance(cfg, Mapping):
        raise ValueError(f"model config must be a mapping, got {type(cfg).__name__}")
    unknown = set(cfg) - set(CONFIG_DEFAULTS) - PASSTHROUGH_KEYS
    if unknown:
        raise ValueError(f"model config has unknown keys {sorted(unknown)}; valid: {sorted(CONFIG_DEFAULTS)}")
    out = {k: cfg.get(k, v) for k, v in CONFIG_DEFAULTS.items()}
    p = cfg.get("prompts", {}) or {}
    if not isinstance(p, Mapping):
        raise ValueError(f"model.prompts={p!r} is invalid: must be a mapping with keys {sorted(CONFIG_DEFAULTS['prompts'])}")
    bad = set(p) - set(CONFIG_DEFAULTS["prompts"])
    if bad:
        raise ValueError(f"model.prompts has unknown keys {sorted(bad)}; valid: {sorted(CONFIG_DEFAULTS['prompts'])}")
    out["prompts"] = {**CONFIG_DEFAULTS["prompts"], **dict(p)}
    for key in ("dtype", "net_dtype"):
        out[key] = parse_dtype(out[key], f"model.{key}")
    res = out["resolution"]
    res = (res, res) if isinstance(res, int) and not isinstance(res, bool) else tuple(res) if isinstance(res, Sequence) and not isinstance(res, str) else None
    if res is None or len(res) != 2 or not all(isinstance(r, int) and not isinstance(r, bool) and r > 0 for r in res):
        raise ValueError(f"model.resolution={out['resolution']!r} is invalid: need a positive int or [H, W]")
    out["resolution"] = res
    mb = out["max_batch"]
    if mb is not None and (isinstance(mb, bool) or not isinstance(mb, int) or mb < 1):
        raise ValueError(f"model.max_batch={mb!r} is invalid: must be null or an integer >= 1")
    dev = str(out["device"])
    if dev.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"model.device={dev!r} is invalid here: CUDA is not available (use model.device=cpu, very slow)")
    return out


def build_sd3_model(cfg: Mapping, *, pipeline=None, prompts: Sequence[str] | None = None) -> SD3Target:
    """Build the SD3 target of section 5.3 from a config (keys and defaults: :data:`CONFIG_DEFAULTS`).

    Loads the pipeline (:func:`load_sd3`), draws the prompts (:func:`specsamp.prompts.load_prompts`),
    encodes them once (:func:`encode_prompts`), optionally frees the text encoders, and wraps the
    transformer in :class:`SD3Velocity` with latent shape ``(in_channels, H / f, W / f)``,
    ``f = 2 ** (len(vae.config.block_out_channels) - 1)`` (16x64x64 at 512x512).

    Args:
        cfg: the model config (an OmegaConf ``DictConfig`` works).
        pipeline: an already loaded pipeline (or any object with ``transformer``, ``vae`` and
            ``encode_prompt``) to use instead of loading one.
        prompts: explicit prompt strings, overriding ``cfg.prompts``.

    Returns:
        :class:`SD3Target`.

    Raises:
        ValueError: an unknown key or a bad value (the message names it), a resolution the VAE and
            transformer cannot take.
        SD3UnavailableError: the weights cannot be loaded (see :func:`load_sd3`).
        FileNotFoundError: a missing prompt source file.
    """
    c = _resolve_config(cfg)
    pc = c["prompts"]
    texts = load_prompts(
        pc["source"], pc["n"], pc["seed"], captions_json=pc["captions_json"], path=pc["path"], prompts=prompts
    )
    pipe = pipeline
    if pipe is None:
        pipe = load_sd3(
            c["model_id"],
            device=c["device"],
            dtype=c["net_dtype"],
            local_files_only=c["local_files_only"],
            cache_dir=c["cache_dir"],
            drop_t5=bool(c["drop_t5"]),
        )
    transformer, vae = pipe.transformer, pipe.vae
    f = 2 ** (len(vae.config.block_out_channels) - 1)
    patch = int(_config_get(transformer, "patch_size", 1) or 1)
    h, w = c["resolution"]
    if h % (f * patch) or w % (f * patch):
        raise ValueError(f"model.resolution={list(c['resolution'])} is invalid: H and W must be multiples of {f * patch} (VAE factor {f} x patch {patch})")
    latent_shape = (int(_config_get(transformer, "in_channels")), h // f, w // f)
    emb = encode_prompts(
        pipe,
        texts,
        c["negative_prompt"],
        batch_size=int(c["encode_batch"]),
        max_sequence_length=int(c["max_sequence_length"]),
    )
    if c["free_text_encoders"]:
        free_text_encoders(pipe)
    model = SD3Velocity(
        transformer,
        **emb.as_kwargs(),
        guidance=float(c["guidance"]),
        latent_shape=latent_shape,
        dtype=c["dtype"],
        net_dtype=c["net_dtype"],
        device=c["device"],
    )
    plan = image_plan(texts, int(c["images_per_prompt"]))
    return SD3Target(
        model=model,
        vae=vae,
        plan=plan,
        cond={"prompt": torch.as_tensor(plan.prompt_index, device=model.device)},
        indices=torch.as_tensor(plan.noise_id, device=model.device),
        max_batch=c["max_batch"],
        decode_chunk=int(c["decode_chunk"]),
        pipeline=pipe,
        config={**c, "dtype": str(c["dtype"]), "net_dtype": str(c["net_dtype"]), "latent_shape": list(latent_shape)},
    )
