"""Shared pieces of the benchmarks: timing, peak memory, the environment, tables, stand-in models."""

from __future__ import annotations

import math
import os
import platform
import resource
import statistics
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


def now(device) -> float:
    """Seconds (``time.perf_counter``) after the device's queued work is done (:func:`sync`)."""
    sync(device)
    return time.perf_counter()


def stats(values) -> dict:
    """``{median, min, max, n}`` of a list of numbers."""
    v = [float(x) for x in values]
    return {"median": statistics.median(v), "min": min(v), "max": max(v), "n": len(v)}


def fmt_stats(s: dict, scale: float = 1e3, unit: str = "ms") -> str:
    """``median [min-max] unit`` of a :func:`stats` dict, scaled (milliseconds by default)."""
    return f"{s['median'] * scale:.3g} [{s['min'] * scale:.3g}-{s['max'] * scale:.3g}] {unit}"


def peak_reset(device) -> None:
    """Restart the GPU's peak-memory counter (no-op on CPU)."""
    if torch.device(device).type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_mib(device) -> float | None:
    """Peak GPU memory allocated since :func:`peak_reset`, in MiB; None on CPU."""
    return torch.cuda.max_memory_allocated(device) / 2**20 if torch.device(device).type == "cuda" else None


class TimedModel:
    """A velocity model that records the rows and the time of every call, without synchronising.

    On CUDA a pair of CUDA events brackets each call (their elapsed times are read by :meth:`network_s`
    after the run); on the CPU the host clock does. ``rows``: rows of each call, in order.

    Args:
        model: the velocity model (``event_shape``, ``dtype``, ``device`` are passed through).
    """

    def __init__(self, model):
        self.model = model
        self.event_shape, self.dtype = model.event_shape, model.dtype
        self.device = torch.device(getattr(model, "device", "cpu"))
        self.label_dim = getattr(model, "label_dim", 0)
        self.reset()

    def reset(self) -> None:
        """Forget the recorded calls."""
        self.rows: list[int] = []
        self._events: list = []
        self._cpu_s = 0.0

    def __call__(self, x, sigma, **cond):
        self.rows.append(int(x.shape[0]))
        if self.device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            out = self.model(x, sigma, **cond)
            b.record()
            self._events.append((a, b))
            return out
        t0 = time.perf_counter()
        out = self.model(x, sigma, **cond)
        self._cpu_s += time.perf_counter() - t0
        return out

    def network_s(self) -> float:
        """Seconds spent inside the network's calls since :meth:`reset` (synchronises first)."""
        if self.device.type != "cuda":
            return self._cpu_s
        torch.cuda.synchronize(self.device)
        return sum(a.elapsed_time(b) for a, b in self._events) / 1e3


def environment(device) -> dict:
    """Device, versions and the numerics flags timings run under (GPU name and memory on CUDA)."""
    device = torch.device(device)
    env = {
        "device": str(device),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu_threads": torch.get_num_threads(),
        "cuda": torch.version.cuda,
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
        "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32,
        "matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["gpu_memory_gib"] = torch.cuda.get_device_properties(device).total_memory / 2**30
    return env


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
    out = subprocess.run(
        [sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=timeout, check=True
    )
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
        for k, _, f in columns:
            v = r.get(k, "")
            line.append(format(v, f) if v != "" and v is not None else "")
        cells.append(line)
    widths = [max([w] + [len(c[i]) for c in cells]) for i, w in enumerate(widths)]
    head = "  ".join(h.rjust(w) if i else h.ljust(w) for i, ((_, h, _), w) in enumerate(zip(columns, widths)))
    body = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(line, widths))) for line in cells]
    return "\n".join([head] + body)


def write_json(rows, path) -> None:
    """``rows`` as indented JSON at ``path`` where a path is given (a benchmark's ``--json``)."""
    if path:
        import json

        with open(path, "w") as f:
            json.dump(rows, f, indent=2)
