"""The Hydra task behind ``run.py``: config in, ``result.json`` and one printed line out."""

from __future__ import annotations

import sys
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from .experiment import ConfigError, config_hash, existing_record, run_config, summary_line, write_json_atomic


def _output_dir() -> Path:
    try:
        from hydra.core.hydra_config import HydraConfig

        return Path(HydraConfig.get().runtime.output_dir)
    except Exception:
        return Path.cwd()


def fail(message: str) -> None:
    """Print a user error as one paragraph on stderr and exit with status 2 (no traceback)."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def run_task(cfg: DictConfig) -> float | None:
    """Validate and run one job; skip it when its record already exists with the same config hash.

    Returns:
        The mean per-trajectory speedup.
    """
    try:
        cfg_dict = OmegaConf.to_container(cfg, resolve=True)
    except Exception as e:  # interpolation errors are config errors
        fail(f"the configuration does not resolve: {e}")
    cfg_dict.pop("hydra", None)
    out_dir = _output_dir()
    h = config_hash(cfg_dict)
    if cfg_dict.get("skip_existing", True):
        rec = existing_record(out_dir, h)
        if rec is not None:
            print(f"skipped (done, config {h}): {summary_line(rec)}")
            return rec["speedup"]["mean"]
    try:
        record, result = run_config(cfg_dict)
    except ConfigError as e:
        fail(str(e))
    record["output_dir"] = str(out_dir)
    if cfg_dict.get("save_samples"):
        import torch

        torch.save(result.samples.cpu(), out_dir / "samples.pt")
    from .loggers import log_record

    log_record(cfg_dict, record, out_dir)
    write_json_atomic(out_dir / "result.json", record)
    print(summary_line(record), flush=True)
    return record["speedup"]["mean"]
