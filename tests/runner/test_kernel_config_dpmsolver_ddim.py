"""``kernel=ddim`` and ``kernel=dpmsolver_sde``: their grids and options are the schedulers' (``DDIMScheduler`` stepped
with ``eta``; ``DPMSolverMultistepScheduler(algorithm_type="sde-dpmsolver++")``), they run in process with the
speculative and the standard samplers, and a bad value is refused naming the key, the value and what is valid."""

from __future__ import annotations

import pytest
import torch

from specsamp.errors import ConfigError
from specsamp.runner import run_config
from specsamp.runner.config import compose, load_config

pytest.importorskip("diffusers")

SMALL = ["model.dim=16", "steps=12", "n_samples=8", "progress=false"]


@pytest.mark.parametrize(
    "args,scheduler,step",
    [
        (["kernel=ddim", "kernel.eta=0.5"], ("DDIMScheduler", dict(clip_sample=False)), dict(eta=0.5)),
        (
            ["kernel=dpmsolver_sde", "kernel.solver_order=3", "kernel.use_karras_sigmas=true"],
            (
                "DPMSolverMultistepScheduler",
                dict(algorithm_type="sde-dpmsolver++", solver_order=3, use_karras_sigmas=True),
            ),
            {},
        ),
    ],
    ids=["ddim", "dpmsolver_sde"],
)
def test_the_grid_and_options_are_the_schedulers(args, scheduler, step):
    import diffusers

    from specsamp.integrations.schedulers import from_scheduler
    from specsamp.runner.build import build_schedule

    run, _ = load_config(compose(["steps=12", *args]))
    schedule, _ = build_schedule(run)
    cls, cfg = scheduler
    want = from_scheduler(getattr(diffusers, cls)(**cfg), 12, event_ndim=1, **step)
    assert torch.equal(schedule.sigmas, want.schedule.sigmas)
    assert schedule.kernel_name == want.kernel and schedule.kernel_options == want.schedule.kernel_options


@pytest.mark.parametrize("kernel", ["ddim", "dpmsolver_sde"])
def test_runs_speculative_and_standard_in_process(kernel):
    for sampler in ("dgrs", "standard"):
        rec, res = run_config(compose([*SMALL, f"kernel={kernel}", f"sampler={sampler}"]))
        assert rec["kernel"] == kernel and rec["eps"] is None
        assert torch.isfinite(res.samples).all() and res.samples.shape == (8, 16)


@pytest.mark.parametrize(
    "args,needle",
    [
        (["kernel=ddim", "kernel.eta=0"], "kernel.eta=0.0 is invalid for kernel=ddim: must be a finite number > 0"),
        (["kernel=ddim", "kernel.timestep_spacing=even"], "kernel.timestep_spacing='even' is invalid for kernel=ddim"),
        (
            ["kernel=dpmsolver_sde", "kernel.solver_order=4"],
            "kernel.solver_order=4 is invalid for kernel=dpmsolver_sde: must be an integer >= 1, at most 3",
        ),
        (
            ["kernel=dpmsolver_sde", "kernel.solver_type=bh2"],
            "kernel.solver_type='bh2' is invalid for kernel=dpmsolver_sde: must be one of midpoint, heun",
        ),
        (
            ["kernel=dpmsolver_sde", "kernel.final_sigmas_type=max"],
            "kernel.final_sigmas_type='max' is invalid for kernel=dpmsolver_sde: must be one of zero, sigma_min",
        ),
    ],
)
def test_a_bad_value_names_the_key_the_value_and_what_is_valid(args, needle):
    with pytest.raises(ConfigError) as e:
        load_config(compose(args))
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_two_sigma_spacings_are_refused_at_build_naming_the_keys():
    from specsamp.runner.build import build_schedule

    run, _ = load_config(
        compose(["kernel=dpmsolver_sde", "kernel.use_karras_sigmas=true", "kernel.use_beta_sigmas=true"])
    )
    with pytest.raises(ConfigError, match="kernel=dpmsolver_sde is invalid with .*use_karras_sigmas=True"):
        build_schedule(run)
