"""GPU check: per-call cost, wall clock of standard vs speculative sampling, CUDA against CPU, laws, compile.

    python3 -m benchmarks.gpu_check                      # on the GPU, from the repository root (< 5 minutes)
    python3 -m benchmarks.gpu_check --device cpu --tiny  # a rehearsal of every section in seconds
    make gpu-check [ARGS="..."]

Runs from the working tree with torch, numpy and scipy only (nothing installed, nothing downloaded).
Output folder: ``--out``, else ``$OUT``, else ``./gpu_check/``. Each section writes ``<section>.json``
(atomically) as soon as it ends, with ``status`` ``ok`` (it ran; its checks are in ``passed``),
``error`` (the traceback is recorded and the next section still runs) or ``skipped`` (no time left in
``--budget-s``); ``summary.txt`` is rewritten after every section. A SIGTERM (``timeout``) ends the
running section with what it had finished (under ``partial``) and marks the rest skipped. Exit status:
0 when every section ran, 1 otherwise, 2 for a bad argument.

Sections, in order of value:

1. ``call_cost``: seconds of one network call against its rows (1 to 4096) for the trained digits
   network (``edm-digits-8x8-cond``, shipped) and for EDM's CIFAR-10 network (the DDPM++ layout,
   55.7M parameters, random weights; :mod:`benchmarks.ddpmpp`), in float32 (TF32 as torch's defaults
   leave it) and under bfloat16 autocast; median [min-max] of the repeats, peak GPU memory.
2. ``wallclock``: standard vs speculative sampling on the digits network at the paper's EDM protocol
   (T = 100, eps = 0.3), ``execution="tree"``, batches 1, 4, 16, 64: D-GRS on the uniform (2, 3) and
   (2, 5) trees, RMC on a chain of 14, and the x0 draft with D-GRS on the optimal tree for B = 14 and
   B = 62 (searched from the shipped profile ``edm-digits-8x8-cond_x0``, as ``tree=optimal`` does).
   Every arm runs once untimed at each batch (the timed runs repeat its shapes exactly), then
   ``--repeats`` timed runs: median [min-max] seconds, the network's share (CUDA events around every
   call) and the rest, peak GPU memory, NFE and wall-clock speedups; then the host's waits on the
   device per round at batch 16, by source line (:func:`~benchmarks.gpu_check.wallclock.host_syncs`).
3. ``projection``: the digits runs' calls (rows of every call, recorded per arm and batch) priced at
   the CIFAR-10 network's measured call cost, plus the digits runs' non-network time: a *projected*
   wall clock and speedup for EDM's network, assuming its trees accept as the digits network's do.
4. ``auto``: ``sample_auto`` on the digits network (T = 100), one image and 16: its choice on this device, the
   first run's set-up (cost curve, host cost, pilot), and its time against the standard sampler and an RMC chain
   of 14, interleaved (:mod:`~benchmarks.gpu_check.auto_check`; passes when it is at least 0.95x the standard's).
5. ``cuda_vs_cpu``: the same seed on the device and on the CPU, for the GMM (float64) and the digits
   network (float32, TF32 off): every count equal, samples within a tolerance derived on the CPU
   (:func:`~benchmarks.gpu_check.cuda_vs_cpu.cuda_vs_cpu`).
6. ``laws``: every registered coupling's law on the device (KS of the output's projections), and
   speculative against standard samples of the digits network under bfloat16 autocast (two-sample KS).
7. ``compile``: the network call under ``torch.compile`` and replayed from a captured CUDA graph,
   against eager, at fixed rows (CUDA only); the sampler's round under ``compile=True`` against eager
   (D-GRS (2, 3), batch 16: times, counts, samples' largest difference), on CUDA and on a CPU with a C
   compiler (not in ``--tiny`` on the CPU: a compilation takes tens of seconds).
8. ``round_cost``: a speculative round's host cost beside its network call, per round, eager against
   ``compile=True`` (on CUDA: the round's pieces replayed from captured CUDA graphs), RMC on a chain and D-GRS on
   the (2, 3) tree over a float32 Gaussian mixture (:mod:`~benchmarks.gpu_check.round_cost`).

``--tiny`` shrinks every size (T = 8, two batches, the DDPM++ layout at 16 channels): a smoke run
whose timings measure nothing.

Layout: :mod:`~benchmarks.gpu_check.harness` (the sections' registry, the command line, the budget,
SIGTERM, the records), one module per section (``call_cost``, ``wallclock``, ``projection``, ``auto_check``,
``cuda_vs_cpu``, ``laws``, ``compile_check``, ``round_cost``), :mod:`~benchmarks.gpu_check.support` (the networks and
one sampling run, which several sections use); timing, peak memory and the environment from
:mod:`benchmarks.common`, atomic writes from :mod:`specsamp.io`.
"""

from __future__ import annotations

# each section module registers its section with the harness as it is imported
from benchmarks.gpu_check import (  # noqa: F401
    auto_check,
    call_cost,
    compile_check,
    cuda_vs_cpu,
    laws,
    projection,
    round_cost,
    wallclock,
)
from benchmarks.gpu_check.harness import SECTION_FNS, SECTIONS, Context, _on_sigterm, main as _main, parse_args  # noqa: F401

__all__ = ["SECTIONS", "SECTION_FNS", "Context", "main"]

if set(SECTION_FNS) != set(SECTIONS):  # every section has its module, every module its place in the order
    raise ImportError(f"GPU check sections registered {sorted(SECTION_FNS)}, ordered {list(SECTIONS)}")


def _args(argv):
    """The parsed command line (:func:`~benchmarks.gpu_check.harness.parse_args`)."""
    return parse_args(argv, description=__doc__.split("\n\n")[0])


def main(argv=None) -> int:
    """Command line entry (module docstring): 0 when every section ran, 1 otherwise, 2 for a bad argument."""
    return _main(argv, description=__doc__.split("\n\n")[0])
