"""Every Python entry point's argument checks, in one place: types, ranges, the first states, the network's output and
the memory a run needs, all refused before the first network call.

``run.py`` checks its keys in its typed config (:mod:`specsamp.runner.config`). The functions users call from their
own code, notebooks and ComfyUI nodes (:func:`specsamp.sampler.sample_speculative`, the k-diffusion entry
:func:`specsamp.integrations.k_diffusion.sample_euler_ancestral` and the diffusers entry
:func:`specsamp.integrations.diffusers.speculative`) check theirs here, with the same rules. A refusal is a
:class:`~specsamp.errors.ConfigError` of one paragraph naming the argument, its value (:func:`describe`: a tensor by
its shape, dtype and device, never its elements) and what is valid.

The memory estimate is the runner's (:func:`specsamp.memory.sampler_bytes`): a draft tree is sized before it is built
(:func:`draft_tree`), a run's states before anything is allocated (:func:`check_sampler_memory`).
"""

from __future__ import annotations

import math
from collections.abc import MutableMapping

import numpy as np
import torch

from . import rng
from .errors import ConfigError
from .memory import TREE_BYTES_PER_NODE, available_bytes, capped_budget, check_memory, gib, sampler_bytes
from .trees import DraftTree

SHOWN = 80
"""Characters of a value's ``repr`` that a message shows before it is cut."""


class ModelOutputError(ConfigError):
    """The network returned something other than what the sampler asked for (a tuple, a non-tensor, another shape)."""


def describe(value) -> str:
    """``value`` as a message shows it: a tensor or an array by its shape, dtype and device, a long ``repr`` cut to
    :data:`SHOWN` characters, a sequence of tensors by its length."""
    if isinstance(value, torch.Tensor):
        return f"<tensor of shape {tuple(value.shape)}, {str(value.dtype).removeprefix('torch.')}, on {value.device}>"
    if isinstance(value, np.ndarray):
        return f"<array of shape {value.shape}, {value.dtype}>"
    if isinstance(value, (list, tuple)) and any(isinstance(v, (torch.Tensor, np.ndarray)) for v in value):
        return f"<{type(value).__name__} of {len(value)} items: {describe(value[0])}, ...>"
    text = repr(value)
    return text if len(text) <= SHOWN else text[: SHOWN - 3] + "..."


def refuse(name: str, value, valid: str) -> ConfigError:
    """The one paragraph refusing ``name=value``: ``valid`` says what would be accepted."""
    return ConfigError(f"{name}={describe(value)} is invalid: {valid}.")


def integer(name: str, value, lo: int = 1, hi: int | None = None, *, optional: bool = False) -> int | None:
    """``value`` as an ``int`` in ``[lo, hi]`` (bools refused; None allowed where ``optional``)."""
    if value is None and optional:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, np.integer))
        or value < lo
        or (hi is not None and value > hi)
    ):
        span = f"an integer >= {lo}" if hi is None else f"an integer in [{lo}, {hi}]"
        raise refuse(name, value, f"must be {span}" + (", or None" if optional else ""))
    return int(value)


def flag(name: str, value, *, optional: bool = False) -> bool | None:
    """``value`` as a ``bool`` (a Python or NumPy bool; None allowed where ``optional``)."""
    if value is None and optional:
        return None
    if not isinstance(value, (bool, np.bool_)):
        raise refuse(name, value, "must be True or False" + (", or None" if optional else ""))
    return bool(value)


def choice(name: str, value, valid) -> str:
    """``value`` if it is one of ``valid``."""
    if not isinstance(value, str) or value not in valid:
        raise refuse(name, value, f"must be one of {', '.join(map(str, valid))}")
    return value


def number(name: str, value, *, positive: bool = False, note: str = "") -> float:
    """``value`` as a finite ``float`` (``> 0`` where ``positive``; bools refused); ``note`` ends the refusal."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float, np.integer, np.floating))
        or not math.isfinite(value)
        or (positive and not value > 0)
    ):
        raise refuse(name, value, "must be a finite number" + (" > 0" if positive else "") + note)
    return float(value)


def function(name: str, value, *, optional: bool = False):
    """``value`` if it can be called (None allowed where ``optional``)."""
    if (value is None and optional) or callable(value):
        return value
    raise refuse(name, value, "must be a callable" + (", or None" if optional else ""))


def seed(value) -> int:
    """The run's seed: an integer in ``[0, rng.MAX_SEED]``; None draws one from torch's global generator, so
    ``torch.manual_seed`` reproduces the run."""
    if value is None:
        return int(torch.randint(0, rng.MAX_SEED + 1, (), dtype=torch.int64))
    return integer("seed", value, 0, rng.MAX_SEED)


def stats(value) -> MutableMapping | None:
    """``stats``: None, or a mapping the run's counts are written into (a ``dict``), checked before the run so that
    a finished run is never lost to it."""
    if value is None or isinstance(value, MutableMapping):
        return value
    raise refuse("stats", value, "must be a dict (filled in with the run's counts), or None")


def velocity_model(model) -> None:
    """A velocity model as the samplers read it (:class:`specsamp.models.base.VelocityModel`): callable, with
    ``event_shape`` a tuple of integers >= 1 and ``dtype`` a floating ``torch.dtype``."""
    function("model", model)
    shape = getattr(model, "event_shape", None)
    if (
        not isinstance(shape, (tuple, list, torch.Size))
        or not shape
        or any(isinstance(d, bool) or not isinstance(d, (int, np.integer)) or d < 1 for d in shape)
    ):
        raise refuse(
            "model.event_shape",
            shape,
            "a velocity model must say the shape of one state as a tuple of integers >= 1, e.g. (16,) or (3, 32, 32) "
            "(specsamp.models.base.VelocityModel)",
        )
    dtype = getattr(model, "dtype", None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise refuse(
            "model.dtype",
            dtype,
            "a velocity model must name the states' dtype as a floating torch.dtype, e.g. torch.float32",
        )


def model_keys(model, keys, name: str) -> None:
    """Refuse a key of ``name`` (``extra_args`` or ``cond``) that is also the name of one of the two positional
    parameters the model is called with (the states and the noise level): Python cannot pass one argument twice,
    and k-diffusion's own loop would fail the same way. A model whose signature cannot be read is not checked."""
    import inspect

    try:
        params = list(inspect.signature(model).parameters.values())[:2]
    except (TypeError, ValueError):
        return
    clash = [p.name for p in params if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD and p.name in keys]
    if clash:
        raise ConfigError(
            f"{name} key {clash[0]!r} is invalid for this model: it is also the name of the model's parameter "
            f"{clash[0]!r}, which the sampler passes by position, so Python would receive it twice. Rename the key, "
            f"or make the model's first two parameters positional-only (def model(x, sigma, /, **kwargs))."
        )


def sampler_inputs(model, schedule, cond) -> None:
    """The samplers' model, schedule and conditioning (:func:`specsamp.sampler.sample_speculative`,
    :func:`~specsamp.sampler.sample_standard`): a velocity model (:func:`velocity_model`), a
    :class:`specsamp.schedule.Schedule`, and ``cond`` None or a mapping of names to tensors."""
    from .schedule import Schedule

    velocity_model(model)
    if not isinstance(schedule, Schedule):
        raise refuse(
            "schedule", schedule, "must be a specsamp.schedule.Schedule, e.g. Schedule.make(steps=30, eps=0.1)"
        )
    if cond is not None and not isinstance(cond, dict):
        raise refuse("cond", cond, "must be a dict of per-trajectory tensors [M, ...] by name, or None")
    if cond:
        model_keys(model, cond, "cond")


def states(name: str, x) -> torch.Tensor:
    """``x [b, ...]``, the first states: a floating-point tensor with at least one row, on a real device, finite.

    One host synchronisation (the finiteness test), before the first network call.
    """
    if not isinstance(x, torch.Tensor) or not x.dtype.is_floating_point or x.ndim < 1 or x.shape[0] < 1:
        raise refuse(name, x, "must be a floating-point tensor [batch, ...] of the first states, batch >= 1")
    if x.device.type == "meta":
        raise refuse(name, x, "a meta tensor has no values: pass the states on the device the model runs on")
    if not bool(torch.isfinite(x).all()):
        bad = (
            int((~torch.isfinite(x)).flatten(1).any(1).nonzero()[0, 0])
            if x.ndim > 1
            else int((~torch.isfinite(x)).nonzero()[0, 0])
        )
        raise refuse(name, x, f"row {bad} holds NaN or inf; the sampler starts from finite states")
    return x


def network_output(out, expected: torch.Size, dtype: torch.dtype | None = None, who: str = "model"):
    """``out`` if it is what the sampler asked ``who`` for: a floating-point tensor of shape ``expected``.

    Raises:
        ModelOutputError: names what was expected (shape, dtype) and what ``who`` returned, at the first call that
            returns it (before the round uses it).
    """
    if isinstance(out, torch.Tensor) and out.dtype.is_floating_point and out.shape == expected:
        return out
    want = f"a floating-point tensor of shape {tuple(expected)}" + (
        f" ({str(dtype).removeprefix('torch.')})" if dtype else ""
    )
    got = describe(out) if isinstance(out, torch.Tensor) else f"a {type(out).__name__} ({describe(out)})"
    hint = (
        " (a diffusers network returns a tuple or an output object unless called with return_dict=False: return its "
        "first element)"
        if isinstance(out, tuple) or hasattr(out, "sample")
        else ""
    )
    raise ModelOutputError(
        f"{who} returned {got}, where the sampler expected {want}: one prediction per row of its input{hint}."
    )


def uniform_nodes(K: int, L: int, horizon: int, chain: bool = False) -> int:
    """Nodes of the uniform ``(K, L)`` tree within ``horizon`` levels (``chain``: the one-child chain of its nominal
    budget), without building it."""
    if chain:
        return min(capped_budget(K, L, horizon), horizon) + 1
    nodes, layer = 1, 1
    for _ in range(min(L, horizon)):
        layer *= K
        nodes += layer
    return nodes


def draft_tree(
    coupling,
    tree,
    K,
    L,
    budget,
    horizon: int,
    options: dict,
    *,
    defaults: tuple[int, int] = (2, 3),
    memory: dict | None = None,
):
    """A run's draft tree: ``tree`` as given, else the ``(K, L)`` tree within ``horizon`` levels (a one-child coupling:
    the chain of its nominal budget ``K + ... + K^L``), else the tree searched for ``budget`` from the
    ``delta_profile`` in ``options`` (:func:`specsamp.treesearch.optimal_tree`). A uniform tree is sized before it
    is built (``TREE_BYTES_PER_NODE`` a node, against the host's free memory).

    Args:
        coupling: a :class:`specsamp.coupling.Coupling`.
        tree: a :class:`DraftTree`, ``tree(n) -> DraftTree``, or None.
        K, L: the uniform tree (None: ``defaults``); budget: drafted states per round, or None.
        horizon: the speculative levels ``T - 2`` (at least 1).
        options: the entry point's options; ``delta_profile`` and ``max_width`` are read here.
        memory: the keywords of :func:`check_sampler_memory` but the tree (the batch, its states, the network's
            rows): a uniform tree is then refused before it is built where the run it would serve cannot fit.

    Raises:
        ConfigError: a bad ``tree``, ``K``, ``L`` or ``budget``; ``tree`` together with ``K``, ``L`` or ``budget``;
            a tree the coupling does not take, or whose arrays cannot fit.
    """
    if tree is not None:
        if K is not None or L is not None or budget is not None:
            raise ConfigError(
                f"tree={describe(tree)} is given together with K, L or budget: give the tree, or K and L, or budget."
            )
        if not (isinstance(tree, DraftTree) or callable(tree)):
            raise refuse(
                "tree",
                tree,
                "must be a specsamp.trees.DraftTree, tree(n) -> DraftTree, or None (the uniform K, L tree)",
            )
        if isinstance(tree, DraftTree):
            coupling.check_tree(tree)
            if len(tree) < 2:
                raise refuse("tree", tree, "the draft tree must draft at least one state (L >= 1)")
        return tree
    K = defaults[0] if K is None else integer("K", K)
    L = defaults[1] if L is None else integer("L", L)
    budget = integer("budget", budget, optional=True)
    chain = coupling.max_children == 1
    if not chain and budget is not None:
        return _searched_tree(coupling, budget, horizon, options)
    if not chain and ("delta_profile" in options or "max_width" in options):
        raise ConfigError("delta_profile and max_width are for a searched tree: give budget= as well.")
    nodes = uniform_nodes(K, L, horizon, chain) if budget is None else min(budget, horizon) + 1
    check_memory(
        f"the draft tree K={K}, L={L} ({nodes:,} nodes within the {horizon} speculative steps)",
        nodes * TREE_BYTES_PER_NODE,
        "cpu",
        "lower K or L.",
    )
    if memory is not None:
        check_sampler_memory((nodes, 1 if chain else K, nodes - 1 if chain else min(L, horizon)), **memory)
    if chain:
        return DraftTree.chain(nodes - 1)
    return DraftTree.uniform(K, min(L, horizon))


def _searched_tree(coupling, budget: int, horizon: int, options: dict) -> DraftTree:
    if options.get("delta_profile") is None:
        raise ConfigError(
            f"budget={budget} with coupling={coupling.name!r} needs delta_profile=[...]: the tree searched "
            "for a budget depends on the displacement per depth (e.g. specsamp.treesearch."
            "deltas_from_acceptance of an earlier run's accepts / attempts); or give K and L."
        )
    from . import treesearch

    try:
        positional = treesearch.profile_positional(options["delta_profile"], coupling)
        width = integer("max_width", options.get("max_width") or 32)
        return treesearch.optimal_tree(budget, positional, min(horizon, budget), min(width, budget))
    except ValueError as e:
        raise ConfigError(str(e)) from None


ROW_ACTIVATION_FACTOR = 256
"""A network's activations for one row of a forward pass, in units of the row's own bytes (``numel * elem``): an
allowance below every network measured (patches32 85x, the digits network 448x, DDPM++ at CIFAR-10's size about
2,000x; :data:`specsamp.runner.memory.EDM_NETWORKS`), so that a refusal is certain to be needed, not merely likely."""


def activation_bytes(event_shape, dtype: torch.dtype) -> int:
    """An allowance for a network's activations in one row of a forward pass: :data:`ROW_ACTIVATION_FACTOR` times the
    row's own bytes (``event_shape`` in ``dtype``)."""
    return int(np.prod(event_shape)) * dtype.itemsize * ROW_ACTIVATION_FACTOR


def check_sampler_memory(
    tree: DraftTree | tuple | None,
    batch: int,
    event_shape,
    dtype: torch.dtype,
    device,
    *,
    execution: str = "tree",
    refine: int = 0,
    steps: int | None = None,
    max_batch: int | None = None,
    row_bytes: int = 0,
    rows_per_state: int = 1,
    available: int | None = None,
) -> None:
    """Refuse a run that cannot fit, before anything is allocated: the runner's estimate of the sampler's states
    (:func:`specsamp.memory.sampler_bytes`) for ``batch`` trajectories of ``event_shape`` in ``dtype`` on ``device``
    with ``tree`` (a tree's ``(nodes, widest, depth)`` before it is built; None: the standard sampler) in
    ``execution``, plus the network's activations, ``row_bytes`` a
    network row (:func:`activation_bytes` for a network of unknown size; 0: not counted), for the rows of its largest
    forward pass (every node of a round's tree for each trajectory, or ``max_batch`` states; ``rows_per_state`` rows
    a state). ``available``: the bytes to fit in (None: :func:`specsamp.memory.available_bytes` of ``device``).

    Raises:
        ConfigError: the estimate is above 80% of the available memory; the message names the tree, the batch, the
            bytes needed and available, and what to lower.
    """
    free = available_bytes(str(device)) if available is None else available
    if free is None:
        return
    numel = int(np.prod(event_shape))
    elem = dtype.itemsize
    if isinstance(tree, DraftTree):
        nodes, widest, depth = len(tree), int(tree.num_children.max()) if len(tree) > 1 else 1, tree.max_depth
    else:
        nodes, widest, depth = tree if tree is not None else (None, 1, 0)
    fixed, per_traj = sampler_bytes(
        nodes, widest, depth, numel, elem, execution=execution, n_total=batch, steps=steps, refine=refine
    )
    per_call = nodes if nodes and execution == "tree" else widest
    states = batch * per_call if max_batch is None else min(batch * per_call, max_batch)
    row = row_bytes * rows_per_state
    need = fixed + batch * per_traj + states * row
    if need <= 0.8 * free:
        return
    what = f"a draft tree of {nodes:,} nodes per round" if nodes else "the standard sampler"
    room = 0.8 * free - fixed - batch * per_traj
    fits = int(room // row) if room > 0 and row > 0 else 0
    hint = f"pass max_batch={fits} (states per forward pass) or less" if fits >= 1 else "sample fewer at once"
    if nodes:
        hint += ", lower K or L" + (
            ", or use execution='path' (the same law and counts, only the visited nodes)"
            if execution == "tree" and not refine
            else ""
        )
    raise ConfigError(
        f"{batch} trajectories of shape {tuple(event_shape)} ({str(dtype).removeprefix('torch.')}) with "
        f"{what} (execution={execution}) need about {gib(need)}: {gib(batch * per_traj)} of states and "
        f"{gib(states * row)} of network activations for {states:,} states in one forward pass; "
        f"{device} has {gib(free)} available: {hint}."
    )


PREFETCH = ("nearest", "parent", "none")
EXECUTIONS = ("tree", "path")
WARMUPS = ("call", "step0")


def sampler_options(
    *, execution, prefetch="nearest", evaluate_leaves=True, max_batch=None, warmup="call", check_contract=None, refine=0
) -> dict:
    """The options of :func:`specsamp.sampler.sample_speculative` that every entry point passes on, checked
    (``compile`` is checked with the machine's compiler, :func:`specsamp.inductor.check_compile`).

    Raises:
        ConfigError: a value of the wrong type or out of range; ``refine > 0`` without the tree execution.
    """
    execution = choice("execution", execution, EXECUTIONS)
    if isinstance(refine, bool) or not isinstance(refine, (int, np.integer)) or refine < 0:
        raise refuse(
            "refine", refine, "the number of Picard sweeps per round must be an integer >= 0 (0: plain drafts)"
        )
    refine = int(refine)
    if refine > 0 and execution != "tree":
        raise ConfigError(
            f"refine={refine} is invalid with execution={execution}: a Picard sweep evaluates every "
            "internal node of the drafted tree in one batched call, which only the tree execution drafts; "
            "use execution=tree, or refine=0."
        )
    return dict(
        prefetch=choice("prefetch", prefetch, PREFETCH),
        evaluate_leaves=flag("evaluate_leaves", evaluate_leaves),
        execution=execution,
        max_batch=integer("max_batch", max_batch, optional=True),
        warmup=choice("warmup", warmup, WARMUPS),
        check_contract=flag("check_contract", check_contract, optional=True),
        refine=refine,
    )


def unknown_option(entry: str, options: dict, valid) -> None:
    """Refuse the first of ``options`` (sorted) that is not in ``valid``, naming ``entry`` and what it takes."""
    bad = sorted(set(options) - set(valid))
    if bad:
        raise ConfigError(
            f"{bad[0]}={describe(options[bad[0]])} is not an option of {entry}: valid are {', '.join(valid)}."
        )
