"""Transition kernels: a reverse step's Gaussian ``N(mean, std^2 I)`` from per-step coefficients.

A kernel owns one step's coefficients on the run's noise grid: the mean as an affine map of the state ``x`` and
the network's output ``out`` (:meth:`Kernel.mean`), and the standard deviation (the ``std`` column). Everything
that writes a step (the standard sampler, the endpoint steps, the drafts, the speculative rounds' target means
and draft noise, the Picard sweeps) reads both from here: the coefficients as one table per device and dtype
(:meth:`Kernel.table`, ``[T, C]``, one row per step, one column per name in :attr:`Kernel.columns`), gathered by
step where a round needs them, so a round never recomputes a coefficient. Every kernel's columns include
``sigma`` (``sigma_n``, which the drafts read), ``lsnr`` (the half log-SNR ``log((1 - sigma) / sigma)`` in the
table's dtype, for the extrapolating drafts) and ``std``.

Adding a kernel is one subclass and a registration (``docs/extending.md``)::

    @register_kernel("mine")
    class Mine(Kernel):
        columns = ("c_x", "c_out", "sigma", "std", "lsnr")
        def columns64(self, device): ...      # float64 [T] per column, from self.sigmas and self.eps
        def mean(self, x, out, c): return c["c_x"] * x + c["c_out"] * out

A kernel that reproduces a diffusers scheduler also says which (:attr:`Kernel.schedulers`) and how the
scheduler's config reads into its options (:meth:`Kernel.read_scheduler`, with the class attributes beside it):
:mod:`specsamp.schedulers`, the diffusers entry point and model and the runner read every scheduler-to-kernel
map from these.

A multistep kernel (DPM-Solver++(2M) SDE and the like) sets :attr:`Kernel.order` to the number of outputs its mean
reads and takes ``history`` in :meth:`Kernel.mean`: the :meth:`Kernel.record` of the ``order - 1`` earlier states of
the same trajectory, which every layout gathers from a node's ancestry and the committed path.

:meth:`Kernel.mean` fixes its floating-point operations: the tables hold bit for bit what a per-step computation
would, and each kernel's ``mean`` is the one formula every caller runs, so the executions agree bitwise.
"""

from __future__ import annotations

from typing import ClassVar, NamedTuple

import torch

from .errors import ConfigError
from .registry import Registry


def per_row(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """View ``t [m]`` as ``[m, 1, ..., 1]`` with ``like.ndim`` dimensions, to scale the rows of ``like``."""
    return t.reshape((-1,) + (1,) * (like.ndim - 1))


def lsnr(sigma: torch.Tensor) -> torch.Tensor:
    """Half log-SNR ``log((1 - sigma) / sigma)`` of the linear path; ``-inf`` at ``sigma = 1``."""
    return torch.log1p(-sigma) - torch.log(sigma)


class SchedulerLevels(NamedTuple):
    """What a diffusers scheduler makes of a kernel (:meth:`Kernel.read_scheduler`).

    Attributes:
        levels: float64 ``[T + 1]`` the grid on the linear path, strictly decreasing, ending at 0.
        options: keyword arguments of the kernel's constructor.
        timesteps: ``[T]`` the network's time argument at each step's level.
        coords: the network's coordinates (``vp`` or ``linear``, :mod:`specsamp.models.parametrisation`).
        prediction: the network's prediction type (``epsilon``, ``v_prediction``, ``sample``, ``flow``).
        init_scale: the first state on the linear path is ``init_scale * latents``.
    """

    levels: torch.Tensor
    options: dict
    timesteps: torch.Tensor
    coords: str
    prediction: str
    init_scale: float


def config_value(scheduler, key, default=None):
    """``scheduler.config[key]`` (a dict-like or attribute config), ``default`` where it is absent."""
    return (
        scheduler.config.get(key, default)
        if hasattr(scheduler.config, "get")
        else getattr(scheduler.config, key, default)
    )


def linear_levels(s: torch.Tensor) -> torch.Tensor:
    """The grid with its final 0, float64, checked strictly decreasing inside ``(0, 1]``.

    Raises:
        ConfigError: repeated or rising levels, or a first level above 1.
    """
    s = torch.cat([s.to(torch.float64).cpu(), torch.zeros(1, dtype=torch.float64)])
    if not (bool((s[1:] < s[:-1]).all()) and float(s[0]) <= 1.0):
        raise ConfigError(
            "the scheduler's grid is not strictly decreasing in noise (repeated or rising timesteps); "
            "choose another num_inference_steps or timestep_spacing"
        )
    return s


def scheduler_kernels() -> list[type]:
    """The registered kernels that reproduce a diffusers scheduler, in registration order, each once."""
    seen: list[type] = []
    for name in KERNELS:
        cls = KERNELS.get(name)
        if cls.schedulers and cls not in seen:
            seen.append(cls)
    return seen


def kernel_of_scheduler(name: str) -> type | None:
    """The kernel class that reproduces the diffusers scheduler class ``name``, or None."""
    return next((cls for cls in scheduler_kernels() if name in cls.schedulers), None)


def supported_schedulers() -> str:
    """``"ddpm (DDPMScheduler), ... and flow_stochastic (...)"``: the kernels that reproduce a scheduler, for
    refusals."""
    parts = [f"{cls.name} ({cls.scheduler_note or cls.schedulers[0]})" for cls in scheduler_kernels()]
    return ", ".join(parts[:-1]) + " and " + parts[-1] if len(parts) > 1 else "".join(parts)


def refuse(name: str, why: str = "") -> ConfigError:
    """The one paragraph that refuses scheduler ``name``."""
    why = why or (
        "its step is not a Gaussian transition with a state-independent scale (a deterministic or "
        "predictor-corrector solver: DPM-Solver++ without noise, DDIM with eta=0, UniPC, Heun, "
        "PNDM, LMS, Euler without noise), so speculation cannot be exact"
    )
    return ConfigError(
        f"scheduler={name!r} is not supported: {why}. The exact kernels are {supported_schedulers()}; "
        "set the pipeline's scheduler to one of them (e.g. DDPMScheduler.from_config(pipe.scheduler.config))."
    )


class Kernel:
    """One step's Gaussian kernel on a noise grid ``sigmas [T + 1]`` with churn ``eps``.

    Subclasses set :attr:`columns` and implement :meth:`columns64` and :meth:`mean`; :meth:`table`, :meth:`coefs`
    and :meth:`named` follow from them.
    """

    name: ClassVar[str] = ""
    columns: ClassVar[tuple[str, ...]] = ()
    order: ClassVar[int] = 1  # outputs the mean reads: this step's and those of order - 1 earlier steps (history)

    # A kernel that reproduces a diffusers scheduler says so here (every map from schedulers to kernels is read
    # from these: specsamp.schedulers, the diffusers entry point and model, the runner's kernel config).
    schedulers: ClassVar[tuple[str, ...]] = ()
    """The diffusers scheduler classes (by class name) whose step this kernel is; the first is the one a run builds."""
    scheduler_note: ClassVar[str] = ""
    """How a refusal names the scheduler beside the kernel (``DDPMScheduler``)."""
    scheduler_flags: ClassVar[dict] = {}
    """Scheduler config keys the kernel sets whatever the config says (``stochastic_sampling=True``)."""
    flow: ClassVar[bool] = False
    """The scheduler is a flow-matching one (networks that predict the linear path's velocity, SD3's family)."""
    scaling_loop: ClassVar[bool | None] = None
    """Its sampler is a diffusers loop that applies ``init_noise_sigma`` and ``scale_model_input`` (True), one that
    must not (False: the scheduler has no ``init_noise_sigma``), or either (None: both are the identity)."""
    run_options: ClassVar[tuple[str, ...]] = ()
    """Kernel config keys that are the sampler's options, not the scheduler's (passed to :meth:`read_scheduler`)."""
    grid_keys: ClassVar[tuple[str, ...]] = ()
    """Config keys of a kernel that makes its own grid, ``make_grid(steps, **keys)`` (no scheduler: Karras' levels)."""
    reads_shift: ClassVar[bool] = True
    """Whether ``model.shift`` moves its grid (a scheduler's own levels do not)."""
    train_steps_bound: ClassVar[bool] = False
    """``steps`` may not exceed the scheduler's ``num_train_timesteps`` (one distinct timestep per step)."""

    @classmethod
    def scheduler_config(cls, keys: dict, model_shift: float | None = None) -> dict:
        """The scheduler's config from the kernel config's keys (``run_options`` and ``name`` left out) and
        :attr:`scheduler_flags`; ``model_shift``: ``model.shift``, for a kernel whose scheduler reads it."""
        return {**keys, **cls.scheduler_flags}

    @classmethod
    def read_scheduler(
        cls, scheduler, steps: int, *, event_ndim: int = 3, mu: float | None = None, **options
    ) -> SchedulerLevels:
        """What a fresh ``scheduler`` (one of :attr:`schedulers`) at ``steps`` makes of this kernel: its grid on the
        linear path, the kernel's options and the network's timesteps, coordinates and prediction.

        Raises:
            ConfigError: an option or step count whose step is not reproduced (:func:`refuse`).
        """
        raise NotImplementedError

    def __init__(self, sigmas: torch.Tensor, eps: float):
        self.sigmas, self.eps = sigmas, eps
        self.steps = sigmas.numel() - 1
        self._tables: dict = {}

    def col(self, name: str) -> int:
        """The column index of coefficient ``name`` in :meth:`table`."""
        return self.columns.index(name)

    def columns64(self, device) -> dict[str, torch.Tensor]:
        """Every coefficient but ``lsnr`` as float64 ``[T]`` on ``device``, indexed by step."""
        raise NotImplementedError

    def bind_event(self, event_shape) -> None:
        """Learn the shape of one state before a run (a kernel whose mean reduces over a sample needs it); default:
        nothing to learn."""

    def mean(self, x: torch.Tensor, out: torch.Tensor, c: dict, history: tuple | None = None) -> torch.Tensor:
        """The kernel mean ``[..., *e]`` of the step from states ``x [..., *e]`` on the linear path.

        Args:
            x: the states, in any layout (``[M, *e]`` per row, ``[nodes, rows, D]`` in the dense round).
            out: the network's output at ``x``, shaped like ``x`` and in its dtype: the velocity
                ``v = xi - x0`` of the linear path ``x = (1 - sigma) x0 + sigma xi`` (what
                :class:`specsamp.models.base.VelocityModel` returns, whatever the network's own parametrisation),
                or a draft's stand-in for it (a frozen velocity, ``(x - x0_hat) / sigma``).
            c: each name in :attr:`columns` mapped to the steps' coefficients, in ``x``'s dtype, broadcasting
                against ``x`` (:meth:`coefs`, :meth:`named`).
            history: kernels of :attr:`order` ``> 1`` only (an order-1 kernel is called without it): a tuple of
                ``order - 1`` tensors shaped like ``out``, the :meth:`record` of the states 1, 2, ... steps back on
                the same trajectory (in a round's tree: the node's parent, grandparent, ...; beyond the round's
                root, the committed path's). Where a trajectory has fewer earlier steps (the first steps of a
                multistep sampler), the entry is a finite stand-in and the step's coefficient columns give it
                weight 0: the lower-order form, as the original samplers take it. ``None``: no earlier output is
                known (a draft's proposal mean, which need not be exact): the kernel reads its own step's record
                in each earlier one's place.
        """
        raise NotImplementedError

    def record(self, x: torch.Tensor, out: torch.Tensor, c: dict) -> torch.Tensor:
        """What later steps of a multistep kernel (:attr:`order` ``> 1``) read of this step (their ``history``), from
        its state ``x``, the network's output ``out`` there and its step's coefficients ``c``; shaped like ``out``.
        Default: ``out`` itself. A data-prediction multistep kernel records ``x - sigma out`` (the denoised output,
        which the state is needed for)."""
        return out

    def table(self, device, dtype) -> torch.Tensor:
        """``[T, C]`` the :attr:`columns` in ``dtype`` on ``device`` (``lsnr`` computed in ``dtype`` from ``sigma``);
        built once per device and dtype."""
        key = (str(torch.device(device)), dtype)
        if key not in self._tables:
            f64 = self.columns64(device)
            cols = {k: v.to(dtype) for k, v in f64.items()}
            cols["lsnr"] = lsnr(cols["sigma"])
            self._tables[key] = torch.stack([cols[k] for k in self.columns], 1)
        return self._tables[key]

    def named(self, cols) -> dict:
        """``{column: tensor}`` from one tensor per column, in :attr:`columns` order (what :meth:`mean` and a draft's
        ``table_mean`` are handed)."""
        return dict(zip(self.columns, cols))

    def coefs(self, n: torch.Tensor, like: torch.Tensor) -> dict:
        """The coefficients of steps ``n [s]`` for the rows of ``like [s, ...]``: one gather of :meth:`table`, each
        ``[s, 1, ..., 1]`` in ``like``'s dtype."""
        c = self.table(like.device, like.dtype)[n]  # [s, C]
        return self.named(c.reshape(c.shape[0], len(self.columns), *(1,) * (like.ndim - 1)).unbind(1))


def positive_option(name: str, value, sampler: str) -> float:
    """A kernel's noise option (``eta``, ``s_noise``, ...) as a float; ValueError unless finite and > 0 (a bool
    refused), naming the option, its value and, for ``eta``, that 0 is the deterministic ``sampler``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        extra = f" (eta=0 is the deterministic {sampler}, where speculation is vacuous)" if name == "eta" else ""
        raise ValueError(f"{name}={value!r} is invalid: must be a finite number > 0{extra}")
    return float(value)


def shift_history(history: tuple | None, record: torch.Tensor, order: int) -> tuple:
    """A multistep kernel's ``history`` one step on: ``record`` (this step's :meth:`Kernel.record`) in front, the
    oldest entry dropped; from ``None`` (no earlier step), ``record`` in each of the ``order - 1`` places (the stand-in
    a first step's zero coefficients read)."""
    return (record,) * (order - 1) if history is None else (record, *history[:-1])


KERNELS: Registry[type] = Registry(
    "kernel", modules=tuple(f"specsamp.{m}" for m in ("dpmpp", "ddim", "dpmsolver", "ancestral", "ersde"))
)
"""The kernels by name: this module's, and those of the modules named (imported on the table's first read)."""


def register_kernel(name: str):
    """Class decorator: register a :class:`Kernel` subclass as ``name``."""

    def deco(cls: type) -> type:
        cls.name = name
        return KERNELS.register(name, cls)

    return deco


def get_kernel(name: str) -> type:
    """A kernel class by registered name (or ``pkg.module:name``)."""
    return KERNELS.get(name)


@register_kernel("euler_maruyama")
class EulerMaruyama(Kernel):
    """The paper's Euler--Maruyama kernel on the linear path (appendix C.3, eqs. 36--37)::

        mean = x + dt (a v + b x),   dt = sigma_{n+1} - sigma_n,   a = 1 + eps^2,   b = eps^2 / (1 - sigma_n),
        std  = eps g sqrt(sigma_n - sigma_{n+1}),   g^2 = 2 sigma_n / (1 - sigma_n),

    the network's output ``v`` a velocity. ``a v + b x = v - eps^2 g^2 s / 2`` with the score
    ``s = -(x + (1 - sigma) v) / sigma``. Steps ``0`` and ``T - 1`` are plain Euler steps with no noise (``a = 1``,
    ``b = 0``, ``std = 0``).
    """

    columns = ("dt", "a", "b", "sigma", "std", "lsnr")

    def columns64(self, device) -> dict[str, torch.Tensor]:
        n = torch.arange(self.steps, device=device)
        sig = self.sigmas.to(device)
        s0, s1 = sig[n], sig[n + 1]
        stochastic = (n >= 1) & (n <= self.steps - 2)
        safe = torch.where(stochastic, 1.0 - s0, torch.ones_like(s0))
        a = torch.where(stochastic, torch.full_like(s0, 1.0 + self.eps**2), torch.ones_like(s0))
        b = torch.where(stochastic, self.eps**2 / safe, torch.zeros_like(s0))
        std = self.eps * torch.sqrt(2.0 * s0 / safe * (s0 - s1))
        std = torch.where(stochastic, std, torch.zeros_like(std))
        return {"dt": s1 - s0, "a": a, "b": b, "sigma": s0, "std": std}

    def mean(self, x: torch.Tensor, out: torch.Tensor, c: dict) -> torch.Tensor:
        return x + c["dt"] * (c["a"] * out + c["b"] * x)


KERNELS.register("em", EulerMaruyama)  # the config's short name (``kernel=em``)


class DataPredictionKernel(Kernel):
    """A kernel whose mean is affine in the state and the data prediction ``x0 = x - sigma v``::

        mean = c_x x + c_x0 clip(x - sigma v),   std = std_n,

    on the linear path (``x = (1 - sigma) x0 + sigma xi``, the states the sampler holds). A scheduler that works
    in its own coordinates ``y = k_n x`` (variance preserving: ``k = alpha + sigma_vp``; variance exploding:
    ``k = 1 + sigma_ve``) has its step ``y' = A y + B x0 + S z`` written here as ``c_x = A k_n / k_{n+1}``,
    ``c_x0 = B / k_{n+1}``, ``std = S / k_{n+1}``: the same Gaussian, so every coupling and draft applies
    unchanged, and the entry points convert ``y`` at the start and the end (``k = 1`` at ``sigma = 0``).

    Options common to these kernels: ``clip`` (clip the data prediction to ``[-clip, clip]``, diffusers'
    ``clip_sample``), ``threshold`` (``(ratio, max_value)``: diffusers' dynamic thresholding over the last
    ``event_ndim`` dimensions) and ``init_scale`` (the initial state is ``init_scale * xi``).
    """

    columns = ("c_x", "c_x0", "sigma", "std", "lsnr")
    stochastic_endpoints = True

    def __init__(
        self,
        sigmas: torch.Tensor,
        eps: float,
        clip: float | None = None,
        threshold=None,
        event_ndim: int = 1,
        init_scale: float | None = None,
    ):
        super().__init__(sigmas, eps)
        self.clip, self.threshold, self.event_ndim = clip, threshold, int(event_ndim)
        self._init_scale = init_scale
        self.event_size: int | None = None  # elements of one state, once a sampler binds it (bind_event)

    def bind_event(self, event_shape) -> None:
        """Fix the elements of one state (``prod(event_shape)``), so that dynamic thresholding stays per sample in
        every layout: the dense round holds states flat and stacked, ``[nodes, rows, D]``, where the last
        ``event_ndim`` dimensions are not one sample's. The samplers call it before their first step."""
        self.event_size = int(torch.Size(event_shape).numel())

    def level_scale(self) -> torch.Tensor:
        """float64 ``[T + 1]``: ``k_n``, the scheduler's state over the linear path's at each level."""
        return torch.ones_like(self.sigmas)

    @property
    def init_scale(self) -> float:
        """The initial state is ``init_scale * xi``, ``xi ~ N(0, I)`` (the scheduler's start, on the linear path)."""
        if self._init_scale is not None:
            return float(self._init_scale)
        return float(1.0 / self.level_scale()[0])

    def step_coefficients(self, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(A, B, S)`` float64 ``[T]``: the step in the scheduler's coordinates, ``y' = A y + B x0 + S z``."""
        raise NotImplementedError

    def clip_x0(self, x0: torch.Tensor) -> torch.Tensor:
        """The data prediction after the scheduler's own clip or dynamic threshold (none unless its options ask)."""
        if self.threshold is not None:  # diffusers' dynamic thresholding: per sample, over its event dimensions
            ratio, max_value = self.threshold
            size = self.event_size or x0.shape[x0.ndim - self.event_ndim :].numel()
            flat = x0.reshape(-1, size)  # one sample per row, whatever the layout's leading dimensions
            up = flat if flat.dtype in (torch.float32, torch.float64) else flat.float()
            s = torch.quantile(up.abs(), ratio, dim=-1, keepdim=True).clamp(min=1.0, max=max_value)
            return (torch.maximum(torch.minimum(up, s), -s) / s).to(x0.dtype).reshape(x0.shape)
        if self.clip is not None:
            return x0.clamp(-self.clip, self.clip)
        return x0

    def columns64(self, device) -> dict[str, torch.Tensor]:
        A, B, S = self.step_coefficients(device)
        k = self.level_scale().to(device)
        return {"c_x": A * k[:-1] / k[1:], "c_x0": B / k[1:], "sigma": self.sigmas.to(device)[:-1], "std": S / k[1:]}

    def mean(self, x: torch.Tensor, out: torch.Tensor, c: dict) -> torch.Tensor:
        return c["c_x"] * x + c["c_x0"] * self.clip_x0(x - c["sigma"] * out)


DDPM_VARIANCES = ("fixed_small", "fixed_small_log", "fixed_large")


@register_kernel("ddpm")
class DDPM(DataPredictionKernel):
    """Ancestral DDPM as ``diffusers.DDPMScheduler.step`` computes it (Ho et al. 2020, eqs. 6-7).

    The grid is the linear path's image of the scheduler's levels: ``sigma = sigma_vp / (alpha + sigma_vp)``
    with ``alpha^2 = alphas_cumprod[t]``, ``sigma_vp^2 = 1 - alpha^2``, and ``alpha = 1`` after the last
    timestep. With ``a_t``, ``a_p`` the cumulative alphas of step ``n``'s two levels::

        A = sqrt(a_t / a_p) (1 - a_p) / (1 - a_t),   B = sqrt(a_p) (1 - a_t / a_p) / (1 - a_t),
        S^2 = max((1 - a_p) / (1 - a_t) (1 - a_t / a_p), 1e-20)   (fixed_small; fixed_large: 1 - a_t / a_p),

    and no noise at a step whose timestep is 0 (``final_noise=False``: diffusers adds noise where ``t > 0``).
    """

    schedulers = ("DDPMScheduler",)
    reads_shift = False
    train_steps_bound = True

    @classmethod
    def read_scheduler(cls, sch, steps: int, *, event_ndim: int = 3, mu=None, **options) -> SchedulerLevels:
        variance = config_value(sch, "variance_type", "fixed_small")
        if variance not in DDPM_VARIANCES:
            raise refuse(
                "DDPMScheduler",
                f"variance_type={variance!r} is not reproduced (supported: "
                f"{', '.join(DDPM_VARIANCES)}; a learned variance depends on the state)",
            )
        if config_value(sch, "rescale_betas_zero_snr", False):
            raise refuse(
                "DDPMScheduler",
                "rescale_betas_zero_snr=True puts the first level at infinite noise, where the "
                "data prediction is undefined on the linear path",
            )
        if steps > config_value(sch, "num_train_timesteps", 1000):
            raise ConfigError(
                f"num_inference_steps={steps} is invalid: DDPMScheduler has num_train_timesteps="
                f"{config_value(sch, 'num_train_timesteps')} and needs num_inference_steps at most that"
            )
        sch.set_timesteps(steps)
        ts = sch.timesteps.long()
        a = sch.alphas_cumprod.to(torch.float64)[ts]
        sg, al = (1.0 - a).sqrt(), a.sqrt()
        s = linear_levels(sg / (al + sg))
        opts = {"variance_type": variance, "final_noise": bool(ts[-1] > 0), "event_ndim": event_ndim}
        if config_value(sch, "thresholding", False):
            opts["threshold"] = (
                float(config_value(sch, "dynamic_thresholding_ratio")),
                float(config_value(sch, "sample_max_value")),
            )
        elif config_value(sch, "clip_sample", False):
            opts["clip"] = float(config_value(sch, "clip_sample_range", 1.0))
        k0 = float(al[0] + sg[0])
        return SchedulerLevels(s, opts, ts, "vp", config_value(sch, "prediction_type", "epsilon"), 1.0 / k0)

    def __init__(self, sigmas, eps, variance_type: str = "fixed_small", final_noise: bool = False, **options):
        super().__init__(sigmas, eps, **options)
        if variance_type not in DDPM_VARIANCES:
            raise ValueError(
                f"variance_type={variance_type!r} is not reproduced: supported are {', '.join(DDPM_VARIANCES)}"
            )
        self.variance_type, self.final_noise = variance_type, bool(final_noise)

    def alphas_cumprod(self) -> torch.Tensor:
        """float64 ``[T + 1]``: ``alpha^2`` at each level, from the grid (``sigma_vp / alpha = sigma / (1 - sigma)``)."""
        r = self.sigmas / (1.0 - self.sigmas)
        return 1.0 / (1.0 + r * r)

    def level_scale(self) -> torch.Tensor:
        a = self.alphas_cumprod()
        return a.sqrt() + (1.0 - a).sqrt()

    def step_coefficients(self, device):
        a = self.alphas_cumprod().to(device)
        a_t, a_p = a[:-1], a[1:]
        cur_alpha = a_t / a_p
        cur_beta = 1.0 - cur_alpha
        A = cur_alpha.sqrt() * (1.0 - a_p) / (1.0 - a_t)
        B = a_p.sqrt() * cur_beta / (1.0 - a_t)
        var = (
            cur_beta if self.variance_type == "fixed_large" else ((1.0 - a_p) / (1.0 - a_t) * cur_beta).clamp(min=1e-20)
        )
        S = var.sqrt()
        if not self.final_noise:
            S = torch.cat([S[:-1], S.new_zeros(1)])
        return A, B, S


@register_kernel("euler_ancestral")
class EulerAncestral(DataPredictionKernel):
    """k-diffusion's ``sample_euler_ancestral`` (and ``diffusers.EulerAncestralDiscreteScheduler``, ``eta = 1``).

    In the variance-exploding coordinates ``y = x0 + sigma_ve xi`` (``sigma_ve = sigma / (1 - sigma)``,
    ``k = 1 + sigma_ve``), with ``sigma_up = min(s', eta sqrt(s'^2 (s^2 - s'^2) / s^2))`` and
    ``sigma_down = sqrt(s'^2 - sigma_up^2)`` for the step ``s -> s'``::

        y' = y + (y - x0) / s (sigma_down - s) + s_noise sigma_up z,

    so ``A = sigma_down / s``, ``B = 1 - A``, ``S = s_noise sigma_up``. The initial state is
    ``sigma_ve[0] xi`` (k-diffusion's ``x = noise * sigmas[0]``) unless ``init_scale`` is given.
    """

    schedulers = ("EulerAncestralDiscreteScheduler",)
    scheduler_note = "EulerAncestralDiscreteScheduler; k-diffusion's sample_euler_ancestral"
    scaling_loop = True
    run_options = ("eta", "s_noise")
    reads_shift = False
    train_steps_bound = True

    @classmethod
    def read_scheduler(
        cls, sch, steps: int, *, event_ndim: int = 3, mu=None, eta: float = 1.0, s_noise: float = 1.0
    ) -> SchedulerLevels:
        pred = config_value(sch, "prediction_type", "epsilon")
        if pred not in ("epsilon", "v_prediction"):
            raise refuse(
                "EulerAncestralDiscreteScheduler",
                f"prediction_type={pred!r} is not implemented by the "
                "scheduler itself (supported: epsilon, v_prediction)",
            )
        sch.set_timesteps(steps)
        sig = sch.sigmas.to(torch.float64)[:-1]
        s = linear_levels(sig / (1.0 + sig))
        init = float(sch.init_noise_sigma) / (1.0 + float(sig[0]))
        return SchedulerLevels(
            s, {"eta": eta, "s_noise": s_noise, "init_scale": init}, sch.timesteps.clone(), "vp", pred, init
        )

    def __init__(self, sigmas, eps, eta: float = 1.0, s_noise: float = 1.0, **options):
        super().__init__(sigmas, eps, **options)
        if not (eta > 0 and s_noise > 0):
            raise ValueError(
                f"eta={eta!r}, s_noise={s_noise!r}: both must be > 0 (eta=0 is the deterministic "
                "Euler sampler, where speculation is vacuous)"
            )
        self.eta, self.s_noise = float(eta), float(s_noise)

    def sigmas_ve(self) -> torch.Tensor:
        """float64 ``[T + 1]``: the variance-exploding levels ``sigma / (1 - sigma)``."""
        return self.sigmas / (1.0 - self.sigmas)

    def level_scale(self) -> torch.Tensor:
        return 1.0 + self.sigmas_ve()

    @property
    def init_scale(self) -> float:
        if self._init_scale is not None:
            return float(self._init_scale)
        return float(self.sigmas_ve()[0] / self.level_scale()[0])

    def step_coefficients(self, device):
        s = self.sigmas_ve().to(device)
        s0, s1 = s[:-1], s[1:]
        up = torch.minimum(s1, self.eta * (s1 * s1 * (s0 * s0 - s1 * s1) / (s0 * s0)).sqrt())
        down = (s1 * s1 - up * up).sqrt()
        A = down / s0
        return A, 1.0 - A, self.s_noise * up


@register_kernel("flow_stochastic")
class FlowStochastic(DataPredictionKernel):
    """``diffusers.FlowMatchEulerDiscreteScheduler(stochastic_sampling=True)``: the data prediction moved to the
    next level with fresh noise, ``x' = (1 - s') (x - s v) + s' z`` (SD3/Flux's flow models; the grid is the
    scheduler's shifted sigmas, already the linear path's)."""

    schedulers = ("FlowMatchEulerDiscreteScheduler",)
    scheduler_note = "FlowMatchEulerDiscreteScheduler with stochastic_sampling=True"
    scheduler_flags = {"stochastic_sampling": True}
    flow = True
    scaling_loop = False

    @classmethod
    def scheduler_config(cls, keys: dict, model_shift: float | None = None) -> dict:
        shift = float(model_shift) if keys.get("shift") is None else float(keys["shift"])  # null: model.shift
        return {**keys, "shift": shift, **cls.scheduler_flags}

    @classmethod
    def read_scheduler(cls, sch, steps: int, *, event_ndim: int = 3, mu=None, **options) -> SchedulerLevels:
        if not config_value(sch, "stochastic_sampling", False):
            raise refuse(
                "FlowMatchEulerDiscreteScheduler",
                "stochastic_sampling=False is the deterministic Euler ODE "
                "solver, where speculation is vacuous; set stochastic_sampling=True",
            )
        if config_value(sch, "use_dynamic_shifting", False):
            if mu is None:
                raise ConfigError(
                    "mu=None is invalid: this FlowMatchEulerDiscreteScheduler uses dynamic shifting, so "
                    "its grid needs the shift mu (the pipeline computes it from the image size); pass mu="
                )
            sch.set_timesteps(steps, mu=mu)
        else:
            sch.set_timesteps(steps)
        s = linear_levels(sch.sigmas.to(torch.float64)[:-1])
        return SchedulerLevels(s, {}, sch.timesteps.clone(), "linear", "flow", 1.0)

    def step_coefficients(self, device):
        s1 = self.sigmas.to(device)[1:]
        return torch.zeros_like(s1), 1.0 - s1, s1.clone()
