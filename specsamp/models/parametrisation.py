"""Adapters from the parametrisations people train to the one target interface (a velocity on the linear path).

The samplers hold states on the linear path ``x = (1 - s) x0 + s xi`` at levels ``s`` in ``[0, 1]`` and ask the
target for the velocity ``v = xi - x0`` (:mod:`specsamp.models`). A network trained in other coordinates or to
predict another quantity is wrapped here, the conversion written once per coordinate system and prediction:

coordinates (``y = k(s) x``, the network's own state):
    - ``"linear"``: ``y = x`` (rectified flow: SD3, Flux);
    - ``"vp"``: variance preserving, ``y = alpha x0 + sigma_vp xi`` with ``alpha^2 + sigma_vp^2 = 1``
      (DDPM, diffusers' UNets): ``sigma_vp / alpha = s / (1 - s)``, ``k = alpha + sigma_vp``;
    - ``"ve"``: variance exploding, ``y = x0 + sigma_ve xi`` (k-diffusion's and ComfyUI's denoisers):
      ``sigma_ve = s / (1 - s)``, ``k = 1 / (1 - s)``;

predictions (what the network returns at ``y``):
    - ``"epsilon"``: ``xi``, so ``v = (xi - x) / (1 - s)``;
    - ``"sample"`` (``"x0"``): ``x0``, so ``v = (x - x0) / s``;
    - ``"v_prediction"`` (``"vp"`` only): ``alpha xi - sigma_vp x0``, so ``xi = sigma_vp y + alpha out`` and
      ``x0 = alpha y - sigma_vp out``;
    - ``"flow"`` (``"linear"`` only): ``v`` itself.

The network's time argument is its own (``time``): a discrete timestep looked up on the run's grid
(:class:`GridTimesteps`), ``sigma_ve`` for k-diffusion, ``1000 s`` for SD3. Classifier-free guidance
(:class:`Guided`) combines a conditional and an unconditional velocity in one call of twice the rows; the
combination is affine, so guiding the velocity equals guiding the network's own prediction.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..arguments import network_output
from ..errors import ConfigError

COORDINATES = ("linear", "vp", "ve")
PREDICTIONS = {
    "linear": ("flow", "epsilon", "sample"),
    "vp": ("epsilon", "sample", "v_prediction"),
    "ve": ("epsilon", "sample"),
}
ALIASES = {"x0": "sample", "denoised": "sample", "eps": "epsilon", "v": "v_prediction", "velocity": "flow"}


def level_scale(s: torch.Tensor, coords: str) -> torch.Tensor:
    """``k(s)``: the network's state over the linear path's at levels ``s`` (any shape; float64 recommended)."""
    if coords == "linear":
        return torch.ones_like(s)
    r = s / (1.0 - s)
    if coords == "vp":
        return (1.0 + r) / torch.sqrt(1.0 + r * r)
    return 1.0 + r


def vp_alpha_sigma(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(alpha, sigma_vp)`` of the variance-preserving path at linear levels ``s``."""
    r = s / (1.0 - s)
    alpha = 1.0 / torch.sqrt(1.0 + r * r)
    return alpha, r * alpha


def check_parametrisation(prediction: str, coords: str) -> tuple[str, str]:
    """The canonical ``(prediction, coords)``.

    Raises:
        ConfigError: an unknown coordinate system or a prediction it does not define; the message names both.
    """
    if coords not in COORDINATES:
        raise ConfigError(f"coordinates={coords!r} is invalid: valid are {', '.join(COORDINATES)}.")
    pred = ALIASES.get(prediction, prediction)
    if pred not in PREDICTIONS[coords]:
        raise ConfigError(
            f"prediction_type={prediction!r} is invalid for {coords} coordinates: supported are "
            f"{', '.join(PREDICTIONS[coords])}."
        )
    return pred, coords


def to_velocity(out: torch.Tensor, x: torch.Tensor, s: torch.Tensor, prediction: str, coords: str) -> torch.Tensor:
    """The linear-path velocity from a network's ``out`` at linear states ``x [b, *e]``, levels ``s [b]``."""
    s = s.reshape((-1,) + (1,) * (x.ndim - 1)).to(x.dtype)
    if prediction == "flow":
        return out
    if prediction == "epsilon":
        return (out - x) / (1.0 - s)
    if prediction == "sample":
        return (x - out) / s
    alpha, sig = vp_alpha_sigma(s)  # v_prediction
    y = level_scale(s, "vp") * x
    return (sig * y + alpha * out) - (alpha * y - sig * out)


def from_velocity(v: torch.Tensor, x: torch.Tensor, s: torch.Tensor, prediction: str, coords: str) -> torch.Tensor:
    """The inverse of :func:`to_velocity`: the network's own prediction from the linear velocity ``v``."""
    s = s.reshape((-1,) + (1,) * (x.ndim - 1)).to(x.dtype)
    if prediction == "flow":
        return v
    eps, x0 = x + (1.0 - s) * v, x - s * v
    if prediction == "epsilon":
        return eps
    if prediction == "sample":
        return x0
    alpha, sig = vp_alpha_sigma(s)
    return alpha * eps - sig * x0


class GridTimesteps:
    """A discrete scheduler's timestep for each level of the run's grid (the network is only ever called there).

    Args:
        sigmas: float64 ``[T + 1]`` the run's linear-path grid.
        timesteps: ``[T]`` the scheduler's timesteps, one per step (the level it starts from).
    """

    def __init__(self, sigmas: torch.Tensor, timesteps):
        self.sigmas = sigmas.to(torch.float64).cpu()[: len(timesteps)]
        self.timesteps = torch.as_tensor(timesteps).cpu()

    def __call__(self, s: torch.Tensor) -> torch.Tensor:
        q = s.detach().to("cpu", torch.float64).reshape(-1)
        idx = torch.searchsorted(-self.sigmas, -q).clamp(max=self.sigmas.numel() - 1)
        if not torch.equal(self.sigmas[idx], q):
            bad = q[self.sigmas[idx] != q][0]
            raise ValueError(
                f"sigma={float(bad)!r} is not a level of this grid: a discrete-time network is only "
                "evaluated on the scheduler's own timesteps"
            )
        return self.timesteps[idx].to(s.device)


class Parametrised:
    """A network in its own parametrisation behind the velocity interface (:class:`specsamp.models.VelocityModel`).

    Args:
        net: ``net(y, t, **cond) -> out``, the network's own call (``y [b, *e]`` its state, ``t`` its time), whose
            ``out [b, *e]`` is checked at every call (:func:`specsamp.arguments.network_output`). The conditioning
            reaches ``net`` unchanged whatever its keys' names (``x``, ``sigma``, ``y``, ``t`` included).
        prediction: ``epsilon``, ``sample`` (``x0``), ``v_prediction`` or ``flow``.
        coords: ``linear``, ``vp`` or ``ve``.
        time: ``s [b] float64 -> t`` the network's time argument (default: ``s`` itself).
        event_shape: shape of one state.
        dtype: the states' dtype (the sampler's; the network is called in ``net_dtype``).
        net_dtype: the dtype ``y`` is cast to for the call (default ``dtype``).

    Raises:
        ConfigError: a prediction the coordinates do not define.
    """

    def __init__(
        self,
        net: Callable,
        prediction: str,
        coords: str,
        event_shape,
        dtype: torch.dtype,
        time: Callable | None = None,
        net_dtype: torch.dtype | None = None,
    ):
        self.net = net
        self.prediction, self.coords = check_parametrisation(prediction, coords)
        self.time = time or (lambda s: s)
        self.event_shape, self.dtype = tuple(event_shape), dtype
        self.net_dtype = net_dtype or dtype

    def __call__(self, x: torch.Tensor, sigma: torch.Tensor, /, **cond) -> torch.Tensor:
        s = torch.as_tensor(sigma, dtype=torch.float64, device=x.device).reshape(-1).expand(x.shape[0])
        k = level_scale(s, self.coords).reshape((-1,) + (1,) * (x.ndim - 1))
        y = (x.to(torch.float64) * k).to(self.net_dtype) if self.coords != "linear" else x.to(self.net_dtype)
        out = network_output(self.net(y, self.time(s), **cond), y.shape, self.net_dtype, "the network").to(x.dtype)
        return to_velocity(out, x, s.to(x.dtype), self.prediction, self.coords)


class Guided:
    """Classifier-free guidance of a conditional velocity model: ``v_u + w (v_c - v_u)`` from one call of ``2b``
    rows (the unconditional half first, as diffusers batches it).

    Args:
        model: velocity model taking the conditioning ``cond_key``.
        scale: the guidance scale ``w`` (1: the conditional model alone, no doubling).
        uncond: the unconditional conditioning, one row (broadcast) or ``[b, ...]``.
        cond_key: the keyword carrying the conditioning.

    ``rows_per_state`` (2 when ``w != 1``) is what each state costs the network in rows: the sampler charges it
    to ``target_rows`` and the memory estimate counts it.
    """

    def __init__(self, model, scale: float, uncond: torch.Tensor, cond_key: str = "cond"):
        self.model, self.scale, self.uncond, self.cond_key = model, float(scale), uncond, cond_key
        self.event_shape, self.dtype = model.event_shape, model.dtype
        self.rows_per_state = 1 if self.scale == 1.0 else 2

    def __call__(self, x: torch.Tensor, sigma: torch.Tensor, /, **cond) -> torch.Tensor:
        if self.rows_per_state == 1:
            return self.model(x, sigma, **cond)
        c = cond.pop(self.cond_key)
        u = self.uncond.to(c.device).expand_as(c) if self.uncond.shape[0] == 1 else self.uncond.to(c.device)
        both = {k: torch.cat([t, t]) for k, t in cond.items()}
        both[self.cond_key] = torch.cat([u, c])
        sigma = torch.as_tensor(sigma, device=x.device).reshape(-1).expand(x.shape[0])
        v_u, v_c = self.model(torch.cat([x, x]), torch.cat([sigma, sigma]), **both).chunk(2)
        return v_u + self.scale * (v_c - v_u)
