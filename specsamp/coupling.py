"""Exact couplings of drafted children with a Gaussian target kernel ("Verify" in Algorithm 1, line 17).

A rule is a :class:`Coupling`: a name, a ``verify`` function with the contract written there, and the
widest node it serves. Rules are found by name in :data:`COUPLINGS`; new ones register with
:func:`register_coupling`, and :func:`specsamp.testing.check_exactness` tests their output law.

All rules work through the rank-1 projection of section 3.1 (eqs. 12--15): only the scalar
projection of each child on the displacement direction ``e`` differs between draft and target.
The scalar algebra (``delta``, the projections, levels, uniforms) runs in float64 and in log space
whatever the input dtype, so ``delta`` from 0 to several hundred gives no NaN, no inf and no bias.
The d-dimensional work (differences, dot products, the residual's shift) runs in the input dtype,
widened to float32 for float16 and bfloat16 states, whose range cannot hold a shift of
``sigma * delta / sqrt(d)`` at small ``sigma``; no float64 copy of the children is made. Inputs the
rules cannot serve are refused: non-finite children or means (:class:`NonFiniteError`), float16
states at a ``sigma`` below their resolution, and finite states whose differences overflow.
``delta`` is computed scale-free (:func:`project`), so any ``sigma`` from :func:`min_sigma` up to that
overflow is served exactly. On valid inputs inside :func:`deferred_checks`, ``dgrs``, ``rmc`` and ``markmax``
ask the host for no value: every row is computed with static shapes and chosen with ``torch.where``
(``markmax`` flags a row whose share its table cannot certify, :func:`specsamp.listcoupling.static_plan`).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from .batching import row_reduce, row_sums
from .errors import ConfigError
from .grs import (  # noqa: F401  (re-exported: the GRS scalar machinery is public here too)
    GRID,
    GRID_LEVELS,
    RESIDUAL_STEPS,
    grs_levels,
    grs_remaining_mass,
    grs_select,
    grs_threshold,
    log_sf,
    sample_grs_residual,
)
from .registry import Registry
from .rng import GeneratorRows


@dataclass
class Verdict:
    """Output of a coupling.

    Attributes:
        sample: ``[n, *event]``, an exact draw from ``N(mean_q, sigma^2 I)``; None from a rule's ``decide``
            (:class:`Coupling`), which gives the choice alone.
        accepted: ``[n]`` bool, True where ``sample`` equals ``children[i, index[i]]``.
        index: ``[n]`` long, the accepted child, or ``K`` where the residual was sampled.
    """

    sample: torch.Tensor | None
    accepted: torch.Tensor
    index: torch.Tensor


class NonFiniteError(ValueError):
    """NaN or infinite children or means in some rows of a verification problem.

    Attributes:
        rows: the offending row indices (parent nodes), ascending.
    """

    def __init__(self, message: str, rows: list[int]):
        super().__init__(message)
        self.rows = rows


class DeferredChecks:
    """Value checks of the couplings, collected on the device instead of raised at once.

    Checking a value (a NaN child, a ``sigma`` out of range) asks the host a question and so stalls
    an accelerator. Inside :func:`deferred_checks` the checks of :func:`check_inputs` and
    :func:`project` (and of any rule that calls :meth:`flag`) run as device operations and OR their
    outcome into :attr:`bad`; shape checks still raise at once (they read no values). The caller
    reads :attr:`bad` once, when it next synchronises anyway, and where it is set repeats the same
    verifications outside the context to raise the precise error (keyed random numbers make the
    repetition draw the same numbers).

    Attributes:
        bad: 0-dim bool tensor on the inputs' device, True once any deferred check failed; ``None``
            while no check has run.
    """

    def __init__(self) -> None:
        self.bad: torch.Tensor | None = None

    def flag(self, failed: torch.Tensor) -> None:
        """OR ``failed.any()`` (a bool tensor of any shape, on any device) into :attr:`bad` (no sync)."""
        failed = failed.any()
        self.bad = failed if self.bad is None else self.bad | failed

    def failed(self) -> bool:
        """Whether any deferred check failed (one host synchronisation; False where none ran)."""
        return self.bad is not None and bool(self.bad)


_ACTIVE = threading.local()


@contextmanager
def deferred_checks() -> Iterator[DeferredChecks]:
    """Context in which the couplings' value checks are collected, not raised (see :class:`DeferredChecks`).

    Yields:
        The :class:`DeferredChecks` that collects them; contexts nest, the innermost collects.
    """
    outer = getattr(_ACTIVE, "checks", None)
    _ACTIVE.checks = checks = DeferredChecks()
    try:
        yield checks
    finally:
        _ACTIVE.checks = outer


def active_checks() -> DeferredChecks | None:
    """The innermost active :class:`DeferredChecks`, or ``None`` (checks raise at once)."""
    return getattr(_ACTIVE, "checks", None)


@dataclass
class Projection:
    """Rank-1 reduction of one verification problem per row (paper eqs. 12--14).

    Attributes:
        delta: ``[n]`` float64, ``||mean_q - mean_p|| / sigma``.
        e: ``[n, D]`` unit displacement direction (zero where ``delta == 0``), in the work dtype
            (the input dtype, float32 for float16 and bfloat16).
        s_hat: ``[n, K]`` float64, the children's standardised projections on ``e`` (N(0, 1) under P).
        sigma: ``[n]`` float64 kernel scale, exactly as given.
    """

    delta: torch.Tensor
    e: torch.Tensor
    s_hat: torch.Tensor
    sigma: torch.Tensor


@dataclass(frozen=True)
class Coupling:
    """A verification rule: ``Verify`` of Algorithm 1 (line 17), with the contract of section 3.1.

    ``verify(children, mean_p, mean_q, sigma, generator=None) -> Verdict``:

    - ``children``: ``[n, K, *event]``, for each of ``n`` parent nodes ``K >= 1`` i.i.d. draws from
      the draft kernel ``N(mean_p, sigma^2 I)``, in drafting order;
    - ``mean_p``, ``mean_q``: ``[n, *event]`` draft and target kernel means (eq. 8);
    - ``sigma``: ``[n]`` or a scalar, the shared kernel std (> 0; eq. 37);
    - ``generator``: a ``torch.Generator``, a per-row uniform source (``uniform(m) -> [n, m]``,
      see :func:`uniform_rows`, which wraps either) or ``None`` (the global generator). The sampler
      passes a :class:`specsamp.rng.KeyedRows`, so a rule must draw every random number through it.

    It returns a :class:`Verdict` whose ``sample`` is distributed exactly as ``N(mean_q, sigma^2 I)``
    per row, whatever ``delta``; ``accepted[i]`` says the sample *is* ``children[i, index[i]]``, and
    ``index[i] == K`` where something else (a residual draw) was returned. It raises ``ValueError`` on
    bad shapes or scales (:func:`check_inputs`) and :class:`NonFiniteError` on NaN or inf inputs.

    Attributes:
        name: registry key (``sampler.coupling`` in configs).
        verify: the rule.
        max_children: widest node the rule serves (``None``: any ``K``; 1: a chain rule).
        positional: optional theory of the rule, ``positional(delta [n] float64, K) -> [n, K]``: for a
            parent whose children are displaced by ``delta`` (eq. 16), the probability that the ``k``-th
            drafted child is the one accepted (D-GRS: eq. 19's increments). ``tree=optimal`` searches
            trees with it (:func:`specsamp.treesearch.profile_positional`) and refuses a rule without it
            before any target call. ``None``: no theory; every other tree works.
        decide: optional, ``verify``'s choice alone: the same arguments, the same numbers drawn for the choice,
            and a :class:`Verdict` with the same ``accepted`` and ``index`` but ``sample=None``. Where a rule's
            sample of a rejection is costly (D-GRS's residual inversion) and only a few rows' samples are
            used, a caller decides every row and then calls ``verify`` again on those rows only (the tree
            execution: every internal node is verified, one per trajectory is committed). ``None``: the
            caller always calls ``verify``.
    """

    name: str
    verify: Callable[..., Verdict]
    max_children: int | None = None
    positional: Callable | None = None
    decide: Callable[..., Verdict] | None = None

    def __call__(self, children, mean_p, mean_q, sigma, generator=None) -> Verdict:
        verdict = self.verify(children, mean_p, mean_q, sigma, generator)
        if not isinstance(verdict, Verdict):
            raise TypeError(f"coupling {self.name!r} returned {type(verdict).__name__}; "
                            "a coupling must return a specsamp.coupling.Verdict")
        return verdict

    def choice(self, children, mean_p, mean_q, sigma, generator=None) -> Verdict:
        """``verify``'s ``accepted`` and ``index`` (same arguments, same numbers): ``decide`` where the rule has
        one (then ``sample`` is None), else ``verify`` itself."""
        if self.decide is None:
            return self(children, mean_p, mean_q, sigma, generator)
        verdict = self.decide(children, mean_p, mean_q, sigma, generator)
        if not isinstance(verdict, Verdict):
            raise TypeError(f"coupling {self.name!r}'s decide returned {type(verdict).__name__}; "
                            "it must return a specsamp.coupling.Verdict")
        return verdict

    def check_tree(self, tree) -> None:
        """Refuse a :class:`specsamp.trees.DraftTree` with a node wider than ``max_children`` (``None``: no tree).

        Raises:
            ConfigError: the tree has a wider node (a ``K = 1`` rule needs a chain, ``DraftTree.chain``).
        """
        if tree is None or self.max_children is None or len(tree) < 2:
            return
        widest = int(tree.num_children.max())
        if widest > self.max_children:
            raise ConfigError(
                f"coupling {self.name!r} accepts at most K={self.max_children} children per node, but the tree "
                f"has a node with {widest}" + ("; a K=1 rule runs a chain" if self.max_children == 1 else "")
            )


def contract_violation(verdict: Verdict, kids: torch.Tensor) -> torch.Tensor:
    """``[n]`` bool: the verdict breaks the contract (an accepted sample that is not the child its index
    names, ``accepted`` that disagrees with ``index < K``, or a sample holding NaN or inf, which no draw
    from ``N(mean_q, sigma^2 I)`` is); device operations only."""
    n, k = kids.shape[:2]
    flat = kids.reshape(n, k, -1)
    index = verdict.index.reshape(n)
    in_range = (index >= 0) & (index <= k)
    pick = flat[torch.arange(n, device=flat.device), index.clamp(0, k - 1)]
    sample = verdict.sample.reshape(n, -1)
    same = (sample == pick).all(1)
    finite = torch.isfinite(sample).all(1)
    return ~in_range | (verdict.accepted.reshape(n) != (index < k)) | (verdict.accepted.reshape(n) & ~same) | ~finite


def check_verdict_contract(coupling: Coupling, verdict: Verdict, kids: torch.Tensor, describe: Callable[[int], str]) -> None:
    """Raise if ``verdict`` breaks the contract of :class:`specsamp.coupling.Coupling` for ``kids [n, K, *e]``.

    Args:
        describe: row -> where it happened (step and node), for the message.

    Raises:
        ContractError: (a ``ValueError``) naming the coupling and the first offending row's step and node.
    """
    bad = contract_violation(verdict, kids)
    if bool(bad.any()):
        r = int(bad.nonzero()[0, 0])
        k = kids.shape[1]
        sample = verdict.sample.reshape(kids.shape[0], -1)
        if not bool(torch.isfinite(sample[r]).all()):
            where = (f"coupling {coupling.name!r} returned a sample holding NaN or inf at {describe(r)} (accepted="
                     f"{bool(verdict.accepted.reshape(-1)[r])}, index={int(verdict.index.reshape(-1)[r])}, K={k})")
            if not bool(torch.isfinite(kids[r]).all()):
                raise NonFiniteSampleError(f"{where}: the children it was handed hold NaN or inf already, so the target's "
                                           "velocity or the draft produced non-finite states there")
            raise NonFiniteSampleError(
                f"{where}, from finite children: a verdict's sample must be a finite draw from N(mean_q, sigma^2 I), "
                "the accepted child itself or the residual (specsamp.coupling.Coupling); check the rule with "
                "specsamp.testing.check_exactness")
        raise ContractError(
            f"coupling {coupling.name!r} broke its contract at {describe(r)}: it returned accepted="
            f"{bool(verdict.accepted.reshape(-1)[r])}, index={int(verdict.index.reshape(-1)[r])} (K={k}), but an accepted "
            "sample must be exactly the child its index names and index < K must hold exactly where accepted "
            "(specsamp.coupling.Coupling); check the rule with specsamp.testing.check_exactness"
        )


class ContractError(ValueError):
    """A coupling returned a verdict that breaks the contract of :class:`specsamp.coupling.Coupling`."""


class NonFiniteSampleError(ContractError):
    """A coupling returned a verdict whose sample holds NaN or inf (its inputs were finite)."""


COUPLINGS: Registry[Coupling] = Registry("coupling")


def register_coupling(name: str, max_children: int | None = None, positional: Callable | None = None,
                      decide: Callable | None = None) -> Callable[[Callable[..., Verdict]], Coupling]:
    """Decorator: register a ``verify`` function (contract: :class:`Coupling`) as coupling ``name``,
    with its widest node ``max_children``, its optional theory ``positional`` and its optional
    choice-only ``decide`` (:class:`Coupling`).

    Returns:
        A decorator that returns the registered :class:`Coupling` (callable like the function).

    Raises:
        ValueError: ``name`` is already registered.
    """

    def deco(fn: Callable[..., Verdict]) -> Coupling:
        return COUPLINGS.register(name, Coupling(name, fn, max_children, positional, decide))

    return deco


def get_coupling(name: str | Coupling | Callable) -> Coupling:
    """A registered coupling by name or ``"pkg.module:name"``; a :class:`Coupling` as is; a bare ``verify``
    function wrapped (any ``K``).

    Raises:
        ConfigError: (a ``ValueError``) unknown name; the message lists the registered ones.
    """
    if isinstance(name, Coupling):
        return name
    if callable(name):
        return Coupling(getattr(name, "__name__", repr(name)), name)
    found = COUPLINGS.get(name)  # a registered name, or "pkg.module:name" (imported)
    if not callable(found):
        raise ConfigError(f"coupling={name!r} is invalid: it names a {type(found).__name__}, "
                          "not a Coupling or a verify function.")
    return get_coupling(found)


def uniform_rows(generator, n: int, device):
    """The per-row uniform source a coupling draws from: ``rows.uniform(m)`` gives float64 ``[n, m]`` in (0, 1).

    The sampler passes an :class:`specsamp.rng.KeyedRows` (counter-based, so row ``i``'s numbers depend
    only on its own key); a ``torch.Generator`` or ``None`` (tests, notebooks) is wrapped in a
    :class:`specsamp.rng.GeneratorRows`. Every call of ``uniform`` returns fresh numbers.
    """
    if generator is None or isinstance(generator, torch.Generator):
        return GeneratorRows(n, device, generator)
    return generator


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """dtype of the d-dimensional coupling work for states of ``dtype`` (float32 for 16-bit floats)."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def min_sigma(dtype: torch.dtype, dim: int) -> float:
    """Smallest kernel scale the couplings serve for states of ``dtype`` with ``dim`` coordinates.

    The residual moves each coordinate by about ``sigma * delta / sqrt(dim)`` and is rounded once to
    ``dtype``; near zero that shift must span at least 16 of the dtype's subnormal steps, or the
    rounding (not the coupling) decides the output. The limit is ``16 * sqrt(dim)`` subnormal steps:
    float16 in ``dim = 256`` needs ``sigma >= 1.5e-5``; float32 and bfloat16 allow ~1e-43 and ~1e-38,
    float64 ~1e-322 (times ``sqrt(dim)``). ``delta`` is computed scale-free (:func:`project`), so
    every ``sigma`` from this limit up to where the states' differences overflow is served exactly.
    (Away from zero a 16-bit state's own spacing, not this limit, bounds how well any sample of the
    kernel can be represented; that holds for the standard sampler as much as for a coupling.)
    """
    fi = torch.finfo(dtype)
    return 16.0 * fi.tiny * fi.eps * math.sqrt(max(dim, 1))


def check_inputs(children, mean_p, mean_q, sigma) -> torch.Tensor:
    """Validate shapes and scales; return ``sigma`` as a float64 ``[n]`` tensor (never rounded).

    Shapes are checked at once; the values of ``sigma`` with one host synchronisation, or none inside
    :func:`deferred_checks` (then a bad ``sigma`` only sets the flag).

    Raises:
        ValueError: mismatched shapes, ``K < 1``, a ``sigma`` that is not finite and positive, or a
            ``sigma`` below :func:`min_sigma` of the children's dtype and event size.
    """
    sigma, bad = _sigma_rows(children, mean_p, mean_q, sigma)
    checks = active_checks()
    if checks is not None:
        checks.flag(bad)
    else:
        _raise_bad_sigma(bad, children, sigma)
    return sigma


def _sigma_rows(children, mean_p, mean_q, sigma) -> tuple[torch.Tensor, torch.Tensor]:
    """Shape checks of :func:`check_inputs`; ``sigma`` as float64 ``[n]`` and ``[n]`` bool, True where it is bad."""
    if children.ndim < 2:
        raise ValueError(f"children must be [n, K, *event], got shape {tuple(children.shape)}")
    n, k = children.shape[:2]
    if k < 1:
        raise ValueError(f"K={k}: need at least one child per parent (K >= 1)")
    for name, m in (("mean_p", mean_p), ("mean_q", mean_q)):
        if m.shape != (n, *children.shape[2:]):
            raise ValueError(
                f"{name} has shape {tuple(m.shape)}; expected {(n, *children.shape[2:])} "
                f"to match children {tuple(children.shape)}"
            )
    if isinstance(sigma, torch.Tensor):
        sigma = sigma.to(device=children.device, dtype=torch.float64)
    else:
        sigma = torch.as_tensor(sigma, dtype=torch.float64, device=children.device)
    if sigma.ndim == 0:
        sigma = sigma.expand(n)
    if sigma.shape != (n,):
        raise ValueError(f"sigma has shape {tuple(sigma.shape)}; expected a scalar or [{n}]")
    dim = math.prod(children.shape[2:])
    floor = min_sigma(children.dtype, dim) if children.dtype.is_floating_point else 0.0
    # finite, > 0 and >= the floor in one clamp: a NaN or an infinity differs from its clamp
    floor = max(floor, math.ulp(0.0))
    return sigma, sigma.clamp(floor, torch.finfo(torch.float64).max) != sigma


def _raise_bad_sigma(bad, children, sigma) -> None:
    """Raise :func:`check_inputs`' error where ``bad`` (of :func:`_sigma_rows`) is set; one host synchronisation."""
    if not bool(bad.any()):
        return
    if not bool(torch.all(torch.isfinite(sigma) & (sigma > 0))):
        raise ValueError(f"sigma must be finite and > 0, got min {float(sigma.min())}")
    dim = math.prod(children.shape[2:])
    name = str(children.dtype).replace("torch.", "")
    raise ValueError(
        f"sigma={float(sigma.min()):.4g} is below what {name} states of {dim} coordinates resolve "
        f"(min_sigma = {min_sigma(children.dtype, dim):.4g}: the residual's per-coordinate shift would "
        f"round away and no coupling can be exact); use float32 or bfloat16 states, or a larger sigma"
    )


BATCHED_ELEMENTS = 1 << 22  # project forms all children's differences at once up to n K D elements


def project(children, mean_p, mean_q, sigma) -> Projection:
    """Rank-1 projection of section 3.1 (eqs. 12--14), one row per parent node, scale-free.

    ``delta = ||mean_q - mean_p|| / sigma`` is computed without squaring the difference itself: it is
    first divided by a power of two near its largest coordinate (exact), so neither a tiny nor a huge
    ``sigma`` under- or overflows the norm (unscaled, float64 would give ``delta = 0`` at ``sigma = 1e-300``
    and a NaN at ``1e300``); in the normal range the result is bit for bit the unscaled one. The differences
    and dot products run in :func:`work_dtype`, the children's differences from ``mean_p`` all at once
    (extra memory: one ``[n, K, D]`` tensor) up to ``BATCHED_ELEMENTS`` elements and one child at a
    time above (two ``[n, D]`` tensors, whatever ``K``); ``delta`` and the projections are float64.
    One host synchronisation checks the values, none inside :func:`deferred_checks`.

    Args:
        children: ``[n, K, *event]``.
        mean_p: ``[n, *event]`` draft kernel mean.
        mean_q: ``[n, *event]`` target kernel mean.
        sigma: ``[n]`` or scalar, shared kernel scale.

    Returns:
        :class:`Projection`.

    Raises:
        ValueError: see :func:`check_inputs`; also finite inputs whose differences overflow the work
            dtype at this ``sigma`` (the message names ``sigma`` and the dtype).
        NonFiniteError: NaN or infinite children or means; the message and ``rows`` name the rows.
    """
    sigma, bad_sigma = _sigma_rows(children, mean_p, mean_q, sigma)
    checks = active_checks()
    if checks is None:
        _raise_bad_sigma(bad_sigma, children, sigma)
    n, k = children.shape[:2]
    w = work_dtype(children.dtype)
    flat = _rows(children, 3)
    mp = _rows(mean_p, 2).to(w)
    diff = _rows(mean_q, 2).to(w) - mp
    # the power of two in (scale / 2, scale] of the largest coordinate (1 where the difference is 0)
    scale = diff.abs().amax(1).clamp_min_(torch.finfo(w).tiny * torch.finfo(w).eps)  # the least subnormal
    mant, _ = torch.frexp(scale)
    pow2 = scale.div_(mant.mul_(2.0))
    unit = diff.div_(pow2[:, None])  # exact; the largest coordinate is in [1, 2)
    dist = row_reduce(lambda t: torch.linalg.vector_norm(t, dim=-1, dtype=torch.float64), unit)  # ||mean_q - mean_p|| / pow2, 0 or >= 1
    p64 = pow2.double()
    full = dist * p64  # exact where it neither over- nor underflows: then delta is the unscaled quotient
    direct = full.clamp(torch.finfo(torch.float64).tiny, torch.finfo(torch.float64).max) == full
    delta = torch.where(direct, full / sigma, p64 / sigma * dist)
    e = unit.mul_(dist.clamp_min(1.0).reciprocal_().to(w)[:, None])  # the difference buffer becomes the direction
    # the dot products as products and a sum over each row's own coordinates, never a batched matrix product
    # (a BLAS rounds a row by the batch's size, so a row alone and inside a batch would differ)
    if n * k * flat.shape[2] <= BATCHED_ELEMENTS:
        dev = flat.to(w) - mp[:, None]
        s_hat = row_sums(dev.mul_(e[:, None])).double()
        del dev
    else:
        s_hat = torch.empty(n, k, dtype=torch.float64, device=children.device)
        for j in range(k):
            d_j = flat[:, j].to(w, copy=True)
            d_j -= mp
            s_hat[:, j] = row_sums(d_j.mul_(e)).double()
        del d_j
    s_hat /= sigma[:, None]
    total = s_hat.sum(1).add_(delta)  # finite iff delta and every projection are
    bad = (total - total) != 0
    if checks is not None:
        checks.flag(bad | bad_sigma)
    elif bool(bad.any()):
        _refuse_non_finite(bad, children, mean_p, mean_q, sigma, w)
    return Projection(delta=delta, e=e, s_hat=s_hat, sigma=sigma)


def _rows(x: torch.Tensor, ndim: int) -> torch.Tensor:
    """``x`` with its event dimensions flattened into one (``ndim`` dimensions in all); as is when it has them."""
    return x if x.ndim == ndim else x.reshape(*x.shape[:ndim - 1], -1)


def _refuse_non_finite(bad, children, mean_p, mean_q, sigma, w) -> None:
    """Raise for the rows ``bad`` of :func:`project`: non-finite inputs, or finite ones whose differences overflow."""
    n = children.shape[0]
    finite = (torch.isfinite(children.reshape(n, -1)).all(1) & torch.isfinite(mean_p.reshape(n, -1)).all(1)
              & torch.isfinite(mean_q.reshape(n, -1)).all(1))
    rows = bad.nonzero(as_tuple=True)[0].tolist()
    listed = f"{rows[:10]}{' ...' if len(rows) > 10 else ''}"
    if bool(finite[bad].all()):
        name = str(w).replace("torch.", "")
        raise ValueError(
            f"sigma={float(sigma[rows[0]]):.4g} with {name} states: in row(s) {listed} of {n} the children and "
            f"means are finite, but their differences overflow {name} (largest finite "
            f"{torch.finfo(w).max:.3g}) or ||mean_q - mean_p|| / sigma exceeds float64's range, so no "
            "coupling can be computed exactly; rescale the states (and sigma with them), or use float64"
        )
    raise NonFiniteError(
        f"NaN or infinite children or means in row(s) {listed} of {n}: "
        "no coupling can serve them; the target or the draft that produced these states returned non-finite values",
        rows,
    )


def reconstruct(children, proj: Projection, s_new: torch.Tensor, accepted, index) -> torch.Tensor:
    """Eq. 15: the accepted child where ``accepted``, else child 0 with its projection replaced.

    One indexing takes the accepted child (child 0 where none was) and one ``addcmul`` adds the shift
    ``sigma (s_new - s_hat_0) e``, zero where accepted, in the projection's work dtype; the result is
    rounded once to the children's dtype (an accepted child comes back bit for bit: adding zero and
    widening are exact). Static shapes, no host synchronisation.

    Args:
        children: ``[n, K, *event]``.
        proj: the rows' projection.
        s_new: ``[n]`` float64, the residual's standardised projection (ignored where accepted).
        accepted: ``[n]`` bool.
        index: ``[n]`` long (``K`` where not accepted).

    Returns:
        ``[n, *event]`` in the children's dtype.
    """
    n, k = children.shape[:2]
    flat = _rows(children, 3)
    if k == 1:
        base = flat[:, 0]
    else:
        base = flat[torch.arange(n, device=flat.device), index * accepted]  # long indices: no host sync
    shift = (proj.sigma * (s_new - proj.s_hat[:, 0])).masked_fill_(accepted, 0.0).to(proj.e.dtype)
    out = torch.addcmul(base.to(proj.e.dtype), shift[:, None], proj.e).to(flat.dtype)
    return out if children.ndim == 3 else out.reshape(children.shape[0], *children.shape[2:])


def _dgrs_positional(delta, K: int):
    from .theory import dgrs_positional  # the closed forms (theory) are read on first use

    return dgrs_positional(delta, K)


def _rmc_positional(delta, K: int):
    from .theory import rmc_positional

    return rmc_positional(delta, K)


def _dgrs_decide(children, mean_p, mean_q, sigma, generator=None) -> Verdict:
    """:func:`dgrs`'s choice alone (``sample=None``): the same projection and acceptance uniforms, no residual."""
    proj = project(children, mean_p, mean_q, sigma)
    rows = uniform_rows(generator, children.shape[0], children.device)
    index, _ = grs_select(proj.delta, proj.s_hat, rows, residual=False)
    return Verdict(None, index < children.shape[1], index)


@register_coupling("dgrs", positional=_dgrs_positional, decide=_dgrs_decide)
def dgrs(children, mean_p, mean_q, sigma, generator=None) -> Verdict:
    """Diffusion greedy rejection sampling (Algorithm 3), any ``K >= 1``.

    Children are examined in drafting order; child ``k`` is accepted with probability
    ``min(1, (rho_k - lambda_{k-1})_+ / G_k)``; if all are rejected the output's projection is drawn
    from the residual of eq. 17 and its orthogonal part is child 0's (eq. 15). Acceptance
    probability ``1 - G_{K+1}`` (eq. 19). Exact for every ``delta >= 0`` (Theorem 1). Contract:
    :class:`Coupling`.
    """
    proj = project(children, mean_p, mean_q, sigma)
    rows = uniform_rows(generator, children.shape[0], children.device)
    index, s_res = grs_select(proj.delta, proj.s_hat, rows)
    accepted = index < children.shape[1]
    return Verdict(reconstruct(children, proj, s_res, accepted, index), accepted, index)


@register_coupling("rmc", max_children=1, positional=_rmc_positional)
def rmc(children, mean_p, mean_q, sigma, generator=None) -> Verdict:
    """Reflection maximal coupling (Algorithm 2; De Bortoli et al., 2025), ``K = 1`` only.

    Accept the child with probability ``min(1, phi(s - delta) / phi(s))``; otherwise reflect its
    projection about ``delta / 2``. Acceptance probability ``2 Phibar(delta / 2)`` (eq. 20). Contract:
    :class:`Coupling`; raises ``ValueError`` for ``K != 1``.
    """
    if children.ndim >= 2 and children.shape[1] != 1:
        raise ValueError(
            f"rmc couples one child per parent (K=1), got K={children.shape[1]}; "
            "use dgrs for K > 1 or a chain tree (K=1) for rmc"
        )
    proj = project(children, mean_p, mean_q, sigma)
    rows = uniform_rows(generator, children.shape[0], children.device)
    u = rows.uniform(1)[:, 0]
    s = proj.s_hat[:, 0]
    log_rho = torch.addcmul(proj.delta * s, proj.delta, proj.delta, value=-0.5)
    accepted = torch.log(u) <= torch.clamp(log_rho, max=0.0)
    index = (~accepted).long()  # 0 accepted, K = 1 reflected
    return Verdict(reconstruct(children, proj, proj.delta - s, accepted, index), accepted, index)
