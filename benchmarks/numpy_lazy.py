"""A plain numpy implementation of the lazy (``path``) protocol on the Gaussian mixture: the baseline.

One trajectory at a time, one parent node at a time, float64 numpy and scipy, no batching and no
counter-based streams (``numpy.random.Generator``). It implements the protocol of
:func:`specsamp.sampler.sample_speculative` with ``draft="velocity"``, ``prefetch="nearest"``,
``evaluate_leaves=True`` and ``warmup="call"`` on uniform trees and chains, D-GRS (Algorithm 3,
eqs. 17--19) and RMC (Algorithm 2), and counts batched calls the same way, so its mean speedup
agrees with ours in law (not bit for bit). It exists to time our implementation against; nothing
in the library uses it.
"""

from __future__ import annotations

import math

import numpy as np
from scipy.special import log_ndtr


class NumpyGMM:
    """Exact velocity of an equal-weight isotropic Gaussian mixture on the linear path (numpy copy).

    Args:
        means: ``[C, d]`` component means.
        stds: ``[C]`` component standard deviations.
    """

    def __init__(self, means: np.ndarray, stds: np.ndarray):
        self.means, self.stds = np.asarray(means, float), np.asarray(stds, float)
        self.msq = (self.means**2).sum(1)

    def __call__(self, x: np.ndarray, sigma: float) -> np.ndarray:
        alpha = 1.0 - sigma
        var = alpha**2 * self.stds**2 + sigma**2
        sq = x @ x - 2 * alpha * (self.means @ x) + alpha**2 * self.msq
        logp = -0.5 * x.size * np.log(2 * math.pi * var) - 0.5 * np.maximum(sq, 0) / var
        r = np.exp(logp - logp.max())
        r /= r.sum()
        gain = alpha * self.stds**2 / var
        x0 = (r * (1 - alpha * gain)) @ self.means + (r * gain).sum() * x
        return (x - x0) / sigma


def kernel(x, v, sig, n, eps, T):
    """Mean and std of step ``n`` (eqs. 36--37); deterministic Euler at the endpoints."""
    s0, s1 = sig[n], sig[n + 1]
    if 1 <= n <= T - 2:
        mean = x + (s1 - s0) * ((1 + eps**2) * v + eps**2 * x / (1 - s0))
        return mean, eps * math.sqrt(2 * s0 / (1 - s0) * (s0 - s1))
    return x + (s1 - s0) * v, 0.0


def _remaining(lam, delta):
    c = math.log(lam) / delta + delta / 2
    a = log_ndtr(delta - c)
    b = math.log(lam) + log_ndtr(-c)
    return min(max(math.exp(a) * -math.expm1(min(b - a, 0.0)), 0.0), 1.0)


def dgrs_scalar(s: np.ndarray, delta: float, rng) -> tuple[int, float]:
    """D-GRS on projections ``s [K]``: ``(index, residual projection)``; index K = residual."""
    K = len(s)
    if delta == 0:
        return 0, 0.0
    lam, g = 0.0, 1.0
    for j in range(K):
        rho = math.exp(min(delta * s[j] - delta**2 / 2, 700.0))
        if rng.random() <= min(1.0, max(rho - lam, 0.0) / max(g, 1e-300)):
            return j, 0.0
        lam += g
        g = _remaining(lam, delta)
    # residual (phi(s - delta) - lam phi(s))_+ / G on s >= c: invert the survival function by bisection
    c = math.log(lam) / delta + delta / 2
    target = math.log(rng.random()) + math.log(max(g, 1e-300))
    lo, hi = c, max(c, delta) + math.sqrt(-2 * target) + 2
    for _ in range(64):
        mid = 0.5 * (lo + hi)
        a = log_ndtr(delta - mid)
        b = math.log(lam) + log_ndtr(-mid)
        surv = a + math.log(-math.expm1(min(b - a, -1e-300)))
        lo, hi = (mid, hi) if surv > target else (lo, mid)
    return K, 0.5 * (lo + hi)


def rmc_scalar(s: np.ndarray, delta: float, rng) -> tuple[int, float]:
    """RMC on one projection: accept with ``min(1, phi(s - delta) / phi(s))``, else reflect about delta / 2."""
    if math.log(rng.random()) <= min(delta * s[0] - delta**2 / 2, 0.0):
        return 0, 0.0
    return 1, delta - s[0]


def trajectory(model, sig, T, eps, K, L, rule, rng, dim) -> int:
    """One trajectory of the lazy protocol; returns its batched calls on the speculative steps."""
    couple = dgrs_scalar if rule == "dgrs" else rmc_scalar
    x = rng.standard_normal(dim)
    x, _ = kernel(x, model(x, sig[0]), sig, 0, eps, T)
    n, end = 1, T - 1
    v_root, root_exact = model(x, sig[n]), True
    calls = 1  # warm-up call at the first root
    while n < end:
        lim = min(L, end - n)
        calls += 1  # the round's batch holds every node of T|_lim (never empty: lim >= 1)
        frozen = v_root
        x_cur, v_cur = x, (v_root if root_exact else model(x, sig[n]))
        steps, out, v_next, exact = 0, None, None, False
        for depth in range(1, lim + 1):
            m = n + depth - 1
            mean_p, sd = kernel(x_cur, frozen, sig, m, eps, T)
            mean_q, _ = kernel(x_cur, v_cur, sig, m, eps, T)
            kids = mean_p + sd * rng.standard_normal((K, dim))
            disp = (mean_q - mean_p) / sd
            delta = float(np.linalg.norm(disp))
            e = disp / delta if delta > 0 else disp
            s = (kids - mean_p) @ e / sd
            idx, s_res = couple(s, delta, rng)
            steps += 1
            if idx < K:
                x_cur = kids[idx]
                v_cur = model(x_cur, sig[m + 1])  # evaluated in the round's batch (every node is)
                continue
            out = kids[0] + sd * (s_res - s[0]) * e
            # nearest prefetch: the evaluated sibling closest to the committed state
            near = int(np.argmin(((kids - out) ** 2).sum(1)))
            v_next, exact = model(kids[near], sig[m + 1]), False
            break
        if out is None:  # walked to a leaf of T|_lim: its own velocity is exact
            out, v_next, exact = x_cur, v_cur, True
        x, n, v_root, root_exact = out, n + steps, v_next, exact
    return calls


def run_cell(model, T, eps, K, L, rule, trajectories, seed=0, dim=500) -> float:
    """Mean NFE speedup ``(T - 2) / calls`` of one grid cell (rule ``dgrs`` on uniform(K, L), ``rmc`` on chain(B))."""
    rng = np.random.default_rng(seed)
    if rule == "rmc":
        K, L = 1, sum(K**i for i in range(1, L + 1))
    sig = np.append(np.linspace(1.0, 1e-3, T), 0.0)
    calls = [trajectory(model, sig, T, eps, K, L, rule, rng, dim) for _ in range(trajectories)]
    return float(np.mean([(T - 2) / c for c in calls]))
