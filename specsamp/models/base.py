"""The velocity interface, the built :class:`Target` a run samples from, and the config schema base.

Every model kind has one config dataclass (a :class:`TargetConfig`) that is both its Hydra schema
(``conf/model/<x>.yaml`` merges onto it, so unknown keys and wrong types are refused) and its builder:
``cfg.build(device)`` validates the values and returns a :class:`Target`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from ..batching import batched  # noqa: F401  (re-exported: the core owns it)
from ..errors import ConfigError

# OmegaConf's marker of a mandatory value (``omegaconf.MISSING`` is this very string): written out so that
# the models import without omegaconf (torch, numpy and scipy only); the runner's schemas read it as MISSING.
MISSING = "???"

DTYPES = ("float16", "bfloat16", "float32", "float64")


@runtime_checkable
class VelocityModel(Protocol):
    """A target velocity field on the linear path.

    Attributes:
        event_shape: shape of one state, e.g. ``(500,)`` or ``(3, 32, 32)``.
        dtype: dtype of states the sampler should use (the kernel and coupling run in it).
    """

    event_shape: tuple[int, ...]
    dtype: torch.dtype

    def __call__(self, x: torch.Tensor, sigma: torch.Tensor, **cond: torch.Tensor) -> torch.Tensor:
        """Velocity ``v(x, sigma)``: ``x [b, *event]``, ``sigma [b]`` float -> ``[b, *event]``."""
        ...


@dataclass
class Target:
    """A built target: the velocity model and what a run needs around it.

    Attributes:
        model: velocity model (:class:`VelocityModel`).
        cond_for: ``(ids [m] long, seed) -> {name: [m, ...]}`` per-trajectory conditioning, or None.
        decode: ``samples [m, *event] -> images [m, C, H, W]`` float in ``[-1, 1]`` (the one image
            convention of :mod:`specsamp.images`, which every metric takes), or None (not images).
        prompts_for: ``ids -> list[str]`` text of each image (for CLIP), or None.
        fid_ref: reference statistics for FID (name, URL or ``.npz`` path), or None.
        fid: further keyword arguments of :func:`specsamp.metrics.fid.compute_fid` (``feature_extractor``,
            ``feature_layer``, ``weights_path``), or None.
        clip: keyword arguments of :func:`specsamp.metrics.clip.load_clip` (all but ``device``), or None.
        max_batch: the model's own rows per forward pass (used when the run sets none), or None.
        indices: int64 ``[N]`` trajectory ids the model's conditioning covers (SD3's image plan), or None.
    """

    model: Any
    cond_for: Callable | None = None
    decode: Callable | None = None
    prompts_for: Callable | None = None
    fid_ref: str | None = None
    fid: dict | None = None
    clip: dict | None = None
    max_batch: int | None = None
    indices: torch.Tensor | None = None


@dataclass
class Paper:
    """The paper's protocol for a target (section 5): grid size ``T``, churn ``eps``, trajectories, tree ``(K, L)``."""

    steps: int
    eps: float
    n_samples: int
    K: int
    L: int


@dataclass
class TargetConfig:
    """Schema shared by every ``conf/model/*.yaml``; subclasses add their keys and implement :meth:`build`.

    Attributes:
        _target_: dotted path of the config class itself (Hydra instantiates it, then the runner calls
            :meth:`build`).
        name: the model's name (the record's ``model``).
        dtype: dtype of the sampler's states, kernel and coupling (one of :data:`DTYPES`).
        shift: timestep shift of the noise grid (paper eq. 38; 1 = none).
        paper: the paper's protocol for this target: the run's ``K``, ``L``, ``eps``, ``steps`` and
            ``n_samples`` unless set (None: :data:`specsamp.runner.config.RUN_DEFAULTS`).
    """

    _target_: str = ""
    name: str = MISSING
    dtype: str = "float32"
    shift: float = 1.0
    paper: Paper | None = None

    def build(self, device: str) -> Target:
        """Validate the values, load the model onto ``device`` and return the :class:`Target`.

        Raises:
            ConfigError: an invalid value (the message names ``model.<key>=<value>`` and what is valid).
            OSError, ImportError, ValueError: the model could not be loaded.
        """
        raise NotImplementedError

    def scheduler_plan(self, steps: int, kernel: str | None):
        """The model's own scheduler at ``steps`` as a :class:`specsamp.integrations.schedulers.SchedulerPlan`
        (its grid, kernel, timesteps and the network's coordinates), for the run's ``kernel`` name (None:
        ``kernel=auto``, the model's own choice); None (every shipped model): the run's ``kernel`` config decides."""
        return None

    def rows_per_state(self) -> int:
        """Network rows one state costs, known from the config before the model loads (2 under classifier-free
        guidance, which evaluates a conditional and an unconditional row per state): the memory estimate reads it."""
        return 1

    def size_from_config(self) -> tuple[str, float] | None:
        """``(what, bytes)`` that building this target allocates, when its config alone decides it (the keys
        named in ``what``), so the runner can refuse it before :meth:`build`; None when it does not (a
        checkpoint's own size)."""
        return None

    def torch_dtype(self, key: str = "dtype", valid=DTYPES) -> torch.dtype | None:
        """The config value ``key`` as a torch dtype (:func:`parse_dtype`, the message naming ``model.<key>``)."""
        return parse_dtype(getattr(self, key), f"model.{key}", valid)


def parse_dtype(value, name: str = "dtype", valid=DTYPES) -> torch.dtype | None:
    """A ``torch.dtype`` from a dtype or its name (``float32``, ``torch.bfloat16``, ...); None stays None.

    Raises:
        ConfigError: a name (or dtype) not in ``valid``; the message names ``name=value``.
    """
    if value is None:
        return None
    key = str(value).removeprefix("torch.")
    if key not in valid:
        raise ConfigError(f"{name}={value!r} is invalid: valid values are {', '.join(valid)}.")
    return getattr(torch, key)


def check_positive(key: str, value, optional: bool = False) -> None:
    """ConfigError unless ``value`` is an integer >= 1 (or None when ``optional``); names ``model.<key>``."""
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"model.{key}={value!r} is invalid: must be {'null or ' if optional else ''}an integer >= 1.")
