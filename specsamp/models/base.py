"""The velocity interface every target implements, and a splitter for large batched calls."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class VelocityModel(Protocol):
    """A target velocity field on the linear path.

    Attributes:
        event_shape: shape of one state, e.g. ``(500,)`` or ``(3, 32, 32)``.
        dtype: dtype of states the sampler should use (the kernel and coupling run in it).
    """

    event_shape: tuple[int, ...]
    dtype: torch.dtype

    def __call__(self, x: torch.Tensor, sigma: torch.Tensor, **cond: torch.Tensor) -> torch.Tensor:
        """Velocity ``v(x, sigma)``: ``x [b, *event]``, ``sigma [b]`` float -> ``[b, *event]``."""
        ...


def batched(model, x: torch.Tensor, sigma: torch.Tensor, max_batch: int | None = None, **cond) -> torch.Tensor:
    """Evaluate ``model`` on ``x`` in chunks of at most ``max_batch`` rows.

    One logical target call (one NFE) may need several forward passes when it does not fit in
    memory; this splits it without changing any count the sampler records.

    Args:
        model: a :class:`VelocityModel`.
        x: ``[b, *event]``.
        sigma: ``[b]``.
        max_batch: rows per forward pass (``None`` or ``<= 0``: all at once).
        **cond: per-row tensors ``[b, ...]``.

    Returns:
        ``[b, *event]`` velocities.
    """
    b = x.shape[0]
    if not max_batch or max_batch <= 0 or b <= max_batch:
        return model(x, sigma, **cond)
    outs = []
    for i in range(0, b, max_batch):
        sl = slice(i, i + max_batch)
        outs.append(model(x[sl], sigma[sl], **{k: v[sl] for k, v in cond.items()}))
    return torch.cat(outs)
