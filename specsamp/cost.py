"""What one network call costs as a function of its rows, measured on the run's device and dtype.

Speculation saves time only where the rows a round adds cost little beside the call itself: below a device's knee a
call of 15 rows costs about what a call of one does, past it each row adds its share. :class:`CallCost` is that curve,
seconds per call against rows, measured once per (model, device, dtype, state shape) by :func:`measure_call_cost`
(warm, interleaved across row counts, the median of a few repeats, within a bounded number of calls), or given by the
user (:func:`call_cost_from`). :class:`CostCache` keeps the curves, in the process and optionally in a JSON file, so a
second run on the same model reuses its curve.

The curve is a piecewise-linear interpolation of its points; beyond the largest row count measured it grows with the
last segment's slope (a device past its knee: a cost per row), never below the last point. Below the first point it
is the first point's cost.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import ConfigError

DEFAULT_ROWS = (1, 2, 4, 8, 16, 32, 64)
"""Row counts :func:`measure_call_cost` times by default (those a round's call takes, up to a 63-node tree)."""


@dataclass(frozen=True)
class CallCost:
    """Seconds per network call at ``rows[i]`` rows: ``seconds[i]``.

    Attributes:
        rows: strictly increasing row counts, each >= 1.
        seconds: the median seconds of one call at each, finite and >= 0.
        source: ``measured`` (:func:`measure_call_cost`) or ``given`` (:func:`call_cost_from`).
        device: the device it was measured on (``cpu``, ``cuda:0``); empty when given.
    """

    rows: tuple[int, ...]
    seconds: tuple[float, ...]
    source: str = "given"
    device: str = ""

    def __call__(self, rows: float) -> float:
        """Seconds of one call of ``rows`` rows (interpolated; see the module docstring)."""
        r, s = self.rows, self.seconds
        if rows <= r[0]:
            return s[0]
        for i in range(1, len(r)):
            if rows <= r[i]:
                t = (rows - r[i - 1]) / (r[i] - r[i - 1])
                return s[i - 1] + t * (s[i] - s[i - 1])
        slope = max((s[-1] - s[-2]) / (r[-1] - r[-2]), 0.0) if len(r) > 1 else 0.0
        return s[-1] + slope * (rows - r[-1])

    def knee(self, tolerance: float = 0.25) -> int:
        """The largest measured row count whose call costs at most ``1 + tolerance`` times a one-row call: below it,
        rows are nearly free."""
        base = self(1)
        return max((r for r, s in zip(self.rows, self.seconds) if s <= (1.0 + tolerance) * base), default=1)

    def as_dict(self) -> dict:
        """What a run's record holds: ``{"rows": [...], "ms": [...], "source", "device"}`` (milliseconds)."""
        return {
            "rows": list(self.rows),
            "ms": [round(1e3 * s, 6) for s in self.seconds],
            "source": self.source,
            "device": self.device,
        }


def call_cost_from(curve, name: str = "call_cost") -> CallCost:
    """A user's curve as a :class:`CallCost`: a mapping ``{rows: milliseconds}``, a sequence of ``(rows,
    milliseconds)`` pairs, a record's ``as_dict()``, or a :class:`CallCost` (returned as it is).

    Raises:
        ConfigError: naming ``name``, the value and what is valid: rows not integers >= 1 or repeated, a cost not
            finite and >= 0, no point at all.
    """
    if isinstance(curve, CallCost):
        return curve
    if isinstance(curve, Mapping) and "rows" in curve and "ms" in curve:
        pairs = list(zip(curve["rows"], curve["ms"]))
    elif isinstance(curve, Mapping):
        pairs = list(curve.items())
    elif isinstance(curve, Sequence) and not isinstance(curve, (str, bytes)):
        pairs = list(curve)
    else:
        pairs = None
    valid = "a mapping {rows: milliseconds per call} or (rows, milliseconds) pairs, rows integers >= 1, each once"
    shown = repr(curve) if len(repr(curve)) <= 120 else repr(curve)[:117] + "..."
    if not pairs or not all(isinstance(p, (tuple, list)) and len(p) == 2 for p in pairs):
        raise ConfigError(f"{name}={shown} is invalid: must be {valid}, at least one point.")
    for r, ms in pairs:
        if isinstance(r, bool) or not isinstance(r, int) or r < 1:
            raise ConfigError(f"{name}={shown} is invalid: rows={r!r} must be an integer >= 1 ({valid}).")
        if isinstance(ms, bool) or not isinstance(ms, (int, float)) or not math.isfinite(ms) or ms < 0:
            raise ConfigError(
                f"{name}={shown} is invalid: the cost {ms!r} at rows={r} must be a finite number of milliseconds >= 0."
            )
    pairs.sort()
    if len({r for r, _ in pairs}) != len(pairs):
        raise ConfigError(f"{name}={shown} is invalid: a row count appears twice ({valid}).")
    return CallCost(tuple(int(r) for r, _ in pairs), tuple(float(ms) / 1e3 for _, ms in pairs))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_call_cost(
    model,
    event_shape,
    *,
    dtype: torch.dtype = torch.float32,
    device="cpu",
    cond: dict | None = None,
    rows: Sequence[int] = DEFAULT_ROWS,
    max_rows: int | None = None,
    repeats: int = 3,
    max_calls: int = 64,
    max_call_seconds: float = 1.0,
    level: float = 0.5,
    clock: Callable[[], float] = time.perf_counter,
) -> CallCost:
    """Time ``model(x [r, *event_shape], sigma [r], **cond)`` at each row count ``r`` in ``rows``.

    Each row count is called once untimed (warm-up: kernels chosen, memory allocated), then ``repeats`` timed rounds
    run every row count in turn (interleaved, so that drift in the machine's speed falls on all alike); a point's cost
    is the median of its repeats. Growth stops at the first row count whose warm-up call takes more than
    ``max_call_seconds``, at ``max_rows`` (the memory estimate's bound: the caller's), or where the next row count's
    calls would pass ``max_calls`` in all.

    Args:
        model: a velocity model, ``model(x, sigma, **cond)`` on the linear path (:mod:`specsamp.models`).
        event_shape: one state's shape.
        dtype, device: the run's state dtype and device.
        cond: per-row conditioning tensors ``[b, ...]``: the calls take row 0 of each, repeated.
        rows: the row counts, increasing.
        max_rows: no call of more rows (None: no bound beyond ``rows``).
        repeats: timed calls per row count.
        max_calls: the most calls in all, warm-ups included.
        max_call_seconds: no larger row count once a call takes longer than this.
        level: the noise level of the states the calls see (their values do not change a dense network's time).
        clock: seconds, monotonic (tests pass a simulated one).

    Returns:
        the measured :class:`CallCost` (at least the first row count's point).

    Raises:
        ConfigError: ``rows`` not increasing integers >= 1, or ``repeats`` / ``max_calls`` < 1.
    """
    rows = [int(r) for r in rows]
    if not rows or rows[0] < 1 or any(b <= a for a, b in zip(rows, rows[1:])):
        raise ConfigError(f"rows={rows!r} is invalid: must be increasing integers >= 1.")
    if repeats < 1 or max_calls < 1:
        raise ConfigError(f"repeats={repeats!r}, max_calls={max_calls!r} are invalid: both must be >= 1.")
    device = torch.device(device)
    shape = tuple(event_shape)
    g = torch.Generator(device="cpu").manual_seed(0)
    kept: list[int] = []
    inputs: dict[int, tuple] = {}
    calls = 0
    with torch.no_grad():
        for r in rows:
            if (max_rows is not None and r > max_rows) or calls + 1 + repeats > max_calls:
                break
            x = torch.randn((r, *shape), generator=g, dtype=torch.float64).to(device=device, dtype=dtype)
            s = torch.full((r,), float(level), dtype=torch.float64, device=device)  # the sampler's levels are float64
            c = {k: v[:1].expand(r, *v.shape[1:]) for k, v in (cond or {}).items()}
            t0 = clock()
            model(x, s, **c)
            _sync(device)
            calls += 1 + repeats
            kept.append(r)
            inputs[r] = (x, s, c)
            if clock() - t0 > max_call_seconds:
                break
        times: dict[int, list[float]] = {r: [] for r in kept}
        for _ in range(repeats):
            for r in kept:
                x, s, c = inputs[r]
                _sync(device)
                t0 = clock()
                model(x, s, **c)
                _sync(device)
                times[r].append(clock() - t0)
    return CallCost(tuple(kept), tuple(float(statistics.median(times[r])) for r in kept), "measured", str(device))


def cost_key(model_key: str, device, dtype: torch.dtype, event_shape) -> str:
    """The cache key of a curve: the model's key, the device, the dtype and the state shape."""
    return f"{model_key}|{torch.device(device)}|{str(dtype).removeprefix('torch.')}|{'x'.join(map(str, event_shape))}"


class CostCache:
    """Curves by :func:`cost_key`, in the process and, with ``path``, in a JSON file read at construction and written
    on every :meth:`put` (atomically: a temporary file renamed over it), so a later run reuses them."""

    def __init__(self, path: str | os.PathLike | None = None):
        self.path = Path(path) if path is not None else None
        self.curves: dict[str, CallCost] = {}
        if self.path is not None and self.path.is_file():
            try:
                data = json.loads(self.path.read_text())
            except (OSError, ValueError):
                data = {}  # an unreadable cache is a cache miss, never an error: the curve is measured again
            for key, d in data.items() if isinstance(data, dict) else ():
                try:
                    c = call_cost_from(d)
                except ConfigError:
                    continue
                self.curves[key] = CallCost(c.rows, c.seconds, d.get("source", "measured"), d.get("device", ""))

    def get(self, key: str) -> CallCost | None:
        """The curve stored under ``key``, or None."""
        return self.curves.get(key)

    def put(self, key: str, curve: CallCost) -> None:
        """Store ``curve`` under ``key`` (and in the file, with ``path``)."""
        self.curves[key] = curve
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(
                f"{self.path.suffix}.{os.getpid()}.tmp"
            )  # one per process: no two write one file
            tmp.write_text(json.dumps({k: c.as_dict() for k, c in self.curves.items()}, indent=1, sort_keys=True))
            os.replace(tmp, self.path)

    def curve(self, key: str, measure: Callable[[], CallCost]) -> CallCost:
        """The curve under ``key``, measured by ``measure()`` and stored the first time."""
        found = self.get(key)
        if found is None:
            found = measure()
            self.put(key, found)
        return found
