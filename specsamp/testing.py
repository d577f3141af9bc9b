"""Statistical test of a coupling's exactness: the test every registered rule passes.

:func:`check_exactness` draws verification problems with a known answer and checks the coupling's
contract (:class:`specsamp.coupling.Coupling`): for each displacement ``delta``, width ``K`` and
dtype, ``n`` parents in ``dim`` coordinates with ``sigma = 0.37``, a random ``mean_p``, ``mean_q =
mean_p + sigma delta e`` for a random unit ``e``, and ``K`` children from ``N(mean_p, sigma^2 I)``.
The output must be finite, of the children's dtype and shape; an accepted output must *be* the
chosen child, and a rejected row's index must be ``K``; and the output's law must be
``N(mean_q, sigma^2 I)``, tested on the rank-1 split of section 3.1 (eq. 13) by :func:`law_pvalues`.

Power: with the defaults (3000 parents, 8 coordinates), a coupling that shifts the output's
projection by 0.1 sigma, or scales it by 10%, fails. Runtime: a few seconds per rule on a CPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .coupling import Coupling, get_coupling


def law_pvalues(sample: torch.Tensor, mean_q: torch.Tensor, sigma, e: torch.Tensor, seed: int = 0) -> dict[str, float]:
    """KS p-values that ``sample [n, *event]`` is distributed as ``N(mean_q, sigma^2 I)``.

    Three one-sample KS tests on ``z = (sample - mean_q) / sigma``: its projection on the unit
    displacement ``e`` against N(0, 1) (``parallel``: the output projection against N(delta, 1));
    its projection on a fixed random unit vector orthogonal to ``e`` (seeded by ``seed``) against
    N(0, 1) (``orthogonal``); and the squared norm of its part orthogonal to ``e`` against
    chi^2(d - 1) (``orth_norm``). ``sigma`` is a scalar or ``[n]``; ``e`` has the event's size.
    """
    from scipy import stats  # costs ~1 s at import: only here

    sig = torch.as_tensor(sigma, dtype=torch.float64).reshape(-1, *([1] * (sample.ndim - 1)))
    z = ((sample.double() - mean_q.double()) / sig).reshape(sample.shape[0], -1)
    e = e.double().reshape(-1)
    d = z.shape[1]
    w = torch.randn(d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    w = w - (w @ e) * e
    w = w / w.norm()
    par = z @ e
    orth = z - par[:, None] * e[None]
    return {
        "parallel": stats.kstest(par.numpy(), "norm").pvalue,
        "orthogonal": stats.kstest((orth @ w).numpy(), "norm").pvalue,
        "orth_norm": stats.kstest((orth**2).sum(1).numpy(), stats.chi2(d - 1).cdf).pvalue,
    }


@dataclass
class ExactnessCase:
    """One ``(delta, K, dtype)`` case: its p-values (:func:`law_pvalues`) and contract violations."""

    delta: float
    K: int
    dtype: torch.dtype
    pvalues: dict[str, float]
    errors: list[str]


@dataclass
class ExactnessReport:
    """Result of :func:`check_exactness`.

    Attributes:
        coupling: the rule's name.
        alpha: smallest p-value that passes.
        cases: every case run.
    """

    coupling: str
    alpha: float
    cases: list[ExactnessCase]

    def failures(self) -> list[str]:
        """One line per failed case (empty when :attr:`ok`)."""
        out = []
        for c in self.cases:
            low = {k: p for k, p in c.pvalues.items() if not p > self.alpha}
            if low or c.errors:
                out.append(
                    f"delta={c.delta:g} K={c.K} {str(c.dtype).replace('torch.', '')}: "
                    + "; ".join(c.errors + [f"{k} p={p:.3g}" for k, p in low.items()])
                )
        return out

    @property
    def ok(self) -> bool:
        """Every case kept the contract and every p-value exceeds ``alpha``."""
        return not self.failures()

    def raise_if_failed(self) -> None:
        """Raises ``AssertionError`` naming every failed case."""
        bad = self.failures()
        if bad:
            raise AssertionError(
                f"coupling {self.coupling!r} failed {len(bad)} of {len(self.cases)} cases "
                f"(alpha={self.alpha:g}):\n" + "\n".join(bad)
            )


def make_problem(delta: float, K: int, dtype: torch.dtype, n: int = 3000, dim: int = 8, seed: int = 1234):
    """A verification problem with a known answer (module docstring), drawn from ``seed`` alone.

    Returns:
        ``(children [n, K, dim], mean_p [n, dim], mean_q [n, dim], sigma, e [dim], generator)``: states
        in ``dtype``, ``sigma = 0.37``, the unit displacement ``e`` (float64) and the
        ``torch.Generator`` after the draws (pass it to the coupling).
    """
    g = torch.Generator().manual_seed(seed)
    sigma = 0.37
    mean_p = torch.randn(n, dim, generator=g, dtype=torch.float64)
    e = torch.randn(dim, generator=g, dtype=torch.float64)
    e = e / e.norm()
    mean_q = mean_p + sigma * delta * e
    children = mean_p[:, None] + sigma * torch.randn(n, K, dim, generator=g, dtype=torch.float64)
    return children.to(dtype), mean_p.to(dtype), mean_q.to(dtype), sigma, e, g


def _case(coupling: Coupling, delta: float, K: int, dtype: torch.dtype, n: int, dim: int, seed: int) -> ExactnessCase:
    children, mean_p, mean_q, sigma, e, g = make_problem(delta, K, dtype, n, dim, seed)
    v = coupling(children, mean_p, mean_q, sigma, g)
    errors = []
    if v.sample.dtype != dtype or v.sample.shape != (n, dim):
        errors.append(f"sample is {v.sample.dtype} {tuple(v.sample.shape)}, expected {dtype} {(n, dim)}")
    elif not bool(torch.isfinite(v.sample).all()):
        errors.append("non-finite samples")
    else:
        acc = v.accepted
        if not torch.equal(v.sample[acc], children[acc, v.index[acc]]):
            errors.append("an accepted sample is not the child its index names")
        if not bool(torch.all(v.index[~acc] == K)):
            errors.append("a rejected row's index is not K")
    pvalues = {} if errors else law_pvalues(v.sample, mean_q, sigma, e)
    return ExactnessCase(float(delta), K, dtype, pvalues, errors)


def check_exactness(
    coupling: str | Coupling,
    *,
    deltas: Sequence[float] = (0.0, 1e-9, 0.1, 1.0, 3.0, 10.0, 50.0, 300.0),
    Ks: Sequence[int] = (1, 2, 7, 32),
    dtypes: Sequence[torch.dtype] = (torch.float32, torch.float64),
    dim: int = 8,
    n: int = 3000,
    seed: int = 1234,
    alpha: float = 1e-4,
) -> ExactnessReport:
    """Test that ``coupling``'s output law is the target kernel's, case by case (module docstring).

    Each ``(delta, K, dtype)`` case draws its problem from ``seed`` alone (the coupling's uniforms
    continue that ``torch.Generator``), so a run is deterministic. ``K`` above the rule's
    ``max_children`` are skipped. With the defaults (3 p-values x 8 deltas x 4 K x 2 dtypes), a
    false alarm of an exact rule has probability about 1 - (1 - alpha)^192, 2% at ``alpha = 1e-4``.

    Args:
        coupling: registered name or :class:`specsamp.coupling.Coupling` (or a bare ``verify``).
        deltas: displacements ``||mean_q - mean_p|| / sigma`` (>= 0).
        Ks: children per parent.
        dtypes: state dtypes.
        dim: coordinates per state (>= 2).
        n: parents per case.
        seed: seed of every case's generator.
        alpha: smallest p-value that passes.

    Returns:
        :class:`ExactnessReport`; call ``.raise_if_failed()`` in a test.

    Raises:
        ValueError: no ``K`` is admitted by ``max_children``, or ``dim < 2``; whatever the coupling raises.
    """
    c = get_coupling(coupling)
    ks = [k for k in Ks if c.max_children is None or k <= c.max_children]
    if not ks or dim < 2:
        raise ValueError(f"nothing to test: Ks={list(Ks)} with max_children={c.max_children}, dim={dim} (need >= 2)")
    cases = [_case(c, d, k, t, n, dim, seed) for d in deltas for k in ks for t in dtypes]
    return ExactnessReport(c.name, alpha, cases)
