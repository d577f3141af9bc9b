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

import weakref
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


DRAFT_FORMS = ("loop", "closed")


def check_draft_form(form, kern: Kernel, draft, execution: str) -> str:
    """``draft_form`` of :func:`specsamp.sampler.sample_speculative`, checked: ``"loop"`` (the default: layer by layer,
    the sparse round's operations) or ``"closed"`` (:func:`closed_tables`: the tree execution, the velocity draft and
    a kernel split here with no clip or threshold, so that the drafted means are affine in the root's state).

    Raises:
        ConfigError: another value, or ``"closed"`` where the draft's means are not affine or the execution is path.
    """
    from ..arguments import choice
    from ..errors import ConfigError

    form = choice("draft_form", form, DRAFT_FORMS)
    if form == "closed":
        affine = output_split(kern, draft) is not None
        affine = affine and getattr(kern, "clip", None) is None and getattr(kern, "threshold", None) is None
        if execution != "tree" or not affine:
            why = (
                f"execution={execution} drafts node by node"
                if execution != "tree"
                else f"draft={draft.name!r} with kernel {type(kern).__name__} is not affine in the root's state"
            )
            raise ConfigError(
                f"draft_form='closed' is invalid here: {why}; it needs execution=tree, draft=velocity and an "
                "Euler-Maruyama or data-prediction kernel without clip or threshold. Use draft_form='loop'."
            )
    return form


CLOSED_LIMIT = 1 << 24  # most elements T * (N - 1)^2 of a closed form's path-mixing table
CLOSED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # kernel -> {(tree, dtype, device): tables}


def closed_tables(lt, ctx) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The closed form of the velocity draft over ``lt``'s tree, per root index (``draft_form="closed"``).

    Each drafted state is ``x_v = alpha x_u + beta v_0 + std xi_v`` with ``u`` its parent and ``alpha``, ``beta`` the
    kernel mean's coefficients of ``x`` and of the output at the parent's step, so ``x_v = A_d x_0 + B_d v_0 +
    sum_e W_{d, d(e)} std xi_e`` over the nodes ``e`` on the path from the root to ``v`` (``v`` included), ``d`` the
    depth of ``v``: ``A_d`` the product of the ``alpha`` above depth ``d``, ``W_{d, j}`` the product from depth ``j + 1``
    to ``d``, ``B_d = alpha_d B_{d-1} + beta_d``. Computed once in float64 and stored in the states' dtype.

    Returns:
        ``A``, ``B`` ``[N-1, T, 1]`` (non-root nodes, root index) and ``mix [T, N-1, N-1]`` (node, its path's nodes),
        kept per kernel, tree, dtype and device for the process (:data:`CLOSED`): the runs of a sweep build them once.

    Raises:
        ConfigError: ``mix`` would hold more than :data:`CLOSED_LIMIT` elements.
    """
    kern, T, dev, dtype = ctx.schedule.kernel, ctx.schedule.steps, lt.depth.device, ctx.coef_table.dtype
    if T * (lt.N - 1) ** 2 > CLOSED_LIMIT:
        from ..errors import ConfigError

        raise ConfigError(
            f"draft_form='closed' is invalid for a tree of {lt.N} nodes over {T} steps: its path-mixing table would "
            f"hold {T * (lt.N - 1) ** 2:,} numbers (at most {CLOSED_LIMIT:,}). Use draft_form='loop'."
        )
    key = (lt.tree.parent.tobytes(), dtype, str(dev))
    per_kernel = CLOSED.setdefault(kern, {})
    if key not in per_kernel:
        per_kernel[key] = _closed_tables(lt, kern, T, dev, dtype)
    return per_kernel[key]


def _closed_tables(lt, kern: Kernel, T: int, dev, dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    L = lt.L
    step = (torch.arange(T, device=dev)[:, None] + torch.arange(L, device=dev)[None]).clamp(max=T - 1)
    c = kern.named(kern.table(dev, torch.float64)[step].unbind(-1))  # [T, L] each: depth l's parent step
    one, zero = (torch.full((T, L), v, dtype=torch.float64, device=dev) for v in (1.0, 0.0))
    base = kern.mean(zero, zero, c)
    alpha, beta = kern.mean(one, zero, c) - base, kern.mean(zero, one, c) - base
    # W[:, d, j] = prod of alpha over depths j+1..d (1 at j = d, 0 above the diagonal): a cumulative product down
    # the depth axis of alpha where i > j, else 1; A = W[:, :, 0], B = W[:, :, 1:] beta
    i = torch.arange(L + 1, device=dev)
    a_at = torch.cat([one[:, :1], alpha], 1)[:, :, None]  # [T, L+1, 1]: depth i's alpha (unused at i = 0)
    W = torch.where(i[:, None] > i[None], a_at, 1.0).cumprod(1) * (i[:, None] >= i[None])
    A, B = W[:, :, 0], W[:, :, 1:] @ beta[..., None]
    d = lt.depth[1:]
    on_path = lt.anc_t[:, 1:].T.to(torch.float64)  # [v, e]: e on the path from the root to v
    mix = W.index_select(1, d).index_select(2, d) * on_path[None]
    return (A[:, d].T[..., None].to(dtype), B[:, d, 0].T[..., None].to(dtype), mix.to(dtype).contiguous())


def closed_draft(r, noise: torch.Tensor) -> None:
    """Every drafted state of the round ``r`` (a :class:`specsamp.round.dense.DenseRound`) in closed form
    (:func:`closed_tables`), written into ``noise`` (``r.states[1:]``, ``[N-1, M, D]``, holding ``std xi`` on entry):
    one product by each node's path noise, over every row at once."""
    lt, n, M = r.lt, r.n, r.n.shape[0]
    A, B, mix = lt.closed
    x = r.states[:1]  # [1, M, D]: the roots
    mixed = torch.bmm(mix.index_select(0, n), noise.transpose(0, 1)).transpose(0, 1)  # [N-1, M, D]
    noise.copy_(A.index_select(1, n) * x + B.index_select(1, n) * r.frozen.reshape(1, M, -1) + mixed)
