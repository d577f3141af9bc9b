"""Self-speculative drafts: proposal kernels built from what a round's root knows.

A draft freezes something known at the root of a round (``freeze``, from a :class:`DraftRoot`) and
rebuilds the proposal mean at any drafted node and step from it (``mean``). The proposal std is always
the target kernel's (eq. 37), so every draft fits the rank-1 coupling. A draft may use only what is
known at the root: the committed trajectory so far and exact target outputs already computed, never
the target at drafted nodes of the current round. Registered drafts (:data:`DRAFTS`):

- ``velocity`` (default; section 5, "Protocol"): freeze the root velocity ``v_r`` and use the kernel
  mean of eq. 36 with ``v_r`` at the node's own state and step.
- ``drift``: freeze the whole increment ``m_n(x_r) - x_r`` of the root step and add it at every depth
  (appendix C.1 read literally, eq. 7).
- ``x0``: freeze the root's data prediction ``x0_hat = x_r - sigma_r v_r`` and rebuild the velocity
  ``(x_u - x0_hat) / sigma_u`` at each node (the exact velocity if the posterior mean did not move).
- ``x0_extrap`` (beyond the paper): like ``x0``, but the data prediction moves with the noise level,
  linearly in the half log-SNR ``lambda = log((1 - sigma) / sigma)``:
  ``x0_hat(lambda) = x0_r + s (lambda - lambda_r)``, the slope ``s`` taken from the two most recent
  exact data predictions of the committed trajectory (the multistep idea of DPM-Solver++(2M), Lu et
  al. 2022, arXiv:2211.01095, applied to a frozen draft). Linear in ``sigma`` instead, or with the
  slope halved, did no better on the section 5.1 mixture.
- ``x0_extrap_gated``: ``x0_extrap`` where the slope of the previous pair of records would have
  predicted the last increment better than no slope; ``x0`` elsewhere (the data prediction is
  noise-driven early in sampling, where extrapolating hurts).
- ``x0_affine`` (beyond the paper): the data prediction moves with the drafted state as it does for one
  isotropic Gaussian ``N(mu, s^2 I)`` on the linear path, ``E[x0 | x] = mu + c(sigma) (x - (1 - sigma) mu)``
  with ``c = (1 - sigma) s^2 / ((1 - sigma)^2 s^2 + sigma^2)`` (in ``[0, 1 / (1 - sigma)]``). Per trajectory,
  ``s^2`` is fitted by least squares through the two most recent exact records (state and data
  prediction; :func:`_fit_s2`) and ``mu`` solved from the most recent one; the drafted velocity at node
  ``x_u`` is ``(x_u - x0_hat(x_u, sigma_u)) / sigma_u``. Where a record lies at ``sigma = 1`` (the
  posterior is the prior there, not one component), a slot is empty, or the fit predicts the older
  record no better than a frozen data prediction would, it drafts like ``x0_extrap_gated``. Motivated by
  the Gaussian posterior form: on the section 5.1 mixture, whose posterior commits to one component
  within a few steps, it is exact after that; on image networks the form holds only locally.

History (``Draft.history > 0``): the sampler records the exact data predictions ``x - sigma v`` (and the
states ``x`` they were computed at) at the
states of the committed trajectory whose exact velocity it computed: the step-0 state (``sigma = 1``)
and every node a round's walk verified (the root and each accepted internal node). The committed state
that ends a round is recorded by the round it roots. With ``prefetch`` ``nearest``/``parent`` the
root's own velocity is exact only when the previous round evaluated it (``DraftRoot.exact``); else the
most recent record is the state one step before the root, which the previous round verified. Every
prefetch mode thus has at least the step-0 record from the first round on. A pair that involves the
step-0 record (``lambda = -inf``) gives slope 0, so the first round (and any round whose pair reaches
back to step 0) drafts like ``x0``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .batching import row_sums
from .kernels import lsnr
from .registry import Registry
from .schedule import Schedule, per_row


@dataclass
class DraftHistory:
    """The exact records of the committed trajectories a draft with ``Draft.history = H > 0`` reads.

    One record per slot, most recent first; the sampler owns one for the whole batch, gives a round the rows it
    serves (:meth:`take`), pushes what the round's walk verified (:meth:`push`, :meth:`prepend`) and writes it
    back (:meth:`put`, :meth:`where`). Every operation is a copy or a selection: no record's value changes.

    Attributes:
        x0: ``[M, H, *e]`` exact data predictions ``x - sigma v`` (:func:`data_prediction`); 0 in empty slots.
        n: ``[M, H]`` long, their state indices; ``-1`` marks an empty slot.
        x: ``[M, H, *e]`` the states at which those data predictions were computed (0 in empty slots), or None
            where the reader needs none (the sampler always records them).
    """

    x0: torch.Tensor
    n: torch.Tensor
    x: torch.Tensor | None = None

    @classmethod
    def empty(cls, like: torch.Tensor, slots: int) -> DraftHistory:
        """``slots`` empty records for each row of ``like [M, *e]`` (its dtype and device)."""
        shape = (like.shape[0], slots) + tuple(like.shape[1:])
        return cls(
            like.new_zeros(shape),
            torch.full(shape[:2], -1, dtype=torch.long, device=like.device),
            like.new_zeros(shape),
        )

    @property
    def slots(self) -> int:
        """``H``, the records kept per row."""
        return self.n.shape[1]

    def _parts(self):
        return (self.x0, self.n) + (() if self.x is None else (self.x,))

    def take(self, rows: torch.Tensor) -> DraftHistory:
        """The records of rows ``rows [m]`` (long), as a copy."""
        return DraftHistory(*(t[rows] for t in self._parts()))

    def clone(self) -> DraftHistory:
        """A copy that later pushes do not share."""
        return DraftHistory(*(t.clone() for t in self._parts()))

    def put(self, rows: torch.Tensor, other: DraftHistory) -> None:
        """Write ``other``'s records (one row per entry of ``rows [m]``) into rows ``rows``, in place."""
        for mine, theirs in zip(self._parts(), other._parts()):
            mine[rows] = theirs

    def push(self, rows: torch.Tensor, x0: torch.Tensor, n: torch.Tensor, x: torch.Tensor) -> None:
        """Shift rows ``rows [r]`` back one slot (the oldest record drops out) and write the record ``x0 [r, *e]``
        at state ``n [r]``, computed at ``x [r, *e]``, in front; in place."""
        new = (x0, n) + (() if self.x is None else (x,))
        for t, v in zip(self._parts(), new):
            if t.shape[1] > 1:
                t[rows, 1:] = t[rows, :-1].clone()
            t[rows, 0] = v

    def prepend(
        self,
        fresh: DraftHistory,
        count: torch.Tensor,
        *,
        slot: torch.Tensor | None = None,
        rows: torch.Tensor | None = None,
    ) -> DraftHistory:
        """What ``count [M, 1]`` (long) pushes per row would leave: slot ``s`` holds ``fresh``'s slot ``s`` where
        ``s < count`` (``fresh`` most recent first, shaped like this history or with the event flattened), else this
        history's slot ``s - count``; a new history.

        ``slot`` (``[1, H]``, ``0..H-1``) and ``rows`` (``[M, 1]``, ``0..M-1``): the index tensors, where the caller
        already holds them (a round that runs once per step keeps its operation count down)."""
        M, H = self.n.shape
        if slot is None:
            slot = torch.arange(H, device=self.n.device)[None]
        if rows is None:
            rows = torch.arange(M, device=self.n.device)[:, None]
        new = slot < count
        old = (slot - count).clamp(min=0, max=H - 1)
        masks = {2: new}

        def pick(mine, theirs):
            if mine.ndim not in masks:
                masks[mine.ndim] = new.reshape(M, H, *(1,) * (mine.ndim - 2))
            return torch.where(
                masks[mine.ndim], theirs if theirs.shape == mine.shape else theirs.reshape(mine.shape), mine[rows, old]
            )

        return DraftHistory(*(pick(a, b) for a, b in zip(self._parts(), fresh._parts())))

    def where(self, keep: torch.Tensor, other: DraftHistory) -> DraftHistory:
        """Rows of this history where ``keep [M]`` (bool), ``other``'s elsewhere (a new history)."""
        masks = {}
        out = []
        for mine, theirs in zip(self._parts(), other._parts()):
            if mine.ndim not in masks:
                masks[mine.ndim] = keep.reshape(-1, *(1,) * (mine.ndim - 1))
            out.append(torch.where(masks[mine.ndim], mine, theirs))
        return DraftHistory(*out)


@dataclass(frozen=True)
class DraftRoot:
    """What the roots of a round's ``m`` live trajectories offer a draft.

    Attributes:
        x: ``[m, *e]`` root states ``Y_n``.
        v: ``[m, *e]`` the velocity the round drafts from (the root's own exact velocity where ``exact``;
            else the prefetched one of a nearby evaluated state, see :func:`specsamp.round.context.leaf_prefetch`).
        n: ``[m]`` long, root state indices (noise level ``sigma_n``).
        exact: ``[m]`` bool, ``v`` is the root's own exact velocity.
        history: the rows' :class:`DraftHistory` (``[m, H, ...]``, earlier states of the committed trajectory,
            most recent first); ``None`` when the draft asks for none (``Draft.history = 0``).
    """

    x: torch.Tensor
    v: torch.Tensor
    n: torch.Tensor
    exact: torch.Tensor
    history: DraftHistory | None = None


@dataclass(frozen=True)
class Draft:
    """A draft rule, registered in :data:`DRAFTS`.

    Attributes:
        name: registry key (``sampler.draft`` in configs).
        freeze: ``(root: DraftRoot, schedule) -> frozen [M, ...]`` (leading dimension: the round's rows).
        mean: ``(frozen [M, ...], x [M, m, *e], n [M] long, schedule) -> [M, m, *e]`` proposal means
            of the children of nodes ``x`` (all of one depth, at step ``n``). ``None`` (a draft given by its table
            form, as every registered draft is): the table form at the kernel's coefficients of ``n``
            (:func:`table_means`), so both executions run one formula.
        history: how many earlier exact data predictions of the trajectory ``freeze`` reads
            (``DraftRoot.history``, with the states they were computed at); 0: none are kept.
        table_mean: optional ``(frozen [M, 1, D], x [M, g, D], coef, kernel) -> [M, g, D]``: the proposal means of
            nodes ``x`` (event flattened to ``D``; ``frozen`` likewise, with a node axis of 1), computed with the
            same operations as ``mean`` (so the same bits) from coefficients already gathered for each node's
            step: ``coef`` maps each column of the kernel's table (:meth:`specsamp.kernels.Kernel.table`: for
            Euler--Maruyama ``dt``, ``a``, ``b``, ``sigma``, ``std`` and ``lsnr``, ``log((1 - sigma) / sigma)`` of that
            ``sigma``, in ``x``'s dtype) to tensors that broadcast against ``x``; ``kernel`` is the target kernel
            (``kernel.mean(x, out, coef)``: its mean, :class:`specsamp.kernels.Kernel`). With it the tree
            execution runs its dense round (no coefficient recomputed per call);
            the same bits matter because the couplings project on ``mean_q - mean_p``, small where the draft
            is good, so a last-bit change of a state can turn the residual's direction.
        table_frozen: optional ``(frozen [C, ..., D], coef) -> frozen for table_mean``, for a draft whose frozen
            quantity has ``C`` components (``freeze`` returns ``[M, C, *e]``) that combine per step: the
            components on a leading axis (each shaped like ``table_mean``'s ``frozen``), combined with the
            step's coefficients ``coef`` as ``mean`` combines them (same bits); a tensor, or a tuple of tensors
            that all have ``coef``'s leading axes. ``None``: ``table_mean`` takes ``frozen`` itself.
    """

    name: str
    freeze: Callable[..., torch.Tensor]
    mean: Callable[..., torch.Tensor] | None = None
    history: int = 0
    table_mean: Callable[..., torch.Tensor] | None = None
    table_frozen: Callable[..., torch.Tensor] | None = None

    def __post_init__(self):
        if self.mean is None:  # one formula: the table form, read at the steps' coefficients
            if self.table_mean is None:
                raise ValueError(f"draft {self.name!r} needs a mean or a table_mean")
            object.__setattr__(self, "mean", functools.partial(_mean_from_table, self))


def table_means(draft: Draft, frozen: torch.Tensor, x: torch.Tensor, coef: dict, kernel) -> torch.Tensor:
    """The proposal means ``[M, g, D]`` of nodes ``x [M, g, D]`` (event flattened) of a draft with a table form, from
    its frozen quantity ``frozen [M, ...]``, the steps' coefficients ``coef`` (each ``[M, 1, 1]``;
    :meth:`specsamp.kernels.Kernel.coefs`) and the target ``kernel``: ``table_frozen`` (where the draft has one)
    then ``table_mean``."""
    M, D = x.shape[0], x.shape[2]
    if draft.table_frozen is None:
        return draft.table_mean(frozen.reshape(M, 1, D), x, coef, kernel)
    frozen = draft.table_frozen(frozen.reshape(M, -1, D).permute(1, 0, 2)[:, :, None], coef)
    return draft.table_mean(frozen, x, coef, kernel)


def _mean_from_table(
    draft: Draft, frozen: torch.Tensor, x: torch.Tensor, n: torch.Tensor, sch: Schedule
) -> torch.Tensor:
    """``Draft.mean`` of a draft given by its table form: :func:`table_means` at the kernel's coefficients of ``n``."""
    flat = x.reshape(x.shape[0], x.shape[1], -1)
    return table_means(draft, frozen, flat, sch.kernel.coefs(n, flat), sch.kernel).reshape(x.shape)


DRAFTS: Registry[Draft] = Registry("draft", Draft)


def register_draft(
    name: str,
    mean: Callable[..., torch.Tensor],
    *,
    history: int = 0,
    table_mean: Callable[..., torch.Tensor] | None = None,
    table_frozen: Callable[..., torch.Tensor] | None = None,
) -> Callable[[Callable], Draft]:
    """Decorator: register a ``freeze`` function with its ``mean`` (contract: :class:`Draft`) as draft ``name``.

    Returns:
        A decorator that returns the registered :class:`Draft`.

    Raises:
        ValueError: ``name`` is already registered.
    """

    def deco(freeze: Callable[..., torch.Tensor]) -> Draft:
        return DRAFTS.register(name, Draft(name, freeze, mean, history, table_mean, table_frozen))

    return deco


def get_draft(name: str | Draft) -> Draft:
    """A draft by registered name or ``"pkg.module:name"`` (:meth:`specsamp.registry.Registry.get`); a
    :class:`Draft` as is.

    Raises:
        ConfigError: (a ``ValueError``) unknown name; the message lists the valid ones.
    """
    return DRAFTS.get(name)


def data_prediction(x: torch.Tensor, v: torch.Tensor, n: torch.Tensor, schedule: Schedule) -> torch.Tensor:
    """Data prediction ``x - sigma_n v`` of the linear path (``[m, *e]`` from ``x, v [m, *e]``, ``n [m]`` long)."""
    return x - per_row(schedule.sigmas.to(x.device)[n].to(x.dtype), x) * v


def _x0_freeze(root: DraftRoot, sch: Schedule):
    return data_prediction(root.x, root.v, root.n, sch)


def _x0_extrap(gate: bool = False):
    """``freeze`` of the extrapolating data-prediction draft in the half log-SNR ``lambda(sigma)``.

    Frozen: ``[m, 2, *e]`` = ``(a, s)`` with ``x0_hat(sigma) = a + s lambda(sigma)``, anchored at the root's
    ``x0_r`` (``a = x0_r - s lambda(sigma_r)``). The slope comes from the two most recent exact records
    (the root itself first where its velocity is exact, then the history). With
    ``gate``, a row extrapolates only if the slope of its previous pair of records would have predicted
    the last increment better than no slope (``|d1 - p| < |d1|``; needs a third record). With fewer
    records, or a pair whose ``lambda`` difference is not finite (a record at ``sigma = 1``), the
    slope is 0 (the ``x0`` draft).
    """
    feature = lsnr

    def freeze(root: DraftRoot, sch: Schedule):
        sig = sch.sigmas.to(root.x.device)
        d_r = data_prediction(root.x, root.v, root.n, sch)
        ex = root.exact
        hist = root.history
        H = hist.slots
        # records, most recent first: the root where exact, then the history (shifted by one where exact)
        pts_x, pts_n = [], []
        for j in range(3 if gate else 2):
            if j == 0:
                xj = torch.where(per_row(ex, d_r), d_r, hist.x0[:, 0])
                nj = torch.where(ex, root.n, hist.n[:, 0])
            else:
                prev_x = hist.x0[:, j - 1]
                prev_n = hist.n[:, j - 1]
                cur_x = hist.x0[:, j] if j < H else torch.zeros_like(d_r)
                cur_n = hist.n[:, j] if j < H else torch.full_like(root.n, -1)
                xj = torch.where(per_row(ex, d_r), prev_x, cur_x)
                nj = torch.where(ex, prev_n, cur_n)
            pts_x.append(xj)
            pts_n.append(nj)
        f = [feature(sig[nj.clamp(min=0)]) for nj in pts_n]

        def rate(i):  # slope between records i and i + 1, and whether it is usable
            den = f[i] - f[i + 1]
            ok = (pts_n[i] >= 0) & (pts_n[i + 1] >= 0) & torch.isfinite(den) & (den != 0)
            inv = torch.where(ok, 1.0 / torch.where(ok, den, torch.ones_like(den)), torch.zeros_like(den))
            diff = torch.where(per_row(ok, d_r), pts_x[i] - pts_x[i + 1], torch.zeros_like(d_r))
            return per_row(inv.to(d_r.dtype), d_r) * diff, ok

        slope, ok = rate(0)
        if gate:
            older, ok1 = rate(1)
            d1 = pts_x[0] - pts_x[1]
            pred = older * per_row((f[0] - f[1]).to(d_r.dtype), d_r)

            def red(t):
                return row_sums(t.reshape(t.shape[0], -1).square())

            ok = ok & ok1 & (red(d1 - pred) < red(d1))
        slope = slope * per_row(ok.to(d_r.dtype), d_r)
        f_r = feature(sig[root.n]).to(d_r.dtype)
        return torch.stack([d_r - per_row(f_r, d_r) * slope, slope], dim=1)

    return freeze


def _gauss_gain(s2: torch.Tensor, sigma: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(b, c)`` of one isotropic Gaussian ``N(mu, s2 I)`` on the linear path: ``E[x0 | x] = b mu + c x`` with
    ``v = (1 - sigma)^2 s2 + sigma^2``, ``b = sigma^2 / v``, ``c = (1 - sigma) s2 / v`` (broadcasting shapes)."""
    a = 1.0 - sigma
    v = a * a * s2 + sigma * sigma
    return sigma * sigma / v, a * s2 / v


_LN10 = math.log(10.0)


def _fit_s2(dA, xA, sA, dB, xB, sB, grid: int = 241, rounds: int = 5):
    """Least-squares ``s^2`` of the one-Gaussian posterior through two exact records, per row.

    Anchored at record A (``mu = (d_A - c_A x_A) / b_A``), record B's data prediction is predicted as
    ``alpha d_A + beta x_A + gamma x_B`` with ``alpha = b_B / b_A``, ``beta = -b_B c_A / b_A``, ``gamma = c_B``;
    the squared residual ``||V' w||^2``, ``V = (d_B, d_A, x_A, x_B)`` and ``w = (-1, alpha, beta, gamma)``, is
    scanned on a log grid of ``s^2`` in ``[1e-6, 1e2]`` and refined ``rounds`` times around the best point.

    It is evaluated as ``||R w||^2`` from the triangular factor of ``V' = Q R`` (Gram--Schmidt, each column
    orthogonalised twice, so ``Q`` is orthonormal to working precision), not as ``w' G w`` from the Gram matrix
    ``G = V V'``: near a good fit the residual is small while ``G``'s entries are ``|V|^2``, so the Gram form's
    rounding (``eps |w|^2 |V|^2``) would swamp it, and its minimiser would move with the square root of any
    rounding of the records. ``R w``'s rounding is ``eps |w| |V|``, so the squared residual's is ``2 eps |w| |V|
    sqrt(r)`` and the minimiser moves linearly with a perturbation of the records, by ``|w| |V| / |dR w / ds^2|``
    times it (the fit's condition number). Every step is a product, a sum over a row's own coordinates
    (:func:`specsamp.batching.row_sums`) or elementwise: a row's fit is the same in a batch of any size.

    Args: ``dA, xA, dB, xB [m, *e]``; ``sA, sB [m]`` noise levels in ``(0, 1)``.
    Returns: ``(s2 [m], residual [m])`` (residual: ``||d_B - prediction||^2`` at ``s2``).
    """
    m = dA.shape[0]
    V = [t.reshape(m, -1).double() for t in (dB, dA, xA, xB)]
    Q: list[torch.Tensor] = []
    R = {}  # (j, k) -> [m], j <= k
    for k in range(4):
        v = V[k].clone()
        coef = [torch.zeros(m, dtype=torch.float64, device=v.device) for _ in range(k)]
        for _ in range(2):  # twice: orthogonal to working precision
            for j in range(k):
                cj = row_sums(Q[j] * v)
                v = v.sub_(Q[j] * cj[:, None])
                coef[j] = coef[j] + cj
        norm = row_sums(v * v).sqrt_()
        Q.append(v.div_(torch.where(norm > 0, norm, torch.ones_like(norm))[:, None]))  # a column in the others' span: 0
        for j in range(k):
            R[j, k] = coef[j]
        R[k, k] = norm
    sA, sB = sA.double()[:, None], sB.double()[:, None]

    def resid(s2):  # s2 [m, g] -> [m, g]: ||R w||^2 with w = (-1, alpha, beta, gamma), in a fixed order
        bA, cA = _gauss_gain(s2, sA)
        bB, cB = _gauss_gain(s2, sB)
        w = (-torch.ones_like(s2), bB / bA, -bB * cA / bA, cB)
        out = torch.zeros_like(s2)
        for j in range(4):
            comp = torch.zeros_like(s2)
            for k in range(j, 4):
                comp = comp + R[j, k][:, None] * w[k]
            out = out + comp * comp
        return out

    lo = torch.full((m, 1), -6.0, dtype=torch.float64, device=dA.device)
    hi = torch.full((m, 1), 2.0, dtype=torch.float64, device=dA.device)
    t = torch.linspace(0, 1, grid, dtype=torch.float64, device=dA.device)[None]
    for _ in range(rounds):
        e = lo + (hi - lo) * t
        r = resid(torch.exp(e * _LN10))  # 10^e; torch.pow rounds its vectorised body and scalar tail differently
        best = r.argmin(1, keepdim=True)
        step = (hi - lo) / (grid - 1)
        c = e.gather(1, best)
        lo, hi = c - step, c + step
    s2 = torch.exp(c[:, 0] * _LN10)
    return s2, resid(s2[:, None])[:, 0].clamp(min=0)


def _x0_affine():
    """``freeze`` of the local-affine data-prediction draft (``x0_affine``).

    Frozen: ``[m, 4, *e]`` = ``(a, s, mu, s2)``: the ``x0_extrap_gated`` fallback ``a + s lambda(sigma)``, the
    fitted component mean ``mu`` and its variance ``s2`` broadcast over the event (``-1``: use the fallback).
    """
    fb_freeze = _x0_extrap(gate=True)  # the x0_extrap_gated fallback's frozen part

    def freeze(root: DraftRoot, sch: Schedule):
        sig = sch.sigmas.to(root.x.device)
        fb = fb_freeze(root, sch)  # [m, 2, *e]
        d_r = data_prediction(root.x, root.v, root.n, sch)
        ex = root.exact

        def pe(t):
            return per_row(ex, t)

        hist = root.history
        # the two most recent exact records (the root where its velocity is exact, then the history)
        dA = torch.where(pe(d_r), d_r, hist.x0[:, 0])
        xA = torch.where(pe(d_r), root.x, hist.x[:, 0])
        nA = torch.where(ex, root.n, hist.n[:, 0])
        dB = torch.where(pe(d_r), hist.x0[:, 0], hist.x0[:, 1])
        xB = torch.where(pe(d_r), hist.x[:, 0], hist.x[:, 1])
        nB = torch.where(ex, hist.n[:, 0], hist.n[:, 1])
        # sigma < 1 at both: the one-Gaussian form needs a committed posterior
        usable = (nA >= 1) & (nB >= 1) & (nA != nB)
        sA, sB = sig[nA.clamp(min=0)], sig[nB.clamp(min=0)]
        s2, res = _fit_s2(dA, xA, sA, dB, xB, sB)

        def red(t):
            return row_sums(t.reshape(t.shape[0], -1).double().square())

        # reliable: the fit predicts record B better than a frozen data prediction (the x0 draft) would
        ok = usable & (res < red(dB - dA)) & torch.isfinite(s2)
        s2 = torch.where(ok, s2, torch.full_like(s2, -1.0))
        bA, cA = _gauss_gain(s2.clamp(min=0), sA.double())
        mu = (dA.double() - per_row(cA, dA) * xA.double()) / per_row(torch.where(ok, bA, torch.ones_like(bA)), dA)
        mu = torch.where(per_row(ok, mu), mu, torch.zeros_like(mu)).to(d_r.dtype)
        return torch.cat([fb, mu[:, None], per_row(s2.to(d_r.dtype), d_r)[:, None].expand_as(mu[:, None])], 1)

    return freeze


def _velocity_table_mean(fr, x, coef, kernel):
    # the kernel mean with the frozen root velocity as the network's output
    return kernel.mean(x, fr, coef)


def _x0_table_mean(fr, x, coef, kernel):
    # the velocity (x - x0_hat) / sigma of the frozen data prediction, then the kernel mean
    return kernel.mean(x, (x - fr) / coef["sigma"], coef)


def _extrap_table_frozen(fr, coef):
    # x0_hat(sigma) = a + lambda(sigma) s, lambda the half log-SNR column of the kernel's table
    return fr[0] + coef["lsnr"] * fr[1]


def _affine_table_frozen(fr, coef):
    # the parts that depend on the step only: (b mu, c, the x0_extrap_gated fallback, use), each with the
    # coefficients' leading axes (use and c broadcast over the event as [..., 1])
    s2_raw = fr[3][..., :1]
    sig = coef["sigma"]
    b, c = _gauss_gain(s2_raw.clamp(min=0), sig)
    c = torch.minimum(c, 1.0 / (1.0 - sig))  # clip to [0, 1 / (1 - sigma)]
    return b * fr[2], c, fr[0] + coef["lsnr"] * fr[1], (s2_raw >= 0).expand_as(c)


def _affine_table_mean(fr, x, coef, kernel):
    # from _affine_table_frozen's parts: x0_hat = b mu + c x (or the fallback), then the x0 draft's mean
    bmu, c, fb, use = fr
    x0 = torch.where(use, bmu + c * x, fb)
    return _x0_table_mean(x0, x, coef, kernel)


for _draft in (
    Draft("velocity", freeze=lambda root, sch: root.v, table_mean=_velocity_table_mean),
    Draft(
        "drift",
        freeze=lambda root, sch: sch.mean(root.x, root.v, root.n) - root.x,
        table_mean=lambda fr, x, coef, kernel: x + fr,
    ),
    Draft("x0", freeze=_x0_freeze, table_mean=_x0_table_mean),
    Draft("x0_extrap", _x0_extrap(), history=2, table_mean=_x0_table_mean, table_frozen=_extrap_table_frozen),
    Draft(
        "x0_extrap_gated",
        _x0_extrap(gate=True),
        history=3,
        table_mean=_x0_table_mean,
        table_frozen=_extrap_table_frozen,
    ),
    Draft("x0_affine", _x0_affine(), history=3, table_mean=_affine_table_mean, table_frozen=_affine_table_frozen),
):
    DRAFTS.register(_draft.name, _draft)
