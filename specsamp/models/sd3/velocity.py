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
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

from ..base import parse_dtype

TIMESTEP_SCALE = 1000.0
"""``timestep = sigma * TIMESTEP_SCALE`` (``FlowMatchEulerDiscreteScheduler.num_train_timesteps``)."""


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
            raise ValueError(
                f"guidance={guidance!r} is invalid: must be a finite number (7.0 in the paper, 1 = no guidance)"
            )
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
    @property
    def rows_per_state(self) -> int:
        """Network rows one state costs: 2 under classifier-free guidance (one call of the unconditional and the
        conditional rows), 1 at ``guidance == 1``; the samplers charge it to ``target_rows``."""
        return 1 if self.guidance == 1.0 else 2

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
                raise ValueError(
                    f"prompt indices must lie in [0, {self.num_prompts}); got {prompt.min()}..{prompt.max()}"
                )
        c, cp = row("prompt_embeds"), row("pooled_prompt_embeds")
        if (c is None) != (cp is None):
            raise ValueError("prompt_embeds and pooled_prompt_embeds must be passed together")
        if c is None:
            if prompt is None:
                raise ValueError(
                    "SD3Velocity needs conditioning: pass prompt=[b] indices or prompt_embeds/pooled_prompt_embeds"
                )
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
            raise ValueError(
                f"unconditional embeddings {tuple(u.shape[1:])} and conditional {tuple(c.shape[1:])} differ in shape"
            )
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
