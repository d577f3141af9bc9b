"""Hydra plugin: the basic sweeper, optionally without its up-front composition check.

Hydra's basic sweeper composes every job's config twice: once to validate the whole batch before
launching, once when the job runs. For a grid of many cheap jobs (section 5.1's 84 cells take ~0.5 s
each) that check costs as much as the sampling. ``hydra/sweeper=specsamp`` with ``validate: false``
skips it; a job whose overrides do not compose then fails on its own and is recorded in its
``failed.json`` like any other failing job, while the others run.
"""

from dataclasses import dataclass
from typing import Dict, List, Optional

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.config_store import ConfigStore


@dataclass
class SpecsampSweeperConf:
    """Config of :class:`SpecsampSweeper` (``hydra/sweeper=specsamp``)."""

    _target_: str = "hydra_plugins.specsamp_sweeper.SpecsampSweeper"
    max_batch_size: Optional[int] = None
    params: Optional[Dict[str, str]] = None
    validate: bool = True


ConfigStore.instance().store(group="hydra/sweeper", name="specsamp", node=SpecsampSweeperConf, provider="specsamp")


class SpecsampSweeper(BasicSweeper):
    """Hydra's basic sweeper with a switch for the batch composition check."""

    def __init__(self, max_batch_size: Optional[int], params: Optional[Dict[str, str]] = None, validate: bool = True):
        super().__init__(max_batch_size=max_batch_size, params=params)
        self.validate = validate

    def validate_batch_is_legal(self, batch: List[List[str]]) -> None:  # noqa: D102
        if self.validate:
            super().validate_batch_is_legal(batch)
