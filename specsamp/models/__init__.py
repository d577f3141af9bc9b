"""Targets behind one velocity interface: ``v = model(x, sigma, **cond)``.

``x [b, *event]`` is a state on the linear path ``x_sigma = (1 - sigma) x0 + sigma xi``, ``sigma [b]``
its noise level in ``(0, 1]``, ``cond`` per-row conditioning tensors (e.g. class labels ``[b]``).
Every model exposes ``event_shape`` and ``dtype``. Each model kind has one config dataclass, its Hydra
schema and builder (:class:`~specsamp.models.base.TargetConfig`); :data:`MODEL_SCHEMAS` names them for
Hydra's ConfigStore (group ``model``); :func:`register_model` adds a user's. Optional dependencies
(diffusers, torch-fidelity) are imported only when a model is built.
"""

from __future__ import annotations

from .base import Paper, Target, TargetConfig, VelocityModel, batched
from .diffusers_pipeline import DiffusersConfig
from .edm import EDMConfig
from .gmm import GaussianMixture, GMMConfig
from .guided import GuidedEDMConfig
from .sd3 import SD3Config

MODEL_SCHEMAS = {
    "gmm_schema": GMMConfig,
    "edm_schema": EDMConfig,
    "guided_edm_schema": GuidedEDMConfig,
    "sd3_schema": SD3Config,
    "diffusers_schema": DiffusersConfig,
}


def register_model(name: str, schema: type | None = None):
    """Register a model kind's config dataclass (a :class:`~specsamp.models.base.TargetConfig` subclass,
    whose ``build(device)`` returns the :class:`~specsamp.models.base.Target`) as Hydra schema
    ``model/<name>_schema``: a model YAML whose ``defaults`` are ``[<name>_schema, _self_]`` is then typed by
    it while Hydra composes (a key it lacks, or a wrong type, names its own keys). Usable as a class
    decorator, ``@register_model("mine")`` taking the class; returns ``schema``.

    A YAML whose ``_target_`` names the class is typed by it without registering too, when the run loads
    (:func:`specsamp.runner.config.load_config`); registering adds the check at composition, which needs
    the module imported before Hydra composes (a notebook, a script, :func:`specsamp.runner.config.compose`).

    Raises:
        TypeError: ``schema`` is not a TargetConfig dataclass.
        ValueError: ``<name>_schema`` is registered to another class.
    """
    import dataclasses

    if schema is None:
        return lambda cls: register_model(name, cls)
    if not (isinstance(schema, type) and dataclasses.is_dataclass(schema) and issubclass(schema, TargetConfig)):
        raise TypeError(
            f"register_model({name!r}, {schema!r}): the schema must be a dataclass subclassing "
            "specsamp.models.base.TargetConfig"
        )
    key = f"{name}_schema"
    if MODEL_SCHEMAS.get(key, schema) is not schema:
        raise ValueError(f"model schema {key!r} is already registered to {MODEL_SCHEMAS[key].__name__}")
    MODEL_SCHEMAS[key] = schema
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(group="model", name=key, node=schema)
    return schema


__all__ = [
    "MODEL_SCHEMAS",
    "DiffusersConfig",
    "EDMConfig",
    "GMMConfig",
    "GaussianMixture",
    "GuidedEDMConfig",
    "Paper",
    "SD3Config",
    "Target",
    "TargetConfig",
    "VelocityModel",
    "batched",
    "register_model",
]
