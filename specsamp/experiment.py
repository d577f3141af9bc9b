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


from .errors import ConfigError  # noqa: E402,F401  (re-exported)


# ----------------------------------------------------------------------------------------------
# validation


def _get(cfg, key, default=None):
    if isinstance(cfg, Mapping):
        return cfg.get(key, default)
    return getattr(cfg, key, default)


def closest_key(name: str, valid=None) -> str | None:
    """The valid key nearest to a mistyped ``name`` (:func:`difflib.get_close_matches`), or None.

    Args:
        name: the key as typed, e.g. ``Kk``, ``+Kk`` or ``model.dtpye``.
        valid: candidate keys (default: :data:`KNOWN_KEYS` without ``hydra``).
    """
    import difflib

    name = str(name).lstrip("+~")
    pool = sorted(valid if valid is not None else KNOWN_KEYS - {"hydra"})
    exact = [k for k in pool if k.lower() == name.lower()]
    if exact:
        return exact[0]
    hit = difflib.get_close_matches(name, pool, n=1, cutoff=0.5)
    return hit[0] if hit else None


def unknown_key_message(name: str, value=None, valid=None, shown: str | None = None) -> str:
    """One paragraph for a key that is not in the config, naming the closest valid key."""
    valid = sorted(valid if valid is not None else KNOWN_KEYS - {"hydra"})
    guess = closest_key(name.rsplit(".", 1)[-1], [k.rsplit(".", 1)[-1] for k in valid])
    if guess is not None:
        guess = next(k for k in valid if k.rsplit(".", 1)[-1] == guess)
    shown = shown or (f"{name}={value!r}" if value is not None else f"{name!r}")
    return (f"{shown} is not a key of specsamp's config" + (f"; did you mean {guess}? (e.g. {guess}=...)" if guess else "")
            + f". Valid keys here: {', '.join(valid)} (see conf/config.yaml and the README).")


# config groups that a command line may select besides the top-level keys (`shape=k2l3`, `+experiment=...`)
_GROUPS = ("shape", "experiment")


def check_override_keys(argv: list[str], conf_dir: str | os.PathLike) -> str | None:
    """The message for the first command-line override that names no key of the config, else None.

    Runs before Hydra composes anything, so a typo (``Kk=3``, ``+Kk=3``, ``model.dtpye=float32``) gets
    one paragraph naming the closest valid key instead of Hydra's advice to append it with ``+``.
    Top-level keys are :data:`KNOWN_KEYS` and the groups ``shape``/``experiment``; a dotted key under
    ``model``, ``sampler`` or ``logger`` must be a key of some option of that group (``conf/<group>/*.yaml``).
    Options (``-m``, ``--cfg job``), ``hydra...`` keys, group paths (``hydra/launcher=...``) and deletions
    (``~key``) are left to Hydra.
    """
    from omegaconf import OmegaConf

    top = sorted((KNOWN_KEYS - {"hydra"}) | set(_GROUPS))
    for arg in argv:
        if arg.startswith("-") or "=" not in arg or arg.startswith("~"):
            continue
        key = arg.split("=", 1)[0].lstrip("+")
        if "/" in key or "@" in key or key.split(".")[0] == "hydra":
            continue
        head, _, rest = key.partition(".")
        if head not in top:
            return unknown_key_message(key, valid=top, shown=arg.lstrip("+"))
        if rest and head in ("model", "sampler", "logger") and not arg.startswith("+"):
            sub = set()
            for f in Path(conf_dir, head).glob("*.yaml"):
                try:
                    sub |= {f"{head}.{k}" for k in OmegaConf.load(f).keys()}
                except Exception:
                    return None  # a config Hydra will report itself
            if key.split(".")[0] + "." + rest.split(".")[0] not in sub:
                return unknown_key_message(key, valid=sorted(sub), shown=arg)
    return None


def refuse_unknown_overrides(argv: list[str], conf_dir: str | os.PathLike) -> None:
    """:func:`check_override_keys`, printed as ``error: ...`` with exit status 2 (``run.py`` calls this)."""
    msg = check_override_keys(argv, conf_dir)
    if msg is not None:
        print(f"error: {msg}", file=sys.stderr)
        sys.exit(2)


def _int(cfg, key: str, lo: int, hi: int | None = None, hi_text: str = "") -> int:
    v = _get(cfg, key)
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo or (hi is not None and v >= hi):
        rng_txt = f">= {lo}" if hi is None else f"in [{lo}, {hi_text or hi})"
        raise ConfigError(f"{key}={v!r} is invalid: must be an integer {rng_txt}.")
    return int(v)


def _opt_int(cfg, key: str, lo: int) -> int | None:
    v = _get(cfg, key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo:
        raise ConfigError(f"{key}={v!r} is invalid: must be an integer >= {lo}, or null.")
    return int(v)


def _bool(cfg, key: str, default=None) -> bool:
    v = _get(cfg, key, default)
    if not isinstance(v, bool):
        raise ConfigError(f"{key}={v!r} is invalid: must be true or false (YAML booleans; strings such as 'no' or "
                          "'yes' are not accepted).")
    return v


def _choice(cfg, key: str, valid) -> Any:
    v = _get(cfg, key)
    if v not in valid:
        raise ConfigError(f"{key}={v!r} is invalid: valid values are {', '.join(map(str, valid))}.")
    return v


# the optimal-tree calibration runs under seed + CALIBRATION_SEED_OFFSET, its own random streams
CALIBRATION_SEED_OFFSET = 1_000_003
# 0 <= seed < 2**59: the rng keys hold 60-bit seeds (rng.MAX_SEED), with room for the calibration offset
SEED_BOUND = 2**59
assert SEED_BOUND + CALIBRATION_SEED_OFFSET <= rng.MAX_SEED
DTYPES = ("float16", "bfloat16", "float32", "float64")


def check_device(device) -> str:
    """``device`` if torch can use it here, else a :class:`ConfigError` naming what is available.

    Valid: ``cpu``, ``cuda`` and ``cuda:N`` with ``N`` below the number of visible CUDA devices.
    """
    d = str(device)
    if d == "cpu":
        return d
    if d == "cuda" or (d.startswith("cuda:") and d[5:].isdigit()):
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n == 0:
            raise ConfigError(f"device={d!r} is invalid here: torch sees no CUDA device on this machine; use device=cpu.")
        if d != "cuda" and int(d[5:]) >= n:
            raise ConfigError(f"device={d!r} is invalid: torch sees {n} CUDA device(s), cuda:0..cuda:{n - 1}.")
        return d
    raise ConfigError(f"device={d!r} is invalid: specsamp runs on cpu, cuda or cuda:N (N a visible CUDA device; "
                      "other torch backends such as mps are not supported).")


def unused_keys(cfg) -> dict:
    """Keys that the configured sampler and tree never read, with the value that stands for them in the hash.

    ``sampler=standard`` reads none of the tree keys (``K``, ``L``, ``draft``, ...); a one-child rule
    (``rmc``) reads ``match`` but no tree-search key; a tree rule does not read ``match``; ``tree=uniform``
    ignores ``widths`` and the search keys, ``tree=widths`` ignores ``K``, ``L`` and the search keys,
    ``tree=optimal`` ignores ``widths`` (and ``K``, ``L`` once ``budget`` is given). Such keys stay in the
    record's config (and are listed under ``unused`` when set away from their default) but are hashed at
    their default value, so setting them neither changes a result nor its config hash.

    Returns:
        ``{key: default}`` for every unused key.
    """
    paper = _get(_get(cfg, "model") or {}, "paper") or {}
    default = {"K": _get(paper, "K"), "L": _get(paper, "L"), "draft": "velocity", "prefetch": "nearest",
               "warmup": "call", "evaluate_leaves": True, "match": "budget", "execution": "path", "tree": "uniform",
               "widths": None, "budget": None, "delta_profile": None, "max_depth": None, "max_width": None}
    sampler = _get(cfg, "sampler") or {}
    coupling = _get(sampler, "coupling")
    search = ("widths", "budget", "delta_profile", "max_depth", "max_width")
    if _get(sampler, "name") in SAMPLERS_BUILTIN or coupling is None:
        keys = list(default)
    elif coupling in COUPLINGS and COUPLINGS[coupling].max_children == 1:
        keys = list(search)
    else:
        tree = _get(cfg, "tree", "uniform")
        tree = tree if isinstance(tree, str) else ""
        keys = ["match"] + {"uniform": list(search), "widths": ["K", "L", *search[1:]],
                            "optimal": ["widths"] + (["K", "L"] if _get(cfg, "budget") is not None else [])}.get(tree, [])
    return {k: default[k] for k in keys}


def validate(cfg) -> dict:
    """Check every top-level key (and ``model.dtype``) and return the typed values the runner uses.

    Strict: booleans must be YAML booleans, integers integers, every value in its documented range
    (README, "Config keys"). Nothing is allocated here; sizes that follow from the config are checked
    against free memory by :func:`check_memory` before they are allocated.

    Raises:
        ConfigError: the first invalid key, with its value and the valid range.
    """
    out = {}
    if isinstance(cfg, Mapping):
        unknown = sorted(set(cfg) - KNOWN_KEYS)
        if unknown:
            raise ConfigError(unknown_key_message(unknown[0], cfg[unknown[0]]))
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
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(float(eps)):
        raise ConfigError(f"eps={eps!r} is invalid: the churn must be a finite number in (0, 1].")
    if not (0.0 < float(eps) <= 1.0):
        raise ConfigError(f"eps={eps!r} is invalid: the churn must lie in (0, 1] (eps=0 is the deterministic ODE, where speculation is vacuous).")
    out["eps"] = float(eps)
    out["steps"] = _int(cfg, "steps", 3)
    out["n_samples"] = _int(cfg, "n_samples", 1)
    out["seed"] = _int(cfg, "seed", 0, SEED_BOUND, "2**59")
    out["draft"] = _choice(cfg, "draft", sorted(DRAFTS))
    out["prefetch"] = _choice(cfg, "prefetch", PREFETCH)
    out["execution"] = _choice(cfg, "execution", EXECUTIONS)
    out["warmup"] = _choice(cfg, "warmup", WARMUPS)
    out["match"] = _choice(cfg, "match", MATCH)
    out["tree"] = _choice(cfg, "tree", TREES)
    out["evaluate_leaves"] = _bool(cfg, "evaluate_leaves")
    out["save_samples"] = _bool(cfg, "save_samples", False)
    out["skip_existing"] = _bool(cfg, "skip_existing", True)
    for key in ("batch_size", "max_batch", "budget", "threads", "max_depth", "max_width"):
        out[key] = _opt_int(cfg, key, 1)
    widths = _get(cfg, "widths")
    if widths is not None and (isinstance(widths, (str, bytes)) or not isinstance(widths, (list, tuple))
                               or len(widths) == 0
                               or any(isinstance(w, bool) or not isinstance(w, int) or w < 1 for w in widths)):
        raise ConfigError(f"widths={widths!r} is invalid: need a non-empty list of integers >= 1, e.g. widths=[3,2,2], or null.")
    if out["tree"] == "widths":
        if widths is None:
            raise ConfigError("widths=None is invalid: tree=widths needs a non-empty list of integers >= 1, e.g. widths=[3,2,2].")
        out["widths"] = [int(w) for w in widths]
    profile = _get(cfg, "delta_profile")
    if profile is not None and (isinstance(profile, (str, bytes)) or not isinstance(profile, (list, tuple)) or len(profile) == 0
                                or any(isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or x < 0
                                       for x in profile)):
        raise ConfigError(f"delta_profile={profile!r} is invalid: need a non-empty list of finite values >= 0, or null (calibrate).")
    out["device"] = check_device(_get(cfg, "device", "cpu"))
    progress = _get(cfg, "progress", "auto")
    if progress not in ("auto", True, False) or (progress != "auto" and not isinstance(progress, bool)):
        raise ConfigError(f"progress={progress!r} is invalid: valid values are auto (a bar on a terminal, a line every "
                          "30 s in a log), true, false.")
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
    for key in ("dtype", "net_dtype"):
        dt = _get(model, key)
        if dt is not None and str(dt).removeprefix("torch.") not in DTYPES:
            raise ConfigError(f"model.{key}={dt!r} is invalid: valid values are {', '.join(DTYPES)}"
                              + (", null." if key == "net_dtype" else "."))
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
        decode: ``samples [m, *event] -> images [m, C, H, W]`` float in ``[-1, 1]`` (the one image
            convention of :mod:`specsamp.images`, which every metric takes), or None (not images).
        prompts_for: ``ids -> list[str]`` text of each image (for CLIP), or None.
        fid_ref: reference statistics for FID (name, URL or ``.npz`` path), or None.
        fid: further FID settings for :func:`specsamp.metrics.fid.compute_fid` (``feature_extractor``,
            ``feature_layer``, ``weights_path``), from the model config's ``fid_*`` keys.
        clip: :func:`specsamp.metrics.clip.load_clip` settings from the model config's ``clip`` block.
        max_batch: the model's own rows per forward pass (used when the top-level ``max_batch`` is null).
    """

    model: Any
    cond_for: Callable | None = None
    decode: Callable | None = None
    prompts_for: Callable | None = None
    fid_ref: str | None = None
    fid: dict | None = None
    clip: dict | None = None
    max_batch: int | None = None


# the model config's FID keys -> compute_fid's arguments; one reference and one extractor per model
FID_KEYS = {"fid_extractor": "feature_extractor", "fid_layer": "feature_layer", "fid_weights": "weights_path"}
# the model config's `clip` block -> load_clip's arguments (paper section 5.3: ViT-L/14, OpenAI weights)
CLIP_DEFAULTS = {"model": "ViT-L-14-quickgelu", "pretrained": "openai", "checkpoint": None, "quick_gelu": None,
                 "cache_dir": None}


def fid_settings(model_cfg) -> dict:
    """``compute_fid`` keyword arguments from a model config's ``fid_extractor``/``fid_layer``/``fid_weights``.

    ``fid_extractor`` names a torch-fidelity extractor (default ``inception-v3-compat``) or
    ``package.module:Class``; ``fid_layer`` its feature (null: the extractor's FID default);
    ``fid_weights`` a local weights file (null: torch-fidelity's own cache).

    Raises:
        ConfigError: a value that is not a string (or null).
    """
    out = {}
    for key, arg in FID_KEYS.items():
        v = _get(model_cfg, key)
        if v is not None and not isinstance(v, str):
            raise ConfigError(f"model.{key}={v!r} is invalid: must be a string or null.")
        if v is not None:
            out[arg] = v
    return out


def clip_settings(model_cfg) -> dict:
    """``load_clip`` settings from a model config's ``clip`` block (keys and defaults: :data:`CLIP_DEFAULTS`).

    Raises:
        ConfigError: an unknown key or a value of the wrong type.
    """
    block = _get(model_cfg, "clip") or {}
    if not isinstance(block, Mapping):
        raise ConfigError(f"model.clip={block!r} is invalid: must be a mapping with keys {', '.join(CLIP_DEFAULTS)}.")
    unknown = sorted(set(block) - set(CLIP_DEFAULTS))
    if unknown:
        raise ConfigError(f"model.clip.{unknown[0]}={block[unknown[0]]!r} is not a key; valid: {', '.join(CLIP_DEFAULTS)}.")
    out = {**CLIP_DEFAULTS, **dict(block)}
    for key in ("model", "pretrained", "checkpoint", "cache_dir"):
        if out[key] is not None and not isinstance(out[key], str):
            raise ConfigError(f"model.clip.{key}={out[key]!r} is invalid: must be a string{' or null' if key != 'model' else ''}.")
    if out["model"] is None:
        raise ConfigError("model.clip.model=None is invalid: name an open_clip model, e.g. ViT-L-14-quickgelu.")
    if out["quick_gelu"] is not None and not isinstance(out["quick_gelu"], bool):
        raise ConfigError(f"model.clip.quick_gelu={out['quick_gelu']!r} is invalid: must be true, false or null.")
    return out


# keys of conf/model/*.yaml that the runner reads (schedule, record, metrics) and the model builders
# must not see, per model kind; every other key goes to the kind's builder, which rejects what it
# does not know, so that no key of a model config is silently dropped
RUNNER_MODEL_KEYS = {
    "gmm": ("kind", "name", "paper", "shift"),
    "edm": ("kind", "paper", "shift", "labels", "fid_ref", *FID_KEYS, "max_batch"),
    "sd3": ("kind", "paper", "shift", "clip"),
}


def _model_kwargs(model_cfg) -> dict:
    skip = RUNNER_MODEL_KEYS.get(_get(model_cfg, "kind"), ("kind", "paper", "shift"))
    return {k: v for k, v in dict(model_cfg).items() if k not in skip}


def _max_batch(model_cfg) -> int | None:
    v = _get(model_cfg, "max_batch")
    if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
        raise ConfigError(f"model.max_batch={v!r} is invalid: must be null or an integer >= 1.")
    return v


def _build_gmm(model_cfg, device: str) -> Target:
    from .models import GaussianMixture

    unknown = sorted(set(_model_kwargs(model_cfg)) - {"dim", "components", "layout_seed", "dtype"})
    if unknown:
        raise ConfigError(f"model.{unknown[0]}={_get(model_cfg, unknown[0])!r} is not a key of model=gmm; valid: "
                          "dim, components, layout_seed, dtype, shift, name, paper.")
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
    if labels == "uniform" and not model.label_dim:
        raise ConfigError("model.labels='uniform' is invalid for an unconditional net (label_dim=0): use none.")
    if model.label_dim:
        if labels != "uniform":
            raise ConfigError(f"model.labels={labels!r} is invalid for a class-conditional net (label_dim={model.label_dim}): use uniform.")
        cond_for = lambda ids, seed: {"class_labels": uniform_labels(ids, seed, model.label_dim)}  # noqa: E731
    return Target(model, cond_for=cond_for, decode=lambda x: x.float().clamp(-1, 1), fid_ref=_get(model_cfg, "fid_ref"),
                  fid=fid_settings(model_cfg), max_batch=_max_batch(model_cfg))


def _build_sd3(model_cfg, device: str) -> Target:
    from .models import sd3

    clip_cfg = clip_settings(model_cfg)
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
        clip=clip_cfg,
        max_batch=built.max_batch,
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


def build_tree(v: dict, horizon: int, cfg=None, callback=None) -> tuple[DraftTree | None, int]:
    """The round tree and its nominal drafted-state budget ``B``.

    ``rmc`` (any rule limited to one child) runs a chain: of length ``B = K + ... + K^L`` with
    ``match=budget``, or with as many target rows as the (K, L) tree with ``match=verification``.
    Chains and trees deeper than the speculative horizon ``T - 2`` are built only to that depth: no
    round can use deeper nodes (eq. 11), so the law and every count are unchanged; the record keeps the
    nominal B. The tree's size is checked against free memory before it is built.

    Args:
        callback: progress of ``tree=optimal``'s search, ``callback(depths_done, depths)``.

    Returns:
        ``(tree, budget)``; ``(None, 0)`` for the standard sampler.

    Raises:
        ConfigError: a tree (or its search) that does not fit in memory.
        ValueError: invalid tree-search settings.
    """
    if v["coupling"] is None:
        return None, 0
    fn = COUPLINGS[v["coupling"]]
    K, L = v["K"], v["L"]
    check_tree_nodes(v, horizon)
    if fn.max_children == 1:
        if v["match"] == "budget":
            length = uniform_budget(K, L)
        else:
            # rows of the (K, L) tree: |V| = B + 1 with leaves, |I| = 1 + K + ... + K^(L-1) without;
            # a chain of length l evaluates l + 1 rows with leaves and l without.
            length = uniform_budget(K, L) if v["evaluate_leaves"] else 1 + (uniform_budget(K, L - 1) if L > 1 else 0)
        return DraftTree.chain(min(length, horizon)), length
    if v["tree"] == "widths":
        tree = DraftTree.from_widths(v["widths"][:horizon])
        return tree, _widths_budget(v["widths"])
    if v["tree"] == "optimal":
        from . import treesearch

        b = v["budget"] or uniform_budget(K, L)
        tree = treesearch.tree_for_config(b, v, cfg, callback=callback, free_bytes=available_bytes("cpu"))
        return tree, b
    tree = DraftTree.uniform(K, min(L, horizon))
    return tree, uniform_budget(K, L)


def _widths_budget(widths) -> int:
    total, layer = 0, 1
    for w in widths:
        layer *= w
        total += layer
    return total


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

    Keys that cannot change a result (``progress``, ``skip_existing``, ``logger``, ``threads``) are left out,
    and keys the sampler does not read (:func:`unused_keys`) are hashed at their default value.
    """
    clean = {k: v for k, v in cfg_dict.items() if k not in ("progress", "skip_existing", "logger", "hydra", "threads")}
    try:
        unused = unused_keys(cfg_dict)
    except (TypeError, AttributeError):  # an invalid config: validate() reports it
        unused = {}
    clean.update({k: d for k, d in unused.items() if k in clean})
    blob = json.dumps(clean, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


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

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.close()
        return False


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


_available_bytes = available_bytes  # the old private name


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
    raise ConfigError(f"{what} needs about {_gib(nbytes)} of memory, but {device} has {_gib(free)} available"
                      + (f": {hint}" if hint else "."))


def _gib(nbytes: float) -> str:
    if nbytes < 2**30:
        return f"{nbytes / 2**20:.3g} MiB"
    return f"{nbytes / 2**30:.3g} GiB" if nbytes < 2**60 else f"{nbytes / 2**30:.2e} GiB"


TREE_BYTES_PER_NODE = 160  # DraftTree's arrays, their construction and the sampler's tensor copies (int64)


def tree_nodes(v: dict, horizon: int) -> int:
    """Nodes of the tree :func:`build_tree` would build, computed without building it (0: no tree)."""
    if v["coupling"] is None:
        return 0
    K, L = v["K"], v["L"]
    if COUPLINGS[v["coupling"]].max_children == 1:
        return min(uniform_budget(K, L), horizon) + 1
    if v["tree"] == "widths":
        widths = v["widths"][:horizon]
    elif v["tree"] == "optimal":
        return 0  # sized by the search (specsamp.treesearch.check_search)
    else:
        widths = [K] * min(L, horizon)
    nodes, layer = 1, 1
    for w in widths:
        layer *= w
        nodes += layer
    return nodes


def check_tree_nodes(v: dict, horizon: int) -> None:
    """Refuse a draft tree (:func:`tree_nodes`) whose arrays cannot fit in host memory, before building it.

    Raises:
        ConfigError: names the shape, the node count, the bytes needed and available.
    """
    nodes = tree_nodes(v, horizon)
    shape = f"widths={v['widths']}" if v["tree"] == "widths" else f"K={v['K']}, L={v['L']}"
    check_memory(f"the draft tree ({shape}: {nodes:.3g} nodes within the T-2={horizon} speculative steps)",
                 nodes * TREE_BYTES_PER_NODE, "cpu", "lower K or L (or widths).")


def check_tree_memory(tree: DraftTree | None, batch: int, model, device: str, *, execution: str = "tree",
                      n_total: int | None = None, steps: int | None = None) -> None:
    """Refuse a run whose sampler states cannot fit, before allocating anything.

    ``execution=tree`` holds, per trajectory of a batch and per node, the state and the velocity in
    the model's dtype plus float64 drafting noise; ``execution=path`` holds about ``2 K + 16`` states
    per trajectory (the walk's current, children, means, noise); the standard sampler about 8. Every run
    also keeps all ``n_total`` samples (twice while batches are concatenated) and per-step counters.

    Raises:
        ConfigError: the estimate exceeds 80% of the available memory; the message gives a batch size
            that fits, or says that ``n_samples`` itself is too large.
    """
    numel = int(np.prod(model.event_shape))
    elem = torch.tensor([], dtype=model.dtype).element_size()
    if tree is None:
        per_traj = 8 * numel * max(elem, 8)
    elif execution == "tree":
        per_traj = len(tree) * numel * (2 * elem + 8) + 4 * numel * max(elem, 8)
    else:
        widest = int(tree.num_children.max()) if len(tree) > 1 else 1
        per_traj = (2 * widest + 16) * numel * max(elem, 8)
    n_total = batch if n_total is None else n_total
    depth = tree.max_depth if tree is not None else 0
    fixed = n_total * (2 * numel * elem + 8 * 3 * ((steps or 0) + 2 * depth))
    free = available_bytes(device)
    need = fixed + batch * per_traj
    if free is None or need <= 0.8 * free:
        return
    fits = max(int((0.8 * free - fixed) // per_traj), 0)
    what = (f"execution={execution} with {len(tree)} nodes per round" if tree is not None and execution == "tree"
            else f"sampler={'standard' if tree is None else 'speculative'} (execution={execution})")
    if fits == 0:
        raise ConfigError(
            f"n_samples={n_total} with batch_size={batch} needs about {_gib(need)}, but {device} has {_gib(free)} "
            f"available: even one trajectory per batch does not fit with {n_total} samples kept ({_gib(fixed)}); "
            + ("use execution=path (same law and counts, only the visited nodes), " if tree is not None and execution == "tree" else "")
            + "lower n_samples, or split the run into shards (num_shards=...)."
        )
    raise ConfigError(
        f"n_samples={n_total} with batch_size={batch}: {what} needs about {_gib(need)} ({_gib(per_traj)} per "
        f"trajectory of a batch), but "
        f"{device} has {_gib(free)} available: use batch_size={fits} or less"
        + (", or execution=path (same law and counts, only the visited nodes)." if tree is not None and execution == "tree" else ".")
    )


def calibration_run(target: Target, schedule: Schedule, v: dict, n: int = 64, K: int = 2, L: int = 8) -> SampleResult:
    """The short run that calibrates ``tree=optimal``: D-GRS with the configured draft on a uniform
    ``(K, L)`` tree (``L`` capped at ``T - 2``) for ``min(n, n_samples)`` trajectories, under its own seed
    (``seed + CALIBRATION_SEED_OFFSET``: the main run's randomness is untouched, so the tree it gets is
    independent of its samples and exactness is kept).

    Returns:
        The run's :class:`SampleResult` (its ``nfe`` and ``target_rows`` are the calibration's cost).
    """
    m = min(n, v["n_samples"])
    tree = DraftTree.uniform(K, min(L, schedule.steps - 2))
    ids = torch.arange(m, device=torch.device(getattr(target.model, "device", "cpu")))
    cond = target.cond_for(ids, v["seed"]) if target.cond_for is not None else None
    return sample_speculative(target.model, schedule, tree, "dgrs", seed=v["seed"] + CALIBRATION_SEED_OFFSET, indices=ids,
                              cond=cond, draft=v["draft"], prefetch=v["prefetch"], evaluate_leaves=v["evaluate_leaves"],
                              max_batch=v["max_batch"], warmup=v["warmup"])


def calibrate_profile(target: Target, schedule: Schedule, v: dict, n: int = 64, K: int = 2, L: int = 8) -> list[float]:
    """Displacement ``delta`` per depth for ``tree=optimal``, from :func:`calibration_run`: each depth's
    measured acceptance inverted into ``delta`` (:func:`specsamp.treesearch.deltas_from_acceptance`).

    Returns:
        ``delta`` per depth ``1..L``.
    """
    from .treesearch import deltas_from_acceptance

    r = calibration_run(target, schedule, v, n, K, L)
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
        The JSON-ready record (README, "The main job") and the concatenated :class:`SampleResult`;
        ``result.extra`` holds ``target`` and ``indices`` for post-processing (images, metrics), and the
        ``max_batch`` the sampler used (the top-level key, else the model's).

    Raises:
        ConfigError: invalid configuration, or a model that cannot be loaded.
    """
    v = validate(cfg_dict)
    if v["threads"] is not None:
        torch.set_num_threads(v["threads"])
    t0 = time.perf_counter()
    model_cfg = cfg_dict["model"]
    try:
        schedule = Schedule.make(v["steps"], v["eps"], shift=float(model_cfg.get("shift", 1.0)))
    except ValueError as e:
        raise ConfigError(str(e)) from None
    horizon = schedule.steps - 2
    # sizes that follow from the config alone are refused before the model is loaded or calibrated
    optimal = v["tree"] == "optimal" and v["coupling"] is not None and COUPLINGS[v["coupling"]].max_children != 1
    if optimal:
        from . import treesearch

        try:
            treesearch.check_config_search(v["budget"] or uniform_budget(v["K"], v["L"]), v, cfg_dict,
                                           available_bytes("cpu"))
        except ValueError as e:
            raise ConfigError(str(e)) from None
    else:
        check_tree_nodes(v, horizon)
    if target is None:
        target = Target(model) if model is not None else build_target(model_cfg, v["device"])
    if v["max_batch"] is None:  # the top-level key wins; else the model config's (e.g. SD3's 64 states)
        v["max_batch"] = target.max_batch
    for m in v["metrics"]:  # refuse before sampling what no scoring step could serve
        if target.decode is None or (m == "clip" and target.prompts_for is None) or (m == "fid" and not target.fid_ref):
            need = "images" if target.decode is None else "prompts" if m == "clip" else "model.fid_ref (reference statistics)"
            raise ConfigError(f"metrics=[{m}] is invalid for model={model_cfg.get('name', model_cfg['kind'])}: it needs {need}, "
                              "which this model does not have.")
    tree_cfg = cfg_dict
    calibrated = None
    if optimal:
        if cfg_dict.get("delta_profile") is None:
            calibrated = calibrate_profile(target, schedule, v)
            tree_cfg = {**cfg_dict, "delta_profile": calibrated}
    try:
        with _Progress(v["progress"], "tree search", "depth", min_seconds=2.0) as search_bar:
            tree, B = build_tree(v, horizon, tree_cfg, callback=search_bar.to)
    except ValueError as e:  # ConfigError included
        raise ConfigError(str(e)) from None
    ids = torch.arange(v["n_samples"]) if indices is None else torch.as_tensor(indices, dtype=torch.long).reshape(-1)
    if ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= v["n_samples"]:
        raise ConfigError(f"indices are invalid: need a non-empty set of trajectory ids in [0, n_samples={v['n_samples']}).")
    bs = v["batch_size"] or ids.numel()
    check_tree_memory(tree.restrict(min(tree.max_depth, horizon)) if tree is not None else None, min(bs, ids.numel()),
                      target.model, v["device"], execution=v["execution"], n_total=ids.numel(), steps=schedule.steps)
    unused = {k: cfg_dict[k] for k, d in unused_keys(cfg_dict).items() if k in cfg_dict and cfg_dict[k] != d}
    if unused:
        print(f"note: {', '.join(f'{k}={x!r}' for k, x in unused.items())} "
              f"{'does' if len(unused) == 1 else 'do'} nothing for sampler={v['sampler']}"
              + (f" with tree={v['tree']}" if v["coupling"] is not None else "")
              + "; recorded as unused, left out of the config hash.", file=sys.stderr, flush=True)
    dev = torch.device(getattr(target.model, "device", v["device"]))
    results = []
    per_traj = schedule.steps - 2  # the bar counts trajectory-steps of the speculative range, per round or step
    with _Progress(v["progress"], "sampling", "traj-step", total=ids.numel() * per_traj) as bar:
        for start in range(0, ids.numel(), bs):
            chunk = ids[start : start + bs].to(dev)
            if cond is not None:
                sub_cond = {k: c[chunk.cpu()].to(dev) for k, c in cond.items()}
            elif target.cond_for is not None:
                sub_cond = target.cond_for(chunk, v["seed"])
            else:
                sub_cond = {}
            base = start * per_traj
            callback = lambda info, base=base: bar.to(base + info["steps_done"])  # noqa: E731
            common = dict(seed=v["seed"], indices=chunk, cond=sub_cond, max_batch=v["max_batch"], callback=callback)
            if tree is None:
                r = sample_standard(target.model, schedule, **common)
            else:
                r = sample_speculative(
                    target.model, schedule, tree, v["coupling"], draft=v["draft"], prefetch=v["prefetch"],
                    evaluate_leaves=v["evaluate_leaves"], execution=v["execution"], warmup=v["warmup"], **common,
                )
            results.append(r)
            bar.to(base + chunk.numel() * per_traj)
    res = _concat(results)
    res.extra.update(target=target, indices=ids, max_batch=v["max_batch"])
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
        **({"unused": unused} if unused else {}),
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


class MetricError(Exception):
    """A metric that could not be scored after sampling (the record and the images are already saved).

    Attributes:
        errors: metric name -> one-sentence reason.
        values: the metrics that were computed.
        user: True when every reason is the user's to fix (missing weights or reference, a bad metric
            setting): the runner then exits 2; otherwise 1.
    """

    def __init__(self, errors: dict[str, str], user: bool, values: dict | None = None):
        super().__init__(" ".join(errors.values()))
        self.errors = errors
        self.user = user
        self.values = values or {}


def compute_metrics(names, result: SampleResult, image_dir: Path | None, cfg_dict: Mapping) -> dict:
    """Score the saved images: ``fid`` (torch-fidelity against ``model.fid_ref``) and ``clip`` (per image).

    Both read the PNGs that :func:`save_images` wrote for this run's indices (uint8, named by global
    index; other files in the folder are ignored), so a run's scores are those of its files, and the
    expensive decode runs once. Every metric is attempted, whatever
    happens to the others.

    Args:
        names: metric names (``fid``, ``clip``).
        result: the run's result (``extra["target"]`` and ``extra["indices"]`` are used).
        image_dir: the folder :func:`save_images` wrote, or None for a target without images.
        cfg_dict: the run's config (``device``, ``model.name``).

    Returns:
        ``fid`` (float) and ``fid_detail`` (``compute_fid``'s other fields); ``clip_score``,
        ``clip_score_sem`` and ``clip_scores`` (per image, in index order).

    Raises:
        MetricError: after trying every metric, when one or more failed (``values`` holds the others).
    """
    out: dict = {}
    errors: dict[str, str] = {}
    user = True
    target: Target = result.extra["target"]
    device = str(cfg_dict.get("device", "cpu"))
    ids = sorted(int(i) for i in result.extra["indices"])
    pixels = None
    from . import images as img

    for name in names:
        try:
            if image_dir is None:
                raise ConfigError(f"metrics=[{name}] is invalid for model={cfg_dict['model'].get('name')}: it scores images.")
            if name == "fid":
                from .metrics.fid import compute_fid

                if not target.fid_ref:
                    raise ConfigError("metrics=[fid] needs model.fid_ref (reference statistics: name, URL or .npz path).")
                pixels = img.load_images(image_dir, indices=ids) if pixels is None else pixels  # this run's, by index
                res = compute_fid(pixels, target.fid_ref, device=device, **(target.fid or {}))
                res["samples"] = str(image_dir)
                out["fid"] = float(res.pop("fid"))
                out["fid_detail"] = res
            elif name == "clip":
                from .metrics import clip

                if target.prompts_for is None:
                    raise ConfigError("metrics=[clip] is invalid: the model has no prompts.")
                c = {**CLIP_DEFAULTS, **(target.clip or {})}
                model, preprocess, tokenizer = clip.load_clip(
                    c["model"], c["pretrained"], checkpoint=c["checkpoint"], quick_gelu=c["quick_gelu"],
                    cache_dir=c["cache_dir"], device=device,
                )
                pixels = img.load_images(image_dir, indices=ids) if pixels is None else pixels
                scores = clip.clip_scores(pixels, target.prompts_for(ids), model=model, preprocess=preprocess, tokenizer=tokenizer)
                summ = clip.summarize(scores)
                out.update(clip_score=summ["mean"], clip_score_sem=summ["sem"], clip_scores=[float(x) for x in scores])
            else:
                raise ConfigError(f"metrics=[{name}] is invalid: valid entries are fid, clip.")
        except (ConfigError, OSError, ValueError, ImportError, KeyError) as e:
            errors[name] = f"metrics=[{name}] could not be computed: {e}" if not str(e).startswith("metrics=") else str(e)
        except Exception as e:  # noqa: BLE001 - the samples are saved; report instead of losing the run
            user = False
            errors[name] = f"metrics=[{name}] failed with {type(e).__name__}: {e}."
    if errors:
        raise MetricError(errors, user, out)
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
    scores = scores_text(rec)
    return (
        f"{head}  speedup {sp['mean']:.2f}x ± {sp['sem']:.2f}  NFE {rec['nfe']['mean']:.1f}{'  ' + scores if scores else ''}  "
        f"({rec['n_samples']} trajectories, {rec['wall_seconds']:.1f} s)"
    )


def scores_text(rec: dict) -> str:
    """The record's metric scores as printed, e.g. ``FID 3.512  CLIP 0.31 ± 0.01``; empty when none."""
    parts = [f"FID {rec['fid']:.3f}"] if isinstance(rec.get("fid"), (int, float)) else []
    if isinstance(rec.get("clip_score"), (int, float)):
        parts.append(f"CLIP {rec['clip_score']:.2f} ± {rec.get('clip_score_sem', float('nan')):.2f}")
    return "  ".join(parts)
