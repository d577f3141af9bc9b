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
``delta`` is computed scale-free (:func:`specsamp.projection.project`), so any ``sigma`` from
:func:`specsamp.projection.min_sigma` up to that overflow is served exactly. On valid inputs inside
:func:`deferred_checks`, ``dgrs``, ``rmc`` and ``markmax`` ask the host for no value: every row is computed
with static shapes and chosen with ``torch.where`` (``markmax`` flags a row whose share its table cannot
certify, :func:`specsamp.listcoupling.static_plan`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

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
from .projection import (  # noqa: F401  (re-exported: the projection and its checks are public here too)
    BATCHED_ELEMENTS,
    DeferredChecks,
    NonFiniteError,
    Projection,
    active_checks,
    check_inputs,
    deferred_checks,
    min_sigma,
    project,
    reconstruct,
    work_dtype,
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
            raise TypeError(
                f"coupling {self.name!r} returned {type(verdict).__name__}; "
                "a coupling must return a specsamp.coupling.Verdict"
            )
        return verdict

    def choice(self, children, mean_p, mean_q, sigma, generator=None) -> Verdict:
        """``verify``'s ``accepted`` and ``index`` (same arguments, same numbers): ``decide`` where the rule has
        one (then ``sample`` is None), else ``verify`` itself."""
        if self.decide is None:
            return self(children, mean_p, mean_q, sigma, generator)
        verdict = self.decide(children, mean_p, mean_q, sigma, generator)
        if not isinstance(verdict, Verdict):
            raise TypeError(
                f"coupling {self.name!r}'s decide returned {type(verdict).__name__}; "
                "it must return a specsamp.coupling.Verdict"
            )
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


def check_verdict_contract(
    coupling: Coupling, verdict: Verdict, kids: torch.Tensor, describe: Callable[[int], str]
) -> None:
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
            where = (
                f"coupling {coupling.name!r} returned a sample holding NaN or inf at {describe(r)} (accepted="
                f"{bool(verdict.accepted.reshape(-1)[r])}, index={int(verdict.index.reshape(-1)[r])}, K={k})"
            )
            if not bool(torch.isfinite(kids[r]).all()):
                raise NonFiniteSampleError(
                    f"{where}: the children it was handed hold NaN or inf already, so the target's "
                    "velocity or the draft produced non-finite states there"
                )
            raise NonFiniteSampleError(
                f"{where}, from finite children: a verdict's sample must be a finite draw from N(mean_q, sigma^2 I), "
                "the accepted child itself or the residual (specsamp.coupling.Coupling); check the rule with "
                "specsamp.testing.check_exactness"
            )
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


def register_coupling(
    name: str, max_children: int | None = None, positional: Callable | None = None, decide: Callable | None = None
) -> Callable[[Callable[..., Verdict]], Coupling]:
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
        raise ConfigError(
            f"coupling={name!r} is invalid: it names a {type(found).__name__}, not a Coupling or a verify function."
        )
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
