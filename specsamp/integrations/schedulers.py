"""A diffusers scheduler as a :class:`~specsamp.schedule.Schedule`: kept for its public names, which now live in
:mod:`specsamp.schedulers` (beside the kernels that read each scheduler)."""

from __future__ import annotations

from ..schedulers import KERNEL_OF, MAX_STEPS, SUPPORTED, SchedulerPlan, from_scheduler, refuse

__all__ = ["KERNEL_OF", "MAX_STEPS", "SUPPORTED", "SchedulerPlan", "from_scheduler", "refuse"]
