"""Targets behind one velocity interface: ``v = model(x, sigma, **cond)``.

``x [b, *event]`` is a state on the linear path ``x_sigma = (1 - sigma) x0 + sigma xi``, ``sigma [b]``
its noise level in ``(0, 1]``, ``cond`` per-row conditioning tensors (e.g. class labels ``[b]``).
Every model exposes ``event_shape`` and ``dtype``. Adapters for EDM and SD3 live in their own modules
and are imported lazily (they need optional dependencies).
"""

from .base import VelocityModel, batched
from .gmm import GaussianMixture

__all__ = ["VelocityModel", "GaussianMixture", "batched"]
