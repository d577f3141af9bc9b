"""Classifier-free guidance of a class-conditional EDM network trained with label dropout (``model=digits_cfg``).

The network learned the unconditional denoiser as the null class, EDM's convention: the all-zero one-hot
(``experiments/train_digits.py --label-dropout 0.1``). The target is the guided velocity
``v_u + w (v_c - v_u)`` (Ho & Salimans 2022), from one network call of ``2b`` rows
(:class:`specsamp.models.parametrisation.Guided`, the unconditional half first). The combination is affine, so
guiding the velocity equals guiding the denoiser ``D_u + w (D_c - D_u)``.

``model=digits_cfg`` is a config of its own (:class:`GuidedEDMConfig`, ``conf/model/digits_cfg.yaml``): the
existing model configs, their records and their hashes are untouched.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import ConfigError
from .base import Target
from .edm import EDMConfig
from .parametrisation import Guided


def one_hot_guided(model, scale: float, label_dim: int) -> Guided:
    """``model`` (an :class:`specsamp.models.edm.EDMVelocity` or any model taking ``class_labels``) guided at
    ``scale``, the null class the all-zero row of ``label_dim`` columns; ``class_labels`` must then be float one-hot
    ``[b, label_dim]`` (:func:`one_hot_labels`). ``device`` is passed through."""
    g = Guided(model, scale, torch.zeros(1, label_dim), cond_key="class_labels")
    g.device = getattr(model, "device", torch.device("cpu"))
    g.label_dim = label_dim
    return g


def one_hot_labels(labels: torch.Tensor, label_dim: int) -> torch.Tensor:
    """Long class labels ``[b]`` in ``[0, label_dim)`` as float32 one-hot rows ``[b, label_dim]``."""
    return torch.nn.functional.one_hot(labels.long(), label_dim).float()


@dataclass
class GuidedEDMConfig(EDMConfig):
    """An EDM checkpoint with a null class, sampled under classifier-free guidance.

    Attributes (beyond :class:`specsamp.models.edm.EDMConfig`'s):
        guidance: the guidance scale ``w``, finite and >= 0 (1: the conditional network alone, one row per state;
            0: the unconditional one, two rows as any other ``w != 1``).

    Raises (``build``):
        ConfigError: a bad ``guidance``, an unconditional network, ``labels`` other than ``uniform``, and whatever
            :meth:`specsamp.models.edm.EDMConfig.build` refuses.
    """

    _target_: str = "specsamp.models.guided.GuidedEDMConfig"
    guidance: float = 1.0

    def build(self, device: str) -> Target:
        w = self.guidance
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w < 0:
            raise ConfigError(
                f"model.guidance={w!r} is invalid: valid values are finite numbers >= 0 (the classifier-free "
                "guidance scale w; 1: the conditional network alone)."
            )
        target = super().build(device)
        label_dim = target.model.label_dim
        if not label_dim or self.labels != "uniform":
            raise ConfigError(
                f"model.labels={self.labels!r} with label_dim={label_dim} is invalid for guidance: a class-conditional "
                "network with labels=uniform is needed."
            )
        inner = target.cond_for
        target.model = one_hot_guided(target.model, float(w), label_dim)
        target.cond_for = lambda ids, seed: {  # noqa: E731
            "class_labels": one_hot_labels(inner(ids, seed)["class_labels"], label_dim)
        }
        return target
