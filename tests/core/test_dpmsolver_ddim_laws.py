"""DPM-Solver++ SDE (``DPMSolverMultistepScheduler(algorithm_type="sde-dpmsolver++")``, solver orders 1 to 3) and DDIM
with ``eta > 0`` (``DDIMScheduler.step(eta=...)``) as kernels: their samplers are diffusers' own loops.

* One step at a time: the kernel's loop on the noise diffusers' ``step`` is handed (``variance_noise``) ends where
  diffusers' loop ends, to float32 rounding (diffusers computes in float32), for each order, solver type, prediction
  type, sigma spacing, final sigma and clipping option tested.
* Bit for bit: the standard sampler is the kernel's own loop written here on the same keyed noise.
* The law: the speculative samplers (dgrs on (2, 4), rmc on a chain of 6; path and tree executions, whose counts are
  identical) against diffusers' loop with a ``torch.Generator`` (``scheduler_models.pipeline_loop``), on the warped
  mixture of ``test_scheduler_laws`` (``warp = 1``; 6 for DDIM: with a near-exact network DDIM's final law hardly
  depends on eta, its marginals being the same for every eta, so a coefficient error shows only through the
  network's error); the statistic (KS on 5 projections and the norm, chi-square of
  the components) passes when its smallest p-value is above ``P_MIN = 1e-3``. Power, in the same statistic: DDIM at
  eta 0.9 against the loop at eta 1.0, and DPM-Solver's first-order loop against the second-order one, min p below
  1e-6. Seeds: the loop's generator 0, specsamp's seed 5; n and T in each test.
* Through a tiny ``DDIMPipeline`` (its ``eta``) and a ``DDPMPipeline`` under DPM-Solver++ SDE: ``speculative(pipe)``
  against ``pipe(...)``; and the refusals.
"""

from __future__ import annotations

import pytest
import torch
from scheduler_models import law_pvalues, mixture_net, pipeline_loop

from specsamp import rng, sampler
from specsamp.errors import ConfigError
from specsamp.integrations.schedulers import from_scheduler
from specsamp.kernels import shift_history
from specsamp.models.gmm import GaussianMixture
from specsamp.models.parametrisation import GridTimesteps, Parametrised
from specsamp.round import initial_state
from specsamp.trees import DraftTree

pytest.importorskip("diffusers")
from diffusers import DDIMScheduler, DPMSolverMultistepScheduler  # noqa: E402

P_MIN = 1e-3
LOOP_SEED, SPEC_SEED = 0, 5
WARP = {"dpm": 1.0, "ddim": 6.0}  # the network's deliberate error per kind (module docstring)
TREES = {"dgrs": DraftTree.uniform(2, 4), "rmc": DraftTree.chain(6)}
GMM = GaussianMixture(dim=8, components=3, layout_seed=1, dtype=torch.float64)


def make(kind: str, **cfg):
    if kind == "dpm":
        return DPMSolverMultistepScheduler(algorithm_type="sde-dpmsolver++", **cfg)
    return DDIMScheduler(**cfg)


def model_of(plan, sch, steps: int, kind: str):
    fresh = type(sch).from_config(sch.config)
    fresh.set_timesteps(steps)
    net = mixture_net(GMM, fresh, plan.prediction, warp=WARP[kind])
    return Parametrised(
        net,
        plan.prediction,
        plan.coords,
        GMM.event_shape,
        torch.float64,
        time=GridTimesteps(plan.schedule.sigmas, plan.timesteps),
    ), net


def kernel_loop(plan, model, x: torch.Tensor, noise) -> torch.Tensor:
    """The kernel's sampler written out: per step the network, the mean from the step's coefficients and the earlier
    steps' records (a multistep kernel), plus ``std * noise(n)``."""
    kern, hist = plan.schedule.kernel, None
    for i in range(plan.schedule.steps):
        n = torch.full((x.shape[0],), i)
        v = model(x, plan.schedule.sigmas[n])
        c = kern.coefs(n, x)
        mean = kern.mean(x, v, c) if kern.order == 1 else kern.mean(x, v, c, hist)
        if kern.order > 1:
            hist = shift_history(hist, kern.record(x, v, c), kern.order)
        x = mean + c["std"] * noise(i)
    return x


STEP_CASES = [  # (kind, scheduler config, T, step options)
    ("dpm", dict(solver_order=2), 10, {}),
    ("dpm", dict(solver_order=3), 20, {}),
    ("dpm", dict(solver_order=1), 8, {}),
    ("dpm", dict(solver_order=2, solver_type="heun", prediction_type="v_prediction"), 10, {}),
    ("dpm", dict(solver_order=3, use_karras_sigmas=True, lower_order_final=False), 12, {}),
    ("dpm", dict(solver_order=3, final_sigmas_type="sigma_min", lower_order_final=False), 12, {}),
    ("dpm", dict(solver_order=3, prediction_type="sample", euler_at_final=True), 16, {}),
    ("dpm", dict(solver_order=2, use_lu_lambdas=True), 10, {}),
    ("ddim", {}, 10, dict(eta=1.0)),
    ("ddim", dict(timestep_spacing="linspace", prediction_type="v_prediction", clip_sample=False), 10, dict(eta=0.7)),
    ("ddim", dict(set_alpha_to_one=False, clip_sample_range=1.5), 10, dict(eta=0.5)),
    ("ddim", dict(timestep_spacing="trailing"), 10, dict(eta=0.5, use_clipped_model_output=True)),
]


@pytest.mark.parametrize("kind,cfg,steps,step", STEP_CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(STEP_CASES)])
def test_the_kernel_is_diffusers_step_on_the_same_noise(kind, cfg, steps, step):
    # 16 trajectories, warped mixture: the kernel's loop (float64) and diffusers' loop (float32, variance_noise) on
    # the same first latents and step noise end within 2e-5 (their float32 rounding)
    n = 16
    sch = make(kind, **cfg)
    sch.set_timesteps(steps)
    net = mixture_net(GMM, sch, sch.config.prediction_type, warp=WARP[kind])
    g = torch.Generator().manual_seed(0)
    lat = torch.randn(n, 8, generator=g, dtype=torch.float64)
    noises = [torch.randn(n, 8, generator=g, dtype=torch.float64) for _ in range(steps)]
    y = lat.float()
    for i, t in enumerate(sch.timesteps):
        y = sch.step(net(y, t), t, y, variance_noise=noises[i].float(), **step).prev_sample
    plan = from_scheduler(make(kind, **cfg), steps, event_ndim=1, **step)
    model, _ = model_of(plan, make(kind, **cfg), steps, kind)
    x = kernel_loop(plan, model, plan.init_scale * lat, lambda i: noises[i])
    assert torch.isfinite(y).all()
    torch.testing.assert_close(x, y.double(), rtol=0, atol=2e-5)


@pytest.mark.parametrize("kind,cfg", [("dpm", dict(solver_order=3)), ("ddim", dict(clip_sample=True))])
def test_the_standard_sampler_is_the_kernel_loop_bit_for_bit(kind, cfg):
    # 6 trajectories, T = 8, seed 4: the loop above on the standard sampler's keyed initial state and step noise
    plan = from_scheduler(make(kind, **cfg), 8, event_ndim=1, eta=0.8)
    model, _ = model_of(plan, make(kind, **cfg), 8, kind)
    ids = torch.arange(6)
    x = initial_state(plan.schedule, 4, ids, GMM.event_shape, torch.float64)
    keys = rng.base_key(4, ids, "step")
    want = kernel_loop(plan, model, x, lambda i: rng.normal(rng.fold(keys, i), GMM.event_shape, dtype=torch.float64))
    assert torch.equal(sampler.sample_standard(model, plan.schedule, 6, seed=4).samples, want)


def reference(kind, steps, n, step=None, seed=LOOP_SEED, **cfg):
    sch = make(kind, **cfg)
    sch.set_timesteps(steps)
    g = torch.Generator().manual_seed(seed)
    latents = torch.randn(n, *GMM.event_shape, generator=g)
    return pipeline_loop(
        sch, mixture_net(GMM, sch, sch.config.prediction_type, warp=WARP[kind]), latents, g, **(step or {})
    )


def speculative(kind, steps, n, coupling, execution, step=None, **cfg):
    plan = from_scheduler(make(kind, **cfg), steps, event_ndim=1, **(step or {}))
    model, _ = model_of(plan, make(kind, **cfg), steps, kind)
    return sampler.sample_speculative(
        model, plan.schedule, TREES[coupling], coupling, n, draft="x0", execution=execution, seed=SPEC_SEED
    )


LAW_CASES = [  # (kind, scheduler config, step options)
    ("dpm", dict(solver_order=2), None),
    ("dpm", dict(solver_order=3, prediction_type="v_prediction"), None),
    ("ddim", dict(clip_sample=False), dict(eta=1.0)),
]


@pytest.mark.parametrize("kind,cfg,step", LAW_CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(LAW_CASES)])
def test_law_matches_the_diffusers_loop(kind, cfg, step, n=2000, steps=10):
    # d = 8, n = 2000, T = 10: dgrs and rmc, path and tree (identical counts, samples to rounding), min p > 1e-3
    ref = reference(kind, steps, n, step, **cfg)
    report = {}
    for coupling in ("dgrs", "rmc"):
        runs = {ex: speculative(kind, steps, n, coupling, ex, step, **cfg) for ex in ("path", "tree")}
        for ex, r in runs.items():
            report[coupling, ex] = p = min(law_pvalues(r.samples, ref, GMM).values())
            assert p > P_MIN, (kind, cfg, coupling, ex, p)
        a, b = runs["path"], runs["tree"]
        for field in ("nfe", "nfe_total", "accepts", "attempts", "target_rows"):
            assert torch.equal(getattr(a, field), getattr(b, field)), field
        torch.testing.assert_close(a.samples, b.samples, rtol=0, atol=1e-10)
    print(kind, cfg, step, report)


def test_the_statistic_rejects_a_wrong_eta_or_order():
    # n = 2000, T = 10, rmc path: DDIM planned at eta 0.9 against the loop at eta 1.0; DPM-Solver++ SDE planned at
    # order 2 against the loop at order 1: min p < 1e-6
    ddim = speculative("ddim", 10, 2000, "rmc", "path", dict(eta=0.9), clip_sample=False)
    p_eta = min(law_pvalues(ddim.samples, reference("ddim", 10, 2000, dict(eta=1.0), clip_sample=False), GMM).values())
    dpm = speculative("dpm", 10, 2000, "rmc", "path", solver_order=2)
    p_order = min(law_pvalues(dpm.samples, reference("dpm", 10, 2000, solver_order=1), GMM).values())
    print(p_eta, p_order)
    assert p_eta < 1e-6 and p_order < 1e-6


SLOW_CASES = LAW_CASES + [
    ("ddim", dict(prediction_type="v_prediction", clip_sample=True, timestep_spacing="trailing"), dict(eta=0.5)),
    ("dpm", dict(solver_order=2, solver_type="heun", use_karras_sigmas=True), None),
    (
        "dpm",
        dict(solver_order=3, final_sigmas_type="sigma_min", lower_order_final=False, prediction_type="sample"),
        None,
    ),
    ("ddim", dict(timestep_spacing="linspace", clip_sample=True, set_alpha_to_one=False), dict(eta=0.8)),
    ("ddim", dict(clip_sample=True), dict(eta=1.0, use_clipped_model_output=True)),
]


@pytest.mark.slow
@pytest.mark.parametrize("kind,cfg,step", SLOW_CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(SLOW_CASES)])
def test_law_matches_the_diffusers_loop_thorough(kind, cfg, step):
    # n = 20,000, T = 20; the first three cases are the default ones, then DDIM on a v network with clipping and
    # trailing timesteps at eta 0.5, DPM-Solver heun on Karras sigmas, order 3
    # to sigma_min on an x0 network, DDIM on linspace timesteps to alphas_cumprod[0], DDIM with the clipped eps.
    # (At n = 10,000 the DDIM eta=1 case gave dgrs/path min p 4e-4, a chance low: the same seeds at n = 40,000 give
    # min p 0.28, and the standard sampler against the loop at n = 40,000 min p 0.06 to 0.21.)
    test_law_matches_the_diffusers_loop(kind, cfg, step, n=20_000, steps=20)


def test_refusals_name_what_is_supported():
    for cfg in (
        dict(algorithm_type="dpmsolver++"),
        dict(algorithm_type="sde-dpmsolver", final_sigmas_type="sigma_min"),
        dict(use_flow_sigmas=True),
    ):
        with pytest.raises(ConfigError, match="sde-dpmsolver\\+\\+"):
            from_scheduler(DPMSolverMultistepScheduler(**{"algorithm_type": "sde-dpmsolver++", **cfg}), 10)
    with pytest.raises(ConfigError, match="variance_type='learned'"):
        from_scheduler(make("dpm", variance_type="learned"), 10)
    with pytest.raises(ConfigError, match="eta=0 .*deterministic"):
        from_scheduler(DDIMScheduler(), 10, eta=0)
    with pytest.raises(ConfigError, match="ddim .*dpmsolver_sde"):
        from_scheduler(DDIMScheduler(), 10, eta=0.0)


# --- through tiny pipelines --------------------------------------------------------------------------------------
def test_ddim_pipeline_with_eta_and_ddpm_pipeline_under_dpm_solver_have_their_loops_law():
    # tiny UNet2D, n = 150, T = 6, dgrs (2, 2): speculative(pipe) against pipe(...) (generators 1 and 0), KS on 5
    # projections and the norm, min p > 1e-3: DDIMPipeline at eta=1, DDPMPipeline under DPM-Solver++(2M) SDE; then the
    # refusals: DDIMPipeline at its default eta=0, DDPMPipeline under DDIM (its loop passes no eta), an eta where the
    # pipeline takes none, DDIMPipeline under DPM-Solver (its loop passes eta, which that step does not take)
    import tiny_diffusers as td
    from diffusers import DDIMPipeline, DDPMPipeline
    from helpers import min_ks_p

    from specsamp.integrations.diffusers import speculative as spec

    args = dict(batch_size=150, num_inference_steps=6, output_type="pt")
    ddim = DDIMPipeline(unet=td.tiny_unet2d(0), scheduler=DDIMScheduler())
    dpm = DDPMPipeline(unet=td.tiny_unet2d(0), scheduler=make("dpm", solver_order=2))
    for pipe, kw in ((ddim, dict(eta=1.0)), (dpm, {})):
        pipe.set_progress_bar_config(disable=True)
        ref = pipe(generator=torch.Generator().manual_seed(0), **args, **kw).images
        out = spec(pipe, 2, 2, "dgrs")(generator=torch.Generator().manual_seed(1), **args, **kw)
        assert min_ks_p(out.images, ref) > P_MIN, type(pipe.scheduler).__name__
    with pytest.raises(ConfigError, match="eta=0"):
        spec(ddim)(**args)  # DDIMPipeline's default eta is 0: deterministic
    with pytest.raises(ConfigError, match="DDIMPipeline with eta > 0"):
        spec(DDPMPipeline(unet=td.tiny_unet2d(0), scheduler=DDIMScheduler()))
    with pytest.raises(ConfigError, match="eta=0.5 is not supported"):
        spec(dpm)(eta=0.5, **args)
    ddim.scheduler = make("dpm")
    with pytest.raises(ConfigError, match="passes eta to scheduler.step, which DPMSolverMultistepScheduler does not"):
        spec(ddim)
