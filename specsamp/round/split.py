"""A kernel mean split at the network's output, for drafting a whole tree's layers with one output term.

The velocity draft's proposal mean is the kernel mean with the frozen root velocity as the network's output
(:mod:`specsamp.drafts`), so the part of the mean that reads the output alone differs from depth to depth by its
coefficient only. :func:`output_split` returns that part (``term``, computed for every depth of the round in one
operation over the per-depth coefficients ``[L, M, 1]``) and the rest of the mean (``rest``, per depth, given the
term); ``rest(x, term(out, c), c)`` runs the kernel mean's own operations in its own order, so it equals
``kernel.mean(x, out, c)`` bit for bit, one multiplication per depth fewer. Kernels split here: Euler-Maruyama
(:class:`specsamp.kernels.EulerMaruyama`, ``x + dt (a v + b x)``: the term ``a v``) and the data-prediction kernels
whose mean is :class:`specsamp.kernels.DataPredictionKernel`'s (``c_x x + c_x0 clip(x - sigma v)``: the term
``sigma v``). Any other kernel (a subclass with its own mean, a multistep kernel) or draft: None, the round calls the
draft's table form per depth.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..drafts import DRAFTS
from ..kernels import DataPredictionKernel, EulerMaruyama, Kernel


def _em_term(out: torch.Tensor, c: dict) -> torch.Tensor:
    return c["a"] * out


def _em_rest(x: torch.Tensor, term: torch.Tensor, c: dict) -> torch.Tensor:
    return x + c["dt"] * (term + c["b"] * x)  # EulerMaruyama.mean with a * out given


def _dp_term(out: torch.Tensor, c: dict) -> torch.Tensor:
    return c["sigma"] * out


def output_split(kern: Kernel, draft) -> tuple[Callable, Callable] | None:
    """``(term, rest)`` of ``kern``'s mean for the draft ``draft`` (module docstring), or None where either is not
    split here.

    ``term(out, c)``: ``out [..., D]`` (the frozen root velocity, ``[1, M, D]``) with coefficients ``c`` (each
    ``[L, M, 1]``) gives ``[L, M, D]``; ``rest(x, term, c)`` the kernel mean at states ``x`` with the depth's slice of
    the term and the depth's coefficients, shaped as ``kern.mean(x, out, c)``."""
    if kern.order != 1 or draft.table_frozen is not None or draft.table_mean is not DRAFTS.get("velocity").table_mean:
        return None
    mean = type(kern).mean
    if mean is EulerMaruyama.mean:
        return _em_term, _em_rest
    if mean is DataPredictionKernel.mean:

        def rest(x: torch.Tensor, term: torch.Tensor, c: dict) -> torch.Tensor:
            return c["c_x"] * x + c["c_x0"] * kern.clip_x0(x - term)  # DataPredictionKernel.mean, sigma * out given

        return _dp_term, rest
    return None
