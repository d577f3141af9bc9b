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

History (``Draft.history > 0``): the sampler records the exact data predictions ``x - sigma v`` at the
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

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .registry import Registry
from .schedule import Schedule, per_row


@dataclass(frozen=True)
class DraftRoot:
    """What the roots of a round's ``m`` live trajectories offer a draft.

    Attributes:
        x: ``[m, *e]`` root states ``Y_n``.
        v: ``[m, *e]`` the velocity the round drafts from (the root's own exact velocity where ``exact``;
            else the prefetched one of a nearby evaluated state, see ``sampler.prefetch``).
        n: ``[m]`` long, root state indices (noise level ``sigma_n``).
        exact: ``[m]`` bool, ``v`` is the root's own exact velocity.
        hist_x0: ``[m, H, *e]`` exact data predictions ``x - sigma v`` at earlier states of the committed
            trajectory, most recent first (``None`` when the draft asks for no history, ``H = 0``).
        hist_n: ``[m, H]`` long, their state indices; ``-1`` marks an empty slot (then ``hist_x0`` is 0).
    """

    x: torch.Tensor
    v: torch.Tensor
    n: torch.Tensor
    exact: torch.Tensor
    hist_x0: torch.Tensor | None = None
    hist_n: torch.Tensor | None = None


@dataclass(frozen=True)
class Draft:
    """A draft rule, registered in :data:`DRAFTS`.

    Attributes:
        name: registry key (``sampler.draft`` in configs).
        freeze: ``(root: DraftRoot, schedule) -> frozen [M, ...]`` (leading dimension: the round's rows).
        mean: ``(frozen [M, ...], x [M, m, *e], n [M] long, schedule) -> [M, m, *e]`` proposal means
            of the children of nodes ``x`` (all of one depth, at step ``n``).
        history: how many earlier exact data predictions of the trajectory ``freeze`` reads
            (``DraftRoot.hist_x0``); 0: none are kept.
    """

    name: str
    freeze: Callable[..., torch.Tensor]
    mean: Callable[..., torch.Tensor]
    history: int = 0


DRAFTS: Registry[Draft] = Registry("draft")


def get_draft(name: str) -> Draft:
    """Look up a draft by name.

    Raises:
        ConfigError: (a ``ValueError``) unknown name; the message lists the valid ones.
    """
    return DRAFTS.get(name)


def data_prediction(x: torch.Tensor, v: torch.Tensor, n: torch.Tensor, schedule: Schedule) -> torch.Tensor:
    """Data prediction ``x - sigma_n v`` of the linear path (``[m, *e]`` from ``x, v [m, *e]``, ``n [m]`` long)."""
    return x - per_row(schedule.sigmas.to(x.device)[n].to(x.dtype), x) * v


def _flat_mean(schedule: Schedule, x: torch.Tensor, v: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """Kernel means (eq. 36) of nodes ``x [M, m, *e]`` with velocities ``v`` like ``x``, all at step ``n [M]``."""
    m, k = x.shape[:2]
    out = schedule.mean(x.reshape(m * k, *x.shape[2:]), v.reshape(m * k, *x.shape[2:]), n.repeat_interleave(k))
    return out.reshape(x.shape)


def _x0_freeze(root: DraftRoot, sch: Schedule):
    return data_prediction(root.x, root.v, root.n, sch)


def _x0_mean(fr, x, n, sch: Schedule):
    s = per_row(sch.sigmas.to(x.device)[n].to(x.dtype), x)
    return _flat_mean(sch, x, (x - fr[:, None]) / s, n)


def _sigma_feature(sigma: torch.Tensor) -> torch.Tensor:
    return sigma


def _lsnr_feature(sigma: torch.Tensor) -> torch.Tensor:
    """Half log-SNR ``log((1 - sigma) / sigma)`` of the linear path; ``-inf`` at ``sigma = 1``."""
    return torch.log1p(-sigma) - torch.log(sigma)


def _x0_extrap(feature: Callable[[torch.Tensor], torch.Tensor], damp: float = 1.0, gate: bool = False):
    """``(freeze, mean)`` of the extrapolating data-prediction draft in the coordinate ``feature(sigma)``.

    Frozen: ``[m, 2, *e]`` = ``(a, s)`` with ``x0_hat(sigma) = a + s feature(sigma)``, anchored at the root's
    ``x0_r`` (``a = x0_r - s feature(sigma_r)``). The slope comes from the two most recent exact records
    (the root itself first where its velocity is exact, then the history); ``damp`` scales it. With
    ``gate``, a row extrapolates only if the slope of its previous pair of records would have predicted
    the last increment better than no slope (``|d1 - p| < |d1|``; needs a third record). With fewer
    records, or a pair whose feature difference is not finite (a record at ``sigma = 1`` in log-SNR), the
    slope is 0 (the ``x0`` draft).
    """

    def freeze(root: DraftRoot, sch: Schedule):
        sig = sch.sigmas.to(root.x.device)
        d_r = data_prediction(root.x, root.v, root.n, sch)
        ex = root.exact
        H = root.hist_n.shape[1]
        # records, most recent first: the root where exact, then the history (shifted by one where exact)
        pts_x, pts_n = [], []
        for j in range(3 if gate else 2):
            if j == 0:
                xj = torch.where(per_row(ex, d_r), d_r, root.hist_x0[:, 0])
                nj = torch.where(ex, root.n, root.hist_n[:, 0])
            else:
                prev_x = root.hist_x0[:, j - 1]
                prev_n = root.hist_n[:, j - 1]
                cur_x = root.hist_x0[:, j] if j < H else torch.zeros_like(d_r)
                cur_n = root.hist_n[:, j] if j < H else torch.full_like(root.n, -1)
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
            red = lambda t: t.reshape(t.shape[0], -1).square().sum(1)
            ok = ok & ok1 & (red(d1 - pred) < red(d1))
        slope = slope * per_row((ok * damp).to(d_r.dtype), d_r)
        f_r = feature(sig[root.n]).to(d_r.dtype)
        return torch.stack([d_r - per_row(f_r, d_r) * slope, slope], dim=1)

    def mean(fr, x, n, sch: Schedule):
        sig = sch.sigmas.to(x.device)[n].to(x.dtype)
        x0 = fr[:, 0] + per_row(feature(sig), fr[:, 0]) * fr[:, 1]
        return _flat_mean(sch, x, (x - x0[:, None]) / per_row(sig, x), n)

    return freeze, mean


for _draft in (
    Draft("velocity", freeze=lambda root, sch: root.v, mean=lambda fr, x, n, sch: _flat_mean(sch, x, fr[:, None].expand_as(x), n)),
    Draft("drift", freeze=lambda root, sch: sch.mean(root.x, root.v, root.n) - root.x, mean=lambda fr, x, n, sch: x + fr[:, None]),
    Draft("x0", freeze=_x0_freeze, mean=_x0_mean),
    Draft("x0_extrap", *_x0_extrap(_lsnr_feature), history=2),
    Draft("x0_extrap_gated", *_x0_extrap(_lsnr_feature, gate=True), history=3),
):
    DRAFTS.register(_draft.name, _draft)
