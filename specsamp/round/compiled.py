"""The dense round under ``torch.compile`` (``compile=true``): its tensor maths fused into kernels, the network outside.

Design and guarantee (the law): ``docs/architecture.md``, "Compiled round"; compile checks: :mod:`specsamp.inductor`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .. import rng
from ..coupling import deferred_checks
from ..inductor import classify_compile_error
from .dense import DenseRound, dense_round, network_outside
from .draws import outside

RECOMPILE_LIMIT = 64  # distinct (tree or chunk shape, batch size, dtype) entries of a piece before eager fallback
# Buffer reuse on (torch 2.14, CPU) broke the law where the verification ran in several chunks (docs/architecture.md,
# "Correction"). With reuse and in-place buffers off, each kernel writes its own buffer, freed after its last use.
INDUCTOR_OPTIONS = (("allow_buffer_reuse", False), ("inplace_buffers", False))


def guarded(fn: Callable) -> Callable:
    """``fn`` with a machine fault of the cache raised as :func:`specsamp.inductor.cache_fault`'s paragraph.

    Before the call, the calling thread's slot of the active deferred checks is made to exist
    (:func:`specsamp.projection.open_checks_slot`)."""
    import functools

    from ..projection import open_checks_slot

    @functools.wraps(fn)
    def call(*args, **kwargs):
        open_checks_slot()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            fault = classify_compile_error(e)
            if fault is None:
                raise
            raise fault from e

    return call


TRACED_COUPLINGS = ("dgrs", "rmc")  # registered couplings whose verify asks the host nothing: traced into the graphs
OUTSIDE_RULES: dict = {}


def for_compile(coupling):
    """``coupling`` as the compiled round calls it (a Coupling of the same name, width limit and theory): D-GRS and RMC
    (:data:`TRACED_COUPLINGS`: no host sync, static shapes) traced into the graphs; any other rule's ``verify`` and
    ``decide`` run outside them (``torch.compiler.disable``). Markmax is sync-free too, but gcc 12 fails on its fused
    bisections (an internal compiler error after 8 minutes on the (2, 3) tree); a user's rule is unknown."""
    import dataclasses

    from ..coupling import COUPLINGS

    if (
        coupling.name in TRACED_COUPLINGS
        and coupling.name in COUPLINGS
        and COUPLINGS.get(coupling.name).verify is coupling.verify
    ):
        return coupling
    for fn in (coupling.verify, coupling.decide):
        if (
            fn is not None and fn not in OUTSIDE_RULES
        ):  # one wrapper per rule: the compiled graphs' guards hold it by identity
            OUTSIDE_RULES[fn] = torch.compiler.disable(fn, recursive=True)
    return dataclasses.replace(
        coupling,
        verify=OUTSIDE_RULES[coupling.verify],
        decide=None if coupling.decide is None else OUTSIDE_RULES[coupling.decide],
    )


def finish(r) -> torch.Tensor:
    """The compiled round's last piece: the walk of the :class:`specsamp.round.dense.DenseRound` ``r``
    (:meth:`~specsamp.round.dense.DenseRound.walk`, its deferred checks collected here) and its
    :meth:`~specsamp.round.dense.DenseRound.accept`. Returns the checks' 0-dim flag."""
    with deferred_checks() as checks:
        r.walk()
    r.accept()
    return r.lt.false if checks.bad is None else checks.bad


@dataclass(frozen=True)
class Stages:
    """The compiled round's pieces (:func:`compiled_round`), each compiled on its own and called by
    :meth:`specsamp.round.dense.DenseRound.run` (eager Python between them): ``draft``
    (:meth:`~specsamp.round.dense.DenseRound.draft`), ``chunk`` (:meth:`~specsamp.round.dense.DenseRound.verify_chunk`,
    one call per verification chunk of ``even_chunks`` (:func:`specsamp.round.tables.even_chunks`), handed no slice
    and no root flag, so that every chunk of a width runs one graph) and ``finish`` (:func:`finish`: the walk and the
    commit's gathers). The verification is not unrolled into one graph: its chunks grow in number with the batch
    (:func:`specsamp.round.tables.plan_chunks`), and so would that graph and its compile (about a minute per chunk of
    D-GRS on the (2, 3) tree, on one CPU core)."""

    draft: Callable
    chunk: Callable
    finish: Callable

    def verify(self, r) -> None:
        """:meth:`~specsamp.round.dense.DenseRound.verify`, its walk and its accept by these pieces, on the round ``r``:
        the chunks' verdicts written into the round's buffers here, each piece's deferred checks collected in it and
        joined into ``r.bad``."""
        r.verify_inputs()
        lt = r.lt
        acc, idx, res = lt.buffers.acc, lt.buffers.idx, lt.buffers.residual
        for k, u, ch, du, pos, sig_tab in lt.even_chunks:
            accepted, index, sample, bad_c = self.chunk(r, (k, u, None, ch, None, du, None), sig_tab, True)
            acc[:, u], idx[:, u], r.bad = accepted, index, r.bad | bad_c
            if res is not None:
                res[pos] = sample
        r.bad = r.bad | self.finish(r)


ROUND: dict[str, Callable] = {}  # device type -> the compiled dense round, built once per process
# On CUDA the pieces are also captured as CUDA graphs (inductor's cudagraph trees: one replay per piece, no kernel
# launches from Python); their shapes are static and they ask the host nothing, which the capture needs.
CUDA_OPTIONS = (("triton.cudagraphs", True),)


def inductor_options(device_type: str) -> dict:
    """``torch.compile``'s inductor options for the round's pieces on ``device_type``: :data:`INDUCTOR_OPTIONS`, and
    on CUDA :data:`CUDA_OPTIONS` (CUDA-graph capture) too."""
    return dict(INDUCTOR_OPTIONS + (CUDA_OPTIONS if device_type == "cuda" else ()))


class QuietCudaHome:
    """A logging filter dropping torch's "No CUDA runtime is found, using CUDA_HOME=..." notice, which inductor's CPU
    build prints where a CUDA toolkit is installed but no GPU is: it says nothing about a CPU run."""

    def filter(self, record) -> bool:
        return not str(record.msg).startswith("No CUDA runtime is found")


def new_step(round_fn: Callable) -> Callable:
    """``round_fn`` that first tells the CUDA-graph trees a new step begins
    (``torch.compiler.cudagraph_mark_step_begin``): a round's pieces may overwrite the previous round's graph
    outputs, which its commit has copied into the run's state by then."""

    def call(*args, **kwargs):
        torch.compiler.cudagraph_mark_step_begin()
        return round_fn(*args, **kwargs)

    return call


def compiled_round(device="cpu") -> Callable:
    """:func:`specsamp.round.dense.dense_round` with its pieces (:class:`Stages`: the drafting, one
    verification chunk, the walk and commit) each under ``torch.compile(dynamic=False)`` (inductor, options
    :func:`inductor_options`: on CUDA, CUDA-graph capture), built once per process and device type; TorchDynamo
    caches by code, so a process's runs share the graphs (per tree or chunk shape, batch size, dtype, device), and the
    chunks of one shape share one graph, so that the compile does not grow with the number of chunks. The recompile
    limit is raised to :data:`RECOMPILE_LIMIT` (torch's: 8) so that a sweep over trees keeps compiling.

    Args:
        device: the run's device (a ``torch.device`` or its name); its type picks the options.
    """
    kind = torch.device(device).type
    if kind not in ROUND:
        import functools

        from torch import _dynamo

        cfg = _dynamo.config
        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(cfg, name):
                setattr(cfg, name, max(getattr(cfg, name), RECOMPILE_LIMIT))
        if hasattr(cfg, "accumulated_recompile_limit"):
            cfg.accumulated_recompile_limit = max(cfg.accumulated_recompile_limit, 4 * RECOMPILE_LIMIT)
        import logging

        logging.getLogger("torch.utils.cpp_extension").addFilter(QuietCudaHome())
        network_outside()  # wrapped here: torch.compiler.disable may not be called inside a compiled region
        outside(rng.draft_noise)
        stages = Stages(
            *(
                torch.compile(fn, dynamic=False, options=inductor_options(kind))
                for fn in (DenseRound.draft, DenseRound.verify_chunk, finish)
            )
        )
        ROUND[kind] = functools.partial(dense_round, stages=stages)
        if kind == "cuda":
            ROUND[kind] = new_step(ROUND[kind])
    return guarded(ROUND[kind])
