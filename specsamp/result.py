"""What a sampler returns: :class:`SampleResult`, the per-trajectory counts of section 5's protocol.

Owns the result's fields, the names of those with one row per trajectory, and how the results of several
batches of one run become one (:meth:`SampleResult.concat`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import torch


@dataclass
class SampleResult:
    """What a sampler returns, per trajectory.

    Attributes:
        samples: ``[M, *event]`` final states (sigma = 0).
        nfe: ``[M]`` batched target calls on the speculative steps ``1..T-2`` (warm-up included).
        nfe_total: ``[M]`` all batched target calls, the two endpoint steps included.
        target_rows: ``[M]`` network rows of the speculative calls: states evaluated, times the model's
            ``rows_per_state`` (2 under classifier-free guidance, :class:`specsamp.models.parametrisation.Guided`).
        rounds: ``[M]`` speculative rounds.
        committed: ``[M, R]`` steps committed by each round (0-padded).
        attempts: ``[M, L]`` verifications attempted at each depth.
        accepts: ``[M, L]`` verifications that accepted a child at each depth.
        speculative_steps: ``T - 2``.
        batch_nfe: batched calls the whole batch spent on speculative steps (its slowest member).
        attempts_by_root: ``[T, L]`` verifications attempted at each depth by rounds rooted at each state
            index ``n``, summed over trajectories (per-step calibration; None from the standard sampler).
        accepts_by_root: ``[T, L]`` accepted verifications, likewise.
    """

    samples: torch.Tensor
    nfe: torch.Tensor
    nfe_total: torch.Tensor
    target_rows: torch.Tensor
    rounds: torch.Tensor
    committed: torch.Tensor
    attempts: torch.Tensor
    accepts: torch.Tensor
    speculative_steps: int
    batch_nfe: int = 0
    extra: dict = field(default_factory=dict)
    attempts_by_root: torch.Tensor | None = None
    accepts_by_root: torch.Tensor | None = None

    PER_TRAJECTORY: ClassVar[tuple[str, ...]] = (
        "samples",
        "nfe",
        "nfe_total",
        "target_rows",
        "rounds",
        "committed",
        "attempts",
        "accepts",
    )
    """The tensor fields with one row per trajectory (leading dimension ``M``), in declaration order."""
    PER_ROOT: ClassVar[tuple[str, ...]] = ("attempts_by_root", "accepts_by_root")
    """The ``[T, L]`` fields summed over trajectories (None from the standard sampler)."""

    def ordinary(self) -> SampleResult:
        """This result with every tensor field an ordinary tensor: a copy of each one made under
        ``torch.inference_mode()`` (which the samplers run in), taken outside it, so that the caller may
        update it in place or use it with autograd; other tensors as they are."""

        def plain(t):
            return t.clone() if isinstance(t, torch.Tensor) and t.is_inference() else t

        names = (*self.PER_TRAJECTORY, *self.PER_ROOT)
        extra = {k: plain(v) for k, v in self.extra.items()}
        return dataclasses.replace(self, **{n: plain(getattr(self, n)) for n in names}, extra=extra)

    @property
    def speedup(self) -> torch.Tensor:
        """Per-trajectory NFE speedup ``(T - 2) / nfe`` (float64 ``[M]``)."""
        return self.speculative_steps / self.nfe.double()

    def speedup_charged(self, calls: float, over: int) -> float:
        """The expected speedup with a one-off cost charged: ``mean_i (T - 2) / (nfe_i + calls / over)``.

        The same estimator as the mean of :attr:`speedup` (the paper's expected speedup, a mean of
        per-trajectory ratios), with ``calls`` network calls paid once (e.g. the ``tree=optimal``
        calibration run's, on its speculative steps as ``nfe`` counts them) shared by ``over`` trajectories;
        ``calls = 0`` gives ``speedup.mean()`` exactly.

        Raises:
            ValueError: ``calls < 0`` or ``over < 1``.
        """
        if calls < 0 or over < 1:
            raise ValueError(f"calls={calls}, over={over}: need calls >= 0 and over >= 1")
        return float((self.speculative_steps / (self.nfe.double() + calls / over)).mean())

    @property
    def batch_speedup(self) -> float:
        """Speedup of the batch as a whole: ``(T - 2) / batch_nfe``."""
        return self.speculative_steps / max(self.batch_nfe, 1)

    @classmethod
    def concat(cls, parts: Sequence[SampleResult]) -> SampleResult:
        """The result of the trajectories of ``parts`` (batches of one run, in order) as one.

        The :attr:`PER_TRAJECTORY` fields are concatenated along rows (a 2-D field zero-padded to the widest
        part's columns, as ``committed`` is 0-padded); :attr:`PER_ROOT` fields are summed (None where any part
        has None); ``batch_nfe`` is the slowest part's. ``extra["batch_speedups"]`` lists every part's
        ``batch_speedup`` (a part that is itself a concatenation contributes its own list); other ``extra``
        keys are kept where every part holds the same plain value (an ``int``, ``float``, ``str`` or ``bool``).
        One part is returned as it is.

        Raises:
            ValueError: no parts, or parts of different ``speculative_steps``.
        """
        parts = list(parts)
        if not parts:
            raise ValueError("SampleResult.concat needs at least one part")
        if len(parts) == 1:
            return parts[0]
        steps = {p.speculative_steps for p in parts}
        if len(steps) != 1:
            raise ValueError(f"cannot concatenate results of different speculative_steps: {sorted(steps)}")

        def cat(name: str) -> torch.Tensor:
            ts = [getattr(p, name) for p in parts]
            if ts[0].ndim == 2:
                width = max(t.shape[1] for t in ts)
                ts = [
                    t if t.shape[1] == width else torch.cat([t, t.new_zeros(t.shape[0], width - t.shape[1])], 1)
                    for t in ts
                ]
            return torch.cat(ts)

        def total(name: str) -> torch.Tensor | None:
            ts = [getattr(p, name) for p in parts]
            return None if any(t is None for t in ts) else torch.stack(ts).sum(0)

        plain = (bool, int, float, str)
        extra = {
            k: v
            for k, v in parts[0].extra.items()
            if k != "batch_speedups"
            and isinstance(v, plain)
            and all(isinstance(p.extra.get(k), type(v)) and p.extra.get(k) == v for p in parts)
        }
        extra["batch_speedups"] = [b for p in parts for b in p.extra.get("batch_speedups", [p.batch_speedup])]
        return cls(
            **{n: cat(n) for n in cls.PER_TRAJECTORY},
            speculative_steps=parts[0].speculative_steps,
            batch_nfe=max(p.batch_nfe for p in parts),
            extra=extra,
            **{n: total(n) for n in cls.PER_ROOT},
        )
