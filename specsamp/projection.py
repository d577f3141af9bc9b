"""The rank-1 projection every coupling works through (section 3.1, eqs. 12--15), and the checks of its inputs.

Only the scalar projection of each child on the displacement direction ``e = (mean_q - mean_p) / ||mean_q - mean_p||``
differs between draft and target: :func:`project` reduces one verification problem per row to ``delta`` and the
children's standardised projections ``s_hat`` (float64, scale-free), and :func:`reconstruct` writes a rule's choice
back as a state (eq. 15). The inputs are checked here: shapes and ``sigma`` (:func:`check_inputs`, :func:`min_sigma`),
non-finite or overflowing values (:class:`NonFiniteError`). Value checks raise at once, or inside
:func:`deferred_checks` are collected on the device (:class:`DeferredChecks`) so that a round asks the host nothing.
The couplings (:mod:`specsamp.coupling`) re-export every public name.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from .batching import row_reduce, row_sums


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


def open_checks_slot() -> None:
    """Make the calling thread's slot of the active checks exist (``None``, no checks active) where it does not yet:
    a compiled piece that enters :func:`deferred_checks` is guarded on whether the slot exists, so calling this
    first keeps it from compiling again on a thread where it was first traced without one."""
    if not hasattr(_ACTIVE, "checks"):
        _ACTIVE.checks = None


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
    dist = row_reduce(
        lambda t: torch.linalg.vector_norm(t, dim=-1, dtype=torch.float64), unit
    )  # ||mean_q - mean_p|| / pow2, 0 or >= 1
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
    return x if x.ndim == ndim else x.reshape(*x.shape[: ndim - 1], -1)


def _refuse_non_finite(bad, children, mean_p, mean_q, sigma, w) -> None:
    """Raise for the rows ``bad`` of :func:`project`: non-finite inputs, or finite ones whose differences overflow."""
    n = children.shape[0]
    finite = (
        torch.isfinite(children.reshape(n, -1)).all(1)
        & torch.isfinite(mean_p.reshape(n, -1)).all(1)
        & torch.isfinite(mean_q.reshape(n, -1)).all(1)
    )
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
