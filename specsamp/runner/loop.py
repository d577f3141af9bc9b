"""The batch loop: one run of one configuration, from its config to its record.

:func:`prepare` loads and checks a config once (:mod:`~specsamp.runner.config`), builds its coupling and
takes its config hash; :func:`run_config` takes that :class:`PreparedRun` (or a config, which it prepares),
refuses sizes that cannot fit (:mod:`~specsamp.runner.memory`) and what scoring could not use
(:func:`specsamp.runner.outputs.check_metrics`), builds the target and tree
(:mod:`~specsamp.runner.build`), samples the trajectories in batches with a progress bar, and returns the
record (:func:`specsamp.runner.records.make_record`) with the concatenated :class:`~specsamp.sampler.SampleResult`.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from omegaconf import DictConfig

import torch

from ..chains import NonFiniteSampleError
from ..coupling import Coupling, NonFiniteError
from ..errors import ConfigError, NonFiniteSamplesError
from ..sampler import SampleResult, sample_speculative, sample_standard
from ..schedule import Schedule
from ..models.base import Target
from ..trees import budget as uniform_budget
from .build import build_coupling, build_target, build_tree, calibrate, calibration_cost, given_profile
from .treerules import SEARCHED_TREES, check_search
from .config import RunConfig, load_config, unused_keys
from .memory import STEP_BYTES, check_memory, check_nominal_budget, check_tree_memory
from .outputs import check_metrics, scoring_settings
from .records import config_hash, make_record, versions


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

            self.bar = _Lines(total=total, desc=self.desc, unit=self.unit, file=sys.stderr, mininterval=LOG_INTERVAL,
                              delay=max(LOG_INTERVAL, self.min_seconds), miniters=1, leave=False,
                              bar_format="{desc}: {percentage:3.0f}% ({n:.0f}/{total:.0f} {unit}), {elapsed} elapsed, "
                                         "{remaining} left")
        else:
            self.bar = tqdm(total=total, desc=self.desc, unit=self.unit, file=sys.stderr, leave=False,
                            delay=self.min_seconds)

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
    return ("Likely causes: a coupling or a draft that returns non-finite values (check_contract=true checks every "
            "verdict and names the first bad one), or a network that overflows in half precision"
            + (f" ({', '.join(half)} here)" if half else "") + ": try model.net_dtype=null and model.dtype=float32.")


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


def non_finite_samples(run, schedule, target, sample, chunk, finite, n_batches: int, batch: int) -> NonFiniteSamplesError:
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
    where = (f"the first non-finite value was a {what} at step {first_step} of T={schedule.steps} (sigma={sigma:.4g}), "
             f"met when trajectory {bad_ids[0]} was sampled again alone" if first_step is not None else
             f"every target call saw finite states and returned finite velocities when trajectory {bad_ids[0]} was "
             "sampled again alone, so the last update (or a coupling's output) made them")
    of = f"batch {batch + 1} of {n_batches} ({chunk.numel()} samples)" if n_batches > 1 else f"the {chunk.numel()} samples"
    shown = ", ".join(map(str, bad_ids[:10])) + (" ..." if len(bad_ids) > 10 else "")
    message = (f"{len(bad_ids)} of {of} hold NaN or inf (trajectories {shown}): {where}. They are not a result: no "
               f"result.json or samples were written for this run. {non_finite_causes(run)}")
    details = {"samples": len(bad_ids), "of": int(chunk.numel()), "batch": batch, "batches": n_batches,
               "trajectories": bad_ids, "first_step": first_step, "first_sigma": sigma, "first_kind": what}
    return NonFiniteSamplesError(message, details)


def check_config_sizes(run: RunConfig) -> None:
    """Refuse, before anything is allocated, what ``steps`` and the model's own keys size alone (the schedule,
    the per-step tables; the GMM's means). Per-trajectory sizes are checked once the model's state shape is
    known (:func:`specsamp.runner.memory.check_tree_memory`).

    Raises:
        ConfigError: names the key, the bytes needed and available.
    """
    check_memory(f"steps={run.steps} (the schedule and the per-step tables)", run.steps * STEP_BYTES, "cpu", "lower steps.")
    size = run.model.size_from_config() if hasattr(run.model, "size_from_config") else None
    if size is not None:
        check_memory(size[0], size[1], run.device, "lower them.")


def half_precision_note(dtype: torch.dtype) -> None:
    """One line on stderr when the sampler's states are half precision: rounding then enters every kernel mean
    and lowers the acceptance, so the speedup is not that of float32 (measured on the GMM's default cell,
    ``python run.py model.dtype=D``: 2.03x in float64 and float32, 2.01x in float16, 1.75x in bfloat16)."""
    if dtype in (torch.float16, torch.bfloat16):
        bits = 11 if dtype == torch.float16 else 8
        print(f"note: model.dtype={str(dtype).removeprefix('torch.')} holds the states and velocities with {bits} significant "
              "bits; that rounding enters every kernel mean and lowers the acceptance, so speedups are below float32's "
              "(GMM, K=2 L=3: 2.03x in float32, 2.01x in float16, 1.75x in bfloat16).", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class PreparedRun:
    """One configuration loaded and checked once: what a job derives from its config before any model is built.

    Attributes:
        run: the typed config (:func:`specsamp.runner.config.load_config`).
        recorded: the plain dict that is recorded (``record["config"]``) and hashed.
        coupling: the sampler's :class:`~specsamp.coupling.Coupling` (:func:`~specsamp.runner.build.build_coupling`),
            None for the standard sampler.
        unused_defaults: ``{key: default}`` of the keys this sampler and tree never read
            (:func:`specsamp.runner.config.unused_keys`); hashed at their default.
        config_hash: :func:`specsamp.runner.records.config_hash` of ``recorded`` with those keys at their default.
    """

    run: RunConfig
    recorded: dict
    coupling: Coupling | None
    unused_defaults: dict
    config_hash: str

    @property
    def unused(self) -> dict:
        """``{key: value}`` of the unused keys set away from their default (the record's ``unused``)."""
        return {k: self.recorded[k] for k, d in self.unused_defaults.items() if self.recorded.get(k, d) != d}


def prepare(cfg: DictConfig | Mapping | PreparedRun) -> PreparedRun:
    """Load and check a config once: typed run, recorded dict, coupling, unused keys and config hash.

    Args:
        cfg: the composed config, a plain mapping with the keys of ``conf/config.yaml``, or a
            :class:`PreparedRun` (returned as it is).

    Raises:
        ConfigError: the first invalid key (with its value and what is valid), or a coupling that cannot be built.
    """
    if isinstance(cfg, PreparedRun):
        return cfg
    run, recorded = load_config(cfg)
    coupling = build_coupling(run)
    unused = unused_keys(run, coupling)
    return PreparedRun(run, recorded, coupling, unused, config_hash(recorded, unused))


def record_hash(cfg: DictConfig | Mapping | PreparedRun) -> tuple[RunConfig, dict, str]:
    """``(run, recorded, config hash)`` of a config, without building the target (resume checks)."""
    p = prepare(cfg)
    return p.run, p.recorded, p.config_hash


def run_config(cfg: DictConfig | Mapping | PreparedRun, *, target: Target | None = None, indices=None,
               before_sampling: Callable[[], None] | None = None, batches=None) -> tuple[dict, SampleResult]:
    """Run one configuration and return ``(record, result)``.

    Args:
        cfg: the composed config (``run.py``, :func:`specsamp.runner.config.compose`), a plain mapping
            with the keys of ``conf/config.yaml``, or a :class:`PreparedRun` (:func:`prepare`: loaded and
            checked once by the caller, as :func:`specsamp.runner.task.run_task` does).
        target: an already-built :class:`~specsamp.models.base.Target` to use instead of ``cfg.model``'s
            (notebooks, benchmarks: build once, run many configs).
        indices: trajectory ids to run (a shard), each in ``[0, n_samples)``; default all. Trajectory
            ``i``'s randomness is keyed by ``(seed, i)``, so any split reproduces the full run's counts
            bitwise and its samples to the rounding of the model's batched evaluation (bitwise when the
            batches are the same; docs/architecture.md, "What is equal across splits").
        before_sampling: called once every value and size is checked, the target built and the tree found,
            just before the first trajectory is sampled (the runner refuses a used output directory there,
            so that a bad value is still reported as such).
        batches: a :class:`~specsamp.runner.resume.BatchStore` of the job's directory: with more than one
            batch, each finished batch is written there, and a batch already there (an earlier, interrupted
            attempt of the same config) is read instead of sampled; the record then holds
            ``resumed: {batches, of}``. None: every batch is sampled, nothing is written.

    Returns:
        The JSON-ready record (README, "The main job") and the concatenated :class:`SampleResult`;
        ``result.extra`` holds ``target`` and ``indices`` for images and metrics.

    Raises:
        ConfigError: invalid configuration, a size that cannot fit, or a model that cannot be loaded.
    """
    prepared = prepare(cfg)
    run, coupling = prepared.run, prepared.coupling
    if run.threads is not None:
        torch.set_num_threads(run.threads)
    t0 = time.perf_counter()
    check_config_sizes(run)
    try:
        schedule = Schedule.make(run.steps, run.eps, shift=float(run.model.shift))
    except ValueError as e:
        raise ConfigError(str(e)) from None
    horizon = schedule.steps - 2
    # sizes that follow from the config alone are refused before the model is loaded or calibrated
    optimal = coupling is not None and run.tree in SEARCHED_TREES and coupling.max_children != 1
    per_step = run.tree == "optimal_per_step"
    given = tree = None
    if optimal:
        if run.budget is None:
            check_nominal_budget(run)
        check_search(run, coupling, run.budget or uniform_budget(run.K, run.L))
        given = given_profile(run)  # a profile that cannot serve this run is refused before the model loads
    else:  # a tree that needs no profile is built (and its size checked) before the model loads
        tree, B = build_tree(run, coupling, horizon)
    # what scoring will need is checked before the model is loaded (a given target: once it is known)
    n_images = run.n_samples if indices is None else int(torch.as_tensor(indices).numel())
    count = f"n_samples={run.n_samples}" + (f" (this shard scores {n_images})" if indices is not None else "")
    settings = scoring_settings(run.model if target is None else target)
    notes = check_metrics(run.metrics, *settings, n_images, count) if run.metrics else []
    target = target if target is not None else build_target(run)
    for note in notes:
        print(f"note: {note}", file=sys.stderr, flush=True)
    half_precision_note(target.model.dtype)
    max_batch = run.max_batch or target.max_batch  # the top-level key wins; else the model's (SD3: 64 states)
    for m in run.metrics:  # refuse before sampling what no scoring step could serve
        if target.decode is None or (m == "clip" and target.prompts_for is None) or (m == "fid" and not target.fid_ref):
            need = "images" if target.decode is None else "prompts" if m == "clip" else "model.fid_ref (reference statistics)"
            raise ConfigError(f"metrics=[{m}] is invalid for model={run.model.name}: it needs {need}, which this model does not "
                              "have (fid: model=digits, cifar10 or ffhq; clip: model=sd3).")
    calibrated = calibration = None
    if optimal and run.delta_profile is None:
        profiles, cal = calibrate(target, schedule, run)
        calibrated = profiles["per_root" if run.tree == "optimal_per_step" else "profile"]
        calibration = {**calibration_cost(cal), "charged": False}
    if optimal:
        with _Progress(run.progress, "tree search", "root" if per_step else "depth", min_seconds=2.0) as search_bar:
            tree, B = build_tree(run, coupling, horizon, calibrated or given, callback=search_bar.to)
    largest = getattr(tree, "largest", tree)  # step-dependent trees: memory is sized by the largest round
    if tree is not None and run.refine > min(largest.max_depth, horizon):
        depth = min(largest.max_depth, horizon)
        raise ConfigError(f"refine={run.refine} is invalid for this tree ({tree.describe()}, {depth} level(s) within T-2): "
                          f"after {depth} Picard sweep(s) every proposal mean is the target kernel mean at its parent, so "
                          "further sweeps change nothing but each costs a batched target call per round; use "
                          f"refine={depth} or less.")
    given_ids = None if indices is None else torch.as_tensor(indices, dtype=torch.long).reshape(-1)
    if given_ids is not None and (given_ids.numel() == 0 or int(given_ids.min()) < 0 or int(given_ids.max()) >= run.n_samples):
        raise ConfigError(f"indices are invalid: need a non-empty set of trajectory ids in [0, n_samples={run.n_samples}).")
    n_total = run.n_samples if given_ids is None else given_ids.numel()
    bs = run.batch_size or n_total
    # every per-trajectory array (the ids included) is sized here, before the first one is allocated
    check_tree_memory(largest.restrict(min(largest.max_depth, horizon)) if tree is not None else None, min(bs, n_total),
                      target.model, run.device, execution=run.execution, n_total=n_total, steps=schedule.steps,
                      refine=run.refine if tree is not None else 0, sampler=run.sampler.name)
    ids = torch.arange(run.n_samples) if given_ids is None else given_ids
    unused = prepared.unused
    if unused:
        print(f"note: {', '.join(f'{k}={x!r}' for k, x in unused.items())} "
              f"{'does' if len(unused) == 1 else 'do'} nothing for sampler={run.sampler.name}"
              + (f" with tree={run.tree}" if coupling is not None else "")
              + "; recorded as unused, left out of the config hash.", file=sys.stderr, flush=True)
    if before_sampling is not None:
        before_sampling()
    dev = torch.device(getattr(target.model, "device", run.device))

    def sample(model, chunk, callback=None, compile=run.compile) -> SampleResult:
        common = dict(seed=run.seed, indices=chunk, max_batch=max_batch, callback=callback,
                      cond=target.cond_for(chunk, run.seed) if target.cond_for is not None else {})
        if tree is None:
            return sample_standard(model, schedule, **common)
        return sample_speculative(model, schedule, tree, coupling, draft=run.draft, prefetch=run.prefetch,
                                  evaluate_leaves=run.evaluate_leaves, execution=run.execution, warmup=run.warmup,
                                  refine=run.refine, compile=compile,
                                  check_contract=None if run.check_contract == "auto" else run.check_contract, **common)

    results = []
    per_traj = horizon  # the bar counts trajectory-steps of the speculative range, per round or step
    n_batches = -(-ids.numel() // bs)
    store = batches if n_batches > 1 else None  # one batch: nothing to keep between attempts
    with _Progress(run.progress, "sampling", "traj-step", total=ids.numel() * per_traj) as bar, \
            (store.running(n_batches, max_batch=max_batch) if store is not None else contextlib.nullcontext()):
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
                r = sample(target.model, chunk, progress)
            except (NonFiniteError, NonFiniteSampleError) as e:  # found while sampling, where it happened
                raise NonFiniteSamplesError(f"{str(e).rstrip('.')}. {non_finite_causes(run)}",
                                            {"error": str(e), "trajectories": getattr(e, "rows", None)}) from None
            # one reduction per batch, after its last round: samples holding NaN or inf are not a result
            finite = torch.isfinite(r.samples.reshape(r.samples.shape[0], -1)).all(1)
            if not bool(finite.all()):
                raise non_finite_samples(run, schedule, target, sample, chunk, finite, n_batches, start // bs)
            if store is not None:
                store.save(chunk, r)
            results.append(r)
            bar.to(base + chunk.numel() * per_traj)
    res = SampleResult.concat(results)
    res.extra.update(target=target, indices=ids, max_batch=max_batch)
    tree_fields = {
        "tree": tree.describe() if tree is not None else "none",
        "budget": B,
        "call_rows": tree.call_rows(run.evaluate_leaves) if tree is not None else 1,
        **({"refine": run.refine} if tree is not None and run.refine else {}),
        **({"delta_profile": calibrated} if optimal else {}),
        **({"trees_by_root": tree.parents()} if optimal and per_step else {"tree_parent": tree.parent.tolist()} if optimal else {}),
    }
    record = make_record(prepared, res, [r.batch_speedup for r in results], tree_fields, calibration=calibration,
                         resumed={"batches": store.loaded, "of": n_batches} if store is not None and store.loaded else None,
                         wall_seconds=time.perf_counter() - t0, versions=versions())
    return record, res
