"""Typed config fields: a dataclass field with the rule its value must meet (``text`` says what is valid, for the
error message; ``ok`` checks it), shared by the run's schema (:mod:`specsamp.runner.config`) and the kernel's
(:mod:`specsamp.runner.kernelconfig`)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import field
from typing import Any

from omegaconf import MISSING


def rule(
    text: str,
    ok: Callable[[Any], bool],
    default: Any = MISSING,
    factory: Callable | None = None,
    nullable: bool | None = None,
) -> Any:
    """A dataclass field whose value must satisfy ``ok`` (``text`` says what is valid, for the error).

    ``nullable``: null is valid without ``ok`` (default: where the default is null); a field that is not
    nullable checks null like any other value."""
    meta = {"text": text, "ok": ok, "nullable": default is None if nullable is None else nullable}
    return field(default_factory=factory, metadata=meta) if factory else field(default=default, metadata=meta)


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def at_least(lo: int, default: Any = MISSING, optional: bool = False) -> Any:
    """A dataclass field holding an integer ``>= lo`` (:func:`rule`); ``optional``: or null, which its text says."""
    return rule(
        f"an integer >= {lo}" + (" or null" if optional else ""),
        lambda v: _int(v) and v >= lo,
        default,
        nullable=optional,
    )


def between(lo: int, hi: int, default: Any = MISSING, optional: bool = False, why: str = "") -> Any:
    """A dataclass field holding an integer in ``lo..hi`` (:func:`rule`); ``why`` says where the upper bound comes from."""
    return rule(
        f"an integer >= {lo}" + (" or null" if optional else "") + f", at most {hi}" + (f" ({why})" if why else ""),
        lambda v: _int(v) and lo <= v <= hi,
        default,
        nullable=optional,
    )


def one_of(valid: Sequence | Callable[[], Sequence], default: Any = MISSING) -> Any:
    """A dataclass field holding one of ``valid`` (a sequence, or a callable giving one: a registry's names)."""
    pool = valid if callable(valid) else (lambda: valid)
    return field(
        default=default,
        metadata={
            "text": lambda: "one of " + ", ".join(map(str, pool())),
            "ok": lambda v: v in pool(),
            "nullable": False,
        },
    )


def _number(text: str, ok: Callable[[float], bool], default: float) -> Any:
    """A dataclass field holding a finite number that satisfies ``ok`` (:func:`rule`)."""
    return rule(
        text,
        lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and ok(v),
        default,
        nullable=False,
    )
