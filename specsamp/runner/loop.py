"""The runner's stages: one run of one configuration, from its config to its record.

:func:`run_config` and the Hydra task (:func:`specsamp.runner.task.run_task`) make the same calls, in order:

1. :func:`prepare`, once: the typed, checked config (:mod:`~specsamp.runner.config`), its coupling, its
   unused keys and config hash, and this job's trajectory ids (a shard's block, given ``indices``, or all);
   the task then skips a run whose record is already there;
2. :func:`build`: sizes, schedule, tree (from a profile, or calibrate then search), target, and what scoring
   will need (:mod:`~specsamp.runner.build`, :mod:`~specsamp.runner.memory`,
   :mod:`~specsamp.runner.outputs`); every refusal of a value or a size happens here, before any
   trajectory is sampled;
3. :func:`sample`: the batch loop with its progress bar, and resume (:mod:`~specsamp.runner.resume`);
4. :func:`specsamp.runner.records.make_record`: the record, the one place it is assembled.

The task then writes, scores, writes again and logs (:mod:`~specsamp.runner.task`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from omegaconf import DictConfig

from ..coupling import Coupling, NonFiniteError, NonFiniteSampleError
from ..errors import ConfigError, NonFiniteSamplesError
from ..kernels import KERNELS
from ..models.base import Target
from ..sampler import SampleResult, sample_speculative, sample_standard
from ..schedule import Schedule
from .autorun import plan_run
from .build import build_coupling, build_schedule, find_tree, load_target
from .config import RunConfig, _paper_value, kernel_name, load_config, unused_keys
from .jobs import shard_indices
from .memory import check_tree_memory
from .records import Job, Sampled, config_hash, make_record

LOG_INTERVAL = 30.0  # seconds between plain progress lines when stderr is not a terminal (progress=auto)


def _progress_enabled(flag) -> bool:
    if flag == "auto":
        return sys.stderr.isatty()
    return bool(flag)


class _Progress:
    """Progress of long work on stderr, set by absolute position (:meth:`to`).

    ``progress=true``, or ``auto`` on a terminal: a tqdm bar. ``auto`` without a terminal (a cluster
    job's log): one plain tqdm line every :data:`LOG_INTERVAL` seconds, none for shorter work.
    ``false``: nothing. ``min_seconds``: show a bar only for work that lasts longer.
    """

    def __init__(self, flag, desc: str, unit: str, total: float | None = None, min_seconds: float = 0.0):
        self.bar = None
        self.desc, self.unit, self.total, self.min_seconds = desc, unit, total, min_seconds
        self.lines = flag == "auto" and not sys.stderr.isatty()
        self.enabled = self.lines or _progress_enabled(flag)

    def __enter__(self):
        return self

    def _open(self, total):
        from tqdm import tqdm

        if self.lines:

            class _Lines(tqdm):  # tqdm's meter, written as whole lines (no carriage returns in a log file)
                def display(self, msg=None, pos=None):
                    msg = (self.__str__() if msg is None else msg).strip()
                    if msg:
                        self.fp.write(msg + "\n")
                        self.fp.flush()
                    return True

            self.bar = _Lines(
                total=total,
                desc=self.desc,
                unit=self.unit,
                file=sys.stderr,
                mininterval=LOG_INTERVAL,
                delay=max(LOG_INTERVAL, self.min_seconds),
                miniters=1,
                leave=False,
                bar_format="{desc}: {percentage:3.0f}% ({n:.0f}/{total:.0f} {unit}), {elapsed} elapsed, "
                "{remaining} left",
            )
        else:
            self.bar = tqdm(
                total=total, desc=self.desc, unit=self.unit, file=sys.stderr, leave=False, delay=self.min_seconds
            )

    def to(self, position: float, total: float | None = None) -> None:
        """Move to ``position`` (of ``total``, when first known here)."""
        if not self.enabled:
            return
        if self.bar is None:
            self._open(total if total is not None else self.total)
        if position > self.bar.n:
            self.bar.update(position - self.bar.n)

    def __exit__(self, *_exc):
        if self.bar is not None:
            self.bar.close()
        return False


def non_finite_causes(run: RunConfig) -> str:
    """The likely causes of non-finite samples, for the error paragraph."""
    dtype, net = getattr(run.model, "dtype", None), getattr(run.model, "net_dtype", None)
    half = [f"model.{k}={v}" for k, v in (("dtype", dtype), ("net_dtype", net)) if str(v) in ("float16", "bfloat16")]
    return (
        "Likely causes: a coupling or a draft that returns non-finite values (check_contract=true checks every "
        "verdict and names the first bad one), or a network that overflows in half precision"
        + (f" ({', '.join(half)} here)" if half else "")
        + ": try model.net_dtype=null and model.dtype=float32."
    )


class _Watched:
    """A velocity model that notes the first call seeing a non-finite state or returning a non-finite velocity:
    the largest ``sigma`` among such rows (the earliest step), and whether the input or the output was bad."""

    def __init__(self, model):
        self._model, self.first = model, None

    def __getattr__(self, name):
        return getattr(self._model, name)

    def __call__(self, x, sigma, **cond):
        out = self._model(x, sigma, **cond)
        if self.first is None:
            bad_in = ~torch.isfinite(x.reshape(x.shape[0], -1)).all(1)
            bad_out = ~torch.isfinite(out.reshape(out.shape[0], -1)).all(1)
            if bool((bad_in | bad_out).any()):
                rows = (bad_in | bad_out).nonzero()[:, 0]
                s = torch.as_tensor(sigma, dtype=torch.float64).reshape(-1).expand(x.shape[0])
                r = int(rows[torch.argmax(s[rows])])
                self.first = (float(s[r]), "state" if bool(bad_in[r]) else "velocity")
        return out


def non_finite_samples(
    run, schedule, target, sample, chunk, finite, n_batches: int, batch: int
) -> NonFiniteSamplesError:
    """The error for a batch whose samples hold NaN or inf: how many, which trajectories, and from which step,
    found by sampling the first such trajectory once more, alone, with a model that watches its calls
    (:class:`_Watched`; trajectory ``i``'s randomness is keyed by ``(seed, i)``, so it meets the same values)."""
    bad_ids = chunk[~finite].tolist()
    watched = _Watched(target.model)
    first_step = sigma = what = None
    try:
        sample(watched, chunk[~finite][:1], None, False)
    except Exception:  # noqa: BLE001 - the search is a courtesy: the error below is the finding
        pass
    if watched.first is not None:
        sigma, what = watched.first
        first_step = int(torch.argmin((schedule.sigmas.double().cpu() - sigma).abs()))
    where = (
        f"the first non-finite value was a {what} at step {first_step} of T={schedule.steps} (sigma={sigma:.4g}), "
        f"met when trajectory {bad_ids[0]} was sampled again alone"
        if first_step is not None
        else f"every target call saw finite states and returned finite velocities when trajectory {bad_ids[0]} was "
        "sampled again alone, so the last update (or a coupling's output) made them"
    )
    of = (
        f"batch {batch + 1} of {n_batches} ({chunk.numel()} samples)"
        if n_batches > 1
        else f"the {chunk.numel()} samples"
    )
    shown = ", ".join(map(str, bad_ids[:10])) + (" ..." if len(bad_ids) > 10 else "")
    message = (
        f"{len(bad_ids)} of {of} hold NaN or inf (trajectories {shown}): {where}. They are not a result: no "
        f"result.json or samples were written for this run. {non_finite_causes(run)}"
    )
    details = {
        "samples": len(bad_ids),
        "of": int(chunk.numel()),
        "batch": batch,
        "batches": n_batches,
        "trajectories": bad_ids,
        "first_step": first_step,
        "first_sigma": sigma,
        "first_kind": what,
    }
    return NonFiniteSamplesError(message, details)


@dataclass(frozen=True)
class PreparedRun:
    """One configuration loaded and checked once: what a job derives from its config before any model is built
    (:func:`prepare`).

    Attributes:
        run: the typed config (:func:`specsamp.runner.config.load_config`).
        recorded: the plain dict that is recorded (``record["config"]``) and hashed.
        coupling: the sampler's :class:`~specsamp.coupling.Coupling` (:func:`~specsamp.runner.build.build_coupling`),
            None for the standard sampler.
        unused_defaults: ``{key: default}`` of the keys this sampler and tree never read
            (:func:`specsamp.runner.config.unused_keys`); hashed at their default.
        config_hash: :func:`specsamp.runner.records.config_hash` of ``recorded`` with those keys at their default.
        unused: ``{key: value}`` of those keys set away from their default (the record's ``unused``).
        indices: the trajectory ids this run samples (a shard's ``range``, or given ids), None for all.
        job: the :class:`~specsamp.runner.records.Job` that writes the record (``run.py``'s task), or None.
    """

    run: RunConfig
    recorded: dict
    coupling: Coupling | None
    unused_defaults: dict
    config_hash: str
    unused: dict
    indices: Sequence[int] | torch.Tensor | None = None
    job: Job | None = None

    @property
    def n_trajectories(self) -> int:
        """How many trajectories this run samples (nothing allocated)."""
        if self.indices is None:
            return self.run.n_samples
        return len(self.indices) if isinstance(self.indices, range) else int(torch.as_tensor(self.indices).numel())

    @property
    def ids(self) -> torch.Tensor:
        """The trajectory ids this run samples, ``[n]`` int64 (``0 .. n_samples-1`` without ``indices``)."""
        if self.indices is None:
            return torch.arange(self.run.n_samples)
        return torch.as_tensor(self.indices, dtype=torch.long).reshape(-1)


def _checked_indices(indices, n_samples: int):
    """``indices`` as given, once each id is checked to lie in ``[0, n_samples)`` (None: all).

    Raises:
        ConfigError: an empty set, or an id out of range.
    """
    if indices is None:
        return None
    ids = torch.as_tensor(indices, dtype=torch.long).reshape(-1)
    if ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= n_samples:
        raise ConfigError(f"indices are invalid: need a non-empty set of trajectory ids in [0, n_samples={n_samples}).")
    return indices


def prepare(cfg: DictConfig | Mapping | PreparedRun, indices=None, *, job: Job | None = None) -> PreparedRun:
    """Stage 1: load and check a config once: typed run, recorded dict, coupling, unused keys, config hash, and
    this job's trajectory ids.

    Args:
        cfg: the composed config, a plain mapping with the keys of ``conf/config.yaml``, or a
            :class:`PreparedRun` (returned as it is, or with ``indices`` when they are given).
        indices: trajectory ids to run (a shard), each in ``[0, n_samples)``; default all.
        job: ``run.py``'s job (:class:`~specsamp.runner.records.Job`), whose fields the record holds; with a job,
            a shard (``num_shards > 1``) runs its block of trajectories
            (:func:`~specsamp.runner.jobs.shard_indices`) and a sweep's job names its sweep (``sweep_name``).

    Raises:
        ConfigError: the first invalid key (with its value and what is valid), a coupling that cannot be built,
            or ids outside ``[0, n_samples)``.
    """
    if isinstance(cfg, PreparedRun):
        return (
            cfg if indices is None else dataclasses.replace(cfg, indices=_checked_indices(indices, cfg.run.n_samples))
        )
    run, recorded = load_config(cfg)
    coupling = build_coupling(run)
    unused = unused_keys(run, coupling)
    if job is not None and run.num_shards > 1:
        indices = shard_indices(run.n_samples, run.shard, run.num_shards, run.batch_size)
    if job is not None and job.multirun and run.sweep_name is not None:
        job = dataclasses.replace(job, sweep=str(run.sweep_name))
    return PreparedRun(
        run,
        recorded,
        coupling,
        unused,
        config_hash(recorded, unused),
        {k: recorded[k] for k, d in unused.items() if recorded.get(k, d) != d},
        _checked_indices(indices, run.n_samples),
        job,
    )


def record_hash(cfg: DictConfig | Mapping | PreparedRun) -> tuple[RunConfig, dict, str]:
    """``(run, recorded, config hash)`` of a config, without building the target (resume checks)."""
    p = prepare(cfg)
    return p.run, p.recorded, p.config_hash


@dataclass(frozen=True)
class Built:
    """What :func:`build` makes of a :class:`PreparedRun`: every part its sampling needs, each value and size
    already checked.

    Attributes:
        prepared: the run.
        schedule: its time grid.
        tree: the round tree (a :class:`~specsamp.trees.DraftTree`, or a
            :class:`~specsamp.treesearch.TreesByRoot` per root step), None for the standard sampler.
        target: the built (or given) target.
        max_batch: rows per forward pass (``max_batch``, else the model's own).
        tree_fields: the record's fields of the tree (:data:`specsamp.runner.records.TREE_FIELDS`).
        calibration: the cost of the calibration run that ``tree=optimal*`` ran, or None.
        started: ``time.perf_counter()`` when the stage began (the record's ``wall_seconds`` counts from it).
    """

    prepared: PreparedRun
    schedule: Schedule
    tree: object
    target: Target
    max_batch: int | None
    tree_fields: dict
    calibration: dict | None
    started: float
    auto: dict | None = None
    auto_coupling: str | None = None

    def draw(self, model, chunk: torch.Tensor, callback=None, compile: bool | None = None) -> SampleResult:
        """Sample the trajectories ``chunk`` (ids) with ``model`` (the target's, or a copy that watches it):
        :func:`~specsamp.sampler.sample_speculative` on the tree, or :func:`~specsamp.sampler.sample_standard`."""
        run, target = self.prepared.run, self.target
        common = dict(
            seed=run.seed,
            indices=chunk,
            max_batch=self.max_batch,
            callback=callback,
            cond=target.cond_for(chunk, run.seed) if target.cond_for is not None else {},
        )
        if self.tree is None:
            return sample_standard(model, self.schedule, **common)
        return sample_speculative(
            model,
            self.schedule,
            self.tree,
            self.auto_coupling or self.prepared.coupling,
            draft=run.draft,
            prefetch=run.prefetch,
            evaluate_leaves=run.evaluate_leaves,
            execution="tree" if self.auto is not None else run.execution,
            warmup=run.warmup,
            refine=run.refine,
            compile=run.compile if compile is None else compile,
            check_contract=None if run.check_contract == "auto" else run.check_contract,
            **common,
        )


def kernel_notes(run: RunConfig) -> None:
    """One line on stderr for each key that a kernel other than ``em`` does not read and that is set away from its
    default: ``eps`` (recorded as null) and, for ``ddpm`` and ``euler_ancestral``, ``model.shift`` (the grid is
    the scheduler's levels; ``flow_stochastic`` reads it where ``kernel.shift`` is null)."""
    name = kernel_name(run)
    if name == "em":
        return
    unread = []
    if run.eps != _paper_value(run.model, "eps"):
        unread.append(f"eps={run.eps!r}")
    shift = getattr(run.model, "shift", 1.0)
    if name in KERNELS and not KERNELS.get(name).reads_shift and shift != 1.0:
        unread.append(f"model.shift={shift!r}")
    if unread:
        print(
            f"note: {', '.join(unread)} {'is' if len(unread) == 1 else 'are'} not read by kernel={name}, whose grid and "
            "noise are its scheduler's (eps is recorded as null).",
            file=sys.stderr,
            flush=True,
        )


def build(prepared: PreparedRun, target: Target | None = None) -> Built:
    """Stage 2: sizes, schedule, tree, target, and what scoring will need; every refusal before sampling.

    In order: what the config alone sizes and the schedule; a searched tree's budget, search and given
    profile; the tree (a rule's, built before the model loads; a searched one from its profile, or from a
    calibration run on the target; :func:`~specsamp.runner.build.find_tree`); the target
    (:func:`~specsamp.runner.build.load_target`); the sampler's states of one batch
    (:func:`~specsamp.runner.memory.check_tree_memory`). Then the note on keys that do nothing.

    Args:
        prepared: the run (:func:`prepare`).
        target: an already-built target to use instead of the config's model.

    Raises:
        ConfigError: the first value or size that cannot serve this run.
    """
    run, coupling = prepared.run, prepared.coupling
    if run.threads is not None:
        torch.set_num_threads(run.threads)
    started = time.perf_counter()
    schedule, plan = build_schedule(run, tuple(target.model.event_shape) if target is not None else None)
    kernel_notes(run)
    # the target, loaded once, when first needed (a calibration needs it before the tree, any other run after)
    get_target = functools.cache(
        functools.partial(load_target, run, target, prepared.n_trajectories, prepared.indices is not None, plan)
    )
    search = "root" if run.tree == "optimal_per_step" else "depth"
    with _Progress(run.progress, "tree search", search, min_seconds=2.0) as bar:  # opened by a search only
        tree, tree_fields, calibration = find_tree(run, coupling, schedule, get_target, callback=bar.to)
    target = get_target()
    max_batch = run.max_batch or target.max_batch  # the top-level key wins; else the model's (SD3: 64 states)
    auto = None
    if run.sampler.name == "auto":  # measure, pilot, choose: the loop (tree None) or one coupling's trees by root
        tree, tree_fields, auto = plan_run(run, schedule, target, prepared, max_batch)
    largest = getattr(tree, "largest", tree)  # step-dependent trees: memory is sized by the largest round
    n_total = prepared.n_trajectories
    # every per-trajectory array (the ids included) is sized here, before the first one is allocated
    check_tree_memory(
        largest.restrict(min(largest.max_depth, schedule.steps - 2)) if tree is not None else None,
        min(run.batch_size or n_total, n_total),
        target.model,
        run.device,
        n_total=n_total,
        steps=schedule.steps,
        refine=run.refine if tree is not None and auto is None else 0,
        execution="tree" if auto is not None else run.execution,
        sampler=run.sampler.name,
    )
    unused = prepared.unused
    if unused:
        print(
            f"note: {', '.join(f'{k}={x!r}' for k, x in unused.items())} "
            f"{'does' if len(unused) == 1 else 'do'} nothing for sampler={run.sampler.name}"
            + (f" with tree={run.tree}" if coupling is not None else "")
            + "; recorded as unused, left out of the config hash.",
            file=sys.stderr,
            flush=True,
        )
    coupling_name = auto["choice"] if auto is not None and auto["choice"] != "loop" else None
    return Built(prepared, schedule, tree, target, max_batch, tree_fields, calibration, started, auto, coupling_name)


def sample(built: Built, batches=None) -> Sampled:
    """Stage 3: sample the run's trajectories in batches of ``batch_size``, with a progress bar, and resume.

    Args:
        built: the run's parts (:func:`build`).
        batches: a :class:`~specsamp.runner.resume.BatchStore` of the job's directory: with more than one
            batch, each finished batch is written there, and a batch already there (an earlier, interrupted
            attempt of the same config) is read instead of sampled; the record then holds
            ``resumed: {batches, of}``. None: every batch is sampled, nothing is written.

    Returns:
        What the record reads (:class:`~specsamp.runner.records.Sampled`); its ``result`` is the concatenated
        :class:`SampleResult`, whose ``extra`` holds ``target``, ``indices`` and ``max_batch`` for images and
        metrics.

    Raises:
        NonFiniteSamplesError: a batch whose samples hold NaN or inf (:func:`non_finite_samples`).
    """
    run, target, ids = built.prepared.run, built.target, built.prepared.ids
    dev = torch.device(getattr(target.model, "device", run.device))
    results = []
    per_traj = built.schedule.steps - 2  # the bar counts trajectory-steps of the speculative range, per round or step
    bs = run.batch_size or ids.numel()
    n_batches = -(-ids.numel() // bs)
    store = batches if n_batches > 1 else None  # one batch: nothing to keep between attempts
    sampling_started = time.perf_counter()
    with (
        _Progress(run.progress, "sampling", "traj-step", total=ids.numel() * per_traj) as bar,
        store.running(n_batches, max_batch=built.max_batch) if store is not None else contextlib.nullcontext(),
    ):
        for start in range(0, ids.numel(), bs):
            chunk = ids[start : start + bs].to(dev)
            base = start * per_traj
            if store is not None and (r := store.load(chunk)) is not None:  # finished by an earlier attempt
                results.append(r)
                bar.to(base + chunk.numel() * per_traj)
                continue
            # no callback without a bar: its progress counts would cost the sampler host syncs
            progress = (lambda info, base=base: bar.to(base + info["steps_done"])) if bar.enabled else None
            try:
                r = built.draw(target.model, chunk, progress)
            except (NonFiniteError, NonFiniteSampleError) as e:  # found while sampling, where it happened
                raise NonFiniteSamplesError(
                    f"{str(e).rstrip('.')}. {non_finite_causes(run)}",
                    {"error": str(e), "trajectories": getattr(e, "rows", None)},
                ) from None
            # one reduction per batch, after its last round: samples holding NaN or inf are not a result
            finite = torch.isfinite(r.samples.reshape(r.samples.shape[0], -1)).all(1)
            if not bool(finite.all()):
                raise non_finite_samples(run, built.schedule, target, built.draw, chunk, finite, n_batches, start // bs)
            if store is not None:
                store.save(chunk, r)
            results.append(r)
            bar.to(base + chunk.numel() * per_traj)
    res = SampleResult.concat(results)
    res.extra.update(target=target, indices=ids, max_batch=built.max_batch)
    auto = built.auto
    if auto is not None:  # the realised seconds of a batch, beside the predicted ones
        sampled_seconds = time.perf_counter() - sampling_started
        auto = {**auto, "realised_seconds": round(sampled_seconds / n_batches, 6)}
        auto["realised_over_predicted"] = round(auto["realised_seconds"] / auto["predicted_seconds"], 4)
        if auto["choice"] != "loop":
            auto["realised_steps_per_round"] = round((built.schedule.steps - 2) / float(res.rounds.double().mean()), 3)
    return Sampled(
        res,
        [r.batch_speedup for r in results],
        built.tree_fields,
        built.calibration,
        resumed={"batches": store.loaded, "of": n_batches} if store is not None and store.loaded else None,
        wall_seconds=time.perf_counter() - built.started,
        kernel=built.schedule.kernel_name,
        auto=auto,
    )


def run_config(
    cfg: DictConfig | Mapping | PreparedRun,
    *,
    target: Target | None = None,
    indices=None,
    before_sampling: Callable[[], None] | None = None,
    batches=None,
) -> tuple[dict, SampleResult]:
    """Run one configuration and return ``(record, result)``: :func:`prepare`, :func:`build`, :func:`sample`,
    :func:`~specsamp.runner.records.make_record`.

    Args:
        cfg: the composed config (``run.py``, :func:`specsamp.runner.config.compose`), a plain mapping
            with the keys of ``conf/config.yaml``, or a :class:`PreparedRun`.
        target: an already-built :class:`~specsamp.models.base.Target` to use instead of ``cfg.model``'s
            (notebooks, benchmarks: build once, run many configs).
        indices: trajectory ids to run (a shard), each in ``[0, n_samples)``; default all. Trajectory
            ``i``'s randomness is keyed by ``(seed, i)``, so any split reproduces the full run's counts
            bitwise and its samples to the rounding of the model's batched evaluation (bitwise when the
            batches are the same; docs/architecture.md, "What is equal across splits").
        before_sampling: called once every value and size is checked, the target built and the tree found,
            just before the first trajectory is sampled.
        batches: a :class:`~specsamp.runner.resume.BatchStore` of the job's directory (:func:`sample`).

    Returns:
        The JSON-ready record (README, "The main job") and the concatenated :class:`SampleResult`;
        ``result.extra`` holds ``target`` and ``indices`` for images and metrics.

    Raises:
        ConfigError: invalid configuration, a size that cannot fit, or a model that cannot be loaded.
    """
    prepared = prepare(cfg, indices)
    built = build(prepared, target)
    if before_sampling is not None:
        before_sampling()
    sampled = sample(built, batches)
    return make_record(prepared, sampled), sampled.result
