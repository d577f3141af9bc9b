"""Config -> objects -> run -> record. The layer between ``run.py`` (Hydra) and the core.

:func:`run_config` takes a resolved config (an OmegaConf ``DictConfig`` or a plain mapping with the keys
of ``conf/config.yaml``), validates it, builds the model, schedule, tree and coupling, samples in
batches of trajectories, and returns a JSON-ready record. :func:`write_record` writes it atomically.
Bad input raises :class:`ConfigError`, whose message names the key, its value and what is valid;
``run.py`` turns it into exit status 2.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from . import __version__, rng
from .coupling import COUPLINGS
from .drafts import DRAFTS
from .io import write_json_atomic  # noqa: F401  (re-exported: cli, shards, report use it from here)
from .sampler import EXECUTIONS, PREFETCH, WARMUPS, SampleResult, sample_speculative, sample_standard
from .schedule import Schedule
from .trees import DraftTree, budget as uniform_budget

SAMPLERS_BUILTIN = ("standard",)
MATCH = ("budget", "verification")
TREES = ("uniform", "widths", "optimal")


# every top-level key of conf/config.yaml (the groups included); `+key=...` additions are rejected
KNOWN_KEYS = frozenset(
    "model sampler logger K L eps steps n_samples seed device tree widths budget delta_profile max_depth max_width "
    "draft prefetch warmup evaluate_leaves match execution batch_size max_batch threads progress save_samples metrics "
    "skip_existing sweep_name num_shards shard hydra".split()
)


class ConfigError(ValueError):
    """A user error in the configuration: names the key, its value and what is valid."""


# ----------------------------------------------------------------------------------------------
# validation


def _get(cfg, key, default=None):
    if isinstance(cfg, Mapping):
        return cfg.get(key, default)
    return getattr(cfg, key, default)


def _int(cfg, key: str, lo: int) -> int:
    v = _get(cfg, key)
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo:
        raise ConfigError(f"{key}={v!r} is invalid: must be an integer >= {lo}.")
    return int(v)


def _choice(cfg, key: str, valid) -> Any:
    v = _get(cfg, key)
    if v not in valid:
        raise ConfigError(f"{key}={v!r} is invalid: valid values are {', '.join(map(str, valid))}.")
    return v


def validate(cfg) -> dict:
    """Check every top-level key and return the typed values the runner uses.

    Raises:
        ConfigError: the first invalid key, with its value and the valid range.
    """
    out = {}
    if isinstance(cfg, Mapping):
        unknown = sorted(set(cfg) - KNOWN_KEYS)
        if unknown:
            raise ConfigError(f"{unknown[0]}={cfg[unknown[0]]!r} is not a key of specsamp's config; valid top-level keys: "
                              f"{', '.join(sorted(KNOWN_KEYS))} (see conf/config.yaml).")
    sampler = _get(cfg, "sampler") or {}
    name = _get(sampler, "name")
    coupling = _get(sampler, "coupling")
    if name not in SAMPLERS_BUILTIN and coupling not in COUPLINGS:
        raise ConfigError(
            f"sampler={name!r} (coupling={coupling!r}) is invalid: valid samplers are "
            f"{', '.join(SAMPLERS_BUILTIN + tuple(sorted(COUPLINGS)))}."
        )
    out["sampler"] = name
    out["coupling"] = None if name in SAMPLERS_BUILTIN else coupling
    out["K"] = _int(cfg, "K", 1)
    out["L"] = _int(cfg, "L", 1)
    eps = _get(cfg, "eps")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not (0.0 < float(eps) <= 1.0):
        raise ConfigError(f"eps={eps!r} is invalid: the churn must lie in (0, 1] (eps=0 is the deterministic ODE, where speculation is vacuous).")
    out["eps"] = float(eps)
    out["steps"] = _int(cfg, "steps", 3)
    out["n_samples"] = _int(cfg, "n_samples", 1)
    seed = _get(cfg, "seed")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise ConfigError(f"seed={seed!r} is invalid: must be an integer.")
    out["seed"] = int(seed)
    out["draft"] = _choice(cfg, "draft", sorted(DRAFTS))
    out["prefetch"] = _choice(cfg, "prefetch", PREFETCH)
    out["execution"] = _choice(cfg, "execution", EXECUTIONS)
    out["warmup"] = _choice(cfg, "warmup", WARMUPS)
    out["match"] = _choice(cfg, "match", MATCH)
    out["tree"] = _choice(cfg, "tree", TREES)
    el = _get(cfg, "evaluate_leaves")
    if not isinstance(el, bool):
        raise ConfigError(f"evaluate_leaves={el!r} is invalid: must be true or false.")
    out["evaluate_leaves"] = el
    for key in ("batch_size", "max_batch", "budget", "threads"):
        v = _get(cfg, key)
        if v is not None:
            out[key] = _int(cfg, key, 1)
        else:
            out[key] = None
    widths = _get(cfg, "widths")
    if out["tree"] == "widths":
        if widths is None or len(widths) == 0 or any(isinstance(w, bool) or not isinstance(w, int) or w < 1 for w in widths):
            raise ConfigError(f"widths={widths!r} is invalid: tree=widths needs a non-empty list of integers >= 1, e.g. widths=[3,2,2].")
        out["widths"] = [int(w) for w in widths]
    device = str(_get(cfg, "device", "cpu"))
    if not (device == "cpu" or device.startswith("cuda") or device == "mps"):
        raise ConfigError(f"device={device!r} is invalid: use cpu, cuda or cuda:N.")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device={device!r} is invalid here: torch sees no CUDA device on this machine; use device=cpu.")
    out["device"] = device
    progress = _get(cfg, "progress", "auto")
    if progress not in ("auto", True, False):
        raise ConfigError(f"progress={progress!r} is invalid: valid values are auto, true, false.")
    out["progress"] = progress
    metrics = _get(cfg, "metrics") or []
    metrics = [metrics] if isinstance(metrics, str) else list(metrics)  # metrics=fid means metrics=[fid]
    for m in metrics:
        if m not in ("fid", "clip"):
            raise ConfigError(f"metrics={metrics!r} is invalid: valid entries are fid, clip.")
    out["metrics"] = metrics
    model = _get(cfg, "model")
    kind = _get(model, "kind") if model is not None else None
    if kind not in MODEL_BUILDERS:
        raise ConfigError(f"model.kind={kind!r} is invalid: valid kinds are {', '.join(sorted(MODEL_BUILDERS))}.")
    if metrics and kind == "gmm":
        raise ConfigError(f"metrics={metrics!r} is invalid for model.kind=gmm: fid and clip score images (model=cifar10, ffhq or sd3).")
    coupling_fn = COUPLINGS.get(out["coupling"]) if out["coupling"] else None
    if coupling_fn is not None and coupling_fn.max_children == 1 and out["tree"] != "uniform":
        raise ConfigError(f"tree={out['tree']!r} is invalid with sampler={name}: a K=1 rule runs a chain (tree=uniform).")
    return out


# ----------------------------------------------------------------------------------------------
# builders


@dataclass
class Target:
    """A built target: the velocity model and what a run needs around it.

    Attributes:
        model: velocity model (:class:`specsamp.models.VelocityModel`).
        cond_for: ``(ids [m] long, seed) -> {name: [m, ...]}`` per-trajectory conditioning, or None.
        decode: ``samples [m, *event] -> images [m, 3, H, W]`` float in ``[-1, 1]``, or None (not images).
        prompts_for: ``ids -> list[str]`` text of each image (for CLIP), or None.
        fid_ref: reference statistics for FID (name, URL or path), or None.
    """

    model: Any
    cond_for: Callable | None = None
    decode: Callable | None = None
    prompts_for: Callable | None = None
    fid_ref: str | None = None


# keys of conf/model/*.yaml that the runner reads and the model builders must not see
RUNNER_MODEL_KEYS = ("kind", "paper", "labels", "fid_ref", "shift")


def _model_kwargs(model_cfg) -> dict:
    return {k: v for k, v in dict(model_cfg).items() if k not in RUNNER_MODEL_KEYS}


def _build_gmm(model_cfg, device: str) -> Target:
    from .models import GaussianMixture

    dtype = getattr(torch, str(_get(model_cfg, "dtype", "float64")))
    try:
        model = GaussianMixture(
            dim=_get(model_cfg, "dim"),
            components=_get(model_cfg, "components"),
            layout_seed=_get(model_cfg, "layout_seed", 0),
            dtype=dtype,
            device=device,
        )
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return Target(model)


def uniform_labels(ids: torch.Tensor, seed: int, classes: int) -> torch.Tensor:
    """Class label of each image, uniform over ``classes``, keyed by ``(seed, image index)``.

    So an image keeps its label whatever the batch or shard it runs in, and every rule sees the same
    (label, noise) pairs.
    """
    u = rng.uniform(rng.base_key(seed, ids, "label", device=ids.device), 1)[:, 0]
    return (u * classes).long().clamp(max=classes - 1)


def _build_edm(model_cfg, device: str) -> Target:
    from .models import edm

    model = edm.build_edm_model({**_model_kwargs(model_cfg), "device": device})
    labels = _get(model_cfg, "labels", "none")
    if labels not in ("uniform", "none", None):
        raise ConfigError(f"model.labels={labels!r} is invalid: valid values are uniform, none.")
    cond_for = None
    if model.label_dim:
        if labels != "uniform":
            raise ConfigError(f"model.labels={labels!r} is invalid for a class-conditional net (label_dim={model.label_dim}): use uniform.")
        cond_for = lambda ids, seed: {"class_labels": uniform_labels(ids, seed, model.label_dim)}  # noqa: E731
    return Target(model, cond_for=cond_for, decode=lambda x: x.float().clamp(-1, 1), fid_ref=_get(model_cfg, "fid_ref"))


def _build_sd3(model_cfg, device: str) -> Target:
    from .models import sd3

    built = sd3.build_sd3_model({**_model_kwargs(model_cfg), "device": device})
    prompt_index = built.cond["prompt"]

    def cond_for(ids, seed):
        if int(ids.max()) >= prompt_index.numel():
            raise ConfigError(f"n_samples is invalid: the prompt plan has {prompt_index.numel()} images (model.prompts.n x images_per_prompt).")
        return {"prompt": prompt_index[ids.to(prompt_index.device)]}

    return Target(
        built.model,
        cond_for=cond_for,
        decode=lambda x: built.decode(x, output="signed"),
        prompts_for=lambda ids: [built.prompts[int(prompt_index[int(i)])] for i in ids],
    )


MODEL_BUILDERS: dict[str, Callable] = {"gmm": _build_gmm, "edm": _build_edm, "sd3": _build_sd3}


def build_target(model_cfg, device: str) -> Target:
    """Build the configured target; loading problems (missing weights, refused checksums) become ConfigErrors.

    Raises:
        ConfigError: unknown kind, a missing or untrusted checkpoint, unavailable weights.
    """
    try:
        return MODEL_BUILDERS[model_cfg["kind"]](model_cfg, device)
    except ConfigError:
        raise
    except (OSError, ValueError, ImportError) as e:
        raise ConfigError(f"model={model_cfg.get('name', model_cfg['kind'])!r} could not be loaded: {e}") from None


def build_tree(v: dict, horizon: int, cfg=None) -> tuple[DraftTree | None, int]:
    """The round tree and its nominal drafted-state budget ``B``.

    ``rmc`` (any rule limited to one child) runs a chain: of length ``B = K + ... + K^L`` with
    ``match=budget``, or with as many target rows as the (K, L) tree with ``match=verification``.
    Chains longer than the speculative horizon ``T - 2`` are built at that length: no round can use
    deeper nodes (eq. 11), so the law and every count are unchanged; the record keeps the nominal B.

    Returns:
        ``(tree, budget)``; ``(None, 0)`` for the standard sampler.
    """
    if v["coupling"] is None:
        return None, 0
    fn = COUPLINGS[v["coupling"]]
    K, L = v["K"], v["L"]
    if fn.max_children == 1:
        if v["match"] == "budget":
            length = uniform_budget(K, L)
        else:
            # rows of the (K, L) tree: |V| = B + 1 with leaves, |I| = 1 + K + ... + K^(L-1) without;
            # a chain of length l evaluates l + 1 rows with leaves and l without.
            length = uniform_budget(K, L) if v["evaluate_leaves"] else 1 + (uniform_budget(K, L - 1) if L > 1 else 0)
        return DraftTree.chain(min(length, horizon)), length
    if v["tree"] == "widths":
        tree = DraftTree.from_widths(v["widths"])
        return tree, tree.budget
    if v["tree"] == "optimal":
        from . import treesearch

        b = v["budget"] or uniform_budget(K, L)
        tree = treesearch.tree_for_config(b, v, cfg)
        return tree, b
    tree = DraftTree.uniform(K, L)
    return tree, tree.budget


def _stats(x: torch.Tensor) -> dict:
    x = x.double().cpu()
    n = x.numel()
    std = float(x.std()) if n > 1 else 0.0
    return {"mean": float(x.mean()), "std": std, "sem": std / math.sqrt(n) if n > 1 else 0.0}


@functools.lru_cache(maxsize=1)
def git_commit() -> str | None:
    """The current git commit of the source tree, or None."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parent, capture_output=True, text=True, timeout=5
        )
        return out.stdout.strip() or None
    except Exception:
        return None


def versions() -> dict:
    """Package, torch and git versions for the record."""
    return {"specsamp": __version__, "torch": torch.__version__, "python": sys.version.split()[0], "git": git_commit()}


def config_hash(cfg_dict: Mapping) -> str:
    """SHA-256 (first 16 hex) of the resolved config, key order independent.

    Keys that cannot change a result (``progress``, ``skip_existing``, ``logger``, ``threads``) are left out.
    """
    clean = {k: v for k, v in cfg_dict.items() if k not in ("progress", "skip_existing", "logger", "hydra", "threads")}
    blob = json.dumps(clean, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def _progress_enabled(flag) -> bool:
    if flag == "auto":
        return sys.stderr.isatty()
    return bool(flag)


def _concat(results: list[SampleResult]) -> SampleResult:
    if len(results) == 1:
        return results[0]
    cat = lambda name: torch.cat([getattr(r, name) for r in results])  # noqa: E731
    return SampleResult(
        samples=cat("samples"),
        calls=cat("calls"),
        nfe=cat("nfe"),
        target_rows=cat("target_rows"),
        rounds=cat("rounds"),
        committed=cat("committed"),
        attempts=cat("attempts"),
        accepts=cat("accepts"),
        speculative_steps=results[0].speculative_steps,
        batch_calls=max(r.batch_calls for r in results),
        extra={"batch_speedups": [r.batch_speedup for r in results]},
    )


def _available_bytes(device: str) -> int | None:
    try:
        if device.startswith("cuda"):
            return int(torch.cuda.mem_get_info(torch.device(device))[0])
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError, RuntimeError):
        return None


def check_tree_memory(tree: DraftTree, batch: int, model, device: str) -> None:
    """Refuse a ``tree`` execution whose node states cannot fit, before allocating anything.

    The tree execution holds, per trajectory of a batch and per node, the state and the velocity in the
    model's dtype, plus the float64 noise of one layer; this estimates that and compares it with the
    free memory of ``device``.

    Raises:
        ConfigError: the estimate exceeds 80% of the free memory (the message gives a batch size that fits).
    """
    numel = int(np.prod(model.event_shape))
    per_traj = len(tree) * numel * (2 * torch.tensor([], dtype=model.dtype).element_size()) + len(tree) * numel * 8
    free = _available_bytes(device)
    if free is None or batch * per_traj <= 0.8 * free:
        return
    fits = max(int(0.8 * free // per_traj), 0)
    raise ConfigError(
        f"execution=tree with batch_size={batch} needs about {batch * per_traj / 2**30:.1f} GiB for {len(tree)} nodes per "
        f"trajectory, but {device} has {free / 2**30:.1f} GiB free: use batch_size={fits} or less"
        + (", or execution=path (same law and counts, only the visited nodes)." if fits else "; use execution=path (same law and counts, only the visited nodes).")
    )


def calibrate_profile(target: Target, schedule: Schedule, v: dict, n: int = 64, K: int = 2, L: int = 8) -> list[float]:
    """Displacement ``delta`` per depth for ``tree=optimal``, from a short calibration run.

    Runs D-GRS with the configured draft on a uniform ``(K, L)`` tree for ``min(n, n_samples)``
    trajectories under its own seed (``seed + 1000003``: the main run's randomness is untouched, so the
    tree it gets is independent of its samples and exactness is kept), and inverts each depth's
    measured acceptance into ``delta`` (:func:`specsamp.treesearch.deltas_from_acceptance`).

    Returns:
        ``delta`` per depth ``1..L``.
    """
    from .treesearch import deltas_from_acceptance

    m = min(n, v["n_samples"])
    tree = DraftTree.uniform(K, min(L, schedule.steps - 2))
    ids = torch.arange(m, device=torch.device(getattr(target.model, "device", "cpu")))
    cond = target.cond_for(ids, v["seed"]) if target.cond_for is not None else None
    r = sample_speculative(target.model, schedule, tree, "dgrs", seed=v["seed"] + 1_000_003, indices=ids, cond=cond,
                           draft=v["draft"], prefetch=v["prefetch"], evaluate_leaves=v["evaluate_leaves"],
                           max_batch=v["max_batch"], warmup=v["warmup"])
    rates = (r.accepts.sum(0).double() / r.attempts.sum(0).double().clamp_min(1)).cpu().numpy()
    return [float(d) for d in deltas_from_acceptance(rates, K, "dgrs")]


def summarize_result(res: SampleResult, steps: int, batch_speedups: list[float]) -> dict:
    """The statistics block of a record, from per-trajectory arrays (also used to merge shards).

    Args:
        res: the run's (or the merged shards') :class:`SampleResult`.
        steps: ``T``.
        batch_speedups: speedup of every batch that ran.

    Returns:
        ``nfe``, ``nfe_total``, ``speedup``, ``nfe_speedup`` (each ``{mean, std, sem}``), ``batch_speedup``,
        ``target_rows``, ``rounds``, ``committed_per_round``, acceptance per depth and pooled.
    """
    attempts = res.attempts.sum(0).double().cpu()
    accepts = res.accepts.sum(0).double().cpu()
    rounds = res.rounds.double().sum()
    return {
        "nfe": _stats(res.calls),
        "nfe_total": _stats(res.nfe),
        "speedup": _stats(res.speedup),
        "nfe_speedup": _stats(steps / res.nfe.double()),
        "batch_speedup": float(np.mean(batch_speedups)),
        "target_rows": _stats(res.target_rows),
        "rounds": _stats(res.rounds),
        "committed_per_round": float(res.committed.double().sum().cpu() / rounds.cpu()) if rounds > 0 else 0.0,
        "acceptance_per_depth": (accepts / attempts.clamp_min(1)).tolist() if attempts.numel() else [],
        "acceptance_pooled": float(accepts.sum() / attempts.sum().clamp_min(1)) if attempts.numel() else None,
        "attempts_per_depth": attempts.tolist(),
    }


def run_config(
    cfg_dict: Mapping, *, model=None, cond: dict | None = None, indices=None, target: Target | None = None
) -> tuple[dict, SampleResult]:
    """Run one configuration and return ``(record, result)``.

    Args:
        cfg_dict: resolved config as a plain dict (keys of ``conf/config.yaml``).
        model: an already-built model to use instead of ``cfg.model`` (tests, notebooks).
        cond: per-trajectory conditioning for ``model`` (``{name: [n_samples, ...]}``).
        indices: trajectory ids to run (a shard), each in ``[0, n_samples)``; default all. Trajectory
            ``i``'s randomness is keyed by ``(seed, i)``, so any split reproduces the full run bitwise.
        target: an already-built :class:`Target` (overrides ``model``).

    Returns:
        The JSON-ready record (see DESIGN.md "Records") and the concatenated :class:`SampleResult`;
        ``result.extra`` holds ``target`` and ``indices`` for post-processing (images, metrics).

    Raises:
        ConfigError: invalid configuration, or a model that cannot be loaded.
    """
    v = validate(cfg_dict)
    if v["threads"] is not None:
        torch.set_num_threads(v["threads"])
    t0 = time.perf_counter()
    model_cfg = cfg_dict["model"]
    if target is None:
        target = Target(model) if model is not None else build_target(model_cfg, v["device"])
    try:
        schedule = Schedule.make(v["steps"], v["eps"], shift=float(model_cfg.get("shift", 1.0)))
    except ValueError as e:
        raise ConfigError(str(e)) from None
    horizon = schedule.steps - 2
    tree_cfg = cfg_dict
    calibrated = None
    if v["tree"] == "optimal" and cfg_dict.get("delta_profile") is None:
        calibrated = calibrate_profile(target, schedule, v)
        tree_cfg = {**cfg_dict, "delta_profile": calibrated}
    try:
        tree, B = build_tree(v, horizon, tree_cfg)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    ids = torch.arange(v["n_samples"]) if indices is None else torch.as_tensor(indices, dtype=torch.long).reshape(-1)
    if ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= v["n_samples"]:
        raise ConfigError(f"indices are invalid: need a non-empty set of trajectory ids in [0, n_samples={v['n_samples']}).")
    bs = v["batch_size"] or ids.numel()
    if tree is not None and v["execution"] == "tree":
        check_tree_memory(tree.restrict(min(tree.max_depth, horizon)), bs, target.model, v["device"])
    from tqdm.auto import tqdm

    bar = tqdm(total=ids.numel(), unit="traj", disable=not _progress_enabled(v["progress"]), leave=False)
    dev = torch.device(getattr(target.model, "device", v["device"]))
    results = []
    for start in range(0, ids.numel(), bs):
        chunk = ids[start : start + bs].to(dev)
        if cond is not None:
            sub_cond = {k: c[chunk.cpu()].to(dev) for k, c in cond.items()}
        elif target.cond_for is not None:
            sub_cond = target.cond_for(chunk, v["seed"])
        else:
            sub_cond = {}
        common = dict(seed=v["seed"], indices=chunk, cond=sub_cond, max_batch=v["max_batch"])
        if tree is None:
            r = sample_standard(target.model, schedule, **common)
        else:
            r = sample_speculative(
                target.model, schedule, tree, v["coupling"], draft=v["draft"], prefetch=v["prefetch"],
                evaluate_leaves=v["evaluate_leaves"], execution=v["execution"], warmup=v["warmup"], **common,
            )
        results.append(r)
        bar.update(chunk.numel())
    bar.close()
    res = _concat(results)
    res.extra.update(target=target, indices=ids)
    record = {
        "status": "ok",
        "config": dict(cfg_dict),
        "config_hash": config_hash(cfg_dict),
        "model": model_cfg.get("name", model_cfg["kind"]),
        "sampler": v["sampler"],
        "K": v["K"],
        "L": v["L"],
        "eps": v["eps"],
        "steps": v["steps"],
        "n_samples": v["n_samples"],
        "tree": tree.describe() if tree is not None else "none",
        "budget": B,
        "verification_rows": tree.verification_budget(v["evaluate_leaves"]) if tree is not None else 1,
        **({"delta_profile": calibrated, "tree_parent": tree.parent.tolist()} if v["tree"] == "optimal" and tree is not None else {}),
        **summarize_result(res, schedule.steps, [r.batch_speedup for r in results]),
        "wall_seconds": time.perf_counter() - t0,
        "versions": versions(),
    }
    return record, res


def save_images(result: SampleResult, out_dir: Path) -> Path | None:
    """Decode an image model's samples; write one PNG per image (named by global index) and a grid.

    Returns:
        The images directory, or None for a target that is not an image model.
    """
    target: Target = result.extra["target"]
    if target.decode is None:
        return None
    from . import images as img

    pics = target.decode(result.samples).cpu()
    ids = result.extra["indices"].cpu()
    img.save_images(pics, Path(out_dir) / "images", indices=ids.tolist())
    img.save_grid(pics[:64], Path(out_dir) / "grid.png")
    return Path(out_dir) / "images"


def compute_metrics(names, result: SampleResult, image_dir: Path | None, cfg_dict: Mapping) -> dict:
    """Score saved samples: ``fid`` (torch-fidelity against ``model.fid_ref``) and ``clip`` (per image).

    Raises:
        ConfigError: a metric that does not apply to the model, or weights/statistics that are unavailable.
    """
    out: dict = {}
    target: Target = result.extra["target"]
    for name in names:
        if image_dir is None:
            raise ConfigError(f"metrics=[{name}] is invalid for model={cfg_dict['model'].get('name')}: it scores images.")
        try:
            if name == "fid":
                from .metrics.fid import compute_fid

                if not target.fid_ref:
                    raise ConfigError("metrics=[fid] needs model.fid_ref (reference statistics: name, URL or .npz path).")
                features = cfg_dict["model"].get("fid_features") or "inception-v3-compat"
                out["fid"] = float(compute_fid(str(image_dir), target.fid_ref, feature_extractor=features)["fid"])
            elif name == "clip":
                from .metrics import clip

                if target.prompts_for is None:
                    raise ConfigError("metrics=[clip] is invalid: the model has no prompts.")
                model, preprocess, tokenizer = clip.load_clip(device=str(cfg_dict.get("device", "cpu")))
                pics = target.decode(result.samples).cpu()
                scores = clip.clip_scores(pics, target.prompts_for(result.extra["indices"]), model=model,
                                          preprocess=preprocess, tokenizer=tokenizer)
                summ = clip.summarize(scores)
                out.update(clip_score=summ["mean"], clip_score_sem=summ["sem"], clip_scores=[float(x) for x in scores])
        except ConfigError:
            raise
        except (OSError, ValueError, ImportError) as e:
            raise ConfigError(f"metrics=[{name}] could not be computed: {e}") from None
    return out


def existing_record(out_dir: str | os.PathLike, cfg_hash: str) -> dict | None:
    """The record in ``out_dir/result.json`` if it exists, is complete and has ``cfg_hash``; else None."""
    p = Path(out_dir) / "result.json"
    if not p.exists():
        return None
    try:
        rec = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if rec.get("config_hash") == cfg_hash and rec.get("status") == "ok":
        return rec
    return None


def summary_line(rec: dict) -> str:
    """One-line result, e.g. ``model=gmm sampler=dgrs K=2 L=3 eps=0.1 B=14  speedup 1.99x ± 0.02  NFE 14.1 (...)``."""
    if rec["sampler"] == "standard":
        head = f"model={rec['model']} sampler=standard eps={rec['eps']:g} T={rec['steps']}"
    elif (rec.get("config") or {}).get("tree", "uniform") != "uniform":
        head = f"model={rec['model']} sampler={rec['sampler']} tree={rec['tree']} eps={rec['eps']:g} B={rec['budget']}"
    else:
        head = f"model={rec['model']} sampler={rec['sampler']} K={rec['K']} L={rec['L']} eps={rec['eps']:g} B={rec['budget']}"
    sp = rec["speedup"]
    return (
        f"{head}  speedup {sp['mean']:.2f}x ± {sp['sem']:.2f}  NFE {rec['nfe']['mean']:.1f}  "
        f"({rec['n_samples']} trajectories, {rec['wall_seconds']:.1f} s)"
        + (f"  FID {rec['fid']:.3f}" if isinstance(rec.get("fid"), float) else "")
    )
