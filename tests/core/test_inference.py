"""The samplers run without autograd's bookkeeping (``torch.inference_mode``) and hand back ordinary tensors.

Setup: ``GaussianMixture(dim=4, components=3, layout_seed=1)`` in float64, ``Schedule.make(8, 1.0)``, 12
trajectories, seed 3. Inference mode changes no arithmetic, so the counts and samples equal, bit for bit,
those of the same sampler run with autograd's bookkeeping on (the undecorated function, ``__wrapped__``).
"""

from __future__ import annotations

import pytest
import torch

from specsamp import sampler
from specsamp.models import GaussianMixture
from specsamp.schedule import Schedule
from specsamp.trees import DraftTree

SCHED = Schedule.make(8, 1.0)
FIELDS = ("samples", "nfe", "nfe_total", "target_rows", "rounds", "committed", "attempts", "accepts")


class _Recording(GaussianMixture):
    """The mixture, recording whether each call ran in inference mode."""

    def __call__(self, *a, **k):
        self.modes.append(torch.is_inference_mode_enabled())
        return super().__call__(*a, **k)


@pytest.mark.parametrize("execution", ["tree", "path", "standard"])
def test_samplers_run_in_inference_mode_with_the_same_bits_and_return_ordinary_tensors(execution):
    model = _Recording(dim=4, components=3, layout_seed=1, dtype=torch.float64)
    model.modes = []
    if execution == "standard":
        run = lambda fn: fn(model, SCHED, 12, seed=3)  # noqa: E731
        fn = sampler.sample_standard
    else:
        run = lambda fn: fn(model, SCHED, DraftTree.uniform(2, 3), "dgrs", 12, execution=execution, seed=3)  # noqa: E731
        fn = sampler.sample_speculative
    got = run(fn)
    assert model.modes and all(model.modes)
    model.modes = []
    ref = run(fn.__wrapped__)  # the same sampler with autograd's bookkeeping
    assert model.modes and not any(model.modes)
    for f in FIELDS:
        t = getattr(got, f)
        assert not t.is_inference(), f
        assert torch.equal(t, getattr(ref, f)), f
    got.samples.mul_(2.0)  # an ordinary tensor: in-place updates and autograd work on it
    assert got.samples.clone().requires_grad_().sum().requires_grad
