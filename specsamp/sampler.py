"""Samplers: the standard Euler--Maruyama chain and speculative sampling on draft trees (Algorithm 1).

Plain functions of ``(model, schedule, ...)`` (k-diffusion style) over a batch of trajectories: argument checks, then
the dense round (``execution="tree"``, :mod:`specsamp.round.dense`) or the sparse one (``"path"``, :mod:`specsamp.round.sparse`).
The round, its keys and what is bitwise equal across splits: ``docs/architecture.md``; counts: ``docs/protocol.md``.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

import torch

from . import arguments, rng
from .arguments import EXECUTIONS, PREFETCH, WARMUPS  # noqa: F401  (public here)
from .coupling import ContractError, Coupling, NonFiniteSampleError, check_verdict_contract, get_coupling  # noqa: F401  (public here)
from .drafts import Draft, get_draft
from .errors import ConfigError
from .inductor import check_compile
from .kernels import shift_history
from .result import SampleResult
from .round import (
    DenseLayout,
    SparseLayout,
    Tally,
    Velocity,
    build_context,
    compiled_round,
    first_step,
    for_compile,
    initial_noise,  # noqa: F401  (initial_noise: public here)
    initial_state,
    run_rounds,
)
from .round.split import check_draft_form
from .schedule import Schedule, per_row
from .trees import DraftTree


def _trajectory_ids(n_samples: int | None, indices, device) -> torch.Tensor:
    if indices is None:
        if isinstance(n_samples, bool) or not isinstance(n_samples, int) or n_samples < 1:
            raise ValueError(f"n_samples={n_samples!r} is invalid: must be an integer >= 1")
        return torch.arange(n_samples, device=device)
    ids = torch.as_tensor(indices, dtype=torch.long, device=device)
    if ids.ndim != 1 or ids.numel() == 0:
        raise ValueError("indices must be a non-empty 1-D sequence of trajectory ids")
    return ids


def _refuse_unknown(fn, unknown: dict) -> None:
    """A ConfigError for the first keyword ``fn`` does not take (not Python's TypeError), naming the ones it does."""
    if unknown:
        named = [p.name for p in inspect.signature(fn).parameters.values() if p.kind is not p.VAR_KEYWORD]
        arguments.unknown_option(fn.__name__, unknown, named)


def _model_device(model) -> torch.device:
    return torch.device(getattr(model, "device", "cpu"))


def _without_autograd(sampler: Callable[..., SampleResult]) -> Callable[..., SampleResult]:
    """``sampler`` under ``torch.inference_mode()`` (same bits, 9-20% less CPU time: ``benchmarks.gmm_batch1``),
    returning ordinary tensors (:meth:`SampleResult.ordinary`). A model that differentiates inside its call
    (gradient guidance) must do so on copies made under ``torch.inference_mode(False)``: ``torch.enable_grad()``
    does not leave inference mode."""

    @functools.wraps(sampler)
    def run(*args, **kwargs) -> SampleResult:
        with torch.inference_mode():
            res = sampler(*args, **kwargs)
        return res.ordinary()

    return run


@_without_autograd
def sample_standard(
    model,
    schedule: Schedule,
    n_samples: int | None = None,
    *,
    seed: int = 0,
    indices=None,
    cond: dict | None = None,
    max_batch: int | None = None,
    callback: Callable[[dict], None] | None = None,
    init: torch.Tensor | None = None,
    **unknown,
) -> SampleResult:
    """The standard Euler--Maruyama sampler: one target call per step (eqs. 4--5, 36--37).

    Args:
        model: velocity model (:class:`specsamp.models.VelocityModel`).
        schedule: time grid and kernel.
        n_samples: number of trajectories (ids ``0..n-1``) when ``indices`` is None.
        seed: run seed.
        indices: explicit trajectory ids ``[M]`` (their randomness is keyed by these).
        cond: per-trajectory conditioning tensors ``[M, ...]``.
        max_batch: rows per forward pass.
        callback: called after each step ``n`` with ``{"step": n + 1, "steps_done", "i": n, "x", "v"}``
            (``steps_done``: speculative steps done, summed over rows; ``x [M, *e]`` the states step ``n`` left and
            ``v`` their velocity; the batch's own: read, do not keep or write).
        init: ``[M, *event]`` first states on the linear path at ``sigmas[0]``; None: the keyed noise times the
            kernel's initial scale (:func:`specsamp.round.loop.initial_state`).

    Returns:
        :class:`SampleResult` with ``nfe = T - 2`` for every trajectory.

    Raises:
        ValueError: ``n_samples < 1`` or bad indices.
        ConfigError: (a ``ValueError``) a model that is not a velocity model, a schedule that is not a
            :class:`Schedule`, ``cond`` not a dict, a bad ``max_batch`` or ``callback``, a run too large for memory, an
            unknown keyword (``generator=``), named with the valid ones.
    """
    _refuse_unknown(sample_standard, unknown)
    arguments.sampler_inputs(model, schedule, cond)
    dev = _model_device(model)
    ids = _trajectory_ids(n_samples, indices, dev)
    m = ids.numel()
    arguments.function("callback", callback, optional=True)
    max_batch = arguments.integer("max_batch", max_batch, optional=True)
    arguments.check_sampler_memory(
        None,
        m,
        model.event_shape,
        model.dtype,
        dev,
        execution="path",
        steps=schedule.steps,
        max_batch=max_batch,
        row_bytes=getattr(model, "row_bytes", 0),
        rows_per_state=rows_per_state(model),
    )
    velocity = Velocity(model, schedule, cond, max_batch)
    x = initial_state(schedule, seed, ids, model.event_shape, model.dtype, init)
    step_keys = rng.base_key(seed, ids, "step", device=dev)
    traj = torch.arange(m, device=dev)
    order, past = schedule.kernel.order, None  # past: a multistep kernel's records of the earlier steps
    for n in range(schedule.steps):
        nn = torch.full((m,), n, dtype=torch.long, device=dev)
        out = velocity(x, nn, traj)
        mean = schedule.mean(x, out, nn, past)
        if order > 1:
            past = shift_history(past, schedule.record(x, out, nn), order)
        std = per_row(schedule.std(nn).to(x.dtype), x)
        noise = rng.normal(rng.fold(step_keys, n), model.event_shape, dtype=x.dtype)
        x_in, x = x, mean + std * noise
        if callback is not None:
            callback({"step": n + 1, "steps_done": m * min(n, schedule.steps - 2), "i": n, "x": x_in, "v": out})
    T = schedule.steps
    z = torch.zeros(m, dtype=torch.long, device=dev)
    return SampleResult(
        samples=x,
        nfe=z + (T - 2),
        nfe_total=z + T,
        target_rows=(z + (T - 2)) * rows_per_state(model),
        rounds=z + (T - 2),
        committed=torch.ones(m, T - 2, dtype=torch.long, device=dev),
        attempts=torch.zeros(m, 0, dtype=torch.long, device=dev),
        accepts=torch.zeros(m, 0, dtype=torch.long, device=dev),
        speculative_steps=T - 2,
        batch_nfe=T - 2,
    )


TreeRule = DraftTree | Callable[[int], DraftTree]


def _trees_by_root(tree: TreeRule, first: int, end: int, coupling: Coupling) -> dict[int, DraftTree]:
    """``{n: T_n}`` for ``first <= n < end``, each cut at the speculative horizon ``end - first``; the round at ``n``
    is cut at its own steps left by the layout (eq. 11), as a fixed tree's is, so trees that differ only below that
    share one set of tables. ``tree(n)`` is called once per root, before sampling, so a round's tree is fixed before
    it drafts (exactness)."""
    out = {}
    for n in range(first, end):
        t = tree(n) if callable(tree) else tree
        if not isinstance(t, DraftTree):
            raise ValueError(f"tree({n}) returned {type(t).__name__}, not a DraftTree")
        coupling.check_tree(t)
        if len(t) < 2:
            raise ValueError(
                f"the draft tree{f' of root {n}' if callable(tree) else ''} must draft at least one state (L >= 1)"
            )
        out[n] = t.restrict(end - first)
    return out


@_without_autograd
def sample_speculative(
    model,
    schedule: Schedule,
    tree: TreeRule,
    coupling: str | Callable = "dgrs",
    n_samples: int | None = None,
    *,
    draft: str | Draft = "velocity",
    prefetch: str = "nearest",
    evaluate_leaves: bool = True,
    execution: str = "path",
    seed: int = 0,
    indices=None,
    cond: dict | None = None,
    max_batch: int | None = None,
    callback: Callable[[dict], None] | None = None,
    warmup: str = "call",
    check_contract: bool | None = None,
    refine: int = 0,
    compile: bool = False,
    init: torch.Tensor | None = None,
    draft_form: str = "loop",
    **unknown,
) -> SampleResult:
    """Speculative sampling on a draft tree (Algorithm 1), any registered coupling; rounds cover steps ``1..T-2``.

    Args:
        model: velocity model.
        schedule: time grid and kernel (:class:`specsamp.schedule.Schedule`).
        tree: a :class:`DraftTree` (a round rooted at state index ``n`` uses ``T|_{L_n}``, ``L_n = min(L, T - 1 - n)``,
            eq. 11) whose widths the coupling admits; or ``tree(n) -> DraftTree``, called once per ``n`` before
            sampling (rows of different trees share one call in ``batch_nfe``).
        coupling: registered name, a :class:`specsamp.coupling.Coupling`, or a bare ``verify`` function.
        n_samples: number of trajectories (ids ``0..n-1``) when ``indices`` is None.
        draft: registered name (``velocity``, ``drift``, ``x0``, ``x0_extrap``, ...; :mod:`specsamp.drafts`),
            ``pkg.module:name``, or a :class:`specsamp.drafts.Draft`.
        prefetch: ``nearest``, ``parent`` or ``none``.
        evaluate_leaves: the B=|V| protocol (True) or internal nodes only (False).
        execution: ``tree`` (every node in one batched call) or ``path`` (only what the walk reaches, charged alike).
        seed: run seed.
        indices: explicit trajectory ids ``[M]``.
        cond: per-trajectory conditioning tensors ``[M, ...]``.
        max_batch: rows per forward pass of one batched call.
        callback: called after each round with ``{"round", "live", "batch_nfe", "steps_done", "n", "x", "v"}``
            (``steps_done`` summed over trajectories; ``n [M]``, ``x [M, *e]``, ``v``: state indices, states and the
            velocities next rounds draft from, exact where evaluated; the batch's own: read, do not keep or write).
        warmup: ``call`` (the paper's: one exact target call at the first root, charged to ``nfe``) or
            ``step0`` (draft the first round from the step-0 velocity; no warm-up call).
        check_contract: check every verdict against the coupling contract, in the round's one host sync (``None``:
            on for a ``verify`` defined outside ``specsamp.``, off for the library's, whose law is tested).
        refine: Picard sweeps ``J >= 0`` per round before verification (tree execution only; law unchanged,
            :func:`specsamp.round.dense.picard`), each one batched call at the internal nodes and a rebuild from the same
            innovations, charged to ``nfe`` and ``target_rows``; recorded in ``SampleResult.extra["refine"]``.
        compile: the dense round under ``torch.compile`` (:mod:`specsamp.round.compiled`; tree execution, table-form drafts,
            ``refine=0``). Same law; samples equal the eager ones to rounding, counts wherever no verdict flips.
        init: as in :func:`sample_standard`.
        draft_form: ``loop`` (layer by layer) or ``closed``: the whole tree's drafted states in one product per round
            (:func:`specsamp.round.split.closed_draft`; tree execution, velocity draft, an affine kernel). Same law;
            samples equal the loop's to rounding, counts wherever no verdict flips.

    Returns:
        :class:`SampleResult`.

    Raises:
        NonFiniteError: (a ``ValueError``) the target or the draft produced NaN or inf states; the message
            names the trajectory, step and node, ``rows`` the trajectory ids.
        ConfigError: (a ``ValueError``) a model that is not a velocity model (callable, with ``event_shape`` and a
            floating ``dtype``), a schedule that is not a :class:`Schedule`, ``cond`` not a dict;
            unknown coupling, draft, prefetch, execution or warmup; a tree wider than
            the coupling allows; ``refine`` not an integer >= 0, or > 0 with ``execution="path"``; ``compile`` not a
            bool, or true with ``execution="path"``, ``refine > 0``, a draft without a table form, or where
            ``torch.compile`` cannot build kernels (:func:`specsamp.inductor.unavailable`); an unknown keyword
            (``generator=``), named with the valid ones.
        ContractError: (a ``ValueError``) with ``check_contract``, a verdict that breaks the contract; the
            message names the coupling, trajectory, step and node.
        ValueError: a tree without drafted states; bad ``n_samples`` or ``indices``.
    """
    _refuse_unknown(sample_speculative, unknown)
    arguments.sampler_inputs(model, schedule, cond)
    coupling = get_coupling(coupling)
    if isinstance(tree, DraftTree):
        coupling.check_tree(tree)
        if len(tree) < 2:
            raise ValueError("the draft tree must draft at least one state (L >= 1)")
    elif not callable(tree):
        raise arguments.refuse("tree", tree, "must be a specsamp.trees.DraftTree or tree(n) -> DraftTree")
    opts = arguments.sampler_options(
        prefetch=prefetch,
        evaluate_leaves=evaluate_leaves,
        execution=execution,
        max_batch=max_batch,
        warmup=warmup,
        check_contract=check_contract,
        refine=refine,
    )
    draft = get_draft(draft)
    draft_form = check_draft_form(draft_form, schedule.kernel, draft, opts["execution"])
    arguments.function("callback", callback, optional=True)
    dev = _model_device(model)
    compiled = check_compile(compile, execution, dev)
    if compiled and (opts["refine"] > 0 or draft.table_mean is None):
        why = (
            f"refine={opts['refine']}: the Picard sweeps run eagerly"
            if opts["refine"] > 0
            else f"draft={draft.name!r} has no table form (Draft.table_mean), and only table forms compile"
        )
        raise ConfigError(
            f"compile=true is invalid here: {why}. Set compile=false, or "
            + ("refine=0." if opts["refine"] > 0 else "a registered draft.")
        )
    ids = _trajectory_ids(n_samples, indices, dev)
    M, T, end = ids.numel(), schedule.steps, schedule.end_speculative
    if isinstance(tree, DraftTree):
        tree = tree.restrict(end - schedule.first_speculative)  # no round can use deeper nodes
        largest = tree
    else:  # step-dependent trees: T_n per root index n
        tree = _trees_by_root(tree, schedule.first_speculative, end, coupling)
        largest = max(tree.values(), key=len)
    arguments.check_sampler_memory(
        largest,
        M,
        model.event_shape,
        model.dtype,
        dev,
        execution=execution,
        refine=opts["refine"],
        steps=T,
        max_batch=opts["max_batch"],
        row_bytes=getattr(model, "row_bytes", 0),
        rows_per_state=rows_per_state(model),
    )
    tally = Tally.zeros(
        M, T, largest.max_depth if isinstance(tree, DraftTree) else max(t.max_depth for t in tree.values()), dev
    )
    rules = dict(
        coupling=for_compile(coupling) if compiled else coupling,
        draft=draft,
        prefetch=opts["prefetch"],
        evaluate_leaves=opts["evaluate_leaves"],
        refine=opts["refine"],
        compiled=compiled,
        draft_form=draft_form,
        check_contract=_contract_default(coupling) if check_contract is None else opts["check_contract"],
    )
    ctx = build_context(
        schedule,
        Velocity(model, schedule, cond, opts["max_batch"]),
        ids,
        seed,
        rules,
        (model.event_shape, model.dtype) if execution == "tree" else None,
    )
    st = first_step(ctx, model, seed, warmup, tally, init)
    if execution == "tree":
        layout = DenseLayout(ctx, st, tally, tree, compiled_round(st.x.device) if ctx.compiled else None)
    else:
        layout = SparseLayout(ctx, st, tally, tree)
    samples = run_rounds(ctx, st, tally, warmup, callback, layout)
    res = tally.result(samples, T)
    res.extra["refine"] = ctx.refine
    if rows_per_state(model) != 1:
        res.target_rows = res.target_rows * rows_per_state(model)
    return res


def rows_per_state(model) -> int:
    """Network rows one state costs (``model.rows_per_state``: 2 under classifier-free guidance, else 1)."""
    return int(getattr(model, "rows_per_state", 1))


def _contract_default(coupling: Coupling) -> bool:
    """``check_contract``'s default: on for a coupling whose ``verify`` is defined outside ``specsamp``."""
    module = getattr(coupling.verify, "__module__", None) or ""
    return not (module == "specsamp" or module.startswith("specsamp."))
