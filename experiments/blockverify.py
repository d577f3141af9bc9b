r"""Block verification of a drafted chain of Gaussian kernels: exact, and never shorter than node-wise.

Source: the idea is block verification for language models (Sun et al., 2024, "Block verification
accelerates speculative decoding"; cited by the paper as Soen et al., 2026). This module carries it
to the continuous chains of Algorithm 1 with ``K = 1`` (the chains RMC verifies, Algorithm 2).

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
(Keeping it keeps the committed state next to an evaluated node, whose velocity the next round drafts from.)

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
:func:`chain_acceptance` (conditional tails of both rules), :func:`sample_block_chain` (a standalone exact
speculative sampler on chains, block or node-wise), :func:`synthetic_rows` and :func:`gmm_rows` (tables;
``python -m experiments.blockverify`` prints them as CSV).
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
from specsamp.schedule import Schedule, per_row

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
        raise ValueError(f"mean_p {tuple(mean_p.shape)} and mean_q {tuple(mean_q.shape)} must match children {tuple(children.shape)}")
    n, L = children.shape[:2]
    sig = _sigma_rows(sigma, n, L, children.device)
    parts = [project(children[:, i : i + 1], mean_p[:, i], mean_q[:, i], sig[:, i]) for i in range(L)]
    delta = torch.stack([p.delta for p in parts], 1)
    s_hat = torch.stack([p.s_hat[:, 0] for p in parts], 1)
    return ChainProjection(
        delta=delta, s_hat=s_hat, e=torch.stack([p.e for p in parts], 1), sigma=sig,
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
# A standalone exact speculative sampler on chains (Algorithm 1 with K = 1), block or node-wise.


@dataclass
class ChainRun:
    """Result of :func:`sample_block_chain`.

    Attributes:
        samples: ``[M, *event]`` final states.
        nfe: ``[M]`` batched target calls on steps ``1..T-2`` (the warm-up call included).
        rounds: ``[M]`` rounds.
        accepted: ``[M]`` drafted nodes accepted, summed over rounds.
        speculative_steps: ``T - 2``.
    """

    samples: torch.Tensor
    nfe: torch.Tensor
    rounds: torch.Tensor
    accepted: torch.Tensor
    speculative_steps: int

    @property
    def speedup(self) -> torch.Tensor:
        """``(T - 2) / nfe`` per trajectory (float64 ``[M]``)."""
        return self.speculative_steps / self.nfe.double()


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
        raise ConfigError(f"draft={name!r} is invalid for block verification: it reads the trajectory's last "
                          f"{dr.history} exact data predictions, which these chains do not keep; valid: {valid}.")
    return dr


def sample_block_chain(model, schedule: Schedule, L: int, n_samples: int, *, rule: str = "block", draft: str = "x0",
                       anchor: str = "root", seed: int = 0, max_batch: int | None = None) -> ChainRun:
    """Speculative sampling on a chain of ``L`` drafted states with block or node-wise verification.

    Protocol as :func:`specsamp.sampler.sample_speculative` with a chain tree, ``evaluate_leaves=True``,
    ``prefetch="nearest"``, ``warmup="call"``: deterministic first and last steps; one charged warm-up call
    at the first root; each round drafts ``L_n = min(L, T - 1 - n)`` nodes from the root's (prefetched)
    velocity with ``draft``, evaluates the root (if its velocity is not exact) and every drafted node in one
    batched call, verifies, and commits. The next root drafts from the leaf's exact velocity when every node
    was accepted, else from the velocity of the drafted node at the committed depth; ``anchor`` says where
    the draft freezes it (``draft.freeze(state, velocity)``): at the root (``root``, as the library's sampler
    does) or at the node the velocity was evaluated at (``node``); either is exact (it is fixed before the
    round's draws). Randomness is keyed by
    ``(seed, trajectory, round root, purpose)`` (:mod:`specsamp.rng`), independent of the batch.

    Args:
        model: velocity model ``model(x [b, *e], sigma [b]) -> [b, *e]``.
        schedule: time grid and kernel.
        L: chain length ``>= 1``.
        n_samples: trajectories.
        rule: ``block`` (:func:`block_verify_chain`) or ``node`` (:func:`node_verify_chain`, RMC).
        anchor: ``node`` or ``root``.
        draft: registered draft name.
        seed: run seed.
        max_batch: rows per forward pass.

    Raises:
        ValueError: ``L < 1``, ``n_samples < 1``, an unknown ``rule`` or ``anchor``; ConfigError: unknown draft,
            or one that reads a history (``x0_extrap``, ``x0_extrap_gated``, ``x0_affine``).
    """
    from specsamp.sampler import initial_noise

    if L < 1 or n_samples < 1:
        raise ValueError(f"need L >= 1 and n_samples >= 1, got L={L}, n_samples={n_samples}")
    verify = {"block": block_verify_chain, "node": node_verify_chain}.get(rule)
    if verify is None:
        raise ValueError(f"rule={rule!r} is invalid; valid: ['block', 'node']")
    if anchor not in ("node", "root"):
        raise ValueError(f"anchor={anchor!r} is invalid; valid: ['node', 'root']")
    dr = _memoryless_draft(draft)
    dev = torch.device(getattr(model, "device", "cpu"))
    sig = schedule.sigmas.to(dev)
    vel = lambda x, n: batched(model, x, sig[n], max_batch).to(x.dtype)
    ids = torch.arange(n_samples, device=dev)
    M, end = n_samples, schedule.end_speculative
    x = initial_noise(seed, ids, model.event_shape, model.dtype)
    n = torch.zeros(M, dtype=torch.long, device=dev)
    x = schedule.mean(x, vel(x, n), n)
    n = n + 1
    v_root = vel(x, n)  # the warm-up call
    x_anchor = x.clone()  # the state v_root was evaluated at
    exact = torch.ones(M, dtype=torch.bool, device=dev)
    nfe = torch.ones(M, dtype=torch.long, device=dev)
    rounds = torch.zeros_like(nfe)
    accepted = torch.zeros_like(nfe)
    draft_keys = rng.base_key(seed, ids, "draft", device=dev)
    verify_keys = rng.base_key(seed, ids, "verify", device=dev)
    e = model.event_shape
    while True:
        live = (n < end).nonzero(as_tuple=True)[0]
        if live.numel() == 0:
            break
        depth = (end - n[live]).clamp(max=L)
        for Ln in torch.unique(depth).tolist():
            r = live[depth == Ln]
            xr, nr = x[r], n[r]
            frozen = dr.freeze(DraftRoot(x_anchor[r] if anchor == "node" else xr, v_root[r], nr, torch.ones_like(nr, dtype=torch.bool)), schedule)
            nodes, mps = [xr], []
            for i in range(Ln):
                step = nr + i
                mp = dr.mean(frozen, nodes[-1][:, None], step, schedule)[:, 0]
                keys = rng.fold(draft_keys[r], nr, i + 1)
                noise = rng.normal(keys, e, dtype=xr.dtype)
                nodes.append(mp + per_row(schedule.std(step).to(xr.dtype), xr) * noise)
                mps.append(mp)
            # one batched call: every drafted node, plus the root where its velocity is not exact
            chain = torch.stack(nodes[1:], 1)  # [m, Ln, *e]
            steps_idx = (nr[:, None] + torch.arange(1, Ln + 1, device=dev)[None]).clamp(max=schedule.steps - 1)
            v_nodes = vel(chain.reshape(-1, *e), steps_idx.reshape(-1)).reshape(chain.shape)
            need = ~exact[r]
            vr = v_root[r].clone()
            if bool(need.any()):
                vr[need] = vel(xr[need], nr[need])
            vall = torch.cat([vr[:, None], v_nodes], 1)
            allx = torch.cat([xr[:, None], chain], 1)
            mq = torch.stack([schedule.mean(allx[:, i], vall[:, i], nr + i) for i in range(Ln)], 1)
            sigma = torch.stack([schedule.std(nr + i) for i in range(Ln)], 1)
            verdict = verify(chain, torch.stack(mps, 1), mq, sigma, rng.KeyedRows(rng.fold(verify_keys[r], nr)))
            full = verdict.accepted == Ln
            rows = torch.arange(r.numel(), device=dev)
            x[r] = verdict.sample
            n[r] = nr + verdict.steps
            v_root[r] = v_nodes[rows, verdict.steps - 1]  # the leaf's (exact) or the drafted node's at that depth
            x_anchor[r] = chain[rows, verdict.steps - 1]
            exact[r] = full
            nfe[r] += 1
            rounds[r] += 1
            accepted[r] += verdict.accepted
    last = torch.full((M,), schedule.steps - 1, dtype=torch.long, device=dev)
    v_last = v_root.clone()
    if bool((~exact).any()):
        w = (~exact).nonzero(as_tuple=True)[0]
        v_last[w] = vel(x[w], last[w])
    return ChainRun(schedule.mean(x, v_last, last), nfe, rounds, accepted, schedule.steps - 2)


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
            rows.append({"source": "synthetic", "delta": d, "L": L, "node_tau": nt, "node_tau_se": nse, "block_tau": bt, "block_tau_se": bse,
                             "node_steps": ns, "block_steps": bs, "steps_se": max(nsse, bsse),
                             "node_exact": sum(alpha**j for j in range(1, L + 1)), "gain": bs / ns})
    return rows


def gmm_chain_tails(model, schedule: Schedule, L: int, n_roots: int = 200, draft: str = "x0", seed: int = 0):
    """Conditional tails of both rules on chains drafted from exact roots of the target's own sampler.

    Roots: the states of :func:`specsamp.sampler.sample_standard`-like trajectories (keyed noise, seed
    ``seed``) at every speculative step ``n``; each drafts ``L_n = min(L, T - 1 - n)`` nodes with ``draft``
    from its exact velocity. Returns ``{n: (block [n_roots, L_n], node [n_roots, L_n], delta [n_roots, L_n])}``.
    """
    from specsamp.sampler import initial_noise

    dev = torch.device(getattr(model, "device", "cpu"))
    sig = schedule.sigmas.to(dev)
    vel = lambda x, n: model(x, sig[n]).to(x.dtype)
    ids = torch.arange(n_roots, device=dev)
    dr = _memoryless_draft(draft)
    x = initial_noise(seed, ids, model.event_shape, model.dtype)
    keys = rng.base_key(seed, ids, "step", device=dev)
    dkeys = rng.base_key(seed, ids, "draft", device=dev)
    out = {}
    e = model.event_shape
    for step in range(schedule.steps - 1):
        nn = torch.full((n_roots,), step, dtype=torch.long, device=dev)
        v = vel(x, nn)
        if schedule.first_speculative <= step < schedule.end_speculative:
            Ln = min(L, schedule.end_speculative - step)
            frozen = dr.freeze(DraftRoot(x, v, nn, torch.ones_like(nn, dtype=torch.bool)), schedule)
            cur, vcur, log_r, deltas = x, v, [], []
            for i in range(Ln):
                si = nn + i
                mp = dr.mean(frozen, cur[:, None], si, schedule)[:, 0]
                mq = schedule.mean(cur, vcur, si)
                s = float(schedule.std(si[:1]))
                child = mp + s * rng.normal(rng.fold(dkeys, step, i + 1), e, dtype=x.dtype)
                pr = project(child[:, None], mp, mq, torch.full((n_roots,), s, dtype=torch.float64))
                log_r.append(pr.delta * pr.s_hat[:, 0] - 0.5 * pr.delta**2)
                deltas.append(pr.delta)
                cur = child
                if i + 1 < Ln:
                    vcur = vel(cur, si + 1)
            block, node = chain_acceptance(torch.stack(log_r, 1))
            out[step] = (block, node, torch.stack(deltas, 1))
        mean = schedule.mean(x, v, nn)
        x = mean + per_row(schedule.std(nn).to(x.dtype), x) * rng.normal(rng.fold(keys, step), e, dtype=x.dtype)
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


def gmm_rows(lengths=(4, 8, 14, 28), n_roots: int = 200, n_samples: int = 0, seed: int = 0, dim: int = 500) -> list[dict]:
    """Section 5.1 mixture (``GaussianMixture(dim)``, ``Schedule.make(30, 0.1)``, x0 draft): per chain length,
    the expected accepted nodes and committed steps per round of both rules on the same drafted chains
    (averaged over root steps, uniformly), the per-node ``delta`` range, and the implied speedup
    ``(T - 2) / implied_nfe``. With ``n_samples > 0`` also runs :func:`sample_block_chain` for both rules and
    reports the measured mean speedup (prefetched, not exact, root velocities after a residual).
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
            for name in ("block", "node"):
                run = sample_block_chain(model, sch, L, n_samples, rule=name, seed=seed)
                row[f"{name}_run_speedup"] = float(run.speedup.mean())
                row[f"{name}_run_se"] = float(run.speedup.std() / math.sqrt(n_samples))
        rows.append(row)
    return rows


def main(argv=None) -> None:
    """Print the synthetic and GMM tables as CSV (``python -m experiments.blockverify [--quick]``)."""
    import argparse
    import csv
    import sys

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small Monte Carlo sizes")
    ap.add_argument("--n-samples", type=int, default=300, help="trajectories per rule for the sampler runs (0: none)")
    ap.add_argument("--out", default=None, help="also write both tables to this folder (blockverify_synthetic.csv, "
                                                  "blockverify_gmm.csv), e.g. results/gmm")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    tables = {"synthetic": synthetic_rows(n=20_000 if a.quick else 200_000),
              "gmm": gmm_rows(n_roots=50 if a.quick else 200, n_samples=min(a.n_samples, 50) if a.quick else a.n_samples)}
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
