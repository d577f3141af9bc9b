"""Self-speculative drafts: proposal kernels built from the round root's network output.

A draft freezes something computed at the root of a round (``freeze``) and rebuilds the proposal
mean at any drafted node and step from it (``mean``). The proposal std is always the target kernel's
(eq. 37), so every draft fits the rank-1 coupling. Registered drafts (:data:`DRAFTS`):

- ``velocity`` (default; section 5, "Protocol"): freeze the root velocity ``v_r`` and use the kernel
  mean of eq. 36 with ``v_r`` at the node's own state and step.
- ``drift``: freeze the whole increment ``m_n(x_r) - x_r`` of the root step and add it at every depth
  (appendix C.1 read literally, eq. 7).
- ``x0``: freeze the root's data prediction ``x0_hat = x_r - sigma_r v_r`` and rebuild the velocity
  ``(x_u - x0_hat) / sigma_u`` at each node (the exact velocity if the posterior mean did not move).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .registry import Registry
from .schedule import Schedule, per_row


@dataclass(frozen=True)
class Draft:
    """A draft rule, registered in :data:`DRAFTS`.

    Attributes:
        name: registry key (``sampler.draft`` in configs).
        freeze: ``(x_root [M, *e], v_root [M, *e], n_root [M] long, schedule) -> frozen [M, *e]``.
        mean: ``(frozen [M, *e], x [M, m, *e], n [M] long, schedule) -> [M, m, *e]`` proposal means
            of the children of nodes ``x`` (all of one depth, at step ``n``).
    """

    name: str
    freeze: Callable[..., torch.Tensor]
    mean: Callable[..., torch.Tensor]


DRAFTS: Registry[Draft] = Registry("draft")


def get_draft(name: str) -> Draft:
    """Look up a draft by name.

    Raises:
        ConfigError: (a ``ValueError``) unknown name; the message lists the valid ones.
    """
    return DRAFTS.get(name)


def _flat_mean(schedule: Schedule, x: torch.Tensor, v: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """Kernel means (eq. 36) of nodes ``x [M, m, *e]`` with velocities ``v`` like ``x``, all at step ``n [M]``."""
    m, k = x.shape[:2]
    out = schedule.mean(x.reshape(m * k, *x.shape[2:]), v.reshape(m * k, *x.shape[2:]), n.repeat_interleave(k))
    return out.reshape(x.shape)


def _x0_freeze(x_r, v_r, n_r, sch: Schedule):
    return x_r - per_row(sch.sigmas.to(x_r.device)[n_r].to(x_r.dtype), x_r) * v_r


def _x0_mean(fr, x, n, sch: Schedule):
    s = per_row(sch.sigmas.to(x.device)[n].to(x.dtype), x)
    return _flat_mean(sch, x, (x - fr[:, None]) / s, n)


for _draft in (
    Draft(
        "velocity",
        freeze=lambda x_r, v_r, n_r, sch: v_r,
        mean=lambda fr, x, n, sch: _flat_mean(sch, x, fr[:, None].expand_as(x), n),
    ),
    Draft("drift", freeze=lambda x_r, v_r, n_r, sch: sch.mean(x_r, v_r, n_r) - x_r, mean=lambda fr, x, n, sch: x + fr[:, None]),
    Draft("x0", freeze=_x0_freeze, mean=_x0_mean),
):
    DRAFTS.register(_draft.name, _draft)
