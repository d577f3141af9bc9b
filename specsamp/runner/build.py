"""From the typed config to objects: the target, the coupling, the schedule and the round tree.

The model and the coupling are built by ``hydra.utils.instantiate`` from their YAML's ``_target_``; the
tree follows from the sampler and the tree keys (README "Trees"); ``tree=optimal`` first calibrates a
displacement profile on a short run of its own (:func:`calibration_run`) unless ``delta_profile`` is given.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from hydra.errors import InstantiationException
from omegaconf import OmegaConf

from ..coupling import Coupling
from ..errors import ConfigError
from ..models.base import Target
from ..sampler import SampleResult, sample_speculative
from ..schedule import Schedule
from ..trees import DraftTree, budget as uniform_budget
from .config import CALIBRATION_SEED_OFFSET, RunConfig
from .memory import available_bytes, check_tree_nodes


def build_target(run: RunConfig) -> Target:
    """The configured target: ``instantiate(model)`` (its ``_target_``), then ``build(device)``.

    Raises:
        ConfigError: a bad model value, a missing or untrusted checkpoint, weights that cannot be loaded.
    """
    from hydra.utils import instantiate

    try:
        return instantiate(OmegaConf.structured(run.model), _convert_="object").build(run.device)
    except ConfigError:
        raise
    except InstantiationException as e:
        raise ConfigError(f"model._target_={run.model._target_!r} could not be built: {e.__cause__ or e}") from None
    except (OSError, ValueError, ImportError) as e:
        raise ConfigError(f"model={run.model.name!r} could not be loaded: {e}") from None


def build_coupling(run: RunConfig) -> Coupling | None:
    """The sampler's coupling, ``instantiate(sampler.coupling)``; None for the standard sampler.

    Raises:
        ConfigError: the node does not build a :class:`~specsamp.coupling.Coupling`, or a one-child rule
            (``max_children=1``) with a tree other than a chain.
    """
    from hydra.utils import instantiate

    node = run.sampler.coupling
    if node is None:
        return None
    try:
        coupling = instantiate(node)
    except InstantiationException as e:
        raise ConfigError(f"sampler={run.sampler.name!r} is invalid: its coupling could not be built: {e.__cause__ or e}") from None
    if not isinstance(coupling, Coupling):
        raise ConfigError(f"sampler={run.sampler.name!r} is invalid: sampler.coupling builds {type(coupling).__name__}, "
                          "not a specsamp.coupling.Coupling.")
    if coupling.max_children == 1 and run.tree != "uniform":
        raise ConfigError(f"tree={run.tree!r} is invalid with sampler={run.sampler.name}: a one-child rule runs a chain (tree=uniform).")
    return coupling


def search_limits(run: RunConfig, budget: int) -> tuple[int, int]:
    """``(max_depth, max_width)`` of ``tree=optimal``'s search: ``max_depth`` defaults to and is capped at
    the speculative horizon ``T - 2`` (no round uses a deeper node, eq. 11), ``max_width`` defaults to 32;
    both are capped at the budget."""
    horizon = run.steps - 2
    depth = horizon if run.max_depth is None else min(run.max_depth, horizon)
    return min(depth, budget), min(run.max_width or 32, budget)


def check_search(run: RunConfig, coupling: Coupling, budget: int) -> None:
    """Refuse a ``tree=optimal`` search too slow or too large, before the calibration run."""
    from .. import treesearch

    try:
        treesearch.check_search(budget, *search_limits(run, budget), coupling.name == "dgrs", treesearch.MAX_PAIRS,
                                available_bytes("cpu"))
    except ValueError as e:
        raise ConfigError(str(e)) from None


def build_tree(run: RunConfig, coupling: Coupling | None, horizon: int, delta_profile=None,
               callback: Callable[[int, int], None] | None = None) -> tuple[DraftTree | None, int]:
    """The round tree and its nominal drafted-state budget ``B``.

    A one-child rule (``rmc``) runs a chain: of length ``B = K + ... + K^L`` with ``match=budget``, or
    with as many target rows as the (K, L) tree with ``match=verification``. Chains and trees deeper than
    the speculative horizon ``T - 2`` are built only to that depth: no round can use deeper nodes
    (eq. 11), so the law and every count are unchanged; the record keeps the nominal B.

    Args:
        run: the typed config.
        coupling: the built coupling, or None (the standard sampler: no tree).
        horizon: ``T - 2``.
        delta_profile: ``tree=optimal``'s displacement per depth (given or calibrated).
        callback: progress of ``tree=optimal``'s search, ``callback(depths_done, depths)``.

    Returns:
        ``(tree, budget)``; ``(None, 0)`` for the standard sampler.

    Raises:
        ConfigError: a tree that does not fit in memory, or a search refused up front.
    """
    if coupling is None:
        return None, 0
    K, L = run.K, run.L
    check_tree_nodes(run, coupling, horizon)
    if coupling.max_children == 1:
        if run.match == "budget":
            length = uniform_budget(K, L)
        else:
            # rows of the (K, L) tree: |V| = B + 1 with leaves, |I| = 1 + K + ... + K^(L-1) without;
            # a chain of length l evaluates l + 1 rows with leaves and l without.
            length = uniform_budget(K, L) if run.evaluate_leaves else 1 + (uniform_budget(K, L - 1) if L > 1 else 0)
        tree, budget = DraftTree.chain(min(length, horizon)), length
    elif run.tree == "widths":
        tree, budget = DraftTree.from_widths(run.widths[:horizon]), _widths_budget(run.widths)
    elif run.tree == "optimal":
        from .. import treesearch

        budget = run.budget or uniform_budget(K, L)
        check_search(run, coupling, budget)
        try:
            positional = treesearch.profile_positional(delta_profile, coupling.name)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        tree = treesearch.optimal_tree(budget, positional, *search_limits(run, budget), callback=callback)
    else:
        tree, budget = DraftTree.uniform(K, min(L, horizon)), uniform_budget(K, L)
    coupling.check_tree(tree)
    return tree, budget


def _widths_budget(widths) -> int:
    total, layer = 0, 1
    for w in widths:
        layer *= w
        total += layer
    return total


def calibration_run(target: Target, schedule: Schedule, run: RunConfig, n: int = 64, K: int = 2, L: int = 8) -> SampleResult:
    """The short run that calibrates ``tree=optimal``: D-GRS with the configured draft on a uniform
    ``(K, L)`` tree (``L`` capped at ``T - 2``) for ``min(n, n_samples)`` trajectories, under its own seed
    (``seed + CALIBRATION_SEED_OFFSET``: the main run's randomness is untouched, so the tree it gets is
    independent of its samples and exactness is kept).

    Returns:
        The run's :class:`SampleResult` (its ``nfe`` and ``target_rows`` are the calibration's cost).
    """
    m = min(n, run.n_samples)
    tree = DraftTree.uniform(K, min(L, schedule.steps - 2))
    ids = torch.arange(m, device=torch.device(getattr(target.model, "device", "cpu")))
    cond = target.cond_for(ids, run.seed) if target.cond_for is not None else None
    return sample_speculative(target.model, schedule, tree, "dgrs", seed=run.seed + CALIBRATION_SEED_OFFSET, indices=ids,
                              cond=cond, draft=run.draft, prefetch=run.prefetch, evaluate_leaves=run.evaluate_leaves,
                              max_batch=run.max_batch or target.max_batch, warmup=run.warmup)


def calibrate_profile(target: Target, schedule: Schedule, run: RunConfig, n: int = 64, K: int = 2, L: int = 8) -> list[float]:
    """Displacement ``delta`` per depth for ``tree=optimal``, from :func:`calibration_run`: each depth's
    measured acceptance inverted into ``delta`` (:func:`specsamp.treesearch.deltas_from_acceptance`).

    Returns:
        ``delta`` per depth ``1..L``.
    """
    from ..treesearch import deltas_from_acceptance

    r = calibration_run(target, schedule, run, n, K, L)
    rates = (r.accepts.sum(0).double() / r.attempts.sum(0).double().clamp_min(1)).cpu().numpy()
    return [float(d) for d in deltas_from_acceptance(rates, K, "dgrs")]
