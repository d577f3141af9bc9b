r"""Block verification of a drafted chain of Gaussian kernels: exact, and never shorter than node-wise.

Source: block verification was introduced for language models by Sun et al. (2024), "Block verification
accelerates speculative decoding" (arXiv:2403.10444): a drafted block is verified jointly instead of token
by token. The paper cites Soen et al. (2026), "Accelerating speculative diffusions via block verification"
(arXiv:2606.13426), in its appendix A.2 among the works that bring speculative sampling to diffusion models.
The rule below, for the continuous chains of Algorithm 1 with ``K = 1`` (the chains RMC verifies,
Algorithm 2), and its proof of exactness are stated here in full.

Setting
-------
A chain roots at ``x_0``; node ``i = 1..L`` is drafted as ``X_i ~ p_i(. | X_{i-1}) = N(mp_i, s_i^2 I)``
and the target kernel is ``q_i(. | X_{i-1}) = N(mq_i, s_i^2 I)`` (eqs. 36--37: same std). With
``delta_i = ||mq_i - mp_i|| / s_i``, unit displacement ``e_i`` and standardised projection
``S_i = <X_i - mp_i, e_i> / s_i ~ N(0, 1)`` under the draft, the likelihood ratio of node ``i`` is
``r_i = q_i(X_i) / p_i(X_i) = exp(delta_i S_i - delta_i^2 / 2)`` (the rank-1 split, eqs. 12--14).

Rule
----
Running weights: ``w_0 = 1``, ``w_i = min(1, w_{i-1} r_i)``, i.e. ``w_i = min_{k <= i} prod_{k < j <= i} r_j``.
Residual mass after prefix ``i < L``:
``rho_{i+1} = int (w_i q_{i+1} - p_{i+1})_+ = w_i Phibar(c - delta) - Phibar(c)`` with
``c = delta / 2 - ln(w_i) / delta`` (``delta = delta_{i+1}``), which is ``w_i G(1 / w_i, delta)`` with
``G`` the remaining mass of greedy rejection sampling (eq. 19, :func:`specsamp.coupling.grs_remaining_mass`).
Stop probabilities: ``h_i = rho_{i+1} / (rho_{i+1} + 1 - w_i)`` for ``i < L`` and ``h_L = w_L``. Draw
independent ``eta_i ~ Bernoulli(h_i)`` (``eta_0 = 1``) and accept ``tau = max{i : eta_i = 1}`` drafted
nodes, scanning from the leaf back. If ``tau = L`` the leaf is committed (``L`` steps); otherwise the
next state ``Y_{tau+1}`` is drawn from the residual law ``(w_tau q_{tau+1} - p_{tau+1})_+ / rho_{tau+1}``
given ``X_tau``, and ``tau + 1`` steps are committed. The residual factorises on the rank-1 split:
``N(0, I)`` orthogonal to ``e_{tau+1}``, and a projection with density ``(w phi(s - delta) - phi(s))_+`` on
``s > c`` -- the GRS residual of eq. 17 at level ``lambda = 1 / w_tau``, drawn exactly by inverting its
survival function (:func:`specsamp.coupling.sample_grs_residual`) with a fresh uniform. The orthogonal
part is the drafted ``X_{tau+1}``'s own (eq. 15), which is exact: by (i) below
``P(tau = i | X_{1:i+1}) = h_i (1 - w_{i+1})`` depends on ``X_{i+1}`` only through its projection
``S_{i+1}``, so given ``tau = i``, ``X_{1:i}`` and ``S_{i+1}`` its orthogonal part is still ``N(0, I)``.
(So the committed state differs from the evaluated node ``X_{tau+1}`` only along ``e_{tau+1}``.)

Exactness (induction on depth). Write ``p(x_{1:j})``, ``q(x_{1:j})`` for the chains' joint densities.
(i) ``P(tau >= j | X_{1:j}) = w_j``: true at ``j = L``; and
``P(tau = j | X_{1:j}) = h_j (1 - E[w_{j+1} | X_{1:j}])`` because ``h_j`` is ``X_{1:j}``-measurable and
``{tau < j+1}`` has conditional probability ``1 - E[w_{j+1} | X_{1:j}]`` by induction; since
``(w_j q - p)_+ = w_j q - w_{j+1} p`` pointwise, ``E[w_{j+1} | X_{1:j}] = w_j - rho_{j+1}``, so
``P(tau = j | X_{1:j}) = rho_{j+1}`` and ``P(tau >= j | X_{1:j}) = rho_{j+1} + w_j - rho_{j+1} = w_j``.
(``0 <= h_j <= 1`` because ``E_p[w_{j+1}] <= w_j E_p[r] = w_j``.)
(ii) Let ``A_j(z)`` be the density of {the first ``j`` committed states are drafted and equal ``z_{1:j}``}
``= p(z_{1:j}) w_j`` by (i), and ``B_j(z)`` that of {a residual was drawn at depth ``<= j``, and the
trajectory, continued by target kernels, passes through ``z_{1:j}``}. Then
``B_{j+1} = B_j q_{j+1} + p(z_{1:j}) (w_j q_{j+1} - w_{j+1} p_{j+1})`` and
``A_{j+1} = p(z_{1:j}) p_{j+1} w_{j+1}``, so ``A_{j+1} + B_{j+1} = (A_j + B_j) q_{j+1}`` and, from
``A_0 + B_0 = 1``, ``A_j + B_j = q(z_{1:j})`` for every ``j``: the committed path has the target chain's
law. Every quantity above is known after one batched target call on the root and the ``L`` drafted
nodes (``mq_i`` needs the target velocity at ``X_{i-1}``), the call node-wise verification makes anyway.

Acceptance. Node-wise maximal coupling (RMC) accepts ``tau >= j`` with conditional probability
``prod_{i <= j} min(1, r_i) <= w_j``, so block verification accepts at least as many nodes on every drafted
chain; ``E[tau] = sum_j E[w_j]`` and committed steps per round ``E[min(tau + 1, L)] = 1 + sum_{j<L} E[w_j]``.
With constant ``delta`` node-wise gives ``P(tau >= j) = alpha^j``, ``alpha = 2 Phibar(delta / 2)`` (eq. 20).

Entry points: :func:`block_verify_chain` (the rule, coupling-like contract on a whole chain),
:func:`node_verify_chain` (node-wise RMC on the same contract), :func:`chain_acceptance` (conditional tails
of both rules), :func:`draft_chain` (a chain drafted from a round's root with the library's draft, noise keys
and kernel, with its target kernel means: the inputs of both rules), :func:`synthetic_rows` and
:func:`gmm_rows` (tables; ``python -m experiments.blockverify`` prints them as CSV). This module is an
analysis: it verifies single rounds; full speculative runs are :func:`specsamp.sampler.sample_speculative`'s
(node-wise on a chain: ``tree=DraftTree.chain(L)``, ``coupling="rmc"``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from specsamp import rng
from specsamp.coupling import grs_remaining_mass, project, sample_grs_residual, uniform_rows
from specsamp.drafts import DraftRoot, get_draft
from specsamp.models.base import batched
from specsamp.sampler import initial_noise, sample_speculative
from specsamp.schedule import Schedule, per_row
from specsamp.trees import DraftTree

LOG_W_FLOOR = -700.0  # residual levels 1/w are computed from max(ln w, this): a residual after a prefix
# with w < e^-700 has probability < e^-700 of being needed


@dataclass
class ChainProjection:
    """Rank-1 split of every node of ``n`` chains of length ``L`` (float64 unless noted).

    Attributes:
        delta: ``[n, L]`` ``||mq_i - mp_i|| / s_i``.
        s_hat: ``[n, L]`` standardised projections ``S_i`` of the drafted nodes.
        e: ``[n, L, D]`` unit displacements, in the coupling work dtype.
        sigma: ``[n, L]`` kernel stds.
        log_r: ``[n, L]`` log likelihood ratios ``delta S - delta^2 / 2``.
    """

    delta: torch.Tensor
    s_hat: torch.Tensor
    e: torch.Tensor
    sigma: torch.Tensor
    log_r: torch.Tensor


@dataclass
class ChainVerdict:
    """Output of :func:`block_verify_chain`.

    Attributes:
        sample: ``[n, *event]`` the committed state, at depth ``steps`` of the chain.
        accepted: ``[n]`` long ``tau``, drafted nodes accepted (0..L).
        steps: ``[n]`` long ``min(tau + 1, L)``, steps committed.
        weights: ``[n, L + 1]`` float64 ``w_0..w_L`` (``P(tau >= j | X_{1:j})``).
    """

    sample: torch.Tensor
    accepted: torch.Tensor
    steps: torch.Tensor
    weights: torch.Tensor


def _sigma_rows(sigma, n: int, L: int, device) -> torch.Tensor:
    s = torch.as_tensor(sigma, dtype=torch.float64, device=device)
    if s.ndim == 0:
        s = s.expand(n, L)
    elif s.ndim == 1 and s.shape[0] == L:
        s = s[None].expand(n, L)
    if s.shape != (n, L):
        raise ValueError(f"sigma has shape {tuple(s.shape)}; expected a scalar, [{L}] or [{n}, {L}]")
    return s


def project_chain(children, mean_p, mean_q, sigma) -> ChainProjection:
    """Rank-1 split (eqs. 12--14) of every node of a chain.

    Args:
        children: ``[n, L, *event]`` drafted nodes ``X_1..X_L``.
        mean_p: ``[n, L, *event]`` draft means ``mp_i`` (given ``X_{i-1}``, ``X_0`` the root).
        mean_q: ``[n, L, *event]`` target means ``mq_i`` (given ``X_{i-1}``).
        sigma: scalar, ``[L]`` or ``[n, L]`` kernel stds ``s_i > 0``.

    Raises:
        ValueError: shapes do not match, ``L < 1``, or a bad ``sigma`` (:func:`specsamp.coupling.check_inputs`).
        NonFiniteError: non-finite nodes or means.
    """
    if children.ndim < 3 or children.shape[1] < 1:
        raise ValueError(f"children must be [n, L, *event] with L >= 1, got {tuple(children.shape)}")
    if mean_p.shape != children.shape or mean_q.shape != children.shape:
        raise ValueError(
            f"mean_p {tuple(mean_p.shape)} and mean_q {tuple(mean_q.shape)} must match children {tuple(children.shape)}"
        )
    n, L = children.shape[:2]
    sig = _sigma_rows(sigma, n, L, children.device)
    parts = [project(children[:, i : i + 1], mean_p[:, i], mean_q[:, i], sig[:, i]) for i in range(L)]
    delta = torch.stack([p.delta for p in parts], 1)
    s_hat = torch.stack([p.s_hat[:, 0] for p in parts], 1)
    return ChainProjection(
        delta=delta,
        s_hat=s_hat,
        e=torch.stack([p.e for p in parts], 1),
        sigma=sig,
        log_r=delta * s_hat - 0.5 * delta**2,
    )


def block_log_weights(log_r: torch.Tensor) -> torch.Tensor:
    """``ln w_0..ln w_L`` (``[n, L + 1]``) from ``ln r_1..ln r_L`` (``[n, L]``): ``w_i = min(1, w_{i-1} r_i)``."""
    out = [torch.zeros_like(log_r[:, 0])]
    for i in range(log_r.shape[1]):
        out.append(torch.clamp(out[-1] + log_r[:, i], max=0.0))
    return torch.stack(out, 1)


def residual_masses(log_w: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """``rho_{i+1} = int (w_i q_{i+1} - p_{i+1})_+`` for ``i = 0..L-1`` (``[n, L]``, float64).

    Args:
        log_w: ``[n, L + 1]`` from :func:`block_log_weights` (only ``w_0..w_{L-1}`` are used).
        delta: ``[n, L]``.
    """
    lw = log_w[:, :-1].clamp_min(LOG_W_FLOOR)
    return torch.exp(lw) * grs_remaining_mass(torch.exp(-lw), delta)


def stop_probabilities(log_w: torch.Tensor, rho: torch.Tensor) -> torch.Tensor:
    """``h_0..h_L`` (``[n, L + 1]``): ``h_i = rho_{i+1} / (rho_{i+1} + 1 - w_i)``, ``h_L = w_L``, ``h_0 = 1``.

    Where ``rho_{i+1} = 0`` (``delta_{i+1} = 0``) the stop has probability zero and ``h_i = 0``.
    """
    one_minus_w = -torch.expm1(log_w[:, :-1])
    den = rho + one_minus_w
    h = torch.where(rho > 0, rho / den.clamp_min(1e-300), torch.zeros_like(rho)).clamp(0.0, 1.0)
    h = torch.cat([h, torch.exp(log_w[:, -1:])], 1)
    h[:, 0] = 1.0
    return h


def chain_acceptance(log_r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Conditional tails ``P(tau >= j | X_{1:j})``, ``j = 1..L``, of both rules on drafted chains.

    Args:
        log_r: ``[n, L]`` log likelihood ratios of the drafted nodes.

    Returns:
        ``(block [n, L], node [n, L])``: ``w_j`` and ``prod_{i <= j} min(1, r_i)`` (float64). Their means
        over drafted chains are ``P(tau >= j)``; ``block >= node`` elementwise.
    """
    block = torch.exp(block_log_weights(log_r)[:, 1:])
    node = torch.exp(torch.cumsum(log_r.clamp(max=0.0), 1))
    return block, node


def block_verify_chain(children, mean_p, mean_q, sigma, generator=None) -> ChainVerdict:
    """Block verification of ``n`` drafted chains (exact; derivation in the module docstring).

    Contract (the chain analogue of :class:`specsamp.coupling.Coupling`): ``children [n, L, *event]``
    are drafted sequentially, ``X_i ~ N(mean_p[:, i-1], s_i^2 I)`` given ``X_{i-1}``; ``mean_q[:, i-1]`` is
    the target kernel's mean given ``X_{i-1}``. The result commits ``steps = min(tau + 1, L)`` states:
    ``X_1..X_tau`` and ``sample`` (``X_L`` if ``tau = L``, else a fresh residual draw at depth ``tau + 1``).
    Continued by target kernels, the committed path is distributed exactly as the target chain.

    Args:
        children, mean_p, mean_q, sigma: see :func:`project_chain`.
        generator: ``torch.Generator``, a per-row uniform source (``uniform(m) -> [n, m]``) or ``None``.

    Returns:
        :class:`ChainVerdict`.

    Raises:
        ValueError, NonFiniteError: see :func:`project_chain`.
    """
    proj = project_chain(children, mean_p, mean_q, sigma)
    n, L = proj.delta.shape
    rows = uniform_rows(generator, n, children.device)
    log_w = block_log_weights(proj.log_r)
    rho = residual_masses(log_w, proj.delta)
    h = stop_probabilities(log_w, rho)
    eta = rows.uniform(L + 1) <= h
    eta[:, 0] = True
    idx = torch.arange(L + 1, device=children.device)
    tau = torch.where(eta, idx, torch.full_like(idx, -1)).amax(1)
    steps = torch.clamp(tau + 1, max=L)
    flat = children.reshape(n, L, -1)
    out = flat[:, L - 1].clone()
    u_res = rows.uniform(1)[:, 0]
    rej = (tau < L).nonzero(as_tuple=True)[0]
    if rej.numel():
        i = tau[rej]  # the residual sits at node i + 1 (column i)
        d = proj.delta[rej, i]
        lw = log_w[rej, i].clamp_min(LOG_W_FLOOR)
        lam = torch.exp(-lw)
        g = grs_remaining_mass(lam, d)
        s_res = sample_grs_residual(d.clamp_min(1e-300), lam, g, u_res[rej])
        # delta = 0 or an empty residual: a stop there has probability zero; q = p is the natural fallback
        s_res = torch.where((d > 0) & (g > 0), s_res, torch.special.ndtri(u_res[rej]))
        # eq. 15: the drafted node at depth i + 1 with its projection replaced
        e = proj.e[rej, i]
        shift = (proj.sigma[rej, i] * (s_res - proj.s_hat[rej, i])).to(e.dtype)
        out[rej] = flat[rej, i].to(e.dtype).addcmul(shift[:, None], e).to(out.dtype)
    return ChainVerdict(out.reshape(n, *children.shape[2:]), tau, steps, torch.exp(log_w))


def node_verify_chain(children, mean_p, mean_q, sigma, generator=None) -> ChainVerdict:
    """Node-wise RMC (Algorithm 2) on the same chain contract as :func:`block_verify_chain`.

    Node ``i`` is verified only if ``1..i-1`` were accepted; the first rejection commits RMC's reflected
    residual. ``weights`` holds ``prod_{i <= j} min(1, r_i)`` (``j = 0..L``).
    """
    from specsamp.coupling import rmc

    proj = project_chain(children, mean_p, mean_q, sigma)
    n, L = proj.delta.shape
    rows = uniform_rows(generator, n, children.device)
    acc, samples = [], []
    for i in range(L):
        v = rmc(children[:, i : i + 1], mean_p[:, i], mean_q[:, i], proj.sigma[:, i], rows)
        acc.append(v.accepted)
        samples.append(v.sample)
    acc = torch.stack(acc, 1)
    tau = torch.where(acc.all(1), torch.full((n,), L, device=acc.device), (~acc).long().argmax(1))
    steps = torch.clamp(tau + 1, max=L)
    out = torch.stack(samples, 1)[torch.arange(n, device=acc.device), steps - 1]
    log_node = torch.cat([torch.zeros_like(proj.log_r[:, :1]), torch.cumsum(proj.log_r.clamp(max=0.0), 1)], 1)
    return ChainVerdict(out, tau, steps, torch.exp(log_node))


# ----------------------------------------------------------------------------------------------
# Chains drafted as the library's sampler drafts them.


@dataclass
class DraftedChain:
    """A chain drafted from ``m`` roots, with the target kernel means at its nodes (:func:`draft_chain`).

    Attributes:
        children: ``[m, L, *e]`` drafted nodes ``X_1..X_L``, in the roots' dtype.
        mean_p: ``[m, L, *e]`` draft means ``mp_i`` given ``X_{i-1}``.
        mean_q: ``[m, L, *e]`` target kernel means ``mq_i`` given ``X_{i-1}`` (eq. 36).
        sigma: ``[m, L]`` float64 kernel stds ``s_i`` (eq. 37).
    """

    children: torch.Tensor
    mean_p: torch.Tensor
    mean_q: torch.Tensor
    sigma: torch.Tensor


def _memoryless_draft(name: str):
    """The registered draft ``name``, refused when it reads the trajectory's history of exact data
    predictions (``Draft.history > 0``): the chains here draft from the root alone and keep no history.

    Raises:
        ConfigError: (a ``ValueError``) unknown name, or a draft that needs a history; the message
            lists the drafts that work here.
    """
    from specsamp.drafts import DRAFTS
    from specsamp.errors import ConfigError

    dr = get_draft(name)
    if dr.history:
        valid = sorted(n for n in DRAFTS.names() if not get_draft(n).history)
        raise ConfigError(
            f"draft={name!r} is invalid for block verification: it reads the trajectory's last "
            f"{dr.history} exact data predictions, which these chains do not keep; valid: {valid}."
        )
    return dr


def draft_chain(
    model,
    schedule: Schedule,
    x: torch.Tensor,
    v: torch.Tensor,
    n: torch.Tensor,
    L: int,
    *,
    draft: str = "x0",
    seed: int = 0,
    ids: torch.Tensor | None = None,
    max_batch: int | None = None,
    velocity=None,
) -> DraftedChain:
    """Draft a chain of ``L`` nodes from each of ``m`` roots and compute its target kernel means.

    The drafting is the library sampler's for a chain tree (Algorithm 1, ``K = 1``): the draft is frozen at
    the root (``Draft.freeze`` of a :class:`specsamp.drafts.DraftRoot` with the root's exact velocity), node
    ``i`` is ``mp_i + s_i Z_i`` with ``mp_i = Draft.mean`` at ``X_{i-1}`` and step ``n + i - 1``, ``s_i`` the
    kernel std (:meth:`specsamp.schedule.Schedule.std`), and ``Z_i`` the normal keyed by
    ``(seed, trajectory, root state index n, node i)`` on the ``draft`` stream (:mod:`specsamp.rng`), so a
    row's nodes are those :func:`specsamp.sampler.sample_speculative` drafts on ``DraftTree.chain(L)`` for that
    trajectory in a round rooted at ``x`` with the exact velocity ``v``. The target means use the root's
    velocity ``v`` and one batched target call on ``X_1..X_{L-1}`` (the leaf's velocity is not needed).

    Args:
        model: velocity model ``model(x [b, *e], sigma [b]) -> [b, *e]`` with ``event_shape``.
        schedule: time grid and kernel.
        x: ``[m, *e]`` root states.
        v: ``[m, *e]`` their exact target velocities.
        n: ``[m]`` long root state indices, ``n + L <= T - 1`` (``schedule.end_speculative``).
        L: chain length ``>= 1``.
        draft: registered draft that reads no history (``velocity``, ``drift``, ``x0``).
        seed: run seed (keys the draft noise).
        ids: ``[m]`` long trajectory ids (default ``0..m-1``).
        max_batch: rows per forward pass of the batched call.
        velocity: optional ``velocity(x [b, *e], n [b]) -> [b, *e]`` replacing the batched model call (the
            target's exact velocity at state index ``n``).

    Returns:
        :class:`DraftedChain`; pass ``children, mean_p, mean_q, sigma`` to :func:`block_verify_chain` or
        :func:`node_verify_chain`.

    Raises:
        ValueError: ``L < 1``, mismatched shapes, or a chain that would pass ``T - 1``.
        ConfigError: unknown draft, or one that reads a history (``x0_extrap``, ``x0_extrap_gated``, ``x0_affine``).
    """
    if L < 1:
        raise ValueError(f"need L >= 1, got L={L}")
    m = x.shape[0]
    if v.shape != x.shape or n.shape != (m,):
        raise ValueError(f"x {tuple(x.shape)}, v {tuple(v.shape)} and n {tuple(n.shape)} must be [m, *e], [m, *e], [m]")
    if m and int(n.max()) + L > schedule.end_speculative:
        raise ValueError(
            f"a chain of L={L} from state index {int(n.max())} passes the last speculative state "
            f"{schedule.end_speculative}; use L <= T - 1 - n"
        )
    dr = _memoryless_draft(draft)
    dev = x.device
    if ids is None:
        ids = torch.arange(m, device=dev)
    if velocity is None:
        sig = schedule.sigmas.to(dev)

        def velocity(y, k):
            return batched(model, y, sig[k], max_batch).to(y.dtype)

    e = x.shape[1:]
    keys = rng.base_key(seed, ids, "draft", device=dev)
    frozen = dr.freeze(DraftRoot(x, v, n, torch.ones_like(n, dtype=torch.bool)), schedule)
    nodes, mps = [x], []
    for i in range(L):
        step = n + i
        mp = dr.mean(frozen, nodes[-1][:, None], step, schedule)[:, 0]
        noise = rng.normal(rng.fold(keys, n, i + 1), e, dtype=x.dtype)
        nodes.append(mp + per_row(schedule.std(step).to(x.dtype), x) * noise)
        mps.append(mp)
    chain = torch.stack(nodes[1:], 1)  # [m, L, *e]
    vel = [v]
    if L > 1:
        inner = chain[:, : L - 1]
        steps = n[:, None] + torch.arange(1, L, device=dev)[None]
        vel += list(velocity(inner.reshape(-1, *e), steps.reshape(-1)).reshape(inner.shape).unbind(1))
    mq = torch.stack([schedule.mean(nodes[i], vel[i], n + i) for i in range(L)], 1)
    sigma = torch.stack([schedule.std(n + i) for i in range(L)], 1)
    return DraftedChain(chain, torch.stack(mps, 1), mq, sigma)


# ----------------------------------------------------------------------------------------------
# Tables.


def expected_lengths(tail: torch.Tensor) -> tuple[float, float, float, float]:
    """From conditional tails ``[N, L]`` (``P(tau >= j | X)``): ``(E tau, s.e., E min(tau+1, L), s.e.)``."""
    tau = tail.sum(1)
    steps = 1.0 + tail[:, :-1].sum(1)
    N = tail.shape[0]
    return (float(tau.mean()), float(tau.std() / math.sqrt(N)), float(steps.mean()), float(steps.std() / math.sqrt(N)))


def synthetic_rows(deltas=(0.25, 0.5, 1.0, 2.0), lengths=(4, 8, 14), n: int = 200_000, seed: int = 0) -> list[dict]:
    """Constant-``delta`` chains: ``ln r_i = delta Z_i - delta^2 / 2``, ``Z_i`` i.i.d. N(0, 1) (exact for any
    kernels whose displacement has constant length). Monte Carlo over ``n`` drafted chains, the same chains
    for both rules (Rao--Blackwellised: the conditional tails are averaged, not the accept draws).

    Returns:
        rows with ``delta, L, node_tau, block_tau`` (expected accepted nodes), their standard errors,
        ``node_steps, block_steps`` (expected committed steps per round), ``node_exact`` (closed form
        ``sum_j alpha^j``) and ``gain`` (block_steps / node_steps).
    """
    g = torch.Generator().manual_seed(seed)
    rows = []
    for L in lengths:
        z = torch.randn(n, L, generator=g, dtype=torch.float64)
        for d in deltas:
            block, node = chain_acceptance(d * z - 0.5 * d * d)
            bt, bse, bs, bsse = expected_lengths(block)
            nt, nse, ns, nsse = expected_lengths(node)
            alpha = 2.0 * float(torch.special.ndtr(torch.tensor(-d / 2.0, dtype=torch.float64)))
            rows.append(
                {
                    "source": "synthetic",
                    "delta": d,
                    "L": L,
                    "node_tau": nt,
                    "node_tau_se": nse,
                    "block_tau": bt,
                    "block_tau_se": bse,
                    "node_steps": ns,
                    "block_steps": bs,
                    "steps_se": max(nsse, bsse),
                    "node_exact": sum(alpha**j for j in range(1, L + 1)),
                    "gain": bs / ns,
                }
            )
    return rows


def gmm_chain_tails(model, schedule: Schedule, L: int, n_roots: int = 200, draft: str = "x0", seed: int = 0):
    """Conditional tails of both rules on chains drafted from exact roots of the target's own sampler.

    Roots: the states of :func:`specsamp.sampler.sample_standard`'s trajectories (the same keyed noise,
    seed ``seed``) at every speculative step ``n``; each drafts ``L_n = min(L, T - 1 - n)`` nodes with
    :func:`draft_chain` from its exact velocity. Returns
    ``{n: (block [n_roots, L_n], node [n_roots, L_n], delta [n_roots, L_n])}``.
    """
    dev = torch.device(getattr(model, "device", "cpu"))
    sig = schedule.sigmas.to(dev)

    def vel(x, n):
        return model(x, sig[n]).to(x.dtype)

    ids = torch.arange(n_roots, device=dev)
    _memoryless_draft(draft)  # a draft that reads a history is refused before any target call
    x = initial_noise(seed, ids, model.event_shape, model.dtype)
    keys = rng.base_key(seed, ids, "step", device=dev)
    out = {}
    for step in range(schedule.steps - 1):
        nn = torch.full((n_roots,), step, dtype=torch.long, device=dev)
        v = vel(x, nn)
        if schedule.first_speculative <= step < schedule.end_speculative:
            Ln = min(L, schedule.end_speculative - step)
            ch = draft_chain(model, schedule, x, v, nn, Ln, draft=draft, seed=seed, ids=ids, velocity=vel)
            proj = project_chain(ch.children, ch.mean_p, ch.mean_q, ch.sigma)
            block, node = chain_acceptance(proj.log_r)
            out[step] = (block, node, proj.delta)
        mean = schedule.mean(x, v, nn)
        x = mean + per_row(schedule.std(nn).to(x.dtype), x) * rng.normal(
            rng.fold(keys, step), model.event_shape, dtype=x.dtype
        )
    return out


def implied_nfe(schedule: Schedule, tails: dict, which: int) -> float:
    """Expected batched calls on steps ``1..T-2`` if every round roots at an exact state with an exact
    velocity and costs one call (plus the warm-up call): a dynamic programme over the root's step, with the
    committed-steps law of each root step taken from ``tails[n][which]`` (0: block, 1: node)."""
    end = schedule.end_speculative
    R = {end: 0.0}
    for n in range(end - 1, schedule.first_speculative - 1, -1):
        tail = tails[n][which].mean(0)  # P(tau >= j), j = 1..L_n
        Ln = tail.numel()
        ge = torch.cat([torch.ones(1, dtype=tail.dtype), tail])  # P(tau >= j), j = 0..L_n
        # steps s = j + 1 for tau = j < L_n; s = L_n for tau >= L_n - 1
        p_steps = [float(ge[s - 1] - ge[s]) for s in range(1, Ln)] + [float(ge[Ln - 1])]
        R[n] = 1.0 + sum(p * R[n + s] for s, p in enumerate(p_steps, start=1))
    return 1.0 + R[schedule.first_speculative]


def gmm_rows(
    lengths=(4, 8, 14, 28), n_roots: int = 200, n_samples: int = 0, seed: int = 0, dim: int = 500
) -> list[dict]:
    """Section 5.1 mixture (``GaussianMixture(dim)``, ``Schedule.make(30, 0.1)``, x0 draft): per chain length,
    the expected accepted nodes and committed steps per round of both rules on the same drafted chains
    (averaged over root steps, uniformly), the per-node ``delta`` range, and the implied speedup
    ``(T - 2) / implied_nfe``. With ``n_samples > 0`` also runs the library's sampler with node-wise
    verification on the same chain (:func:`specsamp.sampler.sample_speculative`, ``DraftTree.chain(L)``,
    ``coupling="rmc"``, the same draft and seed) and reports its measured mean speedup ``node_run_speedup``
    with its standard error (its rounds after a residual draft from a prefetched velocity, not the root's
    exact one, so it sits below ``node_implied_speedup``).
    """
    from specsamp.models import GaussianMixture

    model = GaussianMixture(dim=dim)
    sch = Schedule.make(30, 0.1)
    rows = []
    for L in lengths:
        tails = gmm_chain_tails(model, sch, L, n_roots, seed=seed)
        row = {"source": "gmm", "L": L}
        for name, k in (("block", 0), ("node", 1)):
            stats = [expected_lengths(t[k]) for t in tails.values()]
            row[f"{name}_tau"] = sum(s[0] for s in stats) / len(stats)
            row[f"{name}_steps"] = sum(s[2] for s in stats) / len(stats)
            row[f"{name}_implied_speedup"] = (sch.steps - 2) / implied_nfe(sch, tails, k)
        d = torch.cat([t[2].reshape(-1) for t in tails.values()])
        row["delta_median"] = float(d.median())
        row["delta_q90"] = float(d.quantile(0.9))
        if n_samples:
            run = sample_speculative(model, sch, DraftTree.chain(L), "rmc", n_samples, draft="x0", seed=seed)
            row["node_run_speedup"] = float(run.speedup.mean())
            row["node_run_se"] = float(run.speedup.std() / math.sqrt(n_samples))
        rows.append(row)
    return rows


def main(argv=None) -> None:
    """Print the synthetic and GMM tables as CSV (``python -m experiments.blockverify [--quick]``)."""
    import argparse
    import csv
    import sys

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small Monte Carlo sizes")
    ap.add_argument(
        "--n-samples", type=int, default=300, help="trajectories of the library sampler's node-wise run (0: none)"
    )
    ap.add_argument(
        "--out",
        default=None,
        help="also write both tables to this folder (blockverify_synthetic.csv, blockverify_gmm.csv), e.g. results/gmm",
    )
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    tables = {
        "synthetic": synthetic_rows(n=20_000 if a.quick else 200_000),
        "gmm": gmm_rows(n_roots=50 if a.quick else 200, n_samples=min(a.n_samples, 50) if a.quick else a.n_samples),
    }
    for name, rows in tables.items():
        w = csv.DictWriter(sys.stdout, fieldnames=list(rows[0].keys()))
        w.writeheader()
        for r in rows:
            w.writerow({k: (f"{v:.4f}" if isinstance(v, float) else v) for k, v in r.items()})
        if a.out:
            import pandas as pd

            from experiments.common import write_csv

            write_csv(pd.DataFrame(rows), Path(a.out) / f"blockverify_{name}.csv")


if __name__ == "__main__":
    main()
