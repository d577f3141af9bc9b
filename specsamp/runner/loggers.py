"""Optional experiment loggers: ``logger=none`` (default) or ``logger=wandb`` (``conf/logger/``).

A logger group's YAML names its class with ``_target_``; :func:`log_record` instantiates it once a run's
record is written. A missing logger package is reported and skipped, never fatal.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


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
        run = wandb.init(project=self.project, entity=self.entity, group=self.group, dir=str(out_dir), config=config,
                         mode=self.mode or os.environ.get("WANDB_MODE", "offline"), reinit=True)
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
