"""Memory checks: every size that follows from the config is refused before it is allocated.

:func:`available_bytes` is what this process may still allocate (CUDA: free device memory; CPU: the
smallest of ``MemAvailable``, the cgroup's headroom and ``RLIMIT_AS``). The draft tree is sized from the
config before it is built (:func:`check_tree_nodes`), the sampler's states before the model is called
(:func:`check_tree_memory`). A refusal is a :class:`~specsamp.errors.ConfigError` naming the keys to change.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..arguments import uniform_nodes
from ..errors import ConfigError
from ..memory import (  # public here too, as the runner has always named them
    MAX_BUDGET,
    TREE_BYTES_PER_NODE,
    available_bytes,
    capped_budget,
    check_memory,
    gib as _gib,
    sampler_bytes,
)
from ..trees import DraftTree

STEP_BYTES = 8 * 64  # per step: the schedule's float64 arrays and the per-root tables of a run (generous)


def check_config_sizes(run) -> None:
    """Refuse, before anything is allocated, what ``steps`` and the model's own keys size alone (the schedule,
    the per-step tables; the GMM's means). Per-trajectory sizes are checked once the model's state shape is
    known (:func:`check_tree_memory`).

    Raises:
        ConfigError: names the key, the bytes needed and available.
    """
    check_memory(
        f"steps={run.steps} (the schedule and the per-step tables)", run.steps * STEP_BYTES, "cpu", "lower steps."
    )
    size = run.model.size_from_config() if hasattr(run.model, "size_from_config") else None
    if size is not None:
        check_memory(size[0], size[1], run.device, "lower them.")


def check_nominal_budget(run) -> None:
    """Refuse a ``(K, L)`` whose nominal budget ``B = K + ... + K^L`` is above :data:`MAX_BUDGET`, before it is
    computed: naming the largest ``L`` that fits with this ``K``.

    Raises:
        ConfigError: names K, L and the largest L that fits.
    """
    if capped_budget(run.K, run.L) <= MAX_BUDGET:
        return
    fits = 0
    while capped_budget(run.K, fits + 1) <= MAX_BUDGET:
        fits += 1
    lower = f"L={fits} or less fits with K={run.K} (or lower K)" if fits else "lower K"
    raise ConfigError(
        f"K={run.K}, L={run.L} is invalid: the nominal budget B = K + K^2 + ... + K^L it records is above "
        f"2**63 - 1 (a 64-bit integer); a round uses at most T-2 = {run.steps - 2} levels anyway: {lower}."
    )


def tree_nodes(run, coupling, horizon: int) -> int:
    """Nodes of the tree :func:`specsamp.runner.build.build_tree` would build, without building it
    (0: no tree, or a tree rule other than ``uniform`` and ``widths``: a search sizes its own, and the
    runner sizes any tree once it is built)."""
    if coupling is None or (run.tree not in ("uniform", "widths") and coupling.max_children != 1):
        return 0
    if coupling.max_children == 1 or run.tree == "uniform":
        return uniform_nodes(run.K, run.L, horizon, chain=coupling.max_children == 1)
    nodes, layer = 1, 1
    for w in run.widths[:horizon]:
        layer *= w
        nodes += layer
    return nodes


def check_tree_nodes(run, coupling, horizon: int) -> None:
    """Refuse a draft tree (:func:`tree_nodes`) whose arrays cannot fit in host memory, before building it.

    Raises:
        ConfigError: names the shape, the node count, the bytes needed and available.
    """
    nodes = tree_nodes(run, coupling, horizon)
    shape = f"widths={run.widths}" if run.tree == "widths" else f"K={run.K}, L={run.L}"
    check_memory(
        f"the draft tree ({shape}: {nodes:.3g} nodes within the T-2={horizon} speculative steps)",
        nodes * TREE_BYTES_PER_NODE,
        "cpu",
        "lower K or L (or widths).",
    )
    if coupling is not None and (run.tree == "uniform" or coupling.max_children == 1):
        check_nominal_budget(run)  # the rule records B = K + ... + K^L (RMC: its chain's length)


PROCESS_BYTES = (
    800 * 2**20
)  # Python, torch, Hydra and the runner imported, one run done: 0.67 GiB peak RSS measured (GMM or digits cell)
CUDA_HOST_BYTES = (
    2 * 2**30
)  # host memory of a CUDA context and the libraries it maps (cuBLAS, cuDNN): an allowance, not measured
WEIGHT_LOAD_FACTOR = (
    2  # a checkpoint is read whole and then unpickled (or converted to net_dtype): two copies at the peak
)
UNKNOWN_NETWORK_BYTES = (
    3 * 2**30
)  # activations of a network none of the tables below knows (its architecture is in the pickle)
MEM_MARGIN = 1.5  # the estimate is of the large arrays; the margin covers temporaries and the allocator


@dataclass(frozen=True)
class NetworkSize:
    """What a checkpoint costs on the host, without loading it.

    Attributes:
        weight_bytes: the checkpoint's weights in bytes (used when its file is not on this machine).
        event_shape: the state shape of the network (``(C, H, W)``).
        row_bytes: host memory per row of one forward pass on the CPU (activations and temporaries).
    """

    weight_bytes: int
    event_shape: tuple
    row_bytes: int


# EDM checkpoints by name. digits and patches32 ship with the package: row_bytes measured as the peak RSS
# increase of one forward pass of 256 and 1024 rows on the CPU (digits 104 and 93 KiB per row, patches32 956
# and 857 KiB). CIFAR-10 and FFHQ are not on this machine: weights are their parameter counts (56 M and 62 M,
# float32; the file itself counts when it is in the cache), row_bytes derived from the DDPM++ architecture
# (256 channels at 32x32, 128 at 64x64; the encoder's skip activations plus 14 times the widest feature map,
# the ratio measured on patches32).
EDM_NETWORKS = {
    "edm-digits-8x8-cond": NetworkSize(441_889, (1, 8, 8), 112 * 2**10),
    "edm-patches-32x32-uncond": NetworkSize(5_568_900, (3, 32, 32), 1 * 2**20),
    "edm-cifar10-32x32-cond-vp": NetworkSize(56_000_000 * 4, (3, 32, 32), 24 * 2**20),
    "edm-ffhq-64x64-uncond-vp": NetworkSize(62_000_000 * 4, (3, 64, 64), 48 * 2**20),
}

# Stable Diffusion 3 by diffusers id: parameters of the transformer, the text encoders (CLIP-L, CLIP-G,
# T5-XXL) and the VAE, from the model cards; weights are those counts times net_dtype's bytes. row_bytes
# (a transformer row on the CPU: 1,024 image and 256 text tokens, attention included) is an allowance.
SD3_PARAMS = {  # (transformer, CLIP-L + CLIP-G + VAE, T5-XXL)
    "stabilityai/stable-diffusion-3.5-medium": (2.47e9, 0.90e9, 4.76e9),
    "stabilityai/stable-diffusion-3-medium-diffusers": (2.03e9, 0.90e9, 4.76e9),
    "stabilityai/stable-diffusion-3.5-large": (8.1e9, 0.90e9, 4.76e9),
}
SD3_ROW_BYTES = 256 * 2**20


def _file_size(path) -> int | None:
    try:
        p = Path(str(path)).expanduser()
        return p.stat().st_size if p.is_file() else None
    except OSError:
        return None


def network_size(model) -> tuple[int, tuple | None, int]:
    """``(weight bytes, event shape or None, row bytes)`` of a checkpoint model's config, nothing loaded: the
    weights from the checkpoint file where it is on this machine (``model.path``, the shipped file, the cache),
    else from :data:`EDM_NETWORKS` / :data:`SD3_PARAMS`; a checkpoint neither knows gets
    :data:`UNKNOWN_NETWORK_BYTES` as its row bytes (charged once, not per row) and no event shape."""
    if hasattr(model, "model_id"):  # SD3Config
        mid = str(model.model_id)
        local = Path(mid).expanduser()
        files = sum(f.stat().st_size for f in local.rglob("*.safetensors")) if local.is_dir() else 0
        t, other, t5 = SD3_PARAMS.get(mid, SD3_PARAMS["stabilityai/stable-diffusion-3.5-large"])
        net_bytes = (
            2 if str(getattr(model, "net_dtype", "bfloat16")).removeprefix("torch.") in ("float16", "bfloat16") else 4
        )
        weights = files or int((t + other + (0 if getattr(model, "drop_t5", False) else t5)) * net_bytes)
        res = getattr(model, "resolution", 512)
        h, w = (res, res) if isinstance(res, int) else tuple(res)
        return weights, (16, int(h) // 8, int(w) // 8), SD3_ROW_BYTES
    from ..hub import default_cache_dir
    from ..models.edm import CHECKPOINTS

    name = str(getattr(model, "name", ""))
    known = EDM_NETWORKS.get(name) if not getattr(model, "path", None) else None
    size = _file_size(model.path) if getattr(model, "path", None) else None
    if size is None:
        url = getattr(model, "url", None) or (CHECKPOINTS[name].url if name in CHECKPOINTS else None)
        if url and str(url).startswith("file://"):
            from urllib.parse import urlparse
            from urllib.request import url2pathname

            size = _file_size(url2pathname(urlparse(str(url)).path))
        elif url:
            root = Path(model.cache_dir).expanduser() if getattr(model, "cache_dir", None) else default_cache_dir()
            size = _file_size(root / "edm" / Path(str(url)).name)
    if known is None:
        return size or 0, None, UNKNOWN_NETWORK_BYTES
    return size or known.weight_bytes, known.event_shape, known.row_bytes


def config_event_shape(model) -> tuple | None:
    """The shape of one state as the model's config gives it before anything loads (the GMM's ``dim``, a known
    checkpoint's; :func:`network_size`), or None."""
    dim = getattr(model, "dim", None)
    if isinstance(dim, int) and not isinstance(dim, bool) and dim > 0:
        return (dim,)
    if hasattr(model, "model_id") or hasattr(model, "trust_checkpoint"):
        return network_size(model)[1]
    return None


def rows_per_state(model) -> int:
    """Network rows one state costs, from the model's config (``rows_per_state()``: 2 under classifier-free
    guidance, whose conditional and unconditional rows are one call; 1 otherwise)."""
    f = getattr(model, "rows_per_state", None)
    return max(int(f()), 1) if callable(f) else 1


def run_memory_bytes(run) -> int:
    """Host memory, in bytes, one run of ``run`` (a :class:`~specsamp.runner.config.RunConfig`) needs by the
    estimates the runner refuses sizes with, from its config alone (nothing is built).

    The sum of :data:`PROCESS_BYTES` (a torch process, measured); the schedule and per-step tables and the
    model's config-sized arrays (:func:`check_config_sizes`); the draft tree
    (:func:`tree_nodes`); for a checkpoint model (EDM, SD3), :data:`WEIGHT_LOAD_FACTOR` times its weights
    (:func:`network_size`: the file's bytes, or its parameters); on a CUDA device, :data:`CUDA_HOST_BYTES`
    and the kept samples; on the CPU, the sampler's states of one batch plus the kept samples
    (:func:`sampler_bytes`, where the state shape is known: ``model.dim`` of the GMM, the checkpoint's) and
    the network's activations for the rows of its largest call (the batch's trajectories times the nodes of
    a round in tree execution, times ``K`` in path execution; at most ``max_batch``), times the rows one state
    costs (:func:`rows_per_state`: 2 under classifier-free guidance).
    Used by the SLURM launcher for ``mem_gb`` when its config leaves it unset (:func:`mem_gb_for`).
    The estimate reads only the coupling's ``max_children``: ``sampler.coupling`` is instantiated here as
    :func:`specsamp.runner.build.build_coupling` instantiates it, without its refusals (the task refuses).
    """
    from hydra.utils import instantiate

    total = PROCESS_BYTES + run.steps * STEP_BYTES
    size = run.model.size_from_config() if hasattr(run.model, "size_from_config") else None
    total += size[1] if size is not None else 0
    coupling = instantiate(run.sampler.coupling) if run.sampler.coupling is not None else None
    horizon = max(run.steps - 2, 1)
    nodes = tree_nodes(run, coupling, horizon)
    if coupling is not None and nodes == 0:  # a searched tree: its budget of drafted states, plus the root
        nodes = (run.budget or capped_budget(run.K, run.L)) + 1
    total += nodes * TREE_BYTES_PER_NODE
    on_cpu = not str(run.device).startswith("cuda")
    dtype = run.model.torch_dtype() if hasattr(run.model, "torch_dtype") else None
    elem = torch.tensor([], dtype=dtype or torch.float32).element_size()
    dim = getattr(run.model, "dim", None)
    shape, row_bytes = ((dim,), 0) if isinstance(dim, int) and dim > 0 else (None, 0)
    if shape is None and (hasattr(run.model, "model_id") or hasattr(run.model, "trust_checkpoint")):
        weights, shape, row_bytes = network_size(run.model)
        total += WEIGHT_LOAD_FACTOR * weights
        if shape is None:  # an unknown network: its activations as one allowance
            total += row_bytes
            row_bytes = 0
    elif shape is None:
        total += UNKNOWN_NETWORK_BYTES
    if not on_cpu:
        total += CUDA_HOST_BYTES
    if shape is not None:
        numel = int(np.prod(shape))
        depth = min(run.L, horizon) if coupling is not None else 0
        fixed, per_traj = sampler_bytes(
            nodes if coupling is not None else None,
            max(run.K, 1),
            depth,
            numel,
            elem,
            execution=run.execution,
            n_total=run.n_samples,
            steps=run.steps,
            refine=run.refine,
        )
        total += fixed  # the kept samples come back to the host
        if on_cpu:
            batch = min(run.batch_size or run.n_samples, run.n_samples)
            per_call = (
                nodes
                if coupling is not None and run.execution == "tree"
                else max(run.K, 1)
                if coupling is not None
                else 1
            )
            rows = batch * per_call
            max_batch = run.max_batch or getattr(run.model, "max_batch", None)
            # max_batch counts states; under guidance each state is two network rows
            total += batch * per_traj + min(rows, max_batch or rows) * rows_per_state(run.model) * row_bytes
    return int(total)


def mem_gb_for(run) -> int:
    """``mem_gb`` (whole GiB, SLURM's ``--mem=NG``; at least 1) of a SLURM task running ``run``: :func:`run_memory_bytes` times
    :data:`MEM_MARGIN`, rounded up (2 for a GMM or digits cell)."""
    return max(1, int(np.ceil(MEM_MARGIN * run_memory_bytes(run) / 2**30)))


def check_tree_memory(
    tree: DraftTree | None,
    batch: int,
    model,
    device: str,
    *,
    execution: str = "tree",
    n_total: int | None = None,
    steps: int | None = None,
    refine: int = 0,
    sampler: str | None = None,
) -> None:
    """Refuse a run whose sampler states cannot fit, before allocating anything.

    ``sampler`` is the run's ``sampler=`` value (``dgrs``, ``rmc``, ...), which the message names; without it
    the message says "the speculative sampler" (``tree`` given) or ``sampler=standard``.

    ``execution=tree`` holds, per trajectory of a batch and per node, the state and the velocity in
    the model's dtype plus float64 drafting noise; ``execution=path`` holds about ``2 K + 16`` states
    per trajectory (the walk's current, children, means, noise); the standard sampler about 8; Picard sweeps
    (``refine > 0``) add three per node (the innovations, a sweep's velocities, the last sweep's). Every run
    also keeps all ``n_total`` samples (twice while batches are concatenated) and per-step counters.

    Raises:
        ConfigError: the estimate exceeds 80% of the available memory; the message gives a batch size
            that fits, or says that ``n_samples`` itself is too large.
    """
    numel = int(np.prod(model.event_shape))
    elem = torch.tensor([], dtype=model.dtype).element_size()
    widest = int(tree.num_children.max()) if tree is not None and len(tree) > 1 else 1
    fixed, per_traj = sampler_bytes(
        len(tree) if tree is not None else None,
        widest,
        tree.max_depth if tree is not None else 0,
        numel,
        elem,
        execution=execution,
        n_total=batch if n_total is None else n_total,
        steps=steps,
        refine=refine,
    )
    n_total = batch if n_total is None else n_total
    free = available_bytes(device)
    need = fixed + batch * per_traj
    if free is None or need <= 0.8 * free:
        return
    fits = max(int((0.8 * free - fixed) // per_traj), 0)
    what = (
        f"execution={execution} with {len(tree)} nodes per round"
        if tree is not None and execution == "tree"
        else f"sampler={sampler} (execution={execution})"
        if sampler is not None
        else f"{'sampler=standard' if tree is None else 'the speculative sampler'} (execution={execution})"
    )
    # execution=path holds only the visited nodes, but Picard sweeps need every internal node (tree execution only)
    path_hint = tree is not None and execution == "tree" and not refine
    # "with batch_size=N" only where the user's batch_size split the run; unset, the run is one batch
    batches = "in one batch" if batch >= n_total else f"with batch_size={batch}"
    if fits == 0:
        raise ConfigError(
            f"n_samples={n_total} {batches} needs about {_gib(need)}, but {device} has {_gib(free)} "
            f"available: even one trajectory per batch does not fit with {n_total} samples kept ({_gib(fixed)}); "
            + ("use execution=path (same law and counts, only the visited nodes), " if path_hint else "")
            + "lower n_samples, or split the run into shards (num_shards=...)."
        )
    raise ConfigError(
        f"n_samples={n_total} {batches}: {what} needs about {_gib(need)} ({_gib(per_traj)} per "
        f"trajectory of a batch), but "
        f"{device} has {_gib(free)} available: use batch_size={fits} or less"
        + (
            ", or execution=path (same law and counts, only the visited nodes)."
            if path_hint
            else ", or fewer Picard sweeps (refine=...)."
            if refine
            else "."
        )
    )
