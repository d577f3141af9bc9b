"""Memory: what this process may still allocate, and the sampler's own sizes, refused before they are allocated.

The core's half of the memory checks, shared by every entry point (``run.py``'s runner, :mod:`specsamp.arguments`
for the Python entry points): :func:`available_bytes` (CUDA: free device memory; CPU: the smallest of
``MemAvailable``, the cgroup's headroom and ``RLIMIT_AS``), :func:`check_memory`, the nominal budget's cap
(:func:`capped_budget`) and the sampler's bytes per trajectory (:func:`sampler_bytes`). The run's own sizes
(checkpoints, process, SLURM's ``--mem``) are :mod:`specsamp.runner.memory`'s.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from .errors import ConfigError


def _meminfo_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return None


def _cgroup_available() -> int | None:
    try:  # cgroup v2 (a SLURM job's or a container's memory limit)
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit == "max":
            return None
        return int(limit) - int(Path("/sys/fs/cgroup/memory.current").read_text().strip())
    except (OSError, ValueError):
        return None


def _address_space_available() -> int | None:
    import resource

    try:
        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
        if soft == resource.RLIM_INFINITY:
            return None
        with open("/proc/self/status") as f:
            vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
        return soft - vm
    except (OSError, ValueError, StopIteration, AttributeError):
        return None


def available_bytes(device: str) -> int | None:
    """Memory this process can still allocate on ``device``, in bytes; None when unknown.

    CUDA: ``torch.cuda.mem_get_info``'s free bytes. CPU: the smallest of the kernel's ``MemAvailable``,
    the cgroup's headroom (``memory.max - memory.current``) and the address-space limit
    (``RLIMIT_AS`` less the current virtual size).
    """
    try:
        if str(device).startswith("cuda"):
            return int(torch.cuda.mem_get_info(torch.device(device))[0])
    except (ValueError, RuntimeError, AssertionError):
        return None
    known = [b for b in (_meminfo_available(), _cgroup_available(), _address_space_available()) if b is not None]
    return max(min(known), 0) if known else None


def check_memory(what: str, nbytes: float, device: str, hint: str = "") -> None:
    """Refuse, before allocating, something whose size follows from the config and cannot fit.

    Args:
        what: the allocation and the keys that size it, e.g. ``"the draft tree of K=7, L=100"``.
        nbytes: estimated peak bytes.
        device: where it lives (``cpu``, ``cuda[:N]``).
        hint: what the user can change, appended to the message.

    Raises:
        ConfigError: ``nbytes`` above 80% of :func:`available_bytes` (the message gives both numbers).
    """
    free = available_bytes(device)
    if free is None or nbytes <= 0.8 * free:
        return
    raise ConfigError(
        f"{what} needs about {gib(nbytes)} of memory, but {device} has {gib(free)} available"
        + (f": {hint}" if hint else ".")
    )


def gib(nbytes: float) -> str:
    if nbytes < 2**30:
        return f"{nbytes / 2**20:.3g} MiB"
    return f"{nbytes / 2**30:.3g} GiB" if nbytes < 2**60 else f"{nbytes / 2**30:.2e} GiB"


TREE_BYTES_PER_NODE = 160  # DraftTree's arrays, their construction and the sampler's tensor copies (int64)


MAX_BUDGET = 2**63 - 1  # the nominal budget B is recorded as a 64-bit integer (and printed in the result line)


def capped_budget(K: int, L: int, cap: int = MAX_BUDGET) -> int:
    """``min(K + K^2 + ... + K^L, cap + 1)``, in at most 64 multiplications for ``K >= 2`` whatever ``L``
    (:func:`specsamp.trees.budget` computes ``K^(L+1)``, which never ends for ``L`` near ``2**63``)."""
    if K == 1:
        return min(L, cap + 1)
    total, layer = 0, 1
    for _ in range(L):
        layer *= K
        total += layer
        if total > cap:
            return cap + 1
    return total


def sampler_bytes(
    nodes: int | None,
    widest: int,
    depth: int,
    numel: int,
    elem: int,
    *,
    execution: str = "tree",
    n_total: int,
    steps: int | None = None,
    refine: int = 0,
) -> tuple[int, int]:
    """``(fixed, per trajectory of a batch)`` bytes of the sampler's states (:func:`check_tree_memory`'s estimate).

    Args:
        nodes: nodes of one round's tree; None for the standard sampler.
        widest: the most children of a node; depth: the tree's depth.
        numel: elements of one state; elem: bytes of one element of the model's dtype.
        execution: ``tree`` or ``path``; n_total: samples kept; steps: ``T`` (per-step counters).
        refine: Picard sweeps per round (``refine > 0`` adds three states per node).
    """
    if nodes is None:
        per_traj = 8 * numel * max(elem, 8)
    elif execution == "tree":
        per_traj = nodes * numel * (2 * elem + 8 + (3 * elem if refine else 0)) + 4 * numel * max(elem, 8)
    else:
        per_traj = (2 * widest + 16) * numel * max(elem, 8)
    fixed = n_total * (2 * numel * elem + 8 + 8 * 3 * ((steps or 0) + 2 * depth))  # samples, ids, counters
    return int(fixed), int(per_traj)
