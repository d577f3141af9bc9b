"""What a round costs on this machine outside the network: :func:`measure_host_cost`, on a stand-in network that costs
nothing; and the machine's name (:func:`hardware`), which the costs ``auto`` keeps are filed under."""

from __future__ import annotations

import platform
import time

import torch

from .auto import HostCost
from .result import SampleResult
from .sampler import sample_speculative, sample_standard
from .schedule import Schedule
from .trees import DraftTree


def hardware(device) -> str:
    """What a call's cost depends on beyond the model: the GPU's name, or the CPU's model and torch's thread count."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    return f"{cpu}, {torch.get_num_threads()} thread(s)"


class Stub:
    """A velocity model that costs nothing: zero velocity. A run on it is all host work, the round's own."""

    def __init__(self, event_shape, dtype, device):
        self.event_shape, self.dtype, self.device = tuple(event_shape), dtype, device

    def __call__(self, x, sigma, **cond):
        return torch.zeros_like(x)


def measure_host_cost(
    schedule: Schedule, event_shape, dtype, device, M: int = 1, *, draft="velocity", depths=(4, 32), repeats: int = 2
) -> HostCost:
    """A round's own seconds outside the network on this machine, measured on a model that costs nothing
    (:class:`Stub`): the plain loop's seconds a step, and a chain round's at two depths, fitted as
    ``fixed + per_row * depth`` (the fastest of ``repeats`` runs each, after one warm-up; ``M`` trajectories)."""
    stub = Stub(event_shape, dtype, device)
    horizon = schedule.end_speculative - schedule.first_speculative
    T = schedule.steps

    def best(fn) -> tuple[float, SampleResult]:
        fn()
        times, res = [], None
        for _ in range(repeats):
            t0 = time.perf_counter()
            res = fn()
            times.append(time.perf_counter() - t0)
        return min(times), res

    loop_s, _ = best(lambda: sample_standard(stub, schedule, M))
    points = []
    for d in sorted({max(1, min(d, horizon)) for d in depths}):
        tree = DraftTree.chain(d)
        s, r = best(lambda tree=tree: sample_speculative(stub, schedule, tree, "rmc", M, draft=draft, execution="tree"))
        rounds = max(int(r.batch_nfe), 1)
        points.append((d, max(s - 2 * loop_s / T, 0.0) / rounds))  # the two endpoint steps are a loop's
    if len(points) == 1:
        return HostCost(points[0][1], 0.0, loop_s / T)
    (d1, h1), (d2, h2) = points[0], points[-1]
    per_row = max((h2 - h1) / (d2 - d1), 0.0)
    return HostCost(max(h1 - per_row * d1, 0.0), per_row, loop_s / T)


class Timed:
    """``model`` with the seconds spent inside its calls counted (the pilot's split of its time: network and host)."""

    def __init__(self, model):
        self._model, self.seconds = model, 0.0
        self._cuda = torch.device(getattr(model, "device", "cpu")).type == "cuda"

    def __getattr__(self, name):
        return getattr(self._model, name)

    def __call__(self, *args, **kwargs):
        if self._cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = self._model(*args, **kwargs)
        if self._cuda:
            torch.cuda.synchronize()
        self.seconds += time.perf_counter() - t0
        return out
