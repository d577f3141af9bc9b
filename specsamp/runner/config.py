"""The run's typed configuration: the schema of ``conf/``, its value checks, and composition.

``conf/config.yaml`` is typed by :class:`RunConfig` (registered in Hydra's ConfigStore as ``run_schema``),
each ``conf/model/*.yaml`` by its model's config dataclass (``specsamp.models.MODEL_SCHEMAS``), so Hydra
refuses an unknown key or a value of the wrong type while it composes. What a type cannot say (ranges,
choices, a finite churn) is written once, as each field's rule, and checked by :func:`check_values`.

Groups that build an object say how in their YAML: ``model`` (``_target_``: a config dataclass whose
``build(device)`` returns a :class:`specsamp.models.base.Target`), ``sampler.coupling`` (``_target_``
returning a :class:`specsamp.coupling.Coupling`) and ``logger``. Draft and tree are plain keys, each a
name that its registry resolves (:data:`specsamp.drafts.DRAFTS`, :data:`specsamp.runner.treerules.TREE_RULES`:
a registered name or ``pkg.module:name``), so ``draft=x0`` reads the same either way.

What a user typed, read as typed before any schema applies (raw command-line overrides, sweep names,
path-like keys, the closest valid key to a mistyped one), is :mod:`specsamp.runner.overrides`; its names
stay importable from here.

Every error here is a :class:`specsamp.errors.ConfigError` (or, while Hydra composes, an OmegaConf error
that :func:`specsamp.runner.explain.explain` turns into the same kind of paragraph): ``run.py`` exits with status 2.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from ..errors import ConfigError
from .fields import _int, at_least, between, one_of, rule  # noqa: F401  (importable from here as before)
from .kernelconfig import (  # noqa: F401  (the kernel's schemas; importable from here)
    KERNEL_SCHEMAS,
    SCHEDULER_KERNELS,
    EMKernelConfig,
    _kernel_schema,
    brings_scheduler,
    check_kernel,
    kernel_name,
)
from .overrides import (  # noqa: F401  (what a user typed, read as typed: importable from here as before)
    SWEEP_NAME_TEXT,
    SWEEPER_KEYS,
    _keys,
    _model_paths,
    _type_text,
    closest_key,
    launch_dir,
    misread_override,
    path_problem,
    sweep_name_ok,
    unreadable_override,
)
from .schema import (  # noqa: F401  (the schema and its constants: importable from here as before)
    CALIBRATION_SEED_OFFSET,
    CONF_DIR,
    MATCH,
    MAX_L,
    MAX_THREADS,
    METRICS,
    PROFILE_DIR,
    RUN_DEFAULTS,
    RUNNER_KEYS,
    SEED_BOUND,
    UNHASHED_KEYS,
    LoggerConfig,
    RunConfig,
    SamplerConfig,
    _finite_list,
    _model_schema,
    _paper_value,
    _profile_ok,
    _sampler_const,
    cell_seed,
    paper_default,
    profile_path,
    registered,
)


def register() -> None:
    """Register the schemas with Hydra's ConfigStore (``run_schema``; ``model/<kind>_schema``) and the
    ``specsamp.*`` resolvers; idempotent. Importing this module calls it."""
    from ..models import MODEL_SCHEMAS
    from . import jobs  # noqa: F401  (registers specsamp.job_dir and specsamp.fresh_dir)

    if not OmegaConf.has_resolver("specsamp.cell_seed"):
        OmegaConf.register_new_resolver("specsamp.cell_seed", cell_seed)
    if not OmegaConf.has_resolver("specsamp.paper"):
        OmegaConf.register_new_resolver("specsamp.paper", paper_default)

    cs = ConfigStore.instance()
    cs.store(name="run_schema", node=RunConfig)
    for name, schema in MODEL_SCHEMAS.items():
        cs.store(group="model", name=name, node=schema)
    for name, schema in KERNEL_SCHEMAS.items():
        cs.store(group="kernel", name=f"{name}_schema", node=schema)


register()


def compose(overrides: Sequence[str] = (), conf_dir: str | os.PathLike = CONF_DIR) -> DictConfig:
    """``conf/config.yaml`` composed with ``overrides`` (as ``run.py`` would), outside a Hydra run."""
    from hydra import compose as hydra_compose, initialize_config_dir

    with initialize_config_dir(version_base="1.3", config_dir=str(Path(conf_dir).resolve())):
        return hydra_compose(config_name="config", overrides=list(overrides))


# ----------------------------------------------------------------------------------------------
# typed config from a composed config or a plain dict


def load_config(cfg: DictConfig | Mapping, *, here: bool = True) -> tuple[RunConfig, dict]:
    """The typed, checked config of one run, and the plain dict that is recorded and hashed.

    Accepts what Hydra composed (``run.py``, :func:`compose`) or a plain mapping with the keys of
    ``conf/config.yaml`` (resolved). The mapping is merged onto :class:`RunConfig` and the model onto its
    config dataclass (named by ``model._target_``), so unknown keys and wrong types are refused here too.

    Args:
        cfg: the config.
        here: also check what depends on the machine that runs it (:func:`check_values`); False where the
            run goes elsewhere (a sweep submitted to SLURM from a login node without a GPU).

    Returns:
        ``(run, recorded)``: ``run`` a :class:`RunConfig` whose ``model`` is its config object;
        ``recorded`` the resolved dict without :data:`RUNNER_KEYS` (and without ``shard``/``num_shards``
        for an unsharded run, so it hashes as before sharding).

    Raises:
        ConfigError: the first invalid key, with its value and what is valid.
    """
    from omegaconf.errors import OmegaConfBaseException

    def refuse(e: OmegaConfBaseException, node: Mapping, prefix: str = "") -> ConfigError:
        key = str(getattr(e, "full_key", "") or "")
        value = OmegaConf.select(OmegaConf.create(node), key, default=MISSING) if key else MISSING
        if key:
            e.full_key = prefix + key
        from .explain import explain  # the paragraphs read this module's schemas

        return ConfigError(explain(e, value) or str(e))

    try:
        plain = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else dict(cfg)
    except OmegaConfBaseException as e:  # an interpolation that does not resolve
        raise ConfigError(f"the configuration does not resolve: {e}") from None
    plain = {k: v for k, v in plain.items() if k not in RUNNER_KEYS or k == "sweep_name"}
    model = plain.get("model")
    schema = _model_schema(model)
    try:
        model = OmegaConf.merge(OmegaConf.structured(schema), model) if schema else model
    except OmegaConfBaseException as e:
        raise refuse(e, model, "model.") from None
    kernel = plain.get("kernel")
    kernel = {"name": "em"} if kernel is None else kernel
    if plain.get("eps", 0) is None and isinstance(kernel, Mapping) and kernel.get("name") != "em":
        plain["eps"] = _paper_value(plain.get("model"), "eps")  # a recorded config: no kernel but em reads the churn
    kschema = _kernel_schema(kernel)
    try:
        kernel = OmegaConf.merge(OmegaConf.structured(kschema), kernel)
    except OmegaConfBaseException as e:
        raise refuse(e, kernel, "kernel.") from None
    try:
        run = OmegaConf.to_object(
            OmegaConf.merge(OmegaConf.structured(RunConfig), {**plain, "model": model, "kernel": kernel})
        )
    except OmegaConfBaseException as e:
        raise refuse(e, plain) from None
    if run.kernel.name == "auto" and not brings_scheduler(run.model):  # auto: the model's own scheduler, else em
        run.kernel = EMKernelConfig()
    check_values(run, here=here)
    recorded = OmegaConf.to_container(OmegaConf.structured(run), resolve=True)
    recorded = {k: v for k, v in recorded.items() if k not in RUNNER_KEYS}
    if run.kernel.name == "em":  # the paper's kernel (the default): the key is left out of the record and its hash
        recorded.pop("kernel", None)
    else:  # the churn is Euler--Maruyama's: no other kernel reads it, so it is recorded (and hashed) as null
        recorded["eps"] = None
    if run.num_shards == 1:
        recorded.pop("shard", None)
        recorded.pop("num_shards", None)
    if run.refine == 0:  # plain drafts (refine=0): the key is left out of the record and its hash
        recorded.pop("refine", None)
    if not run.compile:  # the eager round (compile=false): the key is left out of the record and its hash
        recorded.pop("compile", None)
    return run, recorded


def check_values(run: RunConfig, *, here: bool = True) -> None:
    """Check each field's rule (ranges, choices), the device, and the keys that depend on each other.

    ``here=False`` leaves out what depends on the machine (the device being visible, ``compile=true``
    being usable on it): for a run that another machine executes.

    Raises:
        ConfigError: names the key, its value and what is valid.
    """
    v = run.delta_profile
    if isinstance(v, str) and v.endswith(".json") and not profile_path(v).is_file():
        where = "" if Path(v).expanduser().is_absolute() else f", relative paths are read from {launch_dir()}"
        raise ConfigError(
            f"delta_profile={v!r} is invalid: the profile file {profile_path(v)} does not exist{where}. "
            "Give an existing .json (python -m experiments.calibrate writes one), the name of a shipped "
            "profile, a list of values, or null (calibrate)."
        )
    for f in dataclasses.fields(RunConfig):
        meta, v = f.metadata, getattr(run, f.name)
        if meta and v is not None and "get" in meta:
            meta["get"](v)  # a registry's own paragraph: unknown name (with the valid ones), failed import
        if meta and (v is not None or not meta.get("nullable", True)) and not meta["ok"](v):
            text = meta["text"]() if callable(meta["text"]) else meta["text"]
            raise ConfigError(f"{f.name}={'null' if v is None else repr(v)} is invalid: must be {text}.")
    check_kernel(run)
    for key, v in _model_paths(run.model):
        problem = path_problem(v)
        if problem:
            raise ConfigError(
                f"{key}={v!r} is invalid: {problem}; must be a folder or file path without control "
                "characters (null: the default location)."
            )
    if here:
        check_device(run.device)
    from .loggers import check_logger

    check_logger(run.logger)
    if run.tree == "widths" and run.widths is None:
        raise ConfigError(
            "widths=None is invalid: tree=widths needs a non-empty list of integers >= 1, e.g. widths=[3,2,2]."
        )
    if run.refine > 0 and run.execution != "tree" and run.sampler.coupling is not None:
        raise ConfigError(
            f"refine={run.refine} is invalid with execution={run.execution}: a Picard sweep evaluates every "
            "internal node of the drafted tree in one batched call, which only the tree execution drafts; "
            "set execution=tree, or refine=0 (plain drafts)."
        )
    if run.refine > run.steps - 2 and run.sampler.coupling is not None:
        raise ConfigError(
            f"refine={run.refine} is invalid with steps={run.steps}: a round's tree is cut at T-2 = "
            f"{run.steps - 2} levels, and after as many Picard sweeps as the tree has levels every proposal "
            "mean is the target kernel mean at its parent, so further sweeps change nothing but each costs "
            f"a batched target call per round; use refine={max(run.steps - 2, 0)} or less (at most the "
            "tree's depth)."
        )
    if run.compile and run.sampler.coupling is not None:
        if run.refine > 0:
            raise ConfigError(
                f"compile=true is invalid with refine={run.refine}: the Picard sweeps run eagerly (the "
                "compiled round has none); set refine=0, or compile=false."
            )
        from ..inductor import check_compile

        check_compile(True, run.execution, run.device, here=here)
    if not 0 <= run.shard < run.num_shards:
        raise ConfigError(
            f"shard={run.shard!r} is invalid: must be an integer in 0..{run.num_shards - 1} (num_shards={run.num_shards})."
        )
    if run.num_shards > 1:
        units = math.ceil(run.n_samples / run.batch_size) if run.batch_size else run.n_samples
        if run.num_shards > units:
            what = (
                f"the number of batches ceil(n_samples/batch_size) = {units}"
                if run.batch_size
                else f"n_samples={run.n_samples}"
            )
            raise ConfigError(f"num_shards={run.num_shards} is invalid: must be <= {what}, so that no shard is empty.")


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
            raise ConfigError(f"device={d!r} is invalid here: torch sees no CUDA device; use device=cpu.")
        if d != "cuda" and int(d[5:]) >= n:
            raise ConfigError(f"device={d!r} is invalid: torch sees {n} CUDA device(s), cuda:0..cuda:{n - 1}.")
        return d
    raise ConfigError(
        f"device={d!r} is invalid: specsamp runs on cpu, cuda or cuda:N (N a visible CUDA device; "
        "other torch backends such as mps are not supported)."
    )


def unused_keys(run: RunConfig, coupling) -> dict:
    """Keys that the configured sampler and tree never read, with the value that stands for them in the hash.

    ``sampler=standard`` reads none of the tree keys (``K``, ``L``, ``draft``, ...); a one-child rule
    (``rmc``) reads ``K``, ``L`` and ``match`` but no other tree key; a rule with wider nodes does not read
    ``match``, and of :data:`~specsamp.runner.treerules.TREE_KEYS` only those its tree rule declares
    (``TreeRule.reads``: ``tree=uniform`` reads ``K``, ``L``; ``tree=widths`` reads ``widths``;
    ``tree=optimal`` the search keys, and ``K``, ``L`` while ``budget`` is null). Such keys stay in the
    record's config (listed under ``unused`` when set away from their default) but are hashed at their
    default, so setting them changes neither a result nor its config hash.

    Args:
        run: the typed config.
        coupling: the built :class:`specsamp.coupling.Coupling`, or None for the standard sampler.

    Returns:
        ``{key: default}`` for every unused key.

    Raises:
        ConfigError: an unknown tree rule, or one that declares a key that is not a tree key.
    """
    from .treerules import TREE_KEYS, get_tree_rule

    K, L = _paper_value(run.model, "K"), _paper_value(run.model, "L")
    default = {
        "K": K,
        "L": L,
        "draft": "velocity",
        "prefetch": "nearest",
        "warmup": "call",
        "evaluate_leaves": True,
        "match": "budget",
        "execution": "path",
        "refine": 0,
        "compile": False,
        "tree": "uniform",
        "widths": None,
        "budget": None,
        "delta_profile": None,
        "max_depth": None,
        "max_width": None,
    }
    if run.sampler.name == "auto":  # auto reads the draft and the round's options; it chooses the tree itself
        keys = ["K", "L", "match", "execution", "refine", "tree", "widths", "budget", "max_depth", "max_width"]
    elif coupling is None:
        keys = list(default)
    elif coupling.max_children == 1:
        keys = [k for k in TREE_KEYS if k not in ("K", "L")]
    else:
        reads = get_tree_rule(run.tree).keys_read(run)
        keys = ["match"] + [k for k in TREE_KEYS if k not in reads]
    return {k: default[k] for k in keys}
