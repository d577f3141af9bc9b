"""``diffusers.DDIMScheduler.step(eta=...)`` with ``eta > 0`` as a kernel (Song et al. 2021, arXiv:2010.02502, eqs. 12
and 16).

In the scheduler's variance-preserving coordinates ``y = sqrt(a) x0 + sqrt(1 - a) xi`` the step from the cumulative
alpha ``a_t`` (the step's timestep) to ``a_p`` (the timestep ``num_train_timesteps // T`` below it, or
``final_alpha_cumprod`` once that is negative) is::

    sigma_t = eta sqrt((1 - a_p) / (1 - a_t) (1 - a_t / a_p)),
    y' = sqrt(a_p) x0c + sqrt(1 - a_p - sigma_t^2) eps_hat + sigma_t z,

``x0c`` the clipped (``clip_sample``) or thresholded data prediction, ``eps_hat`` the network's noise prediction
``(y - sqrt(a_t) x0) / sqrt(1 - a_t)`` from the unclipped ``x0``, or from ``x0c`` with ``use_clipped_model_output``:
either way affine in ``(y, x0c, x0)``, so the step is a :class:`~specsamp.kernels.DataPredictionKernel` with one more
column, ``c_raw``, the weight of the unclipped data prediction. ``eta = 0`` is the deterministic DDIM sampler, where
speculation is vacuous: refused.

``a_p`` need not be the next step's level (``timestep_spacing="linspace"``: ``t - ratio`` is not the next timestep):
the state the step hands on is read by the next step at that step's level, so the linear-path state there is
``y' / k_{n+1}`` with ``k`` at the next step's level (1 after the last step), while the coefficients use ``a_p``.
"""

from __future__ import annotations

import torch

from .errors import ConfigError
from .kernels import DataPredictionKernel, SchedulerLevels, config_value, linear_levels, refuse, register_kernel

DDIM_PREDICTIONS = ("epsilon", "sample", "v_prediction")


def _clip_options(sch) -> dict:
    """``threshold`` (dynamic thresholding) or ``clip`` (``clip_sample``) from a scheduler's config, as diffusers
    applies them: thresholding first."""
    if config_value(sch, "thresholding", False):
        return {
            "threshold": (
                float(config_value(sch, "dynamic_thresholding_ratio")),
                float(config_value(sch, "sample_max_value")),
            )
        }
    if config_value(sch, "clip_sample", False):
        return {"clip": float(config_value(sch, "clip_sample_range", 1.0))}
    return {}


@register_kernel("ddim")
class DDIM(DataPredictionKernel):
    """DDIM with ``eta > 0`` as ``diffusers.DDIMScheduler.step`` computes it (module docstring).

    Options: ``eta`` (> 0), ``alphas_prev`` (the ``a_p`` of each step, ``[T]``; default: each next level's, and 1
    after the last), ``clipped_eps`` (diffusers' ``use_clipped_model_output``), ``clip``/``threshold``.
    """

    columns = ("c_x", "c_x0", "c_raw", "sigma", "std", "lsnr")
    schedulers = ("DDIMScheduler",)
    scheduler_note = "DDIMScheduler with eta > 0"
    run_options = ("eta", "use_clipped_model_output")
    reads_shift = False
    train_steps_bound = True

    @classmethod
    def read_scheduler(
        cls, sch, steps: int, *, event_ndim: int = 3, mu=None, eta: float = 1.0, use_clipped_model_output=False
    ) -> SchedulerLevels:
        if isinstance(eta, bool) or not isinstance(eta, (int, float)) or not eta > 0:
            raise refuse(
                "DDIMScheduler",
                f"eta={eta!r} is the deterministic DDIM sampler (no noise: speculation is vacuous), or not a "
                "number; pass eta > 0 (eta=1 is DDPM's ancestral variance)",
            )
        pred = config_value(sch, "prediction_type", "epsilon")
        if pred not in DDIM_PREDICTIONS:
            raise refuse("DDIMScheduler", f"prediction_type={pred!r} is not one of {', '.join(DDIM_PREDICTIONS)}")
        if config_value(sch, "rescale_betas_zero_snr", False):
            raise refuse(
                "DDIMScheduler",
                "rescale_betas_zero_snr=True puts a level at infinite noise, where the data prediction is "
                "undefined on the linear path",
            )
        train = config_value(sch, "num_train_timesteps", 1000)
        if steps > train:
            raise ConfigError(
                f"num_inference_steps={steps} is invalid: DDIMScheduler has num_train_timesteps={train} and needs "
                "num_inference_steps at most that"
            )
        sch.set_timesteps(steps)
        ts = sch.timesteps.long()
        ac = sch.alphas_cumprod.to(torch.float64)
        prev = ts - train // steps
        final = float(sch.final_alpha_cumprod)
        a_p = torch.where(prev >= 0, ac[prev.clamp(min=0)], torch.full_like(ac[ts], final))
        a = ac[ts]
        sg, al = (1.0 - a).sqrt(), a.sqrt()
        s = linear_levels(sg / (al + sg))
        opts = {
            "eta": float(eta),
            "alphas_prev": [float(v) for v in a_p],
            "clipped_eps": bool(use_clipped_model_output),
            "event_ndim": event_ndim,
            **_clip_options(sch),
        }
        return SchedulerLevels(s, opts, ts, "vp", pred, 1.0 / float(al[0] + sg[0]))

    def __init__(self, sigmas, eps, eta: float = 1.0, alphas_prev=None, clipped_eps: bool = False, **options):
        super().__init__(sigmas, eps, **options)
        if not float(eta) > 0:
            raise ValueError(f"eta={eta!r} must be > 0 (eta=0 is the deterministic DDIM sampler)")
        self.eta, self.clipped_eps = float(eta), bool(clipped_eps)
        a = self.alphas_cumprod()
        self.alphas_prev = (
            a[1:].clone() if alphas_prev is None else torch.as_tensor(alphas_prev, dtype=torch.float64).reshape(-1)
        )
        if self.alphas_prev.numel() != self.steps:
            raise ValueError(f"alphas_prev has {self.alphas_prev.numel()} entries for {self.steps} steps")

    def alphas_cumprod(self) -> torch.Tensor:
        """float64 ``[T + 1]``: ``a`` at each level of the grid (1 at its final 0)."""
        r = self.sigmas / (1.0 - self.sigmas)
        return 1.0 / (1.0 + r * r)

    def level_scale(self) -> torch.Tensor:
        a = self.alphas_cumprod()
        return a.sqrt() + (1.0 - a).sqrt()

    def columns64(self, device) -> dict[str, torch.Tensor]:
        a_t = self.alphas_cumprod().to(device)[:-1]
        a_p = self.alphas_prev.to(device)
        # clamped at 0: a step from a level to itself (a_p = a_t: set_alpha_to_one=False at timestep 0) has no noise,
        # whatever the last bit of a_t read back from the grid
        std = self.eta * ((1.0 - a_p) / (1.0 - a_t) * (1.0 - a_t / a_p)).clamp(min=0.0).sqrt()
        direction = (1.0 - a_p - std * std).clamp(min=0.0).sqrt()
        A = direction / (1.0 - a_t).sqrt()  # y's weight through eps_hat
        B_eps = -A * a_t.sqrt()  # eps_hat's weight on the data prediction it is computed from
        clipping = self.clip is not None or self.threshold is not None
        if self.clipped_eps or not clipping:  # eps_hat from the clipped prediction (or no clipping: the same)
            B, raw = a_p.sqrt() + B_eps, torch.zeros_like(a_t)
        else:
            B, raw = a_p.sqrt(), B_eps
        k = self.level_scale().to(device)
        return {
            "c_x": A * k[:-1] / k[1:],
            "c_x0": B / k[1:],
            "c_raw": raw / k[1:],
            "sigma": self.sigmas.to(device)[:-1],
            "std": std / k[1:],
        }

    def mean(self, x: torch.Tensor, out: torch.Tensor, c: dict) -> torch.Tensor:
        d = x - c["sigma"] * out
        return c["c_x"] * x + c["c_x0"] * self.clip_x0(d) + c["c_raw"] * d
