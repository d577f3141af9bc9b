"""Load-free cost of a sampler round: ATen operations and host synchronisations, counted, not timed.

``python -m benchmarks.opcount [--models digits,gmm] [--n 1,16] [--compile] [--json PATH]`` (a section of ``make bench``).

Wall-clock numbers move with whatever else the machine runs; the number of tensor operations a round
dispatches and the number of times it makes the host wait for a value do not. This module counts
both with a :class:`torch.utils._python_dispatch.TorchDispatchMode` (every ATen operator call below
Python is seen once, whatever the backend) while a sampler runs, and splits them into four regions:

- ``network``: inside the target's forward pass (``context.Velocity.__call__``); excluded from the
  round's cost, reported as ops per call for scale;
- ``coupling``: inside a :class:`specsamp.coupling.Coupling` call (the verification rule itself);
- ``round``: everything else the sampler does (drafting, noise, walk, commit, prefetch, bookkeeping);
- ``setup``: one-time tables built on first use, whatever run comes first in the process (markmax's
  delta-bin shares: :func:`specsamp.markmax_params.share_table` and ``bin_shares``); excluded from the
  per-round costs.

A host synchronisation is an operation whose result size or value the host must read before it can go
on (on CUDA each one waits for the device queue to drain): ``aten::_local_scalar_dense`` (``item()``,
``bool()``, ``int()``, ``float()`` of a tensor), ``aten::nonzero`` (also what boolean-mask indexing
dispatches on some backends), ``aten::unique*``, ``aten::masked_select``, ``aten::repeat_interleave`` without an output
size, and the Python-level ``Tensor.tolist()`` and ``Tensor.numpy()`` (which bypass the dispatcher and
are counted by wrapping them while counting). ``torch.cuda.set_sync_debug_mode`` reports the same
events on CUDA only; this counter works on any device, the CPU included.

With ``--compile`` the speculative arms also run under ``compile=true`` (:mod:`specsamp.round.compiled`), counted
by :func:`counting_compiled` from the profiler's record: a dispatch counter would switch TorchDynamo off,
and the unit there is an ATen call from Python or one launch of a fused kernel.

Per round: totals divided by the batch's rounds (the sampler loop's iterations, ``max(result.rounds)``),
so the first and last deterministic steps and the setup are amortised into the rounds; the standard
sampler's cost is per step (``T`` steps). The counts are deterministic for a given configuration,
torch version and seed: the tests assert them (``tests/experiments/test_opcount.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

SYNC_OPS = (
    "_local_scalar_dense",
    "nonzero",
    "nonzero_static",
    "unique",
    "_unique",
    "_unique2",
    "unique_dim",
    "unique_consecutive",
    "masked_select",
    "repeat_interleave",
    "item",
    "is_nonzero",
    "nonzero_numpy",
    "argwhere",
)
"""ATen operator base names that make the host wait (see the module docstring). Under ``torch.inference_mode``
(the samplers run in it) composite operators reach the dispatcher undecomposed: ``item()`` and ``bool()`` as
``item`` and ``is_nonzero`` rather than ``_local_scalar_dense``, ``nonzero(as_tuple=True)`` as ``nonzero_numpy``,
``argwhere`` and ``torch.where(condition)`` (counted where it has one argument) rather than ``nonzero``."""


MASK_OPS = ("index", "index_put", "index_put_", "_index_put_impl_")
"""Indexing operators that synchronise when an index is a boolean mask (its size is its number of True)."""


def _has_bool_index(args) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return isinstance(indices, (list, tuple)) and any(
        isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices
    )


def _base(func) -> str:
    name = func.__name__ if hasattr(func, "__name__") else str(func)
    return name.split(".")[0]


@dataclass
class OpCounts:
    """Operator calls and host synchronisations of one counted run, by region.

    Attributes:
        ops: ``{region: ATen operator calls}`` (``round``, ``coupling``, ``network``, ``setup``).
        syncs: ``{region: host synchronisations}``.
        by_op: ``{(region, op name): calls}``, for profiling where a count comes from.
        network_calls: target forward passes seen.
    """

    ops: Counter = field(default_factory=Counter)
    syncs: Counter = field(default_factory=Counter)
    by_op: Counter = field(default_factory=Counter)
    network_calls: int = 0

    @property
    def total_ops(self) -> int:
        """ATen operator calls over every region."""
        return sum(self.ops.values())

    @property
    def total_syncs(self) -> int:
        """Host synchronisations over every region."""
        return sum(self.syncs.values())


class OpCounter(TorchDispatchMode):
    """Counts every ATen call (and every host synchronisation) into the current region of :class:`OpCounts`.

    Use :func:`counting`, which also installs the region markers and the ``tolist``/``numpy`` hooks.
    """

    def __init__(self, counts: OpCounts):
        super().__init__()
        self.counts = counts
        self.region = ["round"]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = _base(func._overloadpacket if hasattr(func, "_overloadpacket") else func)
        reg = self.region[-1]
        self.counts.ops[reg] += 1
        self.counts.by_op[(reg, name)] += 1
        if (
            name in SYNC_OPS
            and not (name == "repeat_interleave" and (kwargs or {}).get("output_size") is not None)
            or name == "where"
            and len(args) == 1
        ):
            self.counts.syncs[reg] += 1
        elif name in MASK_OPS and _has_bool_index(args):
            self.counts.syncs[reg] += 1
            self.counts.by_op[(reg, name + "[bool mask]")] += 1
        return func(*args, **(kwargs or {}))

    def sync(self, what: str) -> None:
        """Count a synchronisation the dispatcher does not see (``tolist``, ``numpy``)."""
        reg = self.region[-1]
        self.counts.syncs[reg] += 1
        self.counts.by_op[(reg, what)] += 1

    @contextlib.contextmanager
    def enter(self, region: str):
        """Attribute what runs inside to ``region``."""
        self.region.append(region)
        try:
            yield
        finally:
            self.region.pop()


@contextlib.contextmanager
def counting():
    """Count ATen calls and host syncs of everything run inside; yields the :class:`OpCounts`.

    The target's forward passes are counted as region ``network`` and coupling calls as ``coupling``,
    by wrapping ``specsamp.round.context.Velocity.__call__``, ``specsamp.coupling.Coupling.__call__`` and
    ``Coupling.choice`` for the duration (restored on exit); ``specsamp.markmax_params.share_table`` and
    ``bin_shares`` (markmax's share table and cache, computed once per process) as ``setup``.
    """
    from specsamp import coupling as cmod, markmax_params as mmod
    from specsamp.round import context as smod

    counts = OpCounts()
    mode = OpCounter(counts)
    vel_call, coup_call, coup_choice = smod.Velocity.__call__, cmod.Coupling.__call__, cmod.Coupling.choice
    bin_shares, share_table = mmod.bin_shares, mmod.share_table

    def velocity(self, *a, **k):
        counts.network_calls += 1
        with mode.enter("network"):
            return vel_call(self, *a, **k)

    def coupling(self, *a, **k):
        with mode.enter("coupling"):
            return coup_call(self, *a, **k)

    def choice(self, *a, **k):
        with mode.enter("coupling"):
            return coup_choice(self, *a, **k)

    def setup(fn):
        def inner(*a, **k):
            with mode.enter("setup"):
                return fn(*a, **k)

        return inner

    smod.Velocity.__call__, cmod.Coupling.__call__, cmod.Coupling.choice = velocity, coupling, choice
    mmod.bin_shares, mmod.share_table = setup(bin_shares), setup(share_table)
    try:
        with _host_reads(mode.sync), mode:
            yield counts
    finally:
        smod.Velocity.__call__, cmod.Coupling.__call__, cmod.Coupling.choice = vel_call, coup_call, coup_choice
        mmod.bin_shares, mmod.share_table = bin_shares, share_table


@contextlib.contextmanager
def _host_reads(sync):
    """``Tensor.tolist()`` and ``Tensor.numpy()`` (host reads the dispatcher does not see) call ``sync(name)``
    first while inside; restored on exit."""
    tolist, numpy = torch.Tensor.tolist, torch.Tensor.numpy

    def tolist_(self, *a, **k):
        sync("tolist")
        return tolist(self, *a, **k)

    def numpy_(self, *a, **k):
        sync("numpy")
        return numpy(self, *a, **k)

    torch.Tensor.tolist, torch.Tensor.numpy = tolist_, numpy_
    try:
        yield
    finally:
        torch.Tensor.tolist, torch.Tensor.numpy = tolist, numpy


NETWORK_RANGE = "specsamp::network"  # the profiler range :func:`counting_compiled` puts around every target call


@contextlib.contextmanager
def counting_compiled():
    """Count what a run under ``compile=true`` dispatches; yields the :class:`OpCounts` (filled on exit).

    A :class:`TorchDispatchMode` turns TorchDynamo off (a compiled graph would run eagerly under it), so this
    counter reads ``torch.profiler``'s record of the run instead, and counts two kinds of operation:

    - ATen operators called from Python: profiler events ``aten::*`` whose parent is not itself an ATen
      operator (the calls a dispatch counter sees; the profiler also records what they call inside), in
      region ``network`` where a :data:`NETWORK_RANGE` range (put around every ``_Velocity.__call__``) lies
      above them, else ``round`` (the commit, the loop, the code between and around the compiled graphs);
    - inductor's fused CPU kernels, each launch one operation of region ``round`` (by-op name
      ``inductor kernel``): C functions named ``kernel`` seen by ``sys.setprofile`` (inductor's generated CPU
      modules name their entry point so; one launch runs a fused loop over every element).

    The coupling traced into the graphs is not separable from the round here: ``coupling`` stays 0. Host
    syncs: the ATen ones of :data:`SYNC_OPS` among the counted events, and ``Tensor.tolist()`` / ``numpy()``
    (wrapped while counting). On CUDA a fused kernel is one launch too; the counts are the CPU's.
    """
    from torch.profiler import ProfilerActivity, profile, record_function

    from specsamp.round import context as smod

    counts = OpCounts()
    vel_call = smod.Velocity.__call__
    kernels = [0]

    def velocity(self, *a, **k):
        counts.network_calls += 1
        with record_function(NETWORK_RANGE):
            return vel_call(self, *a, **k)

    def host_read(what):
        counts.syncs["round"] += 1
        counts.by_op[("round", what)] += 1

    def hook(frame, event, arg):
        if event == "c_call" and getattr(arg, "__name__", "") == "kernel":
            kernels[0] += 1

    smod.Velocity.__call__ = velocity
    try:
        with _host_reads(host_read), profile(activities=[ProfilerActivity.CPU]) as prof:
            sys.setprofile(hook)
            try:
                yield counts
            finally:
                sys.setprofile(None)
    finally:
        smod.Velocity.__call__ = vel_call
    for ev in prof.events():
        if not ev.name.startswith("aten::") or (ev.cpu_parent is not None and ev.cpu_parent.name.startswith("aten::")):
            continue
        up, reg = ev.cpu_parent, "round"
        while up is not None:
            if up.name == NETWORK_RANGE:
                reg = "network"
                break
            up = up.cpu_parent
        name = ev.name[len("aten::") :]
        counts.ops[reg] += 1
        counts.by_op[(reg, name)] += 1
        if name in SYNC_OPS:
            counts.syncs[reg] += 1
    counts.ops["round"] += kernels[0]
    counts.by_op[("round", "inductor kernel")] += kernels[0]


# ----------------------------------------------------------------------------------------------
# The arms of the wall-clock question, as config overrides of the runner.

ARMS = {
    "standard": ["sampler=standard"],
    "dgrs 2x3": ["sampler=dgrs", "K=2", "L=3"],
    "dgrs 2x5": ["sampler=dgrs", "K=2", "L=5"],
    "rmc chain14": ["sampler=rmc", "K=1", "L=14"],
    "rmc chain62": ["sampler=rmc", "K=1", "L=62"],
    "x0+optimal B14": ["sampler=dgrs", "draft=x0", "tree=optimal", "budget=14"],
    "x0+optimal B62": ["sampler=dgrs", "draft=x0", "tree=optimal", "budget=62"],
    "x0g+per-step B14": ["sampler=dgrs", "draft=x0_extrap_gated", "tree=optimal_per_step", "budget=14"],
    "markmax 2x3": ["sampler=markmax", "K=2", "L=3"],
}
"""Arm name -> overrides (on top of the model's paper protocol); the x0 arms add the model's shipped profile."""

PROFILES = {"digits": "edm-digits-8x8-cond_x0", "gmm": "gmm_x0"}
"""Shipped ``delta_profile`` of the ``tree=optimal*`` arms per model (no calibration run)."""

DRAFT_PROFILES = {("gmm", "x0_extrap_gated"): "gmm_x0_extrap_gated"}
"""Where a model ships a profile of the arm's own draft, it replaces :data:`PROFILES` (the digits network ships
none for ``x0_extrap_gated``: its arm searches its trees from the ``x0`` profile, which sets the cost, not the law)."""


def arm_overrides(model: str, arm: str, n: int, execution: str = "tree") -> list[str]:
    """Full override list of ``arm`` on ``model`` (``digits`` or ``gmm``) with ``n`` trajectories.

    Raises:
        KeyError: unknown arm.
    """
    ov = [f"model={model}", f"n_samples={n}", "progress=false", *ARMS[arm]]
    if arm != "standard":
        ov.append(f"execution={execution}")
    if any(o.startswith("tree=optimal") for o in ARMS[arm]):
        draft = next((o.split("=", 1)[1] for o in ARMS[arm] if o.startswith("draft=")), "velocity")
        ov.append(f"delta_profile={DRAFT_PROFILES.get((model, draft), PROFILES[model])}")
    return ov


def count_config(overrides: list[str], target=None, profiler: bool | None = None) -> dict:
    """Run one configuration (``specsamp.runner.run_config``) and count its sampling.

    Only the sampler call is counted (the tree search, the record and the statistics are not). With
    ``compile=true`` among the overrides, the configuration first runs once uncounted (it compiles), then
    the counted run uses :func:`counting_compiled` (a fused kernel launch counts as one operation; the
    coupling is inside the round's count). ``profiler``: which counter, :func:`counting_compiled` (True) or
    :func:`counting` (False); None: the first where ``compile=true``.

    Returns:
        ``{"rounds", "network_calls", "ops_round", "syncs_round", "ops_coupling", "syncs_coupling",
        "ops_network_call", "batch_nfe", "counts"}``; per-round values are floats (totals / rounds).
    """
    from specsamp.runner import build_target, compose, load_config, loop

    d = compose(overrides)
    target = target or build_target(load_config(d)[0])
    box = {}
    spec, std = loop.sample_speculative, loop.sample_standard

    compiled = bool(d.get("compile", False))
    if compiled:
        loop.run_config(d, target=target)  # compiles every graph the counted run uses
    profiler = compiled if profiler is None else profiler

    def wrap(fn):
        def inner(*a, **k):
            with counting_compiled() if profiler else counting() as c:
                res = fn(*a, **k)
            box["counts"], box["res"] = c, res
            return res

        return inner

    loop.sample_speculative, loop.sample_standard = wrap(spec), wrap(std)
    try:
        loop.run_config(d, target=target)
    finally:
        loop.sample_speculative, loop.sample_standard = spec, std
    c, res = box["counts"], box["res"]
    standard = res.attempts.shape[1] == 0 and res.attempts_by_root is None
    rounds = res.speculative_steps + 2 if standard else int(res.rounds.max())
    return {
        "rounds": rounds,
        "network_calls": c.network_calls,
        "batch_nfe": res.batch_nfe,
        "ops_round": c.ops["round"] / rounds,
        "syncs_round": c.syncs["round"] / rounds,
        "ops_coupling": c.ops["coupling"] / rounds,
        "syncs_coupling": c.syncs["coupling"] / rounds,
        "ops_network_call": c.ops["network"] / max(c.network_calls, 1),
        "kernels_round": c.by_op[("round", "inductor kernel")] / rounds,
        "counts": c,
    }


def table_rows(
    models=("digits", "gmm"), ns=(1, 16), arms=tuple(ARMS), progress=print, compiled: bool = False
) -> list[dict]:
    """Counted rows for every ``model x n x arm`` (tree execution), one target built per model; with
    ``compiled``, every speculative arm under ``compile=true`` (:func:`counting_compiled`; column ``compile``)."""
    from specsamp.runner import build_target, compose, load_config

    rows = []
    for model in models:
        target = build_target(load_config(compose([f"model={model}"]))[0])
        for n in ns:
            for arm in arms:
                if compiled and arm == "standard":
                    continue
                ov = arm_overrides(model, arm, n) + (["compile=true"] if compiled else [])
                r = count_config(ov, target=target)
                r.pop("counts")
                rows.append({"model": model, "n": n, "arm": arm, "compile": "yes" if compiled else "no", **r})
                if progress:
                    progress(
                        f"  {model} n={n} {arm}: {r['ops_round']:.0f} ops/round + {r['ops_coupling']:.0f} in the coupling, "
                        f"{r['syncs_round']:.2f} + {r['syncs_coupling']:.2f} syncs/round, {r['rounds']} rounds"
                    )
    return rows


COLUMNS = [
    ("model", "model", "s"),
    ("n", "n", "d"),
    ("arm", "arm", "s"),
    ("compile", "compile", "s"),
    ("rounds", "rounds", "d"),
    ("ops_round", "ops/round", ".0f"),
    ("ops_coupling", "coupling ops", ".0f"),
    ("syncs_round", "syncs/round", ".2f"),
    ("syncs_coupling", "coupling syncs", ".2f"),
    ("kernels_round", "of them fused kernels", ".1f"),
    ("ops_network_call", "ops/net call", ".0f"),
]


def main(argv=None) -> int:
    """CLI (see the module docstring); returns the exit status."""
    from benchmarks.common import table, write_json

    p = argparse.ArgumentParser(prog="python -m benchmarks.opcount", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="digits,gmm", help="comma-separated: digits, gmm")
    p.add_argument("--n", default="1,16", help="comma-separated trajectory counts")
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated arms of: {', '.join(ARMS)}")
    p.add_argument("--json", default=None, help="also write the rows here")
    p.add_argument(
        "--compile",
        action="store_true",
        help="also count every speculative arm under compile=true (needs a C compiler; see specsamp.round.compiled)",
    )
    a = p.parse_args(argv)
    arms = [s.strip() for s in a.arms.split(",")]
    bad = [s for s in arms if s not in ARMS]
    models = a.models.split(",")
    if bad or any(m not in PROFILES for m in models):
        print(
            f"error: --arms/--models invalid ({bad or models}); valid arms: {', '.join(ARMS)}; models: digits, gmm",
            file=sys.stderr,
        )
        return 2
    torch.set_num_threads(1)
    ns = [int(v) for v in a.n.split(",")]
    rows = table_rows(models, ns, arms)
    if a.compile:
        from specsamp.inductor import unavailable

        why = unavailable("cpu")
        if why is not None:
            print(f"error: --compile: {why}", file=sys.stderr)
            return 2
        rows += table_rows(models, ns, arms, compiled=True)
    print(table(rows, COLUMNS), flush=True)
    write_json(rows, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
