"""The repository root, for tests that compose the Hydra configs."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
