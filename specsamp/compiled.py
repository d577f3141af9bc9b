"""The lean round under ``torch.compile`` (``compile=true``): its tensor maths fused into kernels, the network outside.

:func:`specsamp.lean._lean_round` is compiled whole (inductor, ``dynamic=False``): the round's Python control
flow is unchanged, and TorchDynamo turns the pure tensor maths on either side of the batched target call
(drafting, verification, walk and the commit's gathers) into compiled graphs. The call itself
(:func:`specsamp.lean._network`) runs outside them: a model need not be compilable, and the number of rows it
evaluates varies from round to round, while every shape the graphs see is static per tree (every row of the
batch is kept in every round, finished rows padded). So each distinct tree (and batch size, dtype, device)
compiles once per process, and the round keeps its one host synchronisation, in the loop's test.

What is guaranteed is the law: the same as the eager round's (the law tests run with compile on). Compiled
kernels may fuse and reorder float operations (a fused multiply-add rounds once where eager rounds twice), so a
compiled run's samples equal the eager run's to rounding, not bitwise, and its counts are identical wherever
that rounding flips no verdict (``tests/core/test_compiled.py``). Inductor's buffer reuse is off
(:data:`INDUCTOR_OPTIONS`): with it, a verification split into several chunks came out wrong.
Whether this machine can compile at all, and the refusals, are :mod:`specsamp.inductor`'s.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .inductor import classify_compile_error
from .lean import _lean_round, _network_outside

RECOMPILE_LIMIT = 64  # distinct (tree, batch size, dtype) entries one process may compile before eager fallback
# Inductor's buffer reuse off: with it on (torch 2.14, CPU), the graph after the network call of a round whose
# verification ran in several chunks (leantree.bind) gave wrong verdicts and residual draws: not rounding, a
# different law (the same graph without inductor, and inductor with buffer reuse off alone, were exact). Without
# reuse and in-place buffers each kernel writes a buffer of its own: freed after its last use as before, only not
# recycled within the graph (tests/core/test_compiled.py, the several-chunk tests).
INDUCTOR_OPTIONS = (("allow_buffer_reuse", False), ("inplace_buffers", False))


def _guarded(fn: Callable) -> Callable:
    """``fn`` (the compiled round), with a machine fault of the cache raised as
    :func:`specsamp.inductor.cache_fault`'s paragraph."""
    import functools

    @functools.wraps(fn)
    def call(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            fault = classify_compile_error(e)
            if fault is None:
                raise
            raise fault from e

    return call


TRACED_COUPLINGS = ("dgrs", "rmc")  # registered couplings whose verify asks the host nothing: traced into the graphs
_OUTSIDE: dict = {}


def for_compile(coupling):
    """``coupling`` as the compiled round calls it: D-GRS and RMC (:data:`TRACED_COUPLINGS`, whose verification
    makes no host synchronisation and has static shapes) as they are, traced into the compiled graphs; any
    other rule (markmax, sync-free with static shapes too, but its fixed-step bisections fuse into C++ kernels
    that gcc 12 fails to build, an internal compiler error after 8 minutes on the (2, 3) tree; a rule of the
    user's is unknown) with its
    ``verify`` (and ``decide``) run outside them (``torch.compiler.disable``; the drafting, walk and commit are still compiled).

    Returns:
        A :class:`specsamp.coupling.Coupling` with the same name, width limit and theory.
    """
    import dataclasses

    from .coupling import COUPLINGS

    if coupling.name in TRACED_COUPLINGS and coupling.name in COUPLINGS and COUPLINGS.get(coupling.name).verify is coupling.verify:
        return coupling
    for fn in (coupling.verify, coupling.decide):
        if fn is not None and fn not in _OUTSIDE:  # one wrapper per rule: the compiled graphs' guards hold it by identity
            _OUTSIDE[fn] = torch.compiler.disable(fn, recursive=True)
    return dataclasses.replace(coupling, verify=_OUTSIDE[coupling.verify],
                               decide=None if coupling.decide is None else _OUTSIDE[coupling.decide])


_ROUND: list[Callable] = []


class _QuietCudaHome:
    """A logging filter dropping torch's "No CUDA runtime is found, using CUDA_HOME=..." notice, which inductor's CPU
    build prints where a CUDA toolkit is installed but no GPU is: it says nothing about a CPU run."""

    def filter(self, record) -> bool:
        return not str(record.msg).startswith("No CUDA runtime is found")


def compiled_round() -> Callable:
    """:func:`specsamp.lean._lean_round` under ``torch.compile(dynamic=False)`` (inductor), built once per process.

    TorchDynamo's cache belongs to the function's code, so every run of a process shares the compiled graphs:
    a tree compiles on its first round and later runs with the same tree, batch size and dtype reuse it. The
    recompile limit is raised to :data:`RECOMPILE_LIMIT` (from torch's 8) so that a sweep over trees keeps
    compiling rather than falling back to eager.
    """
    if not _ROUND:
        import torch._dynamo

        cfg = torch._dynamo.config
        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(cfg, name):
                setattr(cfg, name, max(getattr(cfg, name), RECOMPILE_LIMIT))
        if hasattr(cfg, "accumulated_recompile_limit"):
            cfg.accumulated_recompile_limit = max(cfg.accumulated_recompile_limit, 4 * RECOMPILE_LIMIT)
        import logging

        logging.getLogger("torch.utils.cpp_extension").addFilter(_QuietCudaHome())
        _network_outside()  # wrapped here: torch.compiler.disable may not be called inside a compiled region
        _ROUND.append(torch.compile(_lean_round, dynamic=False, options=dict(INDUCTOR_OPTIONS)))
    return _guarded(_ROUND[0])
