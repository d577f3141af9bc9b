"""The run's schema: :class:`RunConfig` (``conf/config.yaml``'s keys, each with its rule), the sampler's and the
logger's, the constants they read, and the config class a model's ``_target_`` names. :mod:`specsamp.runner.config`
registers, composes and checks them (and re-exports every name here); :mod:`specsamp.runner.explain` reads them to
word a refusal.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import MISSING, OmegaConf

from .. import rng
from ..errors import ConfigError
from .fields import _int, at_least, between, one_of, rule
from .overrides import (
    SWEEP_NAME_TEXT,
    launch_dir,
    sweep_name_ok,
)

# the Hydra configs, shipped inside the package (``conf/`` at the repository root links here), so an
# installed wheel composes the same configs as a checkout
CONF_DIR = Path(__file__).resolve().parents[1] / "conf"

# 0 <= seed < 2**59: the rng keys hold 60-bit seeds (rng.MAX_SEED), with room for the calibration offset
SEED_BOUND = 2**59
# the tree=optimal calibration runs under seed + CALIBRATION_SEED_OFFSET: its own random streams
CALIBRATION_SEED_OFFSET = 1_000_003
assert SEED_BOUND + CALIBRATION_SEED_OFFSET <= rng.MAX_SEED

PROFILE_DIR = CONF_DIR / "profiles"
MATCH = ("budget", "verification")
METRICS = ("fid", "clip")
# keys that steer the runner, not the run: never part of the record's config or its hash
RUNNER_KEYS = ("hydra", "sweep_name")
# keys that cannot change a result: recorded, but left out of the config hash
UNHASHED_KEYS = ("progress", "skip_existing", "logger", "threads", "check_contract")


def _finite_list(v) -> bool:
    return (
        isinstance(v, (list, tuple))
        and len(v) > 0
        and all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x >= 0 for x in v)
    )


# threads: torch's CPU thread pool; at 2**31 torch's call overflows and far above the cores OpenMP crashes
MAX_THREADS = 1024
# L: trees are cut at T - 2 levels; the bound keeps the nominal budget K + ... + K^L computable
MAX_L = 100_000


def profile_path(value: str) -> Path:
    """The file a ``delta_profile`` string names: ``conf/profiles/<value>.json`` for a name, else the
    ``.json`` path itself, a relative one read from :func:`launch_dir`."""
    if not value.endswith(".json"):
        return PROFILE_DIR / f"{value}.json"
    path = Path(value).expanduser()
    return path if path.is_absolute() else launch_dir() / path


def _profile_ok(v) -> bool:
    if isinstance(v, str):
        return profile_path(v).is_file()
    return _finite_list(v) or (isinstance(v, (list, tuple)) and len(v) > 0 and all(_finite_list(r) for r in v))


def registered(kind: str) -> Any:
    """A dataclass field holding a name of the registry ``kind`` (``draft``, ``tree``): a registered name
    or ``pkg.module:name`` (imported when checked). The registries, not a fixed list, decide."""

    def registry():
        if kind == "draft":
            from ..drafts import DRAFTS

            return DRAFTS
        from .treerules import TREE_RULES

        return TREE_RULES

    return field(
        default={"draft": "velocity", "tree": "uniform"}[kind],
        metadata={
            "text": lambda: registry().valid_text(),
            "ok": lambda v: registry().valid(v),
            "get": lambda v: registry().get(v),
            "nullable": False,
        },
    )


def _sampler_const(name: str):
    from .. import sampler

    return lambda: getattr(sampler, name)


@dataclass
class SamplerConfig:
    """``conf/sampler/*.yaml``: the rule's name and how to build its coupling (null: the standard sampler)."""

    name: str = MISSING
    coupling: Any = None  # {_target_: specsamp.coupling.get_coupling, name: dgrs} -> a Coupling


@dataclass
class LoggerConfig:
    """``conf/logger/*.yaml``: ``none``, or a ``_target_`` logger class (:mod:`specsamp.runner.loggers`)."""

    name: str = "none"
    _target_: str | None = None
    project: str | None = None
    entity: str | None = None
    mode: str | None = None
    group: str | None = None


@dataclass
class RunConfig:
    """Every top-level key of ``conf/config.yaml`` (values and comments there)."""

    model: Any = MISSING
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    kernel: Any = None  # conf/kernel/: a KERNEL_SCHEMAS config (null: em)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    K: int = at_least(1)
    L: int = between(1, MAX_L, why="rounds use at most T-2 levels")
    eps: float = rule(
        "a finite number in (0, 1] (eps=0 is the deterministic ODE, where speculation is vacuous)",
        lambda v: math.isfinite(v) and 0.0 < v <= 1.0,
    )
    steps: int = at_least(3)
    n_samples: int = at_least(1)
    seed: int = rule("an integer in [0, 2**59)", lambda v: _int(v) and 0 <= v < SEED_BOUND)
    device: str = "cpu"
    tree: str = registered("tree")
    widths: list[int] | None = rule(
        "a non-empty list of integers >= 1, e.g. widths=[3,2,2], or null",
        lambda v: len(v) > 0 and all(w >= 1 for w in v),
        None,
    )
    budget: int | None = at_least(1, None, optional=True)
    delta_profile: Any = rule(
        "a non-empty list of finite values >= 0 (one per depth), a list of such lists (one per root step "
        "1..T-2, tree=optimal_per_step), the name of a shipped profile ("
        + ", ".join(sorted(p.stem for p in PROFILE_DIR.glob("*.json")))
        + ") or a .json path, or null (calibrate)",
        lambda v: _profile_ok(v),
        None,
    )
    max_depth: int | None = at_least(1, None, optional=True)
    max_width: int | None = at_least(1, None, optional=True)
    draft: str = registered("draft")
    prefetch: str = one_of(_sampler_const("PREFETCH"), "nearest")
    warmup: str = one_of(_sampler_const("WARMUPS"), "call")
    evaluate_leaves: bool = True
    check_contract: Any = rule(
        "one of auto (on for couplings defined outside specsamp), true, false",
        lambda v: v == "auto" or isinstance(v, bool),
        "auto",
        nullable=False,
    )
    match: str = one_of(MATCH, "budget")
    execution: str = one_of(_sampler_const("EXECUTIONS"), "path")
    refine: int = at_least(0, 0)
    compile: bool = False
    batch_size: int | None = at_least(1, None, optional=True)
    max_batch: int | None = at_least(1, None, optional=True)
    threads: int | None = between(1, MAX_THREADS, 1, optional=True, why="null: torch's default, one per core")
    progress: Any = rule(
        "one of auto (a bar on a terminal, a line every 30 s in a log), true, false",
        lambda v: v == "auto" or isinstance(v, bool),
        "auto",
        nullable=False,
    )
    save_samples: bool = False
    metrics: list[str] = rule(
        "a list of fid, clip, e.g. metrics=[fid]", lambda v: all(m in METRICS for m in v), factory=list
    )
    skip_existing: bool = True
    sweep_name: str | None = rule(SWEEP_NAME_TEXT, sweep_name_ok, None)
    num_shards: int = at_least(1, 1)
    shard: int = at_least(0, 0)


# what K, L, eps, steps and n_samples default to for a model config without a ``paper:`` block
RUN_DEFAULTS = {"steps": 30, "eps": 0.1, "n_samples": 100, "K": 2, "L": 3}


def _paper_value(model, key: str):
    paper = model.get("paper") if isinstance(model, Mapping) else getattr(model, "paper", None)
    value = (paper.get(key) if isinstance(paper, Mapping) else getattr(paper, key, None)) if paper is not None else None
    return RUN_DEFAULTS[key] if value is None else value


def paper_default(key: str, *, _root_) -> Any:
    """Resolver ``specsamp.paper``: ``'K: ${specsamp.paper:K}'`` is the model's ``paper.K`` (its paper's
    protocol), or :data:`RUN_DEFAULTS`' value when the model config has no ``paper:`` block."""
    value = OmegaConf.select(_root_, f"model.paper.{key}", default=None, throw_on_missing=False)
    return RUN_DEFAULTS[key] if value is None else value


def cell_seed(*values) -> int:
    """A seed of its own for one cell of a grid: ``SHA-256`` of the cell's values (their text), reduced to
    ``[0, 2**59)``. Resolver ``specsamp.cell_seed``: ``'seed=${specsamp.cell_seed:${sampler.name},${K},${L}}'``
    gives every (sampler, K, L) cell independent randomness (by default every cell runs trajectory ids
    ``0..n-1`` under one seed, so cells share their Monte Carlo error). Deterministic: a rerun of a cell
    draws the same numbers, and the record holds the resolved seed."""
    import hashlib

    text = "\x1f".join(str(v) for v in values).encode()
    return int.from_bytes(hashlib.sha256(b"specsamp.cell_seed\x00" + text).digest()[:8], "big") % SEED_BOUND


def _model_schema(model: Mapping) -> type | None:
    target = model.get("_target_") if isinstance(model, Mapping) else None
    if not isinstance(target, str):
        return None
    try:
        from hydra.utils import get_class

        cls = get_class(target)
    except Exception as e:
        raise ConfigError(f"model._target_={target!r} is invalid: {' '.join(str(e).split())}") from None
    return cls if dataclasses.is_dataclass(cls) else None
