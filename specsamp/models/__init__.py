"""Targets behind one velocity interface: ``v = model(x, sigma, **cond)``.

``x [b, *event]`` is a state on the linear path ``x_sigma = (1 - sigma) x0 + sigma xi``, ``sigma [b]``
its noise level in ``(0, 1]``, ``cond`` per-row conditioning tensors (e.g. class labels ``[b]``).
Every model exposes ``event_shape`` and ``dtype``. Each model kind has one config dataclass, its Hydra
schema and builder (:class:`~specsamp.models.base.TargetConfig`); :data:`MODEL_SCHEMAS` names them for
Hydra's ConfigStore (group ``model``). Optional dependencies (diffusers, torch-fidelity) are imported
only when a model is built.
"""

from .base import Paper, Target, TargetConfig, VelocityModel, batched
from .edm import EDMConfig
from .gmm import GaussianMixture, GMMConfig
from .sd3 import SD3Config

MODEL_SCHEMAS = {"gmm_schema": GMMConfig, "edm_schema": EDMConfig, "sd3_schema": SD3Config}

__all__ = ["MODEL_SCHEMAS", "EDMConfig", "GMMConfig", "GaussianMixture", "Paper", "SD3Config", "Target", "TargetConfig",
           "VelocityModel", "batched"]
