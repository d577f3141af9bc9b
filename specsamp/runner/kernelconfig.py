"""The transition kernel's configuration (``conf/kernel/*.yaml``): one schema per kernel, the value checks, and
which kernel a run uses (:func:`kernel_name`; a model that brings its own scheduler: :func:`brings_scheduler`)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass

from ..errors import ConfigError
from ..kernels import KERNELS, scheduler_kernels
from .fields import _number, at_least, between, one_of, rule

# num_train_timesteps: the scheduler allocates its betas and cumulative alphas of this length
MAX_TRAIN_TIMESTEPS = 100_000
BETA_SCHEDULES = ("linear", "scaled_linear", "squaredcos_cap_v2")
TIMESTEP_SPACINGS = ("leading", "trailing", "linspace")


@dataclass
class KernelConfig:
    """``conf/kernel/*.yaml``: the transition kernel of every step (:mod:`specsamp.kernels`).

    ``em`` (the default) is the paper's Euler--Maruyama kernel on the run's own grid (``steps``, ``eps``,
    ``model.shift``); ``auto`` is the model's own scheduler where it brings one (``model=diffusers``), else ``em``.
    The scheduler kernels (:class:`DDPMKernelConfig`, :class:`EulerAncestralKernelConfig`,
    :class:`FlowStochasticKernelConfig`, :class:`DDIMKernelConfig`, :class:`DPMSolverSDEKernelConfig`) take their
    grid and noise from a diffusers scheduler built from their keys.
    """

    name: str = "em"


@dataclass
class EMKernelConfig(KernelConfig):
    """``kernel=em``: Euler--Maruyama with churn ``eps`` (no keys of its own)."""

    name: str = "em"


@dataclass
class AutoKernelConfig(KernelConfig):
    """``kernel=auto``: the model's own scheduler (``model=diffusers``: its pipeline's), else ``em``."""

    name: str = "auto"


@dataclass
class BetasKernelConfig(KernelConfig):
    """The keys of a discrete-time scheduler's noise levels (diffusers' names and defaults)."""

    num_train_timesteps: int = between(2, MAX_TRAIN_TIMESTEPS, 1000, why="the scheduler's tables have this length")
    beta_schedule: str = one_of(BETA_SCHEDULES, "linear")
    beta_start: float = _number("a finite number in (0, 1)", lambda v: 0 < v < 1, 0.0001)
    beta_end: float = _number("a finite number in (0, 1)", lambda v: 0 < v < 1, 0.02)
    timestep_spacing: str = one_of(TIMESTEP_SPACINGS, "leading")
    steps_offset: int = at_least(0, 0)


def _ddpm_variances():
    from ..kernels import DDPM_VARIANCES

    return DDPM_VARIANCES


@dataclass
class DDPMKernelConfig(BetasKernelConfig):
    """``kernel=ddpm``: ``diffusers.DDPMScheduler`` with these keys (``clip_sample`` is off here, on in diffusers:
    the shipped targets' data are not confined to ``[-1, 1]``)."""

    name: str = "ddpm"
    variance_type: str = one_of(_ddpm_variances, "fixed_small")
    clip_sample: bool = False
    clip_sample_range: float = _number("a finite number > 0", lambda v: v > 0, 1.0)
    thresholding: bool = False
    dynamic_thresholding_ratio: float = _number("a finite number in (0, 1]", lambda v: 0 < v <= 1, 0.995)
    sample_max_value: float = _number("a finite number > 0", lambda v: v > 0, 1.0)


@dataclass
class EulerAncestralKernelConfig(BetasKernelConfig):
    """``kernel=euler_ancestral``: ``diffusers.EulerAncestralDiscreteScheduler``'s levels with k-diffusion's ``eta``
    and ``s_noise`` (the scheduler itself is ``eta = s_noise = 1``)."""

    name: str = "euler_ancestral"
    timestep_spacing: str = one_of(TIMESTEP_SPACINGS, "linspace")
    eta: float = _number(
        "a finite number > 0 (eta=0 is the deterministic Euler sampler, where speculation is vacuous)",
        lambda v: v > 0,
        1.0,
    )
    s_noise: float = _number("a finite number > 0", lambda v: v > 0, 1.0)


@dataclass
class FlowStochasticKernelConfig(KernelConfig):
    """``kernel=flow_stochastic``: ``diffusers.FlowMatchEulerDiscreteScheduler(stochastic_sampling=True)``."""

    name: str = "flow_stochastic"
    num_train_timesteps: int = between(2, MAX_TRAIN_TIMESTEPS, 1000, why="the scheduler's tables have this length")
    shift: float | None = rule(
        "a finite number > 0, or null (the model's shift, model.shift)",
        lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0,
        None,
    )


def _solver_types():
    from ..dpmpp import SOLVER_TYPES

    return SOLVER_TYPES


POSITIVE = ("a finite number > 0", lambda v: v > 0)


@dataclass
class KarrasLevelsConfig(KernelConfig):
    """The keys of Karras et al.'s levels (k-diffusion's ``get_sigmas_karras``; EDM's defaults)."""

    sigma_min: float = _number(*POSITIVE, 0.002)
    sigma_max: float = _number(*POSITIVE, 80.0)
    rho: float = _number(*POSITIVE, 7.0)


@dataclass
class KarrasKernelConfig(KarrasLevelsConfig):
    """Karras' levels and the stochastic samplers' noise (``eta > 0``: 0 is the deterministic sampler, where speculation
    is vacuous)."""

    eta: float = _number(
        "a finite number > 0 (eta=0 is the deterministic sampler, where speculation is vacuous)", lambda v: v > 0, 1.0
    )
    s_noise: float = _number(*POSITIVE, 1.0)


@dataclass
class DPMPP2MSDEKernelConfig(KarrasKernelConfig):
    """``kernel=dpmpp_2m_sde``: k-diffusion's DPM-Solver++(2M) SDE on Karras' levels."""

    name: str = "dpmpp_2m_sde"
    solver_type: str = one_of(_solver_types, "midpoint")


@dataclass
class DPMPP3MSDEKernelConfig(KarrasKernelConfig):
    """``kernel=dpmpp_3m_sde``: k-diffusion's DPM-Solver++(3M) SDE on Karras' levels."""

    name: str = "dpmpp_3m_sde"


@dataclass
class LCMKernelConfig(KarrasLevelsConfig):
    """``kernel=lcm``: ComfyUI's LCM sampler on Karras' levels, the noise scaled from ``s_noise`` to ``s_noise_end``."""

    name: str = "lcm"
    s_noise: float = _number(*POSITIVE, 1.0)
    s_noise_end: float | None = rule(
        "a finite number > 0, or null (s_noise throughout)",
        lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0,
        None,
    )


@dataclass
class EulerAncestralRFKernelConfig(KernelConfig):
    """``kernel=euler_ancestral_rf``: ComfyUI's Euler ancestral for flow models on the shifted flow levels."""

    name: str = "euler_ancestral_rf"
    shift: float = _number(*POSITIVE, 3.0)
    eta: float = _number(
        "a finite number in (0, 1] (eta=0 is the deterministic Euler sampler; above 1 the step down can fall below 0)",
        lambda v: 0 < v <= 1,
        1.0,
    )
    s_noise: float = _number(*POSITIVE, 1.0)


@dataclass
class ERSDEKernelConfig(KarrasLevelsConfig):
    """``kernel=er_sde``: ComfyUI's ER-SDE solver (default noise scaler) on Karras' levels."""

    name: str = "er_sde"
    s_noise: float = _number(*POSITIVE, 1.0)
    max_stage: int = between(1, 3, 3, why="ComfyUI's stages: the order used")


@dataclass
class RESMultistepAncestralKernelConfig(KarrasKernelConfig):
    """``kernel=res_multistep_ancestral``: ComfyUI's ancestral RES multistep on Karras' levels."""

    name: str = "res_multistep_ancestral"


@dataclass
class DDIMKernelConfig(BetasKernelConfig):
    """``kernel=ddim``: ``diffusers.DDIMScheduler`` with these keys (``clip_sample`` off here, as for ``ddpm``),
    stepped with ``eta`` (> 0) and ``use_clipped_model_output`` as ``DDIMScheduler.step`` takes them."""

    name: str = "ddim"
    clip_sample: bool = False
    clip_sample_range: float = _number("a finite number > 0", lambda v: v > 0, 1.0)
    thresholding: bool = False
    dynamic_thresholding_ratio: float = _number("a finite number in (0, 1]", lambda v: 0 < v <= 1, 0.995)
    sample_max_value: float = _number("a finite number > 0", lambda v: v > 0, 1.0)
    set_alpha_to_one: bool = True
    eta: float = _number(
        "a finite number > 0 (eta=0 is the deterministic DDIM sampler, where speculation is vacuous)",
        lambda v: v > 0,
        1.0,
    )
    use_clipped_model_output: bool = False


@dataclass
class DPMSolverSDEKernelConfig(BetasKernelConfig):
    """``kernel=dpmsolver_sde``: ``diffusers.DPMSolverMultistepScheduler(algorithm_type="sde-dpmsolver++")`` with
    these keys (at most one of the sigma spacings ``use_*_sigmas``)."""

    name: str = "dpmsolver_sde"
    timestep_spacing: str = one_of(TIMESTEP_SPACINGS, "linspace")
    solver_order: int = between(1, 3, 2, why="DPM-Solver++ SDE is written for orders 1 to 3")
    solver_type: str = one_of(("midpoint", "heun"), "midpoint")
    lower_order_final: bool = True
    euler_at_final: bool = False
    final_sigmas_type: str = one_of(("zero", "sigma_min"), "zero")
    use_karras_sigmas: bool = False
    use_exponential_sigmas: bool = False
    use_beta_sigmas: bool = False
    use_lu_lambdas: bool = False
    thresholding: bool = False
    dynamic_thresholding_ratio: float = _number("a finite number in (0, 1]", lambda v: 0 < v <= 1, 0.995)
    sample_max_value: float = _number("a finite number > 0", lambda v: v > 0, 1.0)


KERNEL_SCHEMAS = {
    "em": EMKernelConfig,
    "auto": AutoKernelConfig,
    "ddpm": DDPMKernelConfig,
    "euler_ancestral": EulerAncestralKernelConfig,
    "flow_stochastic": FlowStochasticKernelConfig,
    "dpmpp_2m_sde": DPMPP2MSDEKernelConfig,
    "dpmpp_3m_sde": DPMPP3MSDEKernelConfig,
    "euler_ancestral_rf": EulerAncestralRFKernelConfig,
    "lcm": LCMKernelConfig,
    "er_sde": ERSDEKernelConfig,
    "res_multistep_ancestral": RESMultistepAncestralKernelConfig,
    "ddim": DDIMKernelConfig,
    "dpmsolver_sde": DPMSolverSDEKernelConfig,
}
"""The kernel config classes by ``kernel.name`` (Hydra schemas ``kernel/<name>_schema``)."""
SCHEDULER_KERNELS = tuple(cls.name for cls in scheduler_kernels())
"""The kernels that reproduce a diffusers scheduler (their ``schedulers``, :mod:`specsamp.kernels`)."""


def _kernel_schema(kernel) -> type:
    """The kernel config class that ``kernel.name`` names (:data:`KERNEL_SCHEMAS`).

    Raises:
        ConfigError: a node that is not a mapping, or a name that is not a kernel's.
    """
    name = kernel.get("name") if isinstance(kernel, Mapping) else None
    if name not in KERNEL_SCHEMAS:
        shown = f"kernel.name={name!r}" if isinstance(kernel, Mapping) else f"kernel={kernel!r}"
        schedulers = ", ".join(SCHEDULER_KERNELS[:-1]) + " and " + SCHEDULER_KERNELS[-1]
        raise ConfigError(
            f"{shown} is invalid: must be one of {', '.join(KERNEL_SCHEMAS)} (conf/kernel/: em, the paper's "
            f"Euler-Maruyama kernel and the default; auto, the model's own scheduler; {schedulers}, the "
            "diffusers schedulers' steps)."
        )
    return KERNEL_SCHEMAS[name]


def brings_scheduler(model) -> bool:
    """Whether a model config may bring its own scheduler: its class overrides
    :meth:`~specsamp.models.base.TargetConfig.scheduler_plan` (``model=diffusers``); no shipped model does."""
    from ..models.base import TargetConfig

    own = getattr(type(model), "scheduler_plan", None)
    return own is not None and own is not getattr(TargetConfig, "scheduler_plan", None)


def kernel_name(run) -> str:
    """The run's kernel name (``em`` when the config has none)."""
    return getattr(run.kernel, "name", None) or "em"


def check_kernel(run) -> None:
    """Each kernel key's rule, diffusers being importable for a scheduler kernel, and ``steps`` within the
    scheduler's training timesteps.

    Raises:
        ConfigError: names the key, its value and what is valid.
    """
    k = run.kernel
    if k is None:
        return
    for f in dataclasses.fields(k):
        meta, v = f.metadata, getattr(k, f.name)
        if meta and (v is not None or not meta.get("nullable", True)) and not meta["ok"](v):
            text = meta["text"]() if callable(meta["text"]) else meta["text"]
            raise ConfigError(
                f"kernel.{f.name}={'null' if v is None else repr(v)} is invalid for kernel={k.name}: must be {text}."
            )
    if isinstance(k, KarrasLevelsConfig) and not k.sigma_min < k.sigma_max:
        raise ConfigError(
            f"kernel.sigma_min={k.sigma_min!r} is invalid with kernel.sigma_max={k.sigma_max!r} for kernel={k.name}: "
            "Karras' levels fall from sigma_max to sigma_min, so sigma_min must be below sigma_max."
        )
    kernel = KERNELS.get(k.name) if k.name in KERNELS else None
    if kernel is None or not kernel.schedulers:
        return
    import importlib.util

    if importlib.util.find_spec("diffusers") is None:
        raise ConfigError(
            f"kernel={k.name} is invalid here: it builds its grid with a diffusers scheduler, and diffusers is "
            "not installed; pip install 'specsamp[sd3]' (or diffusers), or use kernel=em."
        )
    if kernel.train_steps_bound and run.steps > k.num_train_timesteps:
        raise ConfigError(
            f"steps={run.steps} is invalid with kernel={k.name}: the scheduler samples at most "
            f"kernel.num_train_timesteps={k.num_train_timesteps} distinct timesteps; use steps <= "
            f"{k.num_train_timesteps}, or raise kernel.num_train_timesteps."
        )
