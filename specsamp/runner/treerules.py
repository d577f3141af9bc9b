"""Tree rules: how a run's config becomes the round tree, one registered rule per ``tree=`` value.

A :class:`TreeRule` has a name (the config's ``tree``), a ``build`` function and the tree keys it
``reads``; the runner hashes the keys a rule does not read at their default
(:func:`specsamp.runner.config.unused_keys`), so setting them changes neither a result nor its config
hash. New rules register with :func:`register_tree_rule`, or are named ``tree=pkg.module:name``.
A one-child coupling (``rmc``) always runs a chain (:func:`specsamp.runner.build.build_tree`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from ..errors import ConfigError
from ..registry import Registry
from ..trees import DraftTree, budget as uniform_budget
from .memory import available_bytes

# the keys a tree rule may read, in the order the record's ``unused`` lists them
TREE_KEYS = ("widths", "K", "L", "budget", "delta_profile", "max_depth", "max_width")


@dataclass(frozen=True)
class TreeRule:
    """A ``tree=`` value.

    Attributes:
        name: registry key (``tree`` in configs).
        build: ``(run, coupling, horizon, delta_profile, callback) -> (tree, budget)``: the round tree
            (a :class:`specsamp.trees.DraftTree`, or a :class:`specsamp.treesearch.TreesByRoot`) built no
            deeper than ``horizon = T - 2`` (no round uses a deeper node, eq. 11) and its nominal drafted-
            state budget ``B`` (int); ``delta_profile`` is the displacement profile of a ``searched`` rule
            (given or calibrated; None otherwise), ``callback(done, total)`` the search's progress.
            Raises :class:`~specsamp.errors.ConfigError` for a value it cannot serve.
        reads: the keys of :data:`TREE_KEYS` that ``build`` reads, or ``run -> those keys`` when that
            depends on the config (``tree=optimal`` reads ``K``, ``L`` only while ``budget`` is null).
        searched: the rule searches its tree from a displacement profile: the runner calibrates one
            (unless ``delta_profile`` is given) and needs the coupling's ``positional`` theory.
    """

    name: str
    build: Callable
    reads: Sequence[str] | Callable = ()
    searched: bool = False

    def keys_read(self, run) -> tuple[str, ...]:
        """The tree keys this rule reads for ``run``.

        Raises:
            ConfigError: a key that is not one of :data:`TREE_KEYS`.
        """
        keys = tuple(self.reads(run) if callable(self.reads) else self.reads)
        bad = [k for k in keys if k not in TREE_KEYS]
        if bad:
            raise ConfigError(
                f"tree={self.name!r} is invalid: its rule reads {bad}, which are not tree keys "
                f"({', '.join(TREE_KEYS)})."
            )
        return keys


TREE_RULES: Registry[TreeRule] = Registry("tree", TreeRule)


def register_tree_rule(
    name: str, reads: Sequence[str] | Callable = (), searched: bool = False
) -> Callable[[Callable], TreeRule]:
    """Decorator: register a ``build`` function (contract: :class:`TreeRule`) as ``tree=name``.

    Returns:
        A decorator that returns the registered :class:`TreeRule`.

    Raises:
        ValueError: ``name`` is already registered.
    """

    def deco(fn: Callable) -> TreeRule:
        return TREE_RULES.register(name, TreeRule(name, fn, tuple(reads) if not callable(reads) else reads, searched))

    return deco


def get_tree_rule(name: str | TreeRule) -> TreeRule:
    """A tree rule by registered name or ``"pkg.module:name"``; a :class:`TreeRule` as is.

    Raises:
        ConfigError: (a ``ValueError``) unknown name; the message lists the valid ones.
    """
    return TREE_RULES.get(name)


class _SearchedTrees:
    """``name in SEARCHED_TREES``: the tree rule ``name`` searches its tree from a displacement profile
    (given, shipped, or calibrated); iterates over the registered ones."""

    def __contains__(self, name) -> bool:
        return TREE_RULES.valid(name) and TREE_RULES.get(name).searched

    def __iter__(self):
        return iter([n for n in TREE_RULES.names() if TREE_RULES.get(n).searched])


SEARCHED_TREES = _SearchedTrees()


@register_tree_rule("uniform", reads=("K", "L"))
def uniform(run, coupling, horizon, delta_profile=None, callback=None):
    """The uniform ``(K, L)`` tree (``L`` capped at the horizon), ``B = K + ... + K^L``."""
    return DraftTree.uniform(run.K, min(run.L, horizon)), uniform_budget(run.K, run.L)


@register_tree_rule("widths", reads=("widths",))
def widths(run, coupling, horizon, delta_profile=None, callback=None):
    """``widths=[K_1, ..., K_L]``: every node of depth ``l - 1`` has ``K_l`` children."""
    total, layer = 0, 1
    for w in run.widths:
        layer *= w
        total += layer
    return DraftTree.from_widths(run.widths[:horizon]), total


def search_limits(run, budget: int) -> tuple[int, int]:
    """``(max_depth, max_width)`` of ``tree=optimal``'s search: ``max_depth`` defaults to and is capped at
    the speculative horizon ``T - 2`` (no round uses a deeper node, eq. 11), ``max_width`` defaults to 32;
    both are capped at the budget."""
    horizon = run.steps - 2
    depth = horizon if run.max_depth is None else min(run.max_depth, horizon)
    return min(depth, budget), min(run.max_width or 32, budget)


def check_search(run, coupling, budget: int) -> None:
    """Refuse a searched tree (``tree=optimal``, ``optimal_per_step``) before the calibration run and before
    any target call: a coupling without positional theory (``Coupling.positional``), or a search too slow
    or too large (``optimal_per_step``: its ``T - 2`` searches together, each at the depth its root has left).

    Raises:
        ConfigError: names the coupling, or the search's cost and what to lower.
    """
    from .. import treesearch

    if coupling.positional is None:
        raise ConfigError(
            f"tree={run.tree} is invalid with sampler={run.sampler.name}: coupling {coupling.name!r} has "
            "no positional theory (Coupling.positional, the probability that the k-th child is accepted at "
            "displacement delta), which the tree search needs; give it one (register_coupling(..., "
            "positional=fn)), or use tree=uniform or tree=widths."
        )
    depth, width = search_limits(run, budget)
    try:
        shared = treesearch.shared_prefix(coupling, width)
        if run.tree == "optimal_per_step":  # two programs per root (tree and value) at depth min(D, steps left)
            pairs = sum(
                2 * treesearch.search_cost(budget, min(depth, h), width, shared)["pairs"]
                for h in range(1, run.steps - 1)
            )
            if pairs > treesearch.MAX_PAIRS:
                raise ValueError(
                    f"tree=optimal_per_step with budget={budget}, max_depth={depth}, max_width={width} needs "
                    f"about {pairs:.2g} max-plus updates for its {run.steps - 2} searches (the limit is "
                    f"{treesearch.MAX_PAIRS:.2g}); lower budget, max_width or max_depth, or use tree=optimal."
                )
        treesearch.check_search(budget, depth, width, shared, treesearch.MAX_PAIRS, available_bytes("cpu"))
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _search_reads(run) -> tuple[str, ...]:
    return ("budget", "delta_profile", "max_depth", "max_width") + (("K", "L") if run.budget is None else ())


@register_tree_rule("optimal", reads=_search_reads, searched=True)
def optimal(run, coupling, horizon, delta_profile=None, callback=None):
    """The tree with at most ``B`` drafted states that minimises the expected rounds under the coupling's
    positional theory at the profile's displacements (:func:`specsamp.treesearch.optimal_tree`)."""
    from .. import treesearch

    budget = run.budget or uniform_budget(run.K, run.L)
    check_search(run, coupling, budget)
    try:
        if np.ndim(delta_profile) != 1:
            raise ValueError(
                f"delta_profile is invalid for tree=optimal: need one list (delta per depth), got "
                f"{np.ndim(delta_profile)} levels of lists (per-root tables are for tree=optimal_per_step)"
            )
        positional = treesearch.profile_positional(delta_profile, coupling)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return treesearch.optimal_tree(budget, positional, *search_limits(run, budget), callback=callback), budget


@register_tree_rule("optimal_per_step", reads=_search_reads, searched=True)
def optimal_per_step(run, coupling, horizon, delta_profile=None, callback=None):
    """One searched tree per root step ``1..T-2``, each at the depth its root has left
    (:func:`specsamp.treesearch.optimal_trees_by_root`); a :class:`~specsamp.treesearch.TreesByRoot`."""
    from .. import treesearch

    budget = run.budget or uniform_budget(run.K, run.L)
    check_search(run, coupling, budget)
    first, end = 1, horizon + 1  # roots 1..T-2 (Schedule.first_speculative, end_speculative)
    try:
        table = np.asarray(delta_profile, dtype=np.float64)
        if table.ndim == 2:
            if table.shape[0] not in (1, horizon):
                raise ValueError(
                    f"delta_profile has {table.shape[0]} rows: tree=optimal_per_step needs one per "
                    f"root step 1..{horizon} (T-2 = {horizon} rows), or a single profile"
                )
            table = np.concatenate([table[:1], table]) if table.shape[0] == horizon else table[0]
        trees = treesearch.optimal_trees_by_root(
            budget, table, first, end, *search_limits(run, budget), coupling, callback=callback
        )
    except ValueError as e:
        raise ConfigError(str(e)) from None
    for t in trees.values():
        coupling.check_tree(t)
    return treesearch.TreesByRoot(trees), budget
