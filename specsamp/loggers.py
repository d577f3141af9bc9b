"""Optional experiment loggers (``logger=none`` or ``logger=wandb``), outside the core."""

from __future__ import annotations

import os
from pathlib import Path


def log_record(cfg: dict, record: dict, out_dir: Path) -> None:
    """Send a finished run's config, scalars and figure files to the configured logger.

    ``logger=wandb`` logs offline unless ``WANDB_MODE``/``logger.mode`` says otherwise; a missing
    ``wandb`` package is reported and skipped, never fatal.
    """
    logger = cfg.get("logger") or {}
    if logger.get("name") != "wandb":
        return
    try:
        import wandb
    except ImportError:
        print("warning: logger=wandb but the wandb package is not installed (pip install specsamp[wandb]); skipped")
        return
    mode = logger.get("mode") or os.environ.get("WANDB_MODE", "offline")
    run = wandb.init(
        project=logger.get("project", "specsamp"),
        entity=logger.get("entity"),
        group=logger.get("group"),
        mode=mode,
        dir=str(out_dir),
        config=cfg,
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
    }
    for k, v in (record.get("metrics") or {}).items():
        if isinstance(v, (int, float)):
            scalars[k] = v
    for i, a in enumerate(record.get("acceptance_per_depth", [])):
        scalars[f"acceptance/depth{i + 1}"] = a
    run.log(scalars)
    for png in Path(out_dir).glob("*.png"):
        run.log({png.stem: wandb.Image(str(png))})
    run.finish()
