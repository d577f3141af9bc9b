"""A diffusers scheduler as a :class:`~specsamp.schedule.Schedule`: its own time grid, its kernel and its options.

:func:`from_scheduler` reads a scheduler's config and the grid its ``set_timesteps`` makes (a fresh instance
from the config, so the caller's scheduler is not touched) and returns the run's :class:`SchedulerPlan`: the
schedule on the linear path (the kernel that names the scheduler's class in its ``schedulers``,
:mod:`specsamp.kernels`, and reads its config: :meth:`~specsamp.kernels.Kernel.read_scheduler`), the timestep of
each level for the network, the coordinates and prediction its network works in
(:mod:`specsamp.models.parametrisation`), and the scale of the first state. A scheduler or an option whose step
is not reproduced exactly is refused with a :class:`~specsamp.errors.ConfigError` naming what is supported.

The plan is the sampler of a loop that uses the scheduler as ``StableDiffusionPipeline``'s does: first latents
times ``init_noise_sigma``, the network at ``scale_model_input`` of the state, then ``step``. For ``DDPMScheduler``
(``init_noise_sigma = 1``, ``scale_model_input`` the identity) and the flow scheduler (neither) every diffusers
loop is that; for Euler ancestral a loop that skips both (``DDPMPipeline``, ``StableDiffusion3Pipeline``) is
another sampler, which :func:`specsamp.integrations.diffusers.check_loop` refuses (the kernel's ``scaling_loop``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .arguments import describe
from .errors import ConfigError
from .kernels import kernel_of_scheduler, refuse, scheduler_kernels, supported_schedulers
from .schedule import Schedule

SUPPORTED = supported_schedulers()
"""The kernels that reproduce a scheduler, as refusals name them (the kernels registered when this was imported)."""
KERNEL_OF = {s: cls.name for cls in scheduler_kernels() for s in cls.schedulers}
"""Scheduler class name to kernel name, read from the kernels' ``schedulers`` (:func:`kernel_of_scheduler` also
sees kernels registered later)."""
MAX_STEPS = 100_000  # a grid longer than this is a typo, not a sampler


@dataclass
class SchedulerPlan:
    """What a run needs from a scheduler.

    Attributes:
        schedule: the linear-path grid ``[T + 1]`` (float64, ending at 0) and the kernel with its options.
        timesteps: ``[T]`` the network's time argument at each step's level (the scheduler's ``timesteps``).
        coords: the network's coordinates (``vp`` for diffusers' UNets, ``linear`` for flow transformers).
        prediction: the network's prediction type (``epsilon``, ``v_prediction``, ``sample``, ``flow``).
        init_scale: the first state on the linear path is ``init_scale * latents`` for latents ``~ N(0, I)`` as
            the pipeline draws them, times ``init_noise_sigma`` as a scaling loop applies it (module docstring).
        name: the scheduler's class name.
    """

    schedule: Schedule
    timesteps: torch.Tensor
    coords: str
    prediction: str
    init_scale: float
    name: str

    @property
    def kernel(self) -> str:
        """The registered kernel's name."""
        return self.schedule.kernel_name


def _check_steps(num_inference_steps) -> int:
    n = num_inference_steps
    if isinstance(n, bool) or not isinstance(n, int) or not 3 <= n <= MAX_STEPS:
        raise ConfigError(
            f"num_inference_steps={describe(num_inference_steps)} is invalid: need an integer in "
            f"[3, {MAX_STEPS}] (the first and last steps lie outside speculation)."
        )
    return num_inference_steps


def from_scheduler(
    scheduler,
    num_inference_steps: int,
    *,
    event_ndim: int = 3,
    mu: float | None = None,
    eta: float = 1.0,
    s_noise: float = 1.0,
    use_clipped_model_output: bool = False,
) -> SchedulerPlan:
    """The :class:`SchedulerPlan` of a diffusers scheduler at ``num_inference_steps``.

    Args:
        scheduler: a scheduler whose class a registered kernel reproduces (``DDPMScheduler``,
            ``EulerAncestralDiscreteScheduler``, ``FlowMatchEulerDiscreteScheduler`` with
            ``stochastic_sampling=True``, ``DDIMScheduler`` (``eta > 0``) or ``DPMSolverMultistepScheduler`` with
            ``algorithm_type="sde-dpmsolver++"``); its config is read, the instance is not changed.
        num_inference_steps: the pipeline's number of steps ``T`` (3 to 100,000).
        event_ndim: dimensions of one state (3 for images ``[C, H, W]``): where DDPM's dynamic thresholding
            takes its per-sample quantile.
        mu: the flow scheduler's shift when it uses dynamic shifting (SD3.5 passes it from the image size).
        eta, s_noise: Euler ancestral's noise options (diffusers' scheduler is ``eta = s_noise = 1``); ``eta`` is
            also DDIM's (``DDIMScheduler.step(eta=...)``, > 0); a kernel reads those in its ``run_options``.
        use_clipped_model_output: DDIM's ``step`` option (the noise prediction recomputed from the clipped data
            prediction).

    Raises:
        ConfigError: a scheduler, option or step count whose step is not reproduced exactly (one paragraph
            naming what is supported).
    """
    name = type(scheduler).__name__
    kernel = kernel_of_scheduler(name)
    if kernel is None:
        raise refuse(name)
    steps = _check_steps(num_inference_steps)
    fresh = type(scheduler).from_config(scheduler.config)
    given = {"eta": eta, "s_noise": s_noise, "use_clipped_model_output": use_clipped_model_output}
    read = kernel.read_scheduler(
        fresh, steps, event_ndim=event_ndim, mu=mu, **{k: given[k] for k in kernel.run_options}
    )
    return SchedulerPlan(
        Schedule(read.levels, 1.0, kernel.name, read.options),
        read.timesteps,
        read.coords,
        read.prediction,
        read.init_scale,
        name,
    )


__all__ = ["KERNEL_OF", "MAX_STEPS", "SUPPORTED", "SchedulerPlan", "from_scheduler", "refuse"]
