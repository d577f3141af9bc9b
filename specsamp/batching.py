"""One logical target call split into forward passes of bounded size (the ``max_batch`` key).

Part of the core: it imports torch only, so the samplers can use it without loading the model adapters.
"""

from __future__ import annotations

import torch


def batched(model, x: torch.Tensor, sigma: torch.Tensor, max_batch: int | None = None, **cond) -> torch.Tensor:
    """Evaluate ``model`` on ``x`` in chunks of at most ``max_batch`` rows.

    One logical target call (one NFE) may need several forward passes when it does not fit in
    memory; this splits it without changing any count the sampler records.

    Args:
        model: a :class:`specsamp.models.VelocityModel` (anything with ``__call__(x, sigma, **cond)``).
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
