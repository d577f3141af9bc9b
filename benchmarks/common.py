"""Shared pieces of the benchmarks: timing, peak memory, tables, stand-in models."""

from __future__ import annotations

import math
import os
import platform
import resource
import subprocess
import sys
import time
from collections.abc import Callable

import torch


def sync(device) -> None:
    """Wait for queued GPU work (no-op on CPU)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def best_of(fn: Callable[[int], object], repeats: int, device="cpu") -> tuple[float, object]:
    """Run ``fn(r)`` for ``r = 0..repeats-1``; return the shortest wall time (seconds) and the last result."""
    best, out = math.inf, None
    for r in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        out = fn(r)
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return best, out


def cpu_model() -> str:
    """The CPU's model name and the vector ISA torch dispatches to, e.g. ``"AMD EPYC (AVX512, 2 CPUs)"``.

    The model name comes from ``/proc/cpuinfo`` (Linux), else ``platform.processor()``, else the machine
    type; the ISA from ``torch.backends.cpu.get_cpu_capability()``. Timings and the last bits of batched
    products depend on both, so every timing table records them.
    """
    name = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith(("model name", "Model", "cpu model")):
                    name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    name = name or platform.processor() or platform.machine() or "unknown CPU"
    try:
        isa = torch.backends.cpu.get_cpu_capability()
    except (AttributeError, RuntimeError):
        isa = "unknown ISA"
    return f"{name} ({isa}, {os.cpu_count()} CPUs)"


def peak_rss_mib() -> float:
    """Peak resident set size of this process so far, in MiB (``getrusage``; Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def in_subprocess(module: str, *args: str, timeout: float = 600) -> str:
    """Run ``python -m module args`` in a fresh process (own peak memory); return its stdout."""
    out = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=timeout, check=True)
    return out.stdout


class LinearVelocity:
    """A cheap analytic target ``v(x, sigma) = -x`` of any event shape (for timing what surrounds the network).

    Args:
        event_shape: shape of one state.
        dtype: state dtype.
        device: torch device.
    """

    def __init__(self, event_shape, dtype=torch.float32, device="cpu"):
        self.event_shape, self.dtype, self.device = tuple(event_shape), dtype, torch.device(device)

    def __call__(self, x: torch.Tensor, sigma: torch.Tensor, **cond) -> torch.Tensor:
        return -x


def table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    """Fixed-width text table: ``columns`` are ``(key, header, format)``; missing keys print blank."""
    widths = [max(len(h), 10) for _, h, _ in columns]
    cells = []
    for r in rows:
        line = []
        for (k, _, f), w in zip(columns, widths):
            v = r.get(k, "")
            line.append(format(v, f) if v != "" and v is not None else "")
        cells.append(line)
    widths = [max([w] + [len(c[i]) for c in cells]) for i, w in enumerate(widths)]
    head = "  ".join(h.rjust(w) if i else h.ljust(w) for i, ((_, h, _), w) in enumerate(zip(columns, widths)))
    body = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(line, widths))) for line in cells]
    return "\n".join([head] + body)
