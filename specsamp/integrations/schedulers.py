"""A diffusers scheduler as a :class:`~specsamp.schedule.Schedule`: its own time grid, its kernel and its options.

:func:`from_scheduler` reads a scheduler's config and the grid its ``set_timesteps`` makes (a fresh instance
from the config, so the caller's scheduler is not touched) and returns the run's :class:`SchedulerPlan`: the
schedule on the linear path (:mod:`specsamp.kernels`: ``ddpm``, ``euler_ancestral``, ``flow_stochastic``), the
timestep of each level for the network, the coordinates and prediction its network works in
(:mod:`specsamp.models.parametrisation`), and the scale of the first state. A scheduler or an option whose step
is not reproduced exactly is refused with a :class:`~specsamp.errors.ConfigError` naming what is supported.

The plan is the sampler of a loop that uses the scheduler as ``StableDiffusionPipeline``'s does: first latents
times ``init_noise_sigma``, the network at ``scale_model_input`` of the state, then ``step``. For ``DDPMScheduler``
(``init_noise_sigma = 1``, ``scale_model_input`` the identity) and the flow scheduler (neither) every diffusers
loop is that; for Euler ancestral a loop that skips both (``DDPMPipeline``, ``StableDiffusion3Pipeline``) is
another sampler, which :func:`specsamp.integrations.diffusers.check_loop` refuses.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..arguments import describe
from ..errors import ConfigError
from ..kernels import DDPM_VARIANCES
from ..schedule import Schedule

SUPPORTED = ("ddpm (DDPMScheduler), euler_ancestral (EulerAncestralDiscreteScheduler; k-diffusion's "
             "sample_euler_ancestral) and flow_stochastic (FlowMatchEulerDiscreteScheduler with stochastic_sampling=True)")
KERNEL_OF = {"DDPMScheduler": "ddpm", "EulerAncestralDiscreteScheduler": "euler_ancestral",
             "FlowMatchEulerDiscreteScheduler": "flow_stochastic"}
MAX_STEPS = 100_000  # a grid longer than this is a typo, not a sampler


def refuse(name: str, why: str = "") -> ConfigError:
    """The one paragraph that refuses scheduler ``name``."""
    why = why or ("its step is not a Gaussian transition with a state-independent scale (a multistep, "
                  "deterministic or predictor-corrector solver: DPM-Solver++, DDIM with eta=0, UniPC, Heun, "
                  "PNDM, LMS, Euler without noise), so speculation cannot be exact")
    return ConfigError(f"scheduler={name!r} is not supported: {why}. The exact kernels are {SUPPORTED}; "
                       "set the pipeline's scheduler to one of them (e.g. DDPMScheduler.from_config(pipe.scheduler.config)).")


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


def _cfg(scheduler, key, default=None):
    return scheduler.config.get(key, default) if hasattr(scheduler.config, "get") else getattr(scheduler.config, key, default)


def _check_steps(num_inference_steps) -> int:
    if isinstance(num_inference_steps, bool) or not isinstance(num_inference_steps, int) or not 3 <= num_inference_steps <= MAX_STEPS:
        raise ConfigError(f"num_inference_steps={describe(num_inference_steps)} is invalid: need an integer in "
                          f"[3, {MAX_STEPS}] (the first and last steps lie outside speculation).")
    return num_inference_steps


def _linear_levels(s: torch.Tensor) -> torch.Tensor:
    """The grid with its final 0, float64, checked strictly decreasing inside ``(0, 1]``."""
    s = torch.cat([s.to(torch.float64).cpu(), torch.zeros(1, dtype=torch.float64)])
    if not (bool((s[1:] < s[:-1]).all()) and float(s[0]) <= 1.0):
        raise ConfigError("the scheduler's grid is not strictly decreasing in noise (repeated or rising timesteps); "
                          "choose another num_inference_steps or timestep_spacing")
    return s


def from_scheduler(scheduler, num_inference_steps: int, *, event_ndim: int = 3, mu: float | None = None,
                   eta: float = 1.0, s_noise: float = 1.0) -> SchedulerPlan:
    """The :class:`SchedulerPlan` of a diffusers scheduler at ``num_inference_steps``.

    Args:
        scheduler: a ``DDPMScheduler``, ``EulerAncestralDiscreteScheduler`` or ``FlowMatchEulerDiscreteScheduler``
            (``stochastic_sampling=True``); its config is read, the instance is not changed.
        num_inference_steps: the pipeline's number of steps ``T`` (3 to 100,000).
        event_ndim: dimensions of one state (3 for images ``[C, H, W]``): where DDPM's dynamic thresholding
            takes its per-sample quantile.
        mu: the flow scheduler's shift when it uses dynamic shifting (SD3.5 passes it from the image size).
        eta, s_noise: Euler ancestral's noise options (diffusers' scheduler is ``eta = s_noise = 1``).

    Raises:
        ConfigError: a scheduler, option or step count whose step is not reproduced exactly (one paragraph
            naming what is supported).
    """
    name = type(scheduler).__name__
    if name not in KERNEL_OF:
        raise refuse(name)
    steps = _check_steps(num_inference_steps)
    fresh = type(scheduler).from_config(scheduler.config)
    kernel = KERNEL_OF[name]
    if kernel == "ddpm":
        return _ddpm(fresh, steps, event_ndim)
    if kernel == "euler_ancestral":
        return _euler_ancestral(fresh, steps, eta, s_noise)
    return _flow(fresh, steps, mu)


def _ddpm(sch, steps: int, event_ndim: int) -> SchedulerPlan:
    variance = _cfg(sch, "variance_type", "fixed_small")
    if variance not in DDPM_VARIANCES:
        raise refuse("DDPMScheduler", f"variance_type={variance!r} is not reproduced (supported: {', '.join(DDPM_VARIANCES)}; "
                     "a learned variance depends on the state)")
    if _cfg(sch, "rescale_betas_zero_snr", False):
        raise refuse("DDPMScheduler", "rescale_betas_zero_snr=True puts the first level at infinite noise, where the "
                     "data prediction is undefined on the linear path")
    if steps > _cfg(sch, "num_train_timesteps", 1000):
        raise ConfigError(f"num_inference_steps={steps} is invalid: DDPMScheduler has num_train_timesteps="
                          f"{_cfg(sch, 'num_train_timesteps')} and needs num_inference_steps at most that")
    sch.set_timesteps(steps)
    ts = sch.timesteps.long()
    a = sch.alphas_cumprod.to(torch.float64)[ts]
    sg, al = (1.0 - a).sqrt(), a.sqrt()
    s = _linear_levels(sg / (al + sg))
    opts = {"variance_type": variance, "final_noise": bool(ts[-1] > 0), "event_ndim": event_ndim}
    if _cfg(sch, "thresholding", False):
        opts["threshold"] = (float(_cfg(sch, "dynamic_thresholding_ratio")), float(_cfg(sch, "sample_max_value")))
    elif _cfg(sch, "clip_sample", False):
        opts["clip"] = float(_cfg(sch, "clip_sample_range", 1.0))
    k0 = float(al[0] + sg[0])
    return SchedulerPlan(Schedule(s, 1.0, "ddpm", opts), ts, "vp", _cfg(sch, "prediction_type", "epsilon"), 1.0 / k0,
                         "DDPMScheduler")


def _euler_ancestral(sch, steps: int, eta: float, s_noise: float) -> SchedulerPlan:
    pred = _cfg(sch, "prediction_type", "epsilon")
    if pred not in ("epsilon", "v_prediction"):
        raise refuse("EulerAncestralDiscreteScheduler", f"prediction_type={pred!r} is not implemented by the scheduler "
                     "itself (supported: epsilon, v_prediction)")
    sch.set_timesteps(steps)
    sig = sch.sigmas.to(torch.float64)[:-1]
    s = _linear_levels(sig / (1.0 + sig))
    init = float(sch.init_noise_sigma) / (1.0 + float(sig[0]))
    opts = {"eta": eta, "s_noise": s_noise, "init_scale": init}
    return SchedulerPlan(Schedule(s, 1.0, "euler_ancestral", opts), sch.timesteps.clone(), "vp", pred, init,
                         "EulerAncestralDiscreteScheduler")


def _flow(sch, steps: int, mu: float | None) -> SchedulerPlan:
    if not _cfg(sch, "stochastic_sampling", False):
        raise refuse("FlowMatchEulerDiscreteScheduler", "stochastic_sampling=False is the deterministic Euler ODE "
                     "solver, where speculation is vacuous; set stochastic_sampling=True")
    if _cfg(sch, "use_dynamic_shifting", False):
        if mu is None:
            raise ConfigError("mu=None is invalid: this FlowMatchEulerDiscreteScheduler uses dynamic shifting, so its "
                              "grid needs the shift mu (the pipeline computes it from the image size); pass mu=")
        sch.set_timesteps(steps, mu=mu)
    else:
        sch.set_timesteps(steps)
    s = _linear_levels(sch.sigmas.to(torch.float64)[:-1])
    return SchedulerPlan(Schedule(s, 1.0, "flow_stochastic", {}), sch.timesteps.clone(), "linear", "flow", 1.0,
                         "FlowMatchEulerDiscreteScheduler")
