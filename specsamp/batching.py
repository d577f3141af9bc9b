"""One logical target call split into forward passes of bounded size (the ``max_batch`` key), and reductions
over a row's coordinates that round each row as inside any batch.

Part of the core: it imports torch only, so the samplers can use it without loading the model adapters.
"""

from __future__ import annotations

import torch


def batched(
    model, x: torch.Tensor, sigma: torch.Tensor, max_batch: int | None = None, cond: dict | None = None
) -> torch.Tensor:
    """Evaluate ``model`` on ``x`` in chunks of at most ``max_batch`` rows.

    One logical target call (one NFE) may need several forward passes when it does not fit in
    memory; this splits it without changing any count the sampler records.

    Args:
        model: a :class:`specsamp.models.VelocityModel` (anything with ``__call__(x, sigma, **cond)``).
        x: ``[b, *event]``.
        sigma: ``[b]``.
        max_batch: rows per forward pass (``None`` or ``<= 0``: all at once).
        cond: per-row tensors ``[b, ...]``, passed to ``model`` as keywords under their own names, whatever they
            are (a model's ``x`` and ``sigma`` are positional).

    Returns:
        ``[b, *event]`` velocities.
    """
    b, cond = x.shape[0], cond or {}
    if not max_batch or max_batch <= 0 or b <= max_batch:
        return model(x, sigma, **cond)
    outs = []
    for i in range(0, b, max_batch):
        sl = slice(i, i + max_batch)
        outs.append(model(x[sl], sigma[sl], **{k: v[sl] for k, v in cond.items()}))
    return torch.cat(outs)


SPLIT_ELEMENTS = 32768  # torch's CPU grain: a reduction with one output and this many elements is split between threads


def row_reduce(fn, x: torch.Tensor) -> torch.Tensor:
    """``fn(x)`` for a reduction ``fn`` over the last dimension, each row reduced as it would be inside any batch.

    A reduction over a row's own contiguous coordinates rounds the same whatever the other rows, except where
    it has a single output: CPU torch then splits that one row between its threads (from ``SPLIT_ELEMENTS``
    elements on), so a row alone would round otherwise than inside a batch. Such a row is reduced as one of
    two equal rows (an expanded view, no copy); smaller ones as they are (the same operations whatever the
    batch's size below that)."""
    if x.ndim and x.numel() == x.shape[-1] and x.numel() >= SPLIT_ELEMENTS:
        return fn(x.reshape(1, -1).expand(2, -1))[:1].reshape(x.shape[:-1])
    return fn(x)


def row_sums(x: torch.Tensor) -> torch.Tensor:
    """``x.sum(-1)`` (``[..., D] -> [...]``), each row summed as inside any batch (:func:`row_reduce`)."""
    return row_reduce(lambda t: t.sum(-1), x)
