"""Choosing the round for time, not calls: the plain loop, an RMC chain or a D-GRS tree, per root step.

A round on a tree of ``B`` drafted states costs one network call of ``B`` rows per trajectory (the tree execution
evaluates every drafted state; the root's velocity is the previous round's) plus the round's own host work, and
commits :func:`specsamp.theory.expected_steps` steps in expectation. The plain loop commits one step per call of one
row. So the rate of an option, committed steps per second, is::

    rate = E[steps per round] / (call(b * rows) + host(rows)),      the loop's: 1 / (call(b) + host_loop),

with ``call`` the measured cost curve (:class:`specsamp.cost.CallCost`), ``b`` the trajectories sharing each call,
and ``host`` the round's own cost (:class:`HostCost`, or one per coupling). :func:`options_at` prices every
candidate at one root step from its per-depth displacement profile (calibrated, :mod:`specsamp.profiles`);
:func:`choose` takes, for each coupling, the fastest option at each root, then the fastest coupling, and keeps the
plain loop unless that plan beats it.

Exactness: the choice reads the profile and the costs, fixed before the round it applies to, never the round's own
draws; each round is then an exact round of its coupling on its tree, so the samples keep the target law whatever is
chosen.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from .cost import CallCost
from .profiles import profile_positional
from .theory import expected_steps
from .trees import DraftTree
from .treesearch import optimal_tree

COUPLINGS = ("rmc", "dgrs")
"""The speculative candidates: RMC chains and D-GRS trees (both sync-free, with a positional theory)."""
BUDGETS = (1, 2, 3, 4, 6, 8, 11, 14, 20, 30, 45, 62)
"""Drafted states per round tried by default (chains of these lengths; trees searched for these budgets)."""


@dataclass(frozen=True)
class HostCost:
    """A round's own seconds outside the network, ``fixed + per_row * rows``; ``loop_step``: a plain step's.

    The defaults are of the order measured on one CPU thread (``benchmarks.roundcost``): 1.5 ms a round plus 30 us per
    drafted state, 0.1 ms a plain step. Measure the machine's own for a real choice.
    """

    fixed: float = 1.5e-3
    per_row: float = 3e-5
    loop_step: float = 1e-4

    def __call__(self, rows: int) -> float:
        return self.fixed + self.per_row * rows


@dataclass(frozen=True)
class Option:
    """One candidate at one root step.

    Attributes:
        name: ``loop``, ``rmc chain L`` or ``dgrs B`` (drafted states of the searched tree).
        coupling: ``None`` for the loop, else the coupling's registered name.
        tree: the round's draft tree (None for the loop).
        steps: expected committed steps per round (1 for the loop).
        seconds: expected seconds per round: the call at its rows plus the host's share.
    """

    name: str
    coupling: str | None
    tree: DraftTree | None
    steps: float
    seconds: float

    @property
    def rate(self) -> float:
        """Committed steps per second."""
        return self.steps / self.seconds

    @property
    def rows(self) -> int:
        """Drafted states a round evaluates per trajectory (0: the loop's one row)."""
        return 0 if self.tree is None else len(self.tree) - 1


Hosts = HostCost | Mapping[str, HostCost]
"""One host cost for every coupling, or one per coupling's name (a D-GRS round does more host work than RMC's)."""


def host_of(host: Hosts, coupling: str | None) -> HostCost:
    """``coupling``'s host cost (any entry's for the loop: its ``loop_step`` is the same)."""
    if isinstance(host, HostCost):
        return host
    return host[coupling] if coupling is not None else next(iter(host.values()))


def loop_option(call: CallCost, host: Hosts, batch: int = 1) -> Option:
    """The plain loop: one step per call of ``batch`` rows."""
    return Option("loop", None, None, 1.0, call(batch) + host_of(host, None).loop_step)


def options_at(
    deltas: Sequence[float],
    call: CallCost,
    host: Hosts,
    *,
    batch: int = 1,
    max_depth: int,
    couplings: Sequence[str] = COUPLINGS,
    budgets: Sequence[int] = BUDGETS,
    max_width: int = 4,
) -> list[Option]:
    """Every candidate at a root with ``max_depth`` steps ahead and displacement profile ``deltas`` (per depth, as
    :func:`specsamp.profiles.profile_positional` reads it), the loop first.

    Raises:
        ValueError: a bad profile, budget or depth (:func:`specsamp.treesearch.optimal_tree`'s checks).
    """
    out = [loop_option(call, host, batch)]
    if max_depth < 1:
        return out
    for coupling in couplings:
        pos = profile_positional(deltas, coupling)
        seen = set()
        for b in budgets:
            if coupling == "rmc":
                tree = DraftTree.chain(min(b, max_depth))
            else:
                tree = optimal_tree(b, pos, max_depth, min(max_width, b))
            rows = len(tree) - 1
            if rows in seen:
                continue
            seen.add(rows)
            steps = expected_steps(tree, pos)
            name = f"rmc chain {rows}" if coupling == "rmc" else f"dgrs {rows}"
            out.append(Option(name, coupling, tree, steps, call(batch * rows) + host_of(host, coupling)(rows)))
    return out


@dataclass
class Plan:
    """The choice for a run: the plain loop, or one coupling with one tree per root step ``1 .. T - 2``.

    Attributes:
        coupling: the coupling of every round (None: the plain loop).
        by_root: the chosen option at each root (``by_root[n - 1]``; empty for the loop).
        loop: the plain loop's option (the anchor every plan is measured against).
        rates: the predicted rate (steps per second) of the best plan of each coupling tried, and the loop's.
    """

    coupling: str | None
    by_root: list[Option]
    loop: Option
    rates: dict[str, float]

    @property
    def use_loop(self) -> bool:
        return self.coupling is None

    def predicted_rate(self) -> float:
        """Committed steps per second of the plan (:func:`plan_rate`)."""
        return self.loop.rate if self.use_loop else plan_rate(self.by_root)

    def speedup(self) -> float:
        """The predicted rate over the loop's (1 for the loop)."""
        return self.predicted_rate() / self.loop.rate

    def tree(self, n: int) -> DraftTree:
        """The draft tree at root state index ``n`` (``1 .. T - 2``)."""
        return self.by_root[min(max(n, 1), len(self.by_root)) - 1].tree

    def summary(self) -> dict:
        """What a run's record holds: the choice, the predicted rates and why."""
        return {
            "choice": self.coupling or "loop",
            "predicted_speedup": round(self.speedup(), 4),
            "rates": {k: round(v, 3) for k, v in self.rates.items()},
            "by_root": runs_of([o.name for o in self.by_root]),
        }


def plan_to_json(plan: Plan) -> dict:
    """``plan`` as JSON: its roots in runs of one option on one tree (``[count, name, steps, seconds, parents]``)."""
    runs: list[list] = []
    for o in plan.by_root:
        entry = [o.name, o.steps, o.seconds, o.tree.parent.tolist()]
        if runs and runs[-1][1:] == entry:
            runs[-1][0] += 1
        else:
            runs.append([1, *entry])
    return {
        "coupling": plan.coupling,
        "loop": [plan.loop.steps, plan.loop.seconds],
        "rates": plan.rates,
        "by_root": runs,
    }


def plan_from_json(data: dict) -> Plan:
    """The :class:`Plan` :func:`plan_to_json` wrote (ValueError, KeyError or TypeError where it is not one)."""
    coupling = data["coupling"]
    if coupling is not None and coupling not in COUPLINGS:
        raise ValueError(f"coupling={coupling!r} is not one of {COUPLINGS}")
    by_root = []
    for count, name, steps, seconds, parents in data["by_root"]:
        o = Option(str(name), coupling, DraftTree(parents), float(steps), float(seconds))
        by_root.extend([o] * int(count))
    steps, seconds = data["loop"]
    rates = {str(k): float(v) for k, v in data["rates"].items()}
    return Plan(coupling, by_root, Option("loop", None, None, float(steps), float(seconds)), rates)


def runs_of(names: Sequence[str], first: int = 1) -> list[list]:
    """``names`` per root ``first, first + 1, ...`` as runs ``[name, first root, last root]`` (a record's form)."""
    out: list[list] = []
    for i, name in enumerate(names, start=first):
        if out and out[-1][0] == name:
            out[-1][2] = i
        else:
            out.append([name, i, i])
    return out


def plan_rate(by_root: Sequence[Option]) -> float:
    """Committed steps per second of one option per root: a run reaches a root as the start of a round with
    probability about ``1 / E`` (``E`` its option's expected steps), so a step there costs ``seconds / E`` and the
    rate is the harmonic mean of the roots' rates (the arithmetic one over-weights the long rounds)."""
    return len(by_root) / sum(o.seconds / o.steps for o in by_root)


def _segments(n_roots: int, segments: int) -> list[range]:
    """``n_roots`` root indices cut into at most ``segments`` contiguous, near-equal groups."""
    k = max(1, min(int(segments), n_roots))
    edges = [round(i * n_roots / k) for i in range(k + 1)]
    return [range(a, b) for a, b in zip(edges, edges[1:]) if b > a]


def choose(
    deltas_by_root: Sequence[Sequence[float]],
    call: CallCost,
    host: Hosts = HostCost(),
    *,
    batch: int = 1,
    couplings: Sequence[str] = COUPLINGS,
    budgets: Sequence[int] = BUDGETS,
    max_width: int = 4,
    margin: float = 0.05,
    segments: int = 4,
    resolution: float = 0.02,
) -> Plan:
    """For each coupling, the fastest option at each root step ``n = 1 .. T - 2`` (``deltas_by_root[n - 1]``, with
    ``T - 1 - n`` steps ahead); the coupling whose plan is fastest, unless the plain loop is within ``margin`` of it.

    The roots are cut into at most ``segments`` contiguous groups, each priced once from its mean profile (rounded to
    ``resolution``; equal profiles are searched once) at the steps its first root has ahead; a later root of the group
    takes that option's tree cut to its own steps ahead, re-priced. So a run of any length is planned in a bounded
    number of tree searches (at most ``segments x len(budgets)`` per coupling). A root with fewer steps ahead than its
    tree's depth is priced on the tree cut there, as the sampler cuts it; its option keeps the whole tree.

    Raises:
        ValueError: an empty or bad profile (:func:`options_at`).
    """
    rows = [np.asarray(d, dtype=np.float64).reshape(-1) for d in deltas_by_root]
    if not rows:
        raise ValueError("deltas_by_root is empty: need one profile per root step 1 .. T - 2")
    loop = loop_option(call, host, batch)
    n_roots, deepest = len(rows), max(budgets)
    memo: dict = {}
    plans: dict[str, list[Option]] = {}
    for coupling in couplings:
        plan: list[Option] = []
        for seg in _segments(n_roots, segments):
            width = min(max(len(rows[i]) for i in seg), deepest)
            mean = np.mean(
                [np.pad(rows[i][:width], (0, width - min(len(rows[i]), width)), mode="edge") for i in seg], 0
            )
            mean = np.round(mean / resolution) * resolution
            ahead = n_roots - seg[0]
            key = (coupling, tuple(mean), min(ahead, deepest))
            if key not in memo:
                opts = options_at(
                    mean,
                    call,
                    host,
                    batch=batch,
                    max_depth=min(ahead, deepest),
                    couplings=(coupling,),
                    budgets=budgets,
                    max_width=max_width,
                )[1:]
                memo[key] = max(opts, key=lambda o: o.rate)
            best = memo[key]
            pos = profile_positional(mean, coupling)
            for i in seg:
                o = best
                if o.tree.max_depth > n_roots - i:  # priced as the sampler cuts it there (eq. 11); kept whole, so
                    cut = o.tree.restrict(n_roots - i)  # that the run's rounds share one tree's tables
                    rows_i = len(cut) - 1
                    seconds = call(batch * rows_i) + host_of(host, coupling)(rows_i)
                    o = Option(o.name, coupling, o.tree, expected_steps(cut, pos), seconds)
                plan.append(o)
        plans[coupling] = plan
    rates = {c: plan_rate(p) for c, p in plans.items()}
    rates["loop"] = loop.rate
    best = max(plans, key=rates.get) if plans else None
    if best is None or rates[best] < (1.0 + margin) * loop.rate:
        return Plan(None, [], loop, rates)
    return Plan(best, plans[best], loop, rates)
