"""The run record: statistics, provenance, the config hash, resume, and the printed result line."""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from .. import __version__
from ..sampler import SampleResult
from .config import UNHASHED_KEYS
from .jobs import RESULT


def stats(x: torch.Tensor) -> dict:
    """``{mean, std, sem}`` of a per-trajectory tensor ``[M]`` (float64; ``std``, ``sem`` 0 for one value)."""
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


def config_hash(recorded: Mapping, unused: Mapping | None = None) -> str:
    """SHA-256 (first 16 hex) of the recorded config, key order independent.

    Keys that cannot change a result (:data:`~specsamp.runner.config.UNHASHED_KEYS`) are left out, and
    keys the sampler does not read (``unused``: :func:`specsamp.runner.config.unused_keys`) are hashed at
    their default value.
    """
    clean = {k: v for k, v in recorded.items() if k not in UNHASHED_KEYS}
    clean.update({k: d for k, d in (unused or {}).items() if k in clean})
    if clean.get("refine") == 0:  # plain drafts (refine=0): the key is left out of the hash
        clean.pop("refine")
    if clean.get("compile") is False:  # the eager round: left out of the hash, so every eager record keeps its hash
        clean.pop("compile")
    blob = json.dumps(clean, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


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
        "nfe": stats(res.nfe),
        "nfe_total": stats(res.nfe_total),
        "speedup": stats(res.speedup),
        "nfe_speedup": stats(steps / res.nfe_total.double()),
        "batch_speedup": float(np.mean(batch_speedups)),
        "target_rows": stats(res.target_rows),
        "rounds": stats(res.rounds),
        "committed_per_round": float(res.committed.double().sum().cpu() / rounds.cpu()) if rounds > 0 else 0.0,
        "acceptance_per_depth": (accepts / attempts.clamp_min(1)).tolist() if attempts.numel() else [],
        "acceptance_pooled": float(accepts.sum() / attempts.sum().clamp_min(1)) if attempts.numel() else None,
        "attempts_per_depth": attempts.tolist(),
    }


TREE_FIELDS = ("tree", "budget", "call_rows", "refine", "delta_profile", "trees_by_root", "tree_parent")
"""The record's keys that describe the tree a run drafted (the same in every shard of a run)."""


@dataclass(frozen=True)
class Job:
    """The job that writes a record (``run.py``'s task, or a shard merge): the record's job fields.

    Attributes:
        output_dir: its directory (``output_dir``).
        overrides: its command-line overrides (``overrides``).
        multirun: a job of a sweep (``-m``): its record names the sweep (``sweep``, set by
            :func:`specsamp.runner.loop.prepare` from ``sweep_name``).
        slurm: :func:`specsamp.runner.slurm.job_identity` inside a SLURM job (``slurm``), else None.
        merged_from: a merge's shard directories (``merged_from``), else None.
        sweep: the sweep's name (``sweep``), or None.
    """

    output_dir: str
    overrides: list
    multirun: bool = False
    slurm: Mapping | None = None
    merged_from: list | None = None
    sweep: str | None = None


@dataclass(frozen=True)
class Sampled:
    """What a run produced, as its record reads it (:func:`specsamp.runner.loop.sample`; a shard merge's, over its
    shards).

    Attributes:
        result: the :class:`SampleResult` over all the run's trajectories (or the shards' concatenated).
        batch_speedups: the speedup of every batch that ran.
        tree_fields: the :data:`TREE_FIELDS` that apply (``tree``, ``budget``, ``call_rows`` always; ``refine``,
            ``delta_profile``, ``trees_by_root`` or ``tree_parent`` when the run has them).
        calibration: the cost of ``tree=optimal``'s calibration run (:func:`specsamp.runner.build.calibration_cost`),
            or None when none ran; adds ``speedup_with_calibration``.
        resumed: ``{batches, of}`` when batches were read from an earlier attempt, else None.
        wall_seconds: the run's wall time (the shards' sum for a merge).
        versions: the software that sampled (default: this process's, :func:`versions`).
        kernel: the kernel that ran (the schedule's; ``kernel=auto`` resolves to the model's own), or None.
        auto: ``sampler=auto``'s record (:meth:`specsamp.autosample.AutoChoice.record`, with the realised seconds of
            a batch), or None.
    """

    result: SampleResult
    batch_speedups: list
    tree_fields: Mapping
    calibration: Mapping | None = None
    resumed: Mapping | None = None
    wall_seconds: float = 0.0
    versions: Mapping | None = field(default_factory=lambda: versions())
    kernel: str | None = None
    auto: Mapping | None = None


def make_record(prepared, sampled: Sampled) -> dict:
    """The record of a run, as ``result.json`` holds it: from one run, or from its shards merged. The one place
    a record is assembled, the job's fields included.

    Args:
        prepared: the run's :class:`specsamp.runner.loop.PreparedRun` (its ``run``, ``recorded``,
            ``config_hash``, ``unused``, ``indices`` and ``job`` are read).
        sampled: what it produced (:class:`Sampled`).

    Returns:
        The JSON-ready record; keys in the order ``result.json`` has always had them. With a :class:`Job`, its
        fields follow; a shard's record (``num_shards > 1``) then counts its own trajectories (``n_samples``)
        and names its block (``shard``, ``num_shards``, ``indices``: ``[start, stop]``).
    """
    run, job, result = prepared.run, prepared.job, sampled.result
    unused = prepared.unused
    tree = {k: sampled.tree_fields[k] for k in TREE_FIELDS if k in sampled.tree_fields}
    calibration = sampled.calibration
    shard = job is not None and run.num_shards > 1  # a shard job's record counts the shard's own trajectories
    job_fields = (
        {}
        if job is None
        else {
            "output_dir": job.output_dir,
            **({"merged_from": list(job.merged_from)} if job.merged_from is not None else {}),
            "overrides": list(job.overrides),
            **({"slurm": job.slurm} if job.slurm else {}),
            **({"sweep": job.sweep} if job.sweep is not None else {}),
            **(
                {
                    "shard": run.shard,
                    "num_shards": run.num_shards,
                    "indices": [prepared.indices.start, prepared.indices.stop],
                }
                if shard
                else {}
            ),
        }
    )
    return {
        "status": "ok",
        "config": prepared.recorded,
        "config_hash": prepared.config_hash,
        "model": run.model.name,
        "sampler": run.sampler.name,
        "K": run.K,
        "L": run.L,
        "eps": prepared.recorded.get("eps", run.eps),  # null for a kernel other than em (it reads no churn)
        # the kernel that ran: kernel=auto is recorded in the config as asked, here as what it resolved to
        **({"kernel": sampled.kernel or prepared.recorded["kernel"]["name"]} if "kernel" in prepared.recorded else {}),
        "steps": run.steps,
        "n_samples": len(prepared.indices) if shard else run.n_samples,
        **{k: tree[k] for k in TREE_FIELDS[:4] if k in tree},
        **({"unused": unused} if unused else {}),
        **{k: tree[k] for k in TREE_FIELDS[4:] if k in tree},
        **summarize_result(result, run.steps, sampled.batch_speedups),
        **({"resumed": dict(sampled.resumed)} if sampled.resumed else {}),
        # the calibration run's calls, paid by this run but not in its speedup; charged like with like: its
        # calls on the speculative steps, as the run's own nfe counts them (endpoints excluded), shared by
        # the run's trajectories, in the same estimator as ``speedup`` (a mean of per-trajectory ratios)
        **(
            {
                "calibration": dict(calibration),
                "speedup_with_calibration": result.speedup_charged(calibration["nfe"], result.nfe.numel()),
            }
            if calibration
            else {}
        ),
        **({"auto": dict(sampled.auto)} if sampled.auto else {}),
        "wall_seconds": sampled.wall_seconds,
        "versions": sampled.versions,
        **job_fields,
    }


def existing_record(out_dir: str | os.PathLike, cfg_hash: str) -> dict | None:
    """The record in ``out_dir/result.json`` if it exists, is complete and has ``cfg_hash``; else None."""
    p = Path(out_dir) / RESULT
    if not p.exists():
        return None
    try:
        rec = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if rec.get("config_hash") == cfg_hash and rec.get("status") == "ok":
        return rec
    return None


def _flat(d, prefix: str = "") -> dict:
    out = {}
    for k, v in (d or {}).items():
        if isinstance(v, Mapping):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def config_difference(old: Mapping, new: Mapping, limit: int = 8) -> list[str]:
    """``key: old -> new`` for every key (dotted) whose value differs between two recorded configs,
    keys that cannot change a result (:data:`~specsamp.runner.config.UNHASHED_KEYS`) left out."""
    a = {k: v for k, v in _flat(old).items() if k.split(".")[0] not in UNHASHED_KEYS}
    b = {k: v for k, v in _flat(new).items() if k.split(".")[0] not in UNHASHED_KEYS}
    keys = sorted(k for k in set(a) | set(b) if a.get(k, "(absent)") != b.get(k, "(absent)"))
    shown = [f"{k}: {a.get(k, '(absent)')!r} -> {b.get(k, '(absent)')!r}" for k in keys[:limit]]
    return shown + ([f"and {len(keys) - limit} more"] if len(keys) > limit else [])


def refuse_other_record(out_dir: str | os.PathLike, cfg_hash: str, recorded: Mapping) -> None:
    """Refuse to run in a directory that already holds the complete record of another configuration.

    A run's files (``result.json``, ``samples.pt``, ``images/``, ``grid.png``, ``shard.pt``) are one set;
    writing a second configuration's set over the first would leave a mix (a new record beside the old
    samples or images). Nothing already written is touched: the run is refused instead.

    Raises:
        ConfigError: ``out_dir/result.json`` is a complete record whose config hash is not ``cfg_hash``;
            the message names the directory, both hashes and the keys that differ.
    """
    from ..errors import ConfigError

    p = Path(out_dir) / RESULT
    try:
        rec = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError):
        return
    if not isinstance(rec, dict) or rec.get("status") != "ok" or rec.get("config_hash") in (None, cfg_hash):
        return
    diff = config_difference(rec.get("config") or {}, recorded)
    raise ConfigError(
        f"the output directory {p.parent} already holds the record of another configuration (config "
        f"{rec['config_hash']}; this run is {cfg_hash}" + (f"; differing: {'; '.join(diff)}" if diff else "") + "). "
        "Its files stay as they are: run in another directory (hydra.run.dir=DIR for a run, hydra.sweep.dir=DIR "
        "or sweep_name=NAME for a sweep), or remove that directory to replace its results."
    )


@functools.lru_cache(maxsize=1)
def shipped_model_names() -> dict[str, str]:
    """``{option: name}`` for every option of the shipped config group ``model`` (``conf/model/*.yaml``): the
    ``model.name`` each sets, e.g. ``{"digits": "edm-digits-8x8-cond", "diffusers": "diffusers", ...}``."""
    from omegaconf import OmegaConf

    from .config import CONF_DIR

    out = {}
    for path in sorted((CONF_DIR / "model").glob("*.yaml")):
        cfg = OmegaConf.load(path)
        name = OmegaConf.select(cfg, "name", default=None) or OmegaConf.select(
            cfg, "model.name", default=None
        )  # _global_
        if isinstance(name, str):
            out[path.stem] = name
    return out


def model_text(rec: Mapping) -> str:
    """The model as the summary line names it: the option of the config group ``model`` that was chosen, and
    what of the model's config the option does not fix, as overrides, e.g. ``model=digits``,
    ``model=diffusers model.path=/data/my-pipeline``, ``model=cifar10 model.path=retrained.pkl``.

    The option is the record's last ``model=OPTION`` override (what was typed, a YAML of one's own included);
    else the shipped option whose YAML sets the record's ``model.name`` (the default model, one chosen by an
    ``experiment``, a run composed in-process); else ``model.name``. ``model.name`` follows when it is not the
    one the option sets, and ``model.path`` (a local checkpoint or pipeline folder) when it is set. Read from
    the record's ``model``, ``overrides`` and ``config`` (a record of any version).
    """
    import shlex

    model = (rec.get("config") or {}).get("model")
    model = model if isinstance(model, Mapping) else {}
    name = model.get("name") if isinstance(model.get("name"), str) else rec.get("model")
    shipped = shipped_model_names()
    typed = [
        o.partition("=")[2]
        for o in rec.get("overrides") or []
        if isinstance(o, str) and o.lstrip("+").partition("=")[0] == "model"
    ]
    option = typed[-1] if typed else next((k for k, v in shipped.items() if v == name), None)
    if option is None:
        return f"model={name}"
    text = f"model={option}"
    if option in shipped and name is not None and shipped[option] != name:
        text += f" model.name={name}"
    if model.get("path") not in (None, ""):
        text += f" model.path={shlex.quote(str(model['path']))}"
    return text


def summary_line(rec: dict) -> str:
    """One-line result, e.g. ``model=gmm sampler=dgrs K=2 L=3 eps=0.1 B=14  speedup 1.99x ± 0.02  NFE 14.1 (...)``.

    The model is named as chosen, ``model=digits`` rather than its checkpoint's name, with the folder of a
    local pipeline or checkpoint: ``model=diffusers model.path=DIR`` (:func:`model_text`). A coupling named apart
    from the sampler's own (``sampler.coupling.name=pkg.module:rule`` on a shipped sampler YAML) is shown beside it:
    ``sampler=dgrs coupling=pkg.module:rule``. Where a ``tree=optimal*`` run calibrated (a cost its speedup does not
    charge), the speedup with those calls shared by the run's trajectories follows it:
    ``speedup 3.11x ± 0.05 (0.68x with the calibration's 643 calls)``.
    """
    coupling = ((rec.get("config") or {}).get("sampler") or {}).get("coupling")
    name = coupling.get("name") if isinstance(coupling, dict) else None
    sampler = rec["sampler"] + (f" coupling={name}" if isinstance(name, str) and name != rec["sampler"] else "")
    # the churn of the em kernel; another kernel is named in its place (it reads no eps)
    eps = f"eps={rec['eps']:g}" if rec.get("eps") is not None else f"kernel={rec.get('kernel')}"
    if rec["sampler"] == "standard":
        head = f"{model_text(rec)} sampler=standard {eps} T={rec['steps']}"
    elif isinstance(rec.get("auto"), dict):  # what auto chose, and its prediction
        a = rec["auto"]
        head = (
            f"{model_text(rec)} sampler=auto chose={a['choice']} {eps} B={rec['budget']} "
            f"(predicted {a['predicted_speedup']:.2f}x the loop's speed)"
        )
    elif (rec.get("config") or {}).get("tree", "uniform") != "uniform":
        head = f"{model_text(rec)} sampler={sampler} tree={rec['tree']} {eps} B={rec['budget']}"
    else:
        head = f"{model_text(rec)} sampler={sampler} K={rec['K']} L={rec['L']} {eps} B={rec['budget']}"
    sp = rec["speedup"]
    scores = scores_text(rec)
    cal = rec.get("calibration")  # tree=optimal*'s calibration run, which the speedup does not charge
    charged = (
        f" ({rec['speedup_with_calibration']:.2f}x with the calibration's {cal['nfe']} calls)"
        if isinstance(cal, dict) and "speedup_with_calibration" in rec
        else ""
    )
    return (
        f"{head}  speedup {sp['mean']:.2f}x ± {sp['sem']:.2f}{charged}  NFE {rec['nfe']['mean']:.1f}"
        f"{'  ' + scores if scores else ''}  "
        f"({rec['n_samples']} trajectories, {rec['wall_seconds']:.1f} s)"
    )


def scores_text(rec: dict) -> str:
    """The record's metric scores as printed, e.g. ``FID 3.512  CLIP 0.31 ± 0.01``; empty when none."""
    parts = [f"FID {rec['fid']:.3f}"] if isinstance(rec.get("fid"), (int, float)) else []
    detail = (rec.get("metrics") or {}).get("fid_detail") or {}
    if parts and detail.get("warning"):  # specsamp.metrics.fid_inputs.few_images_warning
        parts[0] += f" (not usable: {detail.get('n_samples')} images, needs at least {detail.get('min_images')})"
    if isinstance(rec.get("isc"), (int, float)):
        parts.append(f"IS {rec['isc']:.3f} ± {rec.get('isc_se', float('nan')):.3f}")
    if isinstance(rec.get("clip_score"), (int, float)):
        parts.append(f"CLIP {rec['clip_score']:.2f} ± {rec.get('clip_score_sem', float('nan')):.2f}")
    return "  ".join(parts)
