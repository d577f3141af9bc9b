"""Optional experiment loggers: ``logger=none`` (default) or ``logger=wandb`` (``conf/logger/``).

A logger group's YAML names its class with ``_target_``; :func:`log_record` instantiates it once a run's
record is written. A missing logger package is reported and skipped, never fatal. Values are checked at
the start (:func:`check_logger`: ``logger=wandb`` needs a mode wandb knows, and credentials for the modes
that upload), so a bad one exits 2 before any sampling; a logger that fails at run time leaves the record
intact with ``logger_error`` set, and the next launch of the same command retries the logging
(:mod:`specsamp.runner.task`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

WANDB_MODES = ("online", "offline", "shared", "disabled", "dryrun", "run")  # wandb.Settings.mode
UPLOADING_MODES = ("online", "shared", "run")


def _wandb_credentials() -> bool:
    """True when W&B credentials are configured locally: ``WANDB_API_KEY``, or a ``netrc`` entry for the
    API host (what ``wandb login`` writes). Nothing is contacted."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    import netrc
    from urllib.parse import urlparse

    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or "api.wandb.ai"
    path = os.environ.get("NETRC") or os.path.expanduser("~/.netrc")
    try:
        return netrc.netrc(path).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def check_logger(node) -> None:
    """Refuse, before a run starts, a logger configuration that cannot log.

    ``logger=wandb``: ``logger.mode`` (or ``WANDB_MODE`` when it is null) must be one of
    :data:`WANDB_MODES`; a mode that uploads (:data:`UPLOADING_MODES`) needs credentials
    (:func:`_wandb_credentials`). Other loggers are not checked here.

    Raises:
        ConfigError: names the key, its value and what is valid.
    """
    from ..errors import ConfigError

    if getattr(node, "_target_", None) != "specsamp.runner.loggers.WandbLogger":
        return
    mode = node.mode or os.environ.get("WANDB_MODE", "offline")
    if mode not in WANDB_MODES:
        raise ConfigError(
            f"logger.mode={mode!r} is invalid: must be one of {', '.join(WANDB_MODES)} (wandb's modes; "
            "offline writes the run under the output directory for a later `wandb sync`)."
        )
    if mode in UPLOADING_MODES and not _wandb_credentials():
        raise ConfigError(
            f"logger.mode={mode!r} is invalid here: it uploads to W&B, and no credentials are configured "
            "(WANDB_API_KEY unset, no netrc entry from `wandb login`). Log in, or use logger.mode=offline "
            "and `wandb sync` the run later."
        )


@dataclass
class WandbLogger:
    """One Weights & Biases run per specsamp run, offline unless ``mode`` / ``WANDB_MODE`` says otherwise.

    In a sweep, ``group`` defaults to the sweep's name (an explicit ``logger.group`` wins).
    """

    name: str = "wandb"
    project: str = "specsamp"
    entity: str | None = None
    mode: str | None = None
    group: str | None = None

    def log(self, config: dict, record: dict, out_dir: Path) -> None:
        """Send the run's config, its scalars (speedup, NFE, metrics, acceptance per depth) and its PNGs."""
        try:
            import wandb
        except ImportError:
            print("warning: logger=wandb but the wandb package is not installed (pip install specsamp[wandb]); skipped")
            return
        run = wandb.init(
            project=self.project,
            entity=self.entity,
            group=self.group,
            dir=str(out_dir),
            config=config,
            mode=self.mode or os.environ.get("WANDB_MODE", "offline"),
            reinit=True,
        )
        scalars = {
            "speedup": record["speedup"]["mean"],
            "speedup_sem": record["speedup"]["sem"],
            "nfe": record["nfe"]["mean"],
            "target_rows": record["target_rows"]["mean"],
            "batch_speedup": record["batch_speedup"],
            "budget": record["budget"],
            "wall_seconds": record["wall_seconds"],
            **{k: v for k, v in (record.get("metrics") or {}).items() if isinstance(v, (int, float))},
            **{f"acceptance/depth{i + 1}": a for i, a in enumerate(record.get("acceptance_per_depth", []))},
        }
        run.log(scalars)
        for png in Path(out_dir).glob("*.png"):
            run.log({png.stem: wandb.Image(str(png))})
        run.finish()


def log_record(logger_node, config: dict, record: dict, out_dir: Path, sweep_name: str | None = None) -> None:
    """Instantiate the configured logger (``logger._target_``; none: nothing to do) and log the record."""
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    node = OmegaConf.structured(logger_node)
    if node.get("_target_") is None:
        return
    if sweep_name is not None and node.get("group") is None:
        node.group = str(sweep_name)
    instantiate(node).log(config, record, out_dir)
