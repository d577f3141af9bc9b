"""What a round costs on this machine outside the network: :func:`measure_host_cost`, on a stand-in network that costs
nothing; and the machine's name (:func:`hardware`), which the costs ``auto`` keeps are filed under."""

from __future__ import annotations

import platform
import time

import torch

from .auto import HostCost
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


class _Enough(Exception):
    """Raised by :func:`_event_seconds`'s callback once it has timed enough events: the run stops there."""


def _event_seconds(run, events: int) -> float:
    """The median seconds between consecutive callbacks of ``run(callback)`` (a step of the loop, a round), over at
    most ``events`` of them, the run stopped after that: the per-run set-up before the first is left out."""
    stamps: list[float] = []

    def callback(info) -> None:
        stamps.append(time.perf_counter())
        if len(stamps) > events:
            raise _Enough

    try:
        run(callback)
    except _Enough:
        pass
    gaps = sorted(b - a for a, b in zip(stamps, stamps[1:]))
    return gaps[len(gaps) // 2] if gaps else 0.0


def measure_host_cost(
    schedule: Schedule,
    event_shape,
    dtype,
    device,
    M: int = 1,
    *,
    coupling: str = "rmc",
    draft="velocity",
    budgets=(4, 30),
    events: int = 12,
) -> HostCost:
    """A round's own seconds outside the network on this machine, measured on a model that costs nothing
    (:class:`Stub`), for ``M`` trajectories: the plain loop's seconds a step, and ``coupling``'s round on two trees
    (chains of ``budgets`` drafted states for a one-child coupling, else the uniform binary trees of about that
    many), fitted as ``fixed + per_row * drafted states``. Each is the median time between consecutive rounds (steps)
    over ``events`` of them, after a warm-up run; the run stops there, so a run of any length costs the same.

    Returns:
        :class:`specsamp.auto.HostCost`, in seconds.
    """
    stub = Stub(event_shape, dtype, device)
    horizon = schedule.end_speculative - schedule.first_speculative

    def loop(callback):
        return sample_standard(stub, schedule, M, callback=callback)

    _event_seconds(loop, 2)  # warm-up
    loop_step = _event_seconds(loop, events)
    points = []
    for b in sorted(set(budgets)):
        if coupling == "rmc":
            tree = DraftTree.chain(max(1, min(b, horizon)))
        else:  # a binary tree of about b drafted states: 2 + 4 + ... + 2^L
            tree = DraftTree.uniform(2, max(1, min((b + 2).bit_length() - 2, horizon)))
        rows = len(tree) - 1

        def spec(callback, tree=tree):
            return sample_speculative(
                stub, schedule, tree, coupling, M, draft=draft, execution="tree", callback=callback
            )

        _event_seconds(spec, 2)
        points.append((rows, _event_seconds(spec, events)))
    points = sorted(dict(points).items())  # one point per tree size (a short grid cuts both trees alike)
    if len(points) == 1:
        return HostCost(points[0][1], 0.0, loop_step)
    (d1, h1), (d2, h2) = points[0], points[-1]
    per_row = max((h2 - h1) / (d2 - d1), 0.0)
    return HostCost(max(h1 - per_row * d1, 0.0), per_row, loop_step)


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
