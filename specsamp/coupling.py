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
overflow is served exactly. On valid inputs inside :func:`deferred_checks`, ``dgrs`` and ``rmc`` ask the
host for no value: every row is computed with static shapes and chosen with ``torch.where``.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from .errors import ConfigError
from .registry import Registry
from .rng import GeneratorRows

LOG_TINY = -745.0  # log of the smallest positive float64, the floor of every log-probability here


@dataclass
class Verdict:
    """Output of a coupling.

    Attributes:
        sample: ``[n, *event]``, an exact draw from ``N(mean_q, sigma^2 I)``.
        accepted: ``[n]`` bool, True where ``sample`` equals ``children[i, index[i]]``.
        index: ``[n]`` long, the accepted child, or ``K`` where the residual was sampled.
    """

    sample: torch.Tensor
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
    """

    name: str
    verify: Callable[..., Verdict]
    max_children: int | None = None
    positional: Callable | None = None

    def __call__(self, children, mean_p, mean_q, sigma, generator=None) -> Verdict:
        verdict = self.verify(children, mean_p, mean_q, sigma, generator)
        if not isinstance(verdict, Verdict):
            raise TypeError(f"coupling {self.name!r} returned {type(verdict).__name__}; "
                            "a coupling must return a specsamp.coupling.Verdict")
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


COUPLINGS: Registry[Coupling] = Registry("coupling")


def register_coupling(name: str, max_children: int | None = None,
                      positional: Callable | None = None) -> Callable[[Callable[..., Verdict]], Coupling]:
    """Decorator: register a ``verify`` function (contract: :class:`Coupling`) as coupling ``name``,
    with its widest node ``max_children`` and its optional theory ``positional`` (:class:`Coupling`).

    Returns:
        A decorator that returns the registered :class:`Coupling` (callable like the function).

    Raises:
        ValueError: ``name`` is already registered.
    """

    def deco(fn: Callable[..., Verdict]) -> Coupling:
        return COUPLINGS.register(name, Coupling(name, fn, max_children, positional))

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
    ``sigma`` under- or overflows the norm (float64 at ``sigma = 1e-300`` used to give ``delta = 0``, and
    ``1e300`` a NaN); in the normal range the result is bit for bit the unscaled one. The differences
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
    dist = torch.linalg.vector_norm(unit, dim=1, dtype=torch.float64)  # ||mean_q - mean_p|| / pow2, 0 or >= 1
    p64 = pow2.double()
    full = dist * p64  # exact where it neither over- nor underflows: then delta is the unscaled quotient
    direct = full.clamp(torch.finfo(torch.float64).tiny, torch.finfo(torch.float64).max) == full
    delta = torch.where(direct, full / sigma, p64 / sigma * dist)
    e = unit.mul_(dist.clamp_min(1.0).reciprocal_().to(w)[:, None])  # the difference buffer becomes the direction
    if n * k * flat.shape[2] <= BATCHED_ELEMENTS:
        dev = flat.to(w) - mp[:, None]
        s_hat = torch.bmm(dev, e[:, :, None]).reshape(n, k).double()
        del dev
    else:
        s_hat = torch.empty(n, k, dtype=torch.float64, device=children.device)
        for j in range(k):
            d_j = flat[:, j].to(w, copy=True)
            d_j -= mp
            s_hat[:, j] = torch.bmm(d_j[:, None], e[:, :, None]).reshape(n).double()
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



# ----------------------------------------------------------------------------------------------
# Scalar machinery of greedy rejection sampling for N(0,1) proposals and an N(delta,1) target.


def log_sf(x: torch.Tensor) -> torch.Tensor:
    """log of the standard normal survival function, stable in both tails (float64)."""
    return torch.special.log_ndtr(-x)


def grs_threshold(lam: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """The super-level set ``{s : rho(s) >= lam}`` is ``{s >= c}``; return ``c`` (proof of Thm. 4).

    ``rho(s) = exp(delta s - delta^2 / 2)``, so ``c = ln(lam) / delta + delta / 2``. For
    ``delta == 0`` and ``lam == 1`` (the only level reached then) returns 0.
    """
    return torch.log(lam) / delta.clamp_min(1e-300) + 0.5 * delta


def _remaining_mass(log_lam: torch.Tensor, delta: torch.Tensor, safe: torch.Tensor, half: torch.Tensor) -> torch.Tensor:
    """:func:`grs_remaining_mass` from ``log(lam)``, with ``delta``'s derived tensors computed once.

    No mask is needed for ``delta == 0``: there ``lam == 1`` and the formula gives exactly 0; the
    product of ``exp(a) <= 1`` and ``-expm1(x) in [0, 1]`` needs no clamp.
    """
    c = torch.addcdiv(half, log_lam, safe)
    a = torch.special.log_ndtr(delta - c)  # log Phibar(c - delta)
    b = log_lam + torch.special.log_ndtr(-c)
    return torch.exp(a) * -torch.expm1(torch.clamp(b - a, max=0.0))


def grs_remaining_mass(lam: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """``G = Q(H) - lam P(H)`` with ``H = {rho >= lam}`` (eqs. 19 and 25), for ``lam >= 1``.

    Computed as ``Phibar(c - delta) * (1 - lam Phibar(c) / Phibar(c - delta))`` in log space.

    Args:
        lam: float64 levels (``>= 1``).
        delta: float64 ``delta >= 0``, broadcastable with ``lam``.

    Returns:
        float64 masses in ``[0, 1]``.
    """
    return _remaining_mass(torch.log(lam), delta, delta.clamp_min(1e-300), 0.5 * delta)


def grs_levels(delta: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Levels ``lambda_0..lambda_K`` and remaining masses ``G_1..G_{K+1}`` of Algorithm 3.

    ``lambda_j = lambda_{j-1} + G_j`` and ``G_{j+1} = G(lambda_j)`` (:func:`grs_remaining_mass`), with
    ``lambda_0 = 0``, ``G_1 = 1``; ``lambda_1 = 1`` whatever ``delta``, so its mass needs no ``log``
    (``G_2 = Phibar(-delta / 2) - Phibar(delta / 2)``, both terms from one ``log_ndtr``).

    Args:
        delta: float64 ``[*b]``.
        k: number of proposals ``K >= 0``.

    Returns:
        ``(lam [*b, K+1], G [*b, K+1])`` with ``lam[..., j] = lambda_j`` and ``G[..., j] = G_{j+1}``.
    """
    lam, g = _levels(delta, k)
    return torch.stack(lam, -1), torch.stack(g, -1)


def _levels(delta: torch.Tensor, k: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """:func:`grs_levels` as two lists of ``K + 1`` tensors shaped like ``delta`` (unstacked)."""
    zero = torch.zeros_like(delta)
    one = torch.ones_like(delta)
    lam, g = [zero], [one]
    if k == 0:
        return lam, g
    half = 0.5 * delta
    ab = torch.special.log_ndtr(torch.stack([half, -half]))  # c = delta / 2 at lambda_1 = 1
    a, b = ab.unbind(0)
    lam.append(one)
    g.append(torch.exp(a) * -torch.expm1(torch.clamp(b - a, max=0.0)))
    if k > 1:
        safe = delta.clamp_min(1e-300)
        for _ in range(k - 1):
            lam.append(lam[-1] + g[-1])
            g.append(_remaining_mass(torch.log(lam[-1]), delta, safe, half))
    return lam, g


RESIDUAL_STEPS = 1  # Newton steps of sample_grs_residual after its grid (see its docstring for the bound)
GRID = 64  # sample_grs_residual's grid search: points per level
GRID_LEVELS = 4  # ... and levels
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_WIDEN = 4e-5  # sample_grs_residual's ndtri bounds are widened by this: 1e-6 (1 + |ndtri|), |ndtri| <= 38.5


def sample_grs_residual(delta, lam, mass, u, iterations: int = RESIDUAL_STEPS,
                        grid_levels: int = GRID_LEVELS) -> torch.Tensor:
    """Draw ``S`` from the normalised residual of eq. 17 by inverting its survival function at ``u``.

    The residual density is ``r(s) / G`` with ``r(s) = (phi(s - delta) - lam phi(s))_+ =
    phi(s - delta) (1 - exp(-delta (s - c)))`` on ``s >= c`` (:func:`grs_threshold`), and its survival
    is ``S(s) = (Phibar(s - delta) - lam Phibar(s)) / G``, evaluated in log space. ``S(s) = u`` is
    solved with a fixed number of tensor operations whatever the inputs (no data-dependent loop, no
    host synchronisation), in three stages:

    - *Bracket.* ``Phibar(s - delta) >= G S(s)`` gives ``root <= delta + Phibar^-1(u G)`` (tight when
      ``delta`` is large), intersected with ``max(c, delta) + sqrt(-2 log(u G)) + 2`` (from
      ``Phibar(x) <= exp(-x^2 / 2)``). Below: ``root >= c``, and ``Phi(root - delta) >= G (1 - u)``,
      also written on the survival side, where it stays informative when ``G (1 - u)`` rounds to 1:
      ``Phibar(root - delta) <= 1 - G (1 - u) <= 2 K Phibar(delta / 2) + u G`` (a coupling accepts
      each child with probability at most ``1 - TV(P, Q) = 2 Phibar(delta / 2)``), with ``K <= 1 +
      (lambda_K - 1) / G_{K+1}`` (the masses decrease). The ``ndtri`` bounds are widened by ``4e-5``
      (``1e-6 (1 + |ndtri|)`` for its rounding: ``|ndtri| <= 38.5`` in float64).
    - *Grid.* ``GRID_LEVELS = 4`` times, the survival at ``GRID - 1 = 63`` interior points of the
      bracket, in one evaluation, narrows it to the cell where it crosses ``u`` (the same test as a
      bisection, 6 bisection steps per level): the bracket shrinks ``2^24``-fold.
    - *Newton.* ``RESIDUAL_STEPS = 1`` Newton step on ``log(G S(s)) = log(G u)`` from the cell's
      midpoint, clamped into the cell (``fmax``/``fmin``: a NaN step goes to the cell's lower end), so
      where rounding noise dominates the survival the result stays in the grid's cell around the
      crossing, as a bisection's would. ``log S`` is concave (``r`` is log-concave: ``log r`` is a
      sum of concave terms), so Newton converges quadratically from a cell this small; near ``u =
      1``, where ``log S`` is flat, the step is the one of Newton on ``S`` itself (``log S - log u ~
      u - S``), whose quadratic constant there equals that of Newton on ``log(1 - S)``.

    Bound: the result differs from the root of the computed survival (the 64-step bisection this
    function replaced) by at most ``8 eps max(1, |s|) + 32 nu(s)``, where ``nu(s) = eps max(1,
    -log Phibar(s - delta)) (Phibar(s - delta) + lam Phibar(s)) / r(s)`` is the survival's own rounding
    carried to ``s`` (the cancellation of its two terms and of their logs): every root finder of this
    survival is uncertain by about ``nu``. ``tests/test_residual.py`` checks the bound for ``delta`` in
    ``[1e-8, 300]``, ``lambda_K`` and ``G_{K+1}`` of ``K = 1..32`` and ``u`` from ``1e-300`` to
    ``1 - 2^-53``; measured on such grids (six seeds): at most ``3.6 eps max(1, |s|)`` where ``nu <= eps
    max(1, |s|)``, and ``2.2 nu`` beyond ``8 eps max(1, |s|)`` elsewhere. (Three grid levels with one
    step, or two with two, miss the bound by orders of magnitude at small ``delta`` and tiny ``u``.)
    Cost: 119 ATen operations whatever ``n`` (the bisection took about 1110), but ``2 (GRID_LEVELS
    (GRID - 1) + RESIDUAL_STEPS) = 506`` ``log_ndtr`` evaluations per row (the bisection 128): fewer
    launches, four times the arithmetic. ``nu`` is large only at small ``delta`` (``G ~ delta``) and
    for ``u`` within ``1e-10`` of 1 (``r`` vanishes at ``c``).

    Args:
        delta: float64 ``[n]``, > 0 where used.
        lam: float64 ``[n]``, ``lambda_K >= 1``.
        mass: float64 ``[n]``, ``G_{K+1}``.
        u: float64 ``[n]`` uniforms in (0, 1).
        iterations: Newton steps (the bound above is for the defaults).
        grid_levels: grid levels.

    Returns:
        float64 ``[n]``; rows with ``delta == 0`` or ``mass == 0`` (never rejected) hold finite filler.
    """
    delta = delta.clamp_min(1e-300)
    log_lam = torch.log(lam)
    c = torch.addcdiv(0.5 * delta, log_lam, delta)  # grs_threshold
    log_mass = torch.log(mass.clamp_min(1e-300))
    log_u = torch.log(u)
    log_t = log_u + log_mass
    t_lin = torch.exp(log_t)
    # bracket: Phibar(s - delta) >= G S(s) and Phi(s - delta) >= G (1 - S(s)), widened for ndtri's error
    hi = torch.maximum(c, delta).add_(torch.sqrt(log_t * -2.0)).add_(2.0)  # Phibar(x) <= exp(-x^2 / 2), x >= 0
    q = torch.special.ndtri(t_lin)  # ndtri(0) = -inf leaves hi as it is
    hi = torch.minimum(hi, torch.sub(delta + _WIDEN, q).clamp_(min=c))
    # ndtri(1) = inf (G (1 - u) rounded to 1) bounds nothing: it becomes -inf, so lo = c ...
    q = torch.special.ndtri((1.0 - u) * mass).nan_to_num_(posinf=-math.inf)
    # ... but the survival side stays informative there: Phibar(root - delta) = 1 - G (1 - u) <=
    # 2 K Phibar(delta / 2) + u G (a child is accepted with probability at most 1 - TV(P, Q) each),
    # and K <= 1 + (lambda_K - 1) / G_{K+1} (the masses decrease)
    p_up = torch.addcmul(t_lin, (lam - 1.0).div_(mass.clamp_min(1e-300)).add_(1.0),
                         torch.special.erfc(delta * (0.5 * math.sqrt(0.5))))
    q = torch.maximum(q, torch.special.ndtri(p_up.clamp_(max=1.0)).neg_())
    z_lo = torch.add(delta - _WIDEN, q)
    lo = torch.minimum(torch.maximum(z_lo, c), hi)
    # grid levels: the survival at GRID - 1 interior points of the bracket in one evaluation; the
    # bracket becomes the cell where it crosses u (a static-shape GRID-ary bisection). The cell's
    # ends and the points are one product [lo, hi] @ [1 - f; f] with f = 0, 1/GRID, ..., 1.
    ends = torch.stack([lo, hi], 1)
    if grid_levels:
        f = torch.linspace(0.0, 1.0, GRID + 1, dtype=torch.float64, device=u.device)
        weights = torch.stack([1.0 - f, f])
        pair = torch.arange(2, device=u.device)
        d2, lam2, t2 = delta[:, None], log_lam[:, None], log_t[:, None]
        for _ in range(grid_levels):
            grid = ends @ weights  # [n, GRID + 1]: lo, the GRID - 1 points, hi
            pts = grid[:, 1:GRID]
            # S(s) > u, i.e. Phibar(s - delta) > lam Phibar(s) + u G, in log space: the root lies above
            above = torch.special.log_ndtr(d2 - pts) > torch.logaddexp(torch.special.log_ndtr(-pts) + lam2, t2)
            ends = grid.gather(1, above.sum(1, keepdim=True) + pair)
    lo, hi = ends.unbind(1)
    s = torch.lerp(lo, hi, 0.5)
    if iterations:
        # Newton on log(G S(s)) towards log(G u): d/ds log(G S) = -r / (G S), so the step is
        # (log(G S) - log(G u)) G S / r, all in log space
        for _ in range(iterations):
            nz = delta - s
            a = torch.special.log_ndtr(nz)  # log Phibar(s - delta)
            e = torch.special.log_ndtr(-s) + log_lam - a
            log_gs = a + torch.log(-torch.expm1(e.clamp_(max=-1e-300)))  # log(G S(s)), as the grid
            # log r(s) = log phi(s - delta) + log(1 - exp(-delta (s - c)))
            log_r = torch.addcmul(torch.log(torch.expm1(delta * (c - s)) * -_INV_SQRT_2PI), nz, nz, value=-0.5)
            step = torch.addcmul(s, log_gs - log_t, torch.exp(log_gs - log_r))
            s = torch.fmin(torch.fmax(step, lo), hi)  # never leaves the grid's cell; a NaN step goes to lo
    return s


def grs_select(delta: torch.Tensor, s_hat: torch.Tensor, rows) -> tuple[torch.Tensor, torch.Tensor]:
    """Scalar part of Algorithm 3: which child to accept, and the residual projection.

    Child ``j`` is accepted with probability ``beta_j = min(1, (rho_j - lambda_{j-1})_+ / G_j)``, that
    is where ``u_j G_j <= rho_j - lambda_{j-1}``, tested for every child at once as ``log rho_j >=
    log(lambda_{j-1} + u_j G_j)`` (no division, so ``G_j = 0`` needs no guard); the first accepted in
    drafting order is taken. The residual is drawn for every row (static shapes, no host
    synchronisation) and kept where all were rejected.

    Args:
        delta: float64 ``[n]``.
        s_hat: float64 ``[n, K]`` projections, examined in column order.
        rows: per-row uniform source (``uniform(m) -> [n, m]``); draws ``K`` then 1 per row.

    Returns:
        ``(index [n] long, s_res [n] float64)``; ``index == K`` where every child was rejected,
        and then ``s_res`` is the residual draw (elsewhere finite filler, which
        :func:`reconstruct` ignores).
    """
    n, k = s_hat.shape
    u = rows.uniform(k)
    lam, g = _levels(delta, k)
    d = delta[:, None]
    log_rho = torch.addcmul(d * s_hat, d, d, value=-0.5)  # log rho = delta s - delta^2 / 2
    accept = log_rho >= torch.log(torch.addcmul(torch.stack(lam[:k], 1), u, torch.stack(g[:k], 1)))
    index = accept.logical_not().cumprod(1).sum(1)  # leading rejections: the first accepted, or K
    u_res = rows.uniform(1)[:, 0]
    s_res = sample_grs_residual(delta, lam[k], g[k], u_res)
    return index, s_res


def _dgrs_positional(delta, K: int):
    from .theory import dgrs_positional  # theory imports this module

    return dgrs_positional(delta, K)


def _rmc_positional(delta, K: int):
    from .theory import rmc_positional

    return rmc_positional(delta, K)


@register_coupling("dgrs", positional=_dgrs_positional)
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
