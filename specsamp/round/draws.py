"""Every keyed draw of a round, both layouts: the draft noise of a node and the uniforms of its verification.

A node ``v`` of the round rooted at state ``n`` of trajectory ``k`` draws its noise from ``fold(fold(draft_k, n), v)``
and its verification's uniforms from ``fold(fold(verify_k, n), v)`` (:mod:`specsamp.rng`), whichever layout runs it
and whether its numbers come from a per-run table, a per-round table or a draw of their own: the same keys, so the
same numbers. The sparse round draws per node it visits (:func:`sparse_noise`, :func:`sparse_uniforms`); the dense
round gathers from the run's tables (:func:`run_tables`) or draws every node at once (:func:`dense_noise`,
:func:`dense_uniforms`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch

from .. import rng

if TYPE_CHECKING:
    from .context import Context

KEY_CACHE = 1 << 21  # largest M * T * N for which a run keeps every (row, root, node) key in a table
NOISE_CACHE = 1 << 20  # largest M * T * (N - 1) * D for which a run draws every (row, root, node) draft noise once
UNIFORM_CACHE = 1 << 20  # largest M * T * N * (Kmax + 1) for which a run draws every node's coupling uniforms once
UNIFORM_TABLE = (
    1 << 18
)  # largest m * I * (K_max + 1) for which a sparse round draws every internal node's uniforms at once
DISABLED: dict = {}


def outside(fn: Callable) -> Callable:
    """``fn`` excluded from ``torch.compile``'s tracing (``torch.compiler.disable``), one wrapper per function, built on
    first use (:func:`specsamp.round.compiled.compiled_round` builds them first: disable may not be called while
    tracing)."""
    if fn not in DISABLED:
        DISABLED[fn] = torch.compiler.disable(fn, recursive=True)
    return DISABLED[fn]


def run_tables(lt, ctx: Context, M: int, shared: dict, several: bool) -> tuple:
    """A dense run's keyed tables for the tree of ``lt`` (:class:`specsamp.round.tables.DenseTables`), where small:
    ``(key_cache, noise_cache, noise_scaled, uniform_cache)``.

    ``key_cache``: every (row, root, node)'s (draft, verify) keys ``[M, T, N-1]``, ``[M, T, N]`` where ``M T N``
    is within :data:`KEY_CACHE`, else None (and so are the others); ``noise_cache [N-1, M, T, D]``,
    each non-root node's draft noise (:func:`specsamp.rng.normal` of its key, the states' dtype), times its parent
    step's ``std`` where ``noise_scaled`` (the run's one tree); ``uniform_cache``, per coupling call ``c``
    ``[N, M, T, W_c]``, a node's first two :class:`specsamp.rng.KeyedRows` draws (widths ``Kmax`` and 1: D-GRS's
    acceptance and residual uniforms, the reflection coupling's one). ``shared``: the run's tables of a node count,
    reused by its other trees of that size (``several``: the run has more than one tree)."""
    N, T, e, dtype = lt.N, ctx.schedule.steps, tuple(ctx.x_event), ctx.coef_table.dtype
    D = int(np.prod(e, dtype=np.int64))
    if M * T * N > KEY_CACHE:
        return None, None, False, None
    if ("keys", N) not in shared:
        shared["keys", N] = (
            rng.node_keys(ctx.key_tables[0][:, :, None], lt.ids[None, None]),
            rng.node_keys(ctx.key_tables[1][:, :, None], lt.nodes[None, None]),
        )
    keys = shared["keys", N]

    def once(key, make):  # the run's table under key, made by its first tree; the tree's own where it has one tree
        if several and key not in shared:
            shared[key] = make()
        return shared[key] if several else make()

    noise = lambda: rng.draft_noise(keys[0], e, dtype).reshape(M, T, N - 1, D).permute(2, 0, 1, 3)  # noqa: E731
    noise_cache, scaled, uniform_cache = None, False, None
    if N > 1 and M * T * (N - 1) * D <= NOISE_CACHE:
        if not several:
            std = lt.coefs_by_root[lt.dm1, lt.std_col]  # [N-1, T, 1]: each node's parent step, per root
            noise_cache, scaled = (noise() * std[:, None]).contiguous(), True  # std z, as sparse_noise scales it
        else:
            noise_cache = once(("noise", N), lambda: noise().contiguous())
    widths = rng.verify_widths(lt.tree.num_children)
    if M * T * N * sum(widths) <= UNIFORM_CACHE:
        uniform_cache = once(
            ("uniform", N, widths),
            lambda: [u.permute(2, 0, 1, 3).contiguous() for u in rng.verify_uniforms(keys[1], widths)],
        )
    return keys, noise_cache, scaled, uniform_cache


def dense_noise(ctx: Context, lt, n: torch.Tensor, coefs: torch.Tensor, out: torch.Tensor) -> None:
    """Every non-root node's ``std z`` of the dense round rooted at ``n [M]`` into ``out [N-1, M, D]`` (``std`` its
    parent step's, of the round's coefficients ``coefs [L, C, M, 1]``): gathered from the run's table
    (``lt.noise_cache``), or drawn in one draw of
    every node's key (compiled: outside the graph, whose unrolled loop over the draw's blocks would grow with the
    batch); ``z`` times ``std``, as :func:`sparse_noise` scales it."""
    ar = lt.ar
    if lt.noise_scaled:  # per-run table of every (row, root, node) std z: one gather
        out[:] = lt.noise_cache[:, ar, n]
        return
    if lt.noise_cache is not None:  # per-run table of every (row, root, node) z
        torch.mul(lt.noise_cache[:, ar, n], coefs[lt.dm1, lt.std_col], out=out)
        return
    keys = (
        lt.key_cache[0][ar, n].T
        if lt.key_cache is not None
        else rng.node_keys(ctx.key_tables[0][ar, n][None, :], lt.ids[:, None])
    )  # [N-1, M]: fold(k, n) a per-run table
    (outside(rng.draft_noise) if ctx.compiled else rng.draft_noise)(keys, ctx.x_event, out=out)
    out *= coefs[lt.dm1, lt.std_col]


def dense_uniforms(ctx: Context, lt, n: torch.Tensor) -> tuple:
    """The verification keys of every node of the dense round rooted at ``n [M]``: ``(vkeys_all, drawn_all)``, the
    keys ``[N, M]`` (None where the run's uniform table ``drawn_all``, ``[N, M, W_c]`` per call, holds their
    numbers); a chunk reads its nodes' through :func:`keyed_rows`."""
    ar = lt.ar
    if lt.key_cache is not None:  # every node's verification keys, unless the run's uniform table holds their numbers
        vkeys_all = lt.key_cache[1][ar, n].T if lt.uniform_cache is None else None  # [N, M]
    else:
        vkeys_all = rng.node_keys(ctx.key_tables[1][ar, n][None, :], lt.nodes[:, None])
    drawn_all = None if lt.uniform_cache is None else [t[:, ar, n] for t in lt.uniform_cache]  # [N, M, W_c] per call
    return vkeys_all, drawn_all


def keyed_rows(vkeys_all, drawn_all, take, lazy_keys) -> rng.KeyedRows:
    """The uniform source of the verification of the nodes ``take`` picks from node-major ``[N, M, ...]`` tables: their
    rows of the run's uniform table ``drawn_all`` where there is one (their keys, ``lazy_keys()`` where ``vkeys_all``
    is not at hand, drawn only if a coupling asks for more numbers), else their keys."""
    if drawn_all is None:
        return rng.KeyedRows(take(vkeys_all))
    return rng.KeyedRows(take(vkeys_all) if vkeys_all is not None else lazy_keys, [take(d) for d in drawn_all])


def sparse_noise(round_keys: torch.Tensor, ids: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """The children ``ids [s, k]`` of the sparse round's nodes, keyed by their round's draft keys ``round_keys [s]``:
    ``mean [s, *e]`` plus ``std [s, 1...]`` times their noise, ``[s, k, *e]`` (in place in the noise buffer: the same
    numbers as ``mean + std z``)."""
    noise = rng.draft_noise(rng.node_keys(round_keys[:, None], ids), mean.shape[1:], mean.dtype)
    noise *= std[:, None]
    noise += mean[:, None]
    return noise


def sparse_uniforms(verify_keys: torch.Tensor, num_children) -> Callable:
    """``uniforms(sub, u, k)``: the :class:`~specsamp.rng.KeyedRows` of the verification of nodes ``u [s]`` (width ``k``)
    of rows ``sub [s]`` of a sparse round with verification keys ``verify_keys [m]`` (the root folded in) on a tree of
    ``num_children``. Up to :data:`UNIFORM_TABLE` numbers, every internal node's first two calls are drawn at once
    for the round (:func:`specsamp.rng.verify_uniforms`) and gathered: the numbers of the keys, so the rule cannot tell."""
    nc = np.asarray(num_children)
    internal, widths = np.flatnonzero(nc > 0), rng.verify_widths(nc)
    if verify_keys.shape[0] * internal.size * sum(widths) > UNIFORM_TABLE:

        def uniforms(sub, u, k):
            keys = rng.node_keys(verify_keys if sub.numel() == verify_keys.shape[0] else verify_keys[sub], u)
            return rng.KeyedRows(keys, rng.verify_uniforms(keys, (k, 1)))

        return uniforms
    dev = verify_keys.device
    col = torch.as_tensor(np.cumsum(nc > 0) - 1, device=dev)  # an internal node's column of the draw
    keys = rng.node_keys(verify_keys[:, None], torch.as_tensor(internal, device=dev)[None])  # [m, I]
    drawn = rng.verify_uniforms(keys, widths)  # [m, I, W_c] per call c

    def uniforms(sub, u, k):
        j = col[u]
        return rng.KeyedRows(lambda: keys[sub, j], [d[sub, j] for d in drawn])

    return uniforms
