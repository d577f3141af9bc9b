"""The ``kernel`` config group: ``em`` (the default) leaves every record and config hash as it was; the scheduler
kernels (``ddpm``, ``euler_ancestral``, ``flow_stochastic``) take their grid from a diffusers scheduler built from
their keys, run end to end through ``run.py`` and record the kernel; a model that brings its own scheduler plan
is built with it; bad kernel values exit 2 with one paragraph.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import pytest
import torch
from helpers import ROOT, python

from specsamp.ancestral import flow_levels
from specsamp.dpmpp import karras_levels
from specsamp.errors import ConfigError
from specsamp.models.gmm import GMMConfig
from specsamp.runner import run_config
from specsamp.runner.config import compose, load_config
from specsamp.runner.loop import record_hash

pytest.importorskip("diffusers")

SMALL = ["model.dim=16", "steps=20", "n_samples=8", "progress=false"]


def test_em_is_the_default_and_its_records_hold_no_kernel():
    """The default cell's hash (tests/runner/test_config_hashes.py) with kernel unset, em or auto (a model without
    a scheduler of its own); a scheduler kernel records its keys and a null eps, and hashes apart."""
    for extra in ([], ["kernel=em"], ["kernel=auto"]):
        run, recorded, h = record_hash(compose(extra))
        assert (
            h == "dd3aca344e5fa5ea" and "kernel" not in recorded and recorded["eps"] == 0.1 and run.kernel.name == "em"
        )
    run, recorded, h = record_hash(compose(["kernel=ddpm"]))
    assert recorded["kernel"]["name"] == "ddpm" and recorded["kernel"]["variance_type"] == "fixed_small"
    assert recorded["eps"] is None and h != "dd3aca344e5fa5ea"
    # eps is not read by a scheduler kernel: another eps is the same config
    assert record_hash(compose(["kernel=ddpm", "eps=0.5"]))[2] == h
    assert record_hash(compose(["kernel=ddpm", "kernel.variance_type=fixed_large"]))[2] != h
    # a recorded config (shard merges and resume read it again) gives its own hash back
    assert record_hash(recorded)[2] == h
    with pytest.raises(ConfigError, match="eps=None is invalid"):
        load_config({**record_hash(compose([]))[1], "eps": None})  # em reads eps: null stays refused


def test_a_scheduler_kernels_grid_is_the_schedulers():
    """kernel=ddpm's grid is DDPMScheduler's levels on the linear path, its options the scheduler's."""
    import diffusers

    from specsamp.integrations.schedulers import from_scheduler
    from specsamp.runner.build import build_schedule

    run, _ = load_config(compose(["kernel=ddpm", "steps=50", "kernel.thresholding=true"]))
    schedule, plan = build_schedule(run)
    want = from_scheduler(diffusers.DDPMScheduler(clip_sample=False, thresholding=True), 50, event_ndim=1)
    assert torch.equal(schedule.sigmas, want.schedule.sigmas) and schedule.kernel_name == "ddpm"
    assert schedule.kernel_options == want.schedule.kernel_options and schedule.kernel_options["threshold"] == (
        0.995,
        1.0,
    )
    run, _ = load_config(compose(["kernel=flow_stochastic", "model.shift=3.0", "steps=10"]))
    schedule, _ = build_schedule(run)
    sch = diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0, stochastic_sampling=True)
    sch.set_timesteps(10)
    assert torch.allclose(schedule.sigmas, sch.sigmas.double(), atol=1e-7) and schedule.kernel_name == "flow_stochastic"


@pytest.mark.slow
def test_every_scheduler_kernel_runs_through_run_py_and_records_its_kernel(tmp_path):
    """Six jobs of one sweep (3 kernels x dgrs, standard) on the GMM (d=16, T=20, 8 trajectories)."""
    env = dict(
        os.environ,
        HYDRA_FULL_ERROR="0",
        PYTHONPATH=os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
    )
    p = python(
        [
            sys.executable,
            str(ROOT / "run.py"),
            "-m",
            *SMALL,
            "kernel=ddpm,euler_ancestral,flow_stochastic",
            "sampler=dgrs,standard",
            "sweep_name=k",
        ],
        cwd=tmp_path,
        env=env,
        timeout=600,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    recs = [json.loads(f.read_text()) for f in sorted((tmp_path / "multirun" / "k").glob("*/result.json"))]
    assert len(recs) == 6
    seen = set()
    for rec in recs:
        assert rec["kernel"] == rec["config"]["kernel"]["name"] and rec["eps"] is None and rec["config"]["eps"] is None
        seen.add((rec["kernel"], rec["sampler"]))
        assert rec["nfe_total"]["mean"] <= 20 + 2 and rec["nfe"]["mean"] <= 18
    assert seen == {(k, s) for k in ("ddpm", "euler_ancestral", "flow_stochastic") for s in ("dgrs", "standard")}
    assert "kernel=ddpm T=20" in p.stdout  # the result line names the kernel in place of eps


def test_a_scheduler_kernel_runs_speculative_and_standard_in_process():
    for sampler in ("dgrs", "standard"):
        rec, res = run_config(compose([*SMALL, "kernel=euler_ancestral", f"sampler={sampler}"]))
        assert rec["kernel"] == "euler_ancestral" and rec["config"]["kernel"]["eta"] == 1.0
        assert torch.isfinite(res.samples).all() and res.samples.shape == (8, 16)


@pytest.mark.parametrize("kernel", ["dpmpp_2m_sde", "dpmpp_3m_sde"])
def test_a_karras_kernel_runs_on_its_own_grid_and_records_its_keys(kernel):
    from specsamp.dpmpp import karras_levels
    from specsamp.runner.build import build_schedule

    run, _ = load_config(compose([*SMALL, f"kernel={kernel}", "kernel.sigma_max=20", "kernel.eta=0.8"]))
    schedule, plan = build_schedule(run)
    assert plan is None and torch.equal(schedule.sigmas, karras_levels(20, 0.002, 20.0, 7.0))
    assert schedule.kernel.eta == 0.8 and schedule.kernel.order == int(kernel[6])
    for sampler in ("rmc", "standard"):
        rec, res = run_config(compose([*SMALL, f"kernel={kernel}", f"sampler={sampler}"]))
        assert rec["kernel"] == kernel and rec["eps"] is None and rec["config"]["kernel"]["sigma_max"] == 80.0
        assert torch.isfinite(res.samples).all() and res.samples.shape == (8, 16)


@pytest.mark.parametrize(
    "kernel, keys, grid",
    [
        ("euler_ancestral_rf", ["kernel.shift=2", "kernel.eta=0.7"], lambda: flow_levels(20, 2.0)),
        ("lcm", ["kernel.sigma_max=20", "kernel.s_noise_end=0.9"], lambda: karras_levels(20, 0.002, 20.0, 7.0)),
        ("er_sde", ["kernel.sigma_max=20", "kernel.max_stage=2"], lambda: karras_levels(20, 0.002, 20.0, 7.0)),
        ("res_multistep_ancestral", ["kernel.rho=5", "kernel.eta=0.9"], lambda: karras_levels(20, 0.002, 80.0, 5.0)),
    ],
)
def test_the_comfyui_kernels_run_on_their_own_grids(kernel, keys, grid):
    from specsamp.runner.build import build_schedule

    run, _ = load_config(compose([*SMALL, f"kernel={kernel}", *keys]))
    schedule, plan = build_schedule(run)
    assert plan is None and torch.equal(schedule.sigmas, grid())
    for sampler in ("rmc", "standard"):
        rec, res = run_config(compose([*SMALL, f"kernel={kernel}", f"sampler={sampler}", *keys]))
        assert rec["kernel"] == kernel and rec["eps"] is None and torch.isfinite(res.samples).all()


def test_ddpm_speculative_and_standard_sample_the_same_law_on_the_gmm():
    """A sanity check of the wiring (the thorough law tests live with the kernels): D-GRS and the standard
    sampler under kernel=ddpm, T=20, on the GMM (d=16), n=400 each under different seeds (0 and 1, so the two
    samples are independent); the two-sample KS test on the sample norms and on the first coordinate must
    not reject at level 1e-3 (deterministic: fixed seeds)."""
    from scipy.stats import ks_2samp

    base = ["model.dim=16", "steps=20", "n_samples=400", "progress=false", "kernel=ddpm"]
    _, spec = run_config(compose([*base, "sampler=dgrs", "seed=0"]))
    rec, std = run_config(compose([*base, "sampler=standard", "seed=1"]))
    for f in (lambda x: x.norm(dim=1), lambda x: x[:, 0]):
        assert ks_2samp(f(spec.samples).numpy(), f(std.samples).numpy()).pvalue > 1e-3
    # and not a trivial pass: the GMM's own samples (its exact law) are near in norm
    assert abs(float(std.samples.norm(dim=1).mean()) - float(spec.samples.norm(dim=1).mean())) < 0.5


@pytest.mark.slow
def test_digits_runs_with_kernel_ddpm():
    rec, res = run_config(compose(["model=digits", "kernel=ddpm", "steps=30", "n_samples=4", "progress=false"]))
    assert rec["kernel"] == "ddpm" and rec["model"] == "edm-digits-8x8-cond" and torch.isfinite(res.samples).all()
    assert res.samples.shape == (4, 1, 8, 8) and rec["nfe"]["mean"] < 28


# ----------------------------------------------------------------------------------------------
# a model that brings its own scheduler (model=diffusers's contract)


@dataclasses.dataclass
class PlannedGMMConfig(GMMConfig):
    """The GMM with a scheduler of its own (DDPM with 500 training steps unless the run names another kernel):
    what a pipeline-backed model (model=diffusers) does."""

    def scheduler_plan(self, steps, kernel):
        import diffusers

        from specsamp.integrations.schedulers import from_scheduler

        if kernel == "em":
            return None
        cls = diffusers.EulerAncestralDiscreteScheduler if kernel == "euler_ancestral" else diffusers.DDPMScheduler
        return from_scheduler(cls(num_train_timesteps=500), steps, event_ndim=1)

    def build(self, device, plan=None):
        PLANS.append(plan)
        return super().build(device)


PLANS: list = []


def _planned(extra):
    from omegaconf import OmegaConf

    cfg = OmegaConf.to_container(compose([*SMALL, *extra]), resolve=True)
    cfg["model"] = {**cfg["model"], "_target_": f"{__name__}.PlannedGMMConfig"}
    return cfg


def test_a_model_that_brings_its_scheduler_is_built_with_its_plan():
    from specsamp.models.base import TargetConfig

    assert TargetConfig.scheduler_plan(None, 10, None) is None  # every shipped model: no plan
    PLANS.clear()
    rec, _ = run_config(_planned(["kernel=auto"]))
    plan = PLANS[-1]
    assert (
        plan is not None
        and plan.kernel == "ddpm"
        and rec["config"]["kernel"] == {"name": "auto"}
        and rec["eps"] is None
    )
    assert float(plan.timesteps[0]) == 475  # the model's own scheduler (500 training steps, leading spacing)
    rec, _ = run_config(_planned(["kernel=euler_ancestral"]))
    assert PLANS[-1].kernel == "euler_ancestral"  # the model read the kernel's name
    rec, _ = run_config(_planned(["kernel=em"]))
    assert PLANS[-1] is None and "kernel" not in rec["config"]  # no plan: em's grid, build(device, plan=None)


# ----------------------------------------------------------------------------------------------
# bad input


@pytest.mark.parametrize(
    "args, needle",
    [
        (
            ["kernel=ddpm", "kernel.variance_type=learned"],
            "kernel.variance_type='learned' is invalid for kernel=ddpm: "
            "must be one of fixed_small, fixed_small_log, fixed_large.",
        ),
        (
            ["kernel=ddpm", "kernel.timestep_spacing=foo"],
            "kernel.timestep_spacing='foo' is invalid for kernel=ddpm: must be one of leading, trailing, linspace.",
        ),
        (
            ["kernel=euler_ancestral", "kernel.eta=0"],
            "kernel.eta=0.0 is invalid for kernel=euler_ancestral: must be a finite number > 0",
        ),
        (["kernel=euler_ancestral", "kernel.s_noise=nan"], "kernel.s_noise=nan is invalid for kernel=euler_ancestral"),
        (
            ["kernel=ddpm", "steps=1001"],
            "steps=1001 is invalid with kernel=ddpm: the scheduler samples at most "
            "kernel.num_train_timesteps=1000 distinct timesteps; use steps <= 1000",
        ),
        (
            ["kernel=euler_ancestral", "steps=50", "kernel.num_train_timesteps=40"],
            "steps=50 is invalid with kernel=euler_ancestral",
        ),
        (
            ["kernel=ddpm", "kernel.num_train_timesteps=1000000"],
            "kernel.num_train_timesteps=1000000 is invalid for kernel=ddpm: must be an integer >= 2, at most 100000",
        ),
        (
            ["kernel=ddpm", "kernel.beta_schedule=cosine"],
            "kernel.beta_schedule='cosine' is invalid for kernel=ddpm: must be one of linear",
        ),
        (
            ["kernel=flow_stochastic", "kernel.shift=0"],
            "kernel.shift=0.0 is invalid for kernel=flow_stochastic: must be a finite number > 0",
        ),
        (
            ["kernel=dpmpp_2m_sde", "kernel.eta=0"],
            "kernel.eta=0.0 is invalid for kernel=dpmpp_2m_sde: must be a finite number > 0 (eta=0 is the "
            "deterministic sampler",
        ),
        (
            ["kernel=dpmpp_2m_sde", "kernel.solver_type=euler"],
            "kernel.solver_type='euler' is invalid for kernel=dpmpp_2m_sde: must be one of midpoint, heun",
        ),
        (
            ["kernel=dpmpp_3m_sde", "kernel.sigma_min=100"],
            "kernel.sigma_min=100.0 is invalid with kernel.sigma_max=80.0 for kernel=dpmpp_3m_sde",
        ),
        (
            ["kernel=euler_ancestral_rf", "kernel.eta=1.5"],
            "kernel.eta=1.5 is invalid for kernel=euler_ancestral_rf: must be a finite number in (0, 1]",
        ),
        (
            ["kernel=lcm", "kernel.s_noise_end=0"],
            "kernel.s_noise_end=0.0 is invalid for kernel=lcm: must be a finite number > 0, or null",
        ),
        (
            ["kernel=er_sde", "kernel.max_stage=4"],
            "kernel.max_stage=4 is invalid for kernel=er_sde: must be an integer >= 1, at most 3",
        ),
        (
            ["kernel.name=foo"],
            "kernel.name='foo' is invalid: must be one of em, auto, ddpm, euler_ancestral, flow_stochastic",
        ),
    ],
)
def test_a_bad_kernel_value_names_the_key_the_value_and_what_is_valid(args, needle):
    with pytest.raises(ConfigError) as e:
        load_config(compose(args))
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_a_scheduler_grid_that_repeats_a_level_is_refused_at_build_naming_the_keys():
    from specsamp.runner.build import build_schedule

    run, _ = load_config(
        compose(["kernel=euler_ancestral", "steps=1000", "kernel.timestep_spacing=leading", "kernel.steps_offset=1"])
    )
    with pytest.raises(ConfigError) as e:
        build_schedule(run)
    assert str(e.value).startswith(
        "steps=1000 is invalid with kernel=euler_ancestral, kernel.timestep_spacing=leading, "
        "kernel.steps_offset=1: the scheduler's grid is not strictly decreasing"
    )


@pytest.mark.parametrize(
    "args, needle",
    [
        (
            ["kernel=foo"],
            "error: kernel=foo is not an option of the config group kernel; valid: auto, ddim, ddpm, dpmpp_2m_sde, "
            "dpmpp_3m_sde, dpmsolver_sde, em, er_sde, euler_ancestral, euler_ancestral_rf, flow_stochastic, lcm, "
            "res_multistep_ancestral (conf/kernel/)",
        ),
        (
            ["kernel=ddpm", "kernel.clip_sample=2"],
            "error: kernel.clip_sample=2 is invalid: kernel.clip_sample takes true or false",
        ),
        (["kernel=ddpm", "steps=5000"], "error: steps=5000 is invalid with kernel=ddpm"),
        (
            ["kernel=ddpm", "kernel.eta=1"],
            "error: kernel.eta=1 is not a key of DDPMKernelConfig (the config of kernel); did "
            "you mean kernel.beta_end?",
        ),
    ],
)
def test_a_bad_kernel_exits_2_with_one_paragraph(tmp_path, args, needle):
    env = dict(
        os.environ,
        HYDRA_FULL_ERROR="0",
        PYTHONPATH=os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
    )
    p = python([sys.executable, str(ROOT / "run.py"), *args], cwd=tmp_path, env=env)
    err = p.stderr.strip()
    assert (
        p.returncode == 2 and err.startswith(needle) and "\n" not in err and "Traceback" not in p.stdout + p.stderr
    ), err
    assert not (tmp_path / "outputs").exists() or not list((tmp_path / "outputs").rglob("result.json"))


def test_a_scheduler_kernel_without_diffusers_is_refused(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "diffusers" else real(name, *a))
    with pytest.raises(
        ConfigError,
        match=r"kernel=ddpm is invalid here: it builds its grid with a diffusers scheduler, "
        r"and diffusers is not installed",
    ):
        load_config(compose(["kernel=ddpm"]))
    load_config(compose(["kernel=em"]))  # em needs no diffusers


# ----------------------------------------------------------------------------------------------
# memory: classifier-free guidance doubles the network's rows


def test_the_memory_estimate_counts_two_rows_per_state_under_guidance():
    from specsamp.runner.memory import SD3_ROW_BYTES, run_memory_bytes

    def est(*o):
        return run_memory_bytes(load_config(compose(["model=sd3", *o]), here=False)[0])

    # SD3's paper cell on the CPU: 100 trajectories x K=6 rows per call, capped at max_batch=64 states; guidance
    # evaluates a conditional and an unconditional row per state
    assert est("model.guidance=7.0") - est("model.guidance=1.0") == 64 * SD3_ROW_BYTES


def test_a_model_yaml_in_package_global_selects_kernel_auto_and_the_command_line_wins(tmp_path):
    """How a model that brings its own scheduler makes ``kernel=auto`` its default (docs/architecture.md)."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "own.yaml").write_text(
        "# @package _global_\ndefaults:\n  - /model/gmm_schema@model\n  - override /kernel: auto\n  - _self_\n"
        "model:\n  _target_: specsamp.models.gmm.GMMConfig\n  name: gmm\n  dim: 16\n"
    )
    search = f"hydra.searchpath=[file://{tmp_path}]"
    assert compose([search, "model=own"]).kernel.name == "auto"
    assert compose([search, "model=own", "kernel=ddpm"]).kernel.name == "ddpm"
    assert compose([search, "model=own", "model.dim=4"]).model.dim == 4
    assert compose([]).kernel.name == "em"


def test_keys_a_scheduler_kernel_does_not_read_are_noted_once(capsys):
    rec, _ = run_config(compose([*SMALL, "kernel=ddpm", "eps=0.5", "model.shift=2.0", "sampler=standard"]))
    err = capsys.readouterr().err
    assert (
        "note: eps=0.5, model.shift=2.0 are not read by kernel=ddpm, whose grid and noise are its scheduler's "
        "(eps is recorded as null)."
    ) in err
    assert rec["eps"] is None and rec["config"]["eps"] is None
    run_config(compose([*SMALL, "kernel=flow_stochastic", "model.shift=2.0", "sampler=standard"]))
    assert "not read" not in capsys.readouterr().err  # the flow kernel reads model.shift (kernel.shift=null)


def test_a_profile_names_its_kernel_and_a_run_on_another_is_told(capsys):
    # a shipped profile (made on em) read by a ddpm run: one note naming both kernels; em runs read it silently
    run_config(compose([*SMALL, "kernel=ddpm", "draft=x0", "tree=optimal", "delta_profile=gmm_x0", "steps=30"]))
    err = capsys.readouterr().err
    assert "kernel='em'" in err and "kernel='ddpm'" in err and "used as given" in err
    run_config(compose([*SMALL, "draft=x0", "tree=optimal", "delta_profile=gmm_x0", "steps=30", "model.dim=500"]))
    assert "kernel=" not in capsys.readouterr().err


def test_calibrate_samples_the_runs_kernel_and_records_it(tmp_path):
    # experiments.calibrate on kernel=ddpm: the profile is the scheduler kernel's, and says so
    out = tmp_path / "p.json"
    p = python(
        [
            sys.executable,
            "-m",
            "experiments.calibrate",
            "kernel=ddpm",
            "steps=12",
            "model.dim=8",
            "trajectories=8",
            f"out={out}",
        ],
        cwd=ROOT,
    )
    assert p.returncode == 0, p.stderr
    cfg = json.loads(out.read_text())["config"]
    assert cfg["kernel"] == "ddpm" and "eps" not in cfg
