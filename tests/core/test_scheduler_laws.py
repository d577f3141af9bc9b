"""The speculative samplers with the scheduler kernels have the law of diffusers' own loop.

The original loop is a pipeline's: ``latents * init_noise_sigma``, then per timestep the network at
``scale_model_input`` of the state and ``scheduler.step(out, t, y, generator=g)`` with a ``torch.Generator``
(:func:`scheduler_models.pipeline_loop`), float32. The network is the Gaussian mixture's exact prediction in the
scheduler's coordinates (epsilon, v-prediction, x0 or flow; :class:`scheduler_models.PredictionNet`), exact or with
a deliberate level-dependent error (``warp``: with an exact network every sampler ends near the data law, so a
wrong grid or kernel would hide in the discretisation error; with the warp it shows, see
``test_the_statistic_sees_a_wrong_grid``). Specsamp runs the same network through
:class:`~specsamp.models.parametrisation.Parametrised` on the plan :func:`~specsamp.integrations.schedulers.from_scheduler`
makes, with dgrs and rmc, in the path and the tree executions. The two executions draw the same keyed numbers for
trajectory ``i`` in runs of any size, so the tree run on the path run's first trajectories has equal counts and
samples equal to the batched mixture's rounding (``16 T eps`` of the dtype times 4, the samples' scale): the path's
law is the tree's.

Statistic: KS on 5 fixed random projections and on the norm, and the chi-square of the mixture components
(7 p-values); a case passes when the smallest is above ``P_MIN = 1e-3`` (about 0.7% of cases fail by chance at a
true null; the seeds are fixed, so each case is deterministic). Seeds: the loop's generator 0, specsamp seed 5.
"""

import time

import pytest
import torch
from scheduler_models import law_pvalues, mixture_net, pipeline_loop

from specsamp.integrations.schedulers import from_scheduler
from specsamp.models.gmm import GaussianMixture
from specsamp.models.parametrisation import GridTimesteps, Parametrised
from specsamp.sampler import sample_speculative
from specsamp.trees import DraftTree

pytest.importorskip("diffusers")
from diffusers import DDPMScheduler, EulerAncestralDiscreteScheduler, FlowMatchEulerDiscreteScheduler  # noqa: E402

P_MIN = 1e-3
LOOP_SEED, SPEC_SEED = 0, 5
TREES = {"dgrs": DraftTree.uniform(2, 4), "rmc": DraftTree.uniform(1, 12)}
WARP = 1.0  # the network's deliberate error (PredictionNet's warp): the final law then shows a wrong grid or kernel
GMM = GaussianMixture(dim=8, components=3, layout_seed=1, dtype=torch.float64)


def make(kind: str, prediction: str, **cfg):
    if kind == "ddpm":
        return DDPMScheduler(num_train_timesteps=1000, prediction_type=prediction, **cfg)
    if kind == "euler_ancestral":
        return EulerAncestralDiscreteScheduler(num_train_timesteps=1000, prediction_type=prediction, **cfg)
    return FlowMatchEulerDiscreteScheduler(stochastic_sampling=True, **cfg)


def reference(sch, steps: int, prediction: str, n: int, mu=None, warp: float = 0.0) -> torch.Tensor:
    """``n`` samples of diffusers' loop (float32 states), generator seed ``LOOP_SEED``."""
    sch.set_timesteps(steps, **({"mu": mu} if mu is not None else {}))
    g = torch.Generator().manual_seed(LOOP_SEED)
    latents = torch.randn(n, *GMM.event_shape, generator=g)
    return pipeline_loop(sch, mixture_net(GMM, sch, prediction, warp=warp), latents, g)


def speculative(
    sch,
    steps: int,
    prediction: str,
    n: int,
    coupling: str,
    execution: str,
    dtype=torch.float64,
    mu=None,
    seed: int = SPEC_SEED,
    warp: float = 0.0,
):
    plan = from_scheduler(sch, steps, event_ndim=1, mu=mu)
    fresh = type(sch).from_config(sch.config)
    fresh.set_timesteps(steps, **({"mu": mu} if mu is not None else {}))
    assert plan.prediction == prediction
    model = Parametrised(
        mixture_net(GMM, fresh, prediction, warp=warp),
        plan.prediction,
        plan.coords,
        GMM.event_shape,
        dtype,
        time=GridTimesteps(plan.schedule.sigmas, plan.timesteps),
    )
    return sample_speculative(
        model, plan.schedule, TREES[coupling], coupling, n, draft="x0", execution=execution, seed=seed
    )


def check_law(
    kind,
    prediction,
    steps,
    n,
    couplings=("dgrs", "rmc"),
    tree_n=None,
    dtype=torch.float64,
    mu=None,
    warp: float = WARP,
    **cfg,
):
    """The law of each coupling's path execution against the loop (``n`` samples each); the tree execution on the
    first ``tree_n`` trajectories (default ``n``) has the path's counts and samples (trajectory ``i`` draws the same
    keyed numbers in any run), so it has the path's law. Returns a report of p-values, NFE and seconds."""
    t0 = time.time()
    ref = reference(make(kind, prediction, **cfg), steps, prediction, n, mu, warp)
    report = {"loop_s": round(time.time() - t0, 2)}
    eps = torch.finfo(dtype).eps
    m = n if tree_n is None else tree_n
    for coupling in couplings:
        runs = {}
        for ex, rows in (("path", n), ("tree", m)):
            t0 = time.time()
            runs[ex] = r = speculative(
                make(kind, prediction, **cfg), steps, prediction, rows, coupling, ex, dtype, mu, warp=warp
            )
            assert bool(torch.isfinite(r.samples).all()) and r.samples.dtype == dtype
            p = law_pvalues(r.samples, ref, GMM) if rows == n else None  # the tree's law is tested when tree_n = n
            report[(coupling, ex)] = dict(
                p_min=min(p.values()) if p else None,
                nfe=round(float(r.nfe_total.double().mean()), 3),
                n=rows,
                seconds=round(time.time() - t0, 2),
            )
            assert p is None or min(p.values()) > P_MIN, f"{kind}/{prediction} {coupling} {ex}: {p}"
        a, b = runs["path"], runs["tree"]
        for field in ("nfe", "nfe_total", "rounds", "accepts", "attempts", "committed", "target_rows"):
            fa, fb = getattr(a, field)[:m], getattr(b, field)
            w = min(fa.shape[-1], fb.shape[-1]) if fa.ndim > 1 else None  # committed: padded to each run's longest
            if w is not None:
                assert not fa[:, w:].any() and not fb[:, w:].any()
                fa, fb = fa[:, :w], fb[:, :w]
            assert torch.equal(fa, fb), field
        # the batched mixture rounds a row's last bits by its batch: 16 T eps of samples of scale ~4 (means in [-2, 2]^8)
        assert torch.allclose(a.samples[:m], b.samples, rtol=0, atol=16 * steps * eps * 4)
    return report


FAST = [
    ("ddpm", "epsilon", {}),
    ("ddpm", "v_prediction", dict(variance_type="fixed_large")),
    ("ddpm", "sample", dict(clip_sample=False)),
    ("ddpm", "epsilon", dict(timestep_spacing="leading", steps_offset=1, clip_sample=True, clip_sample_range=1.5)),
    ("euler_ancestral", "epsilon", {}),
    ("euler_ancestral", "v_prediction", dict(timestep_spacing="trailing")),
    ("flow_stochastic", "flow", dict(shift=3.0)),
]
# the v_prediction cases run in the slow set (as do the thorough ones below, v_prediction included): every kernel
# keeps a default law case, and the one-step tests (test_scheduler_kernels.py) compare every prediction type's step
# with diffusers' by default
FAST_SLOW = ("v_prediction",)


@pytest.mark.parametrize(
    "kind,prediction,cfg",
    [pytest.param(*c, marks=pytest.mark.slow) if c[1] in FAST_SLOW else c for c in FAST],
    ids=[f"{k}-{p}-{'-'.join(map(str, c.values()))}" for k, p, c in FAST],
)
def test_law_matches_the_diffusers_loop(kind, prediction, cfg):
    # d = 8, n = 1000, T = 20; dgrs K=2 L=4 and rmc chain L=12, path (n = 1000) and tree (its first 200)
    report = check_law(kind, prediction, 20, 1000, tree_n=200, **cfg)
    print(kind, prediction, cfg, report)


def test_law_exact_network():
    # the mixture's exact posterior mean as the epsilon network (no warp): DDPM T = 20, n = 1000, rmc and dgrs
    report = check_law("ddpm", "epsilon", 20, 1000, tree_n=200, warp=0.0)
    print(report)


def test_the_statistic_sees_a_wrong_grid():
    # power: the loop at one config, specsamp planned from a slightly different one (n = 1000, T = 20, rmc path):
    # min p below 1e-6 where the law tests ask above 1e-3; seeds as above
    for kind, prediction, loop, spec in [
        ("flow_stochastic", "flow", dict(shift=3.0), dict(shift=2.5)),
        ("ddpm", "epsilon", dict(clip_sample=True), dict(clip_sample=False)),
    ]:
        ref = reference(make(kind, prediction, **loop), 20, prediction, 1000, warp=WARP)
        r = speculative(make(kind, prediction, **spec), 20, prediction, 1000, "rmc", "path", warp=WARP)
        p = min(law_pvalues(r.samples, ref, GMM).values())
        print(kind, loop, spec, p)
        assert p < 1e-6


def test_law_float32_states():
    # the sampler in float32 (states, kernel table): DDPM epsilon, T = 20, n = 1000, dgrs path, tree on 200
    report = check_law("ddpm", "epsilon", 20, 1000, couplings=("dgrs",), tree_n=200, dtype=torch.float32)
    print(report)


SLOW = [  # (kind, prediction, T, scheduler config, warp)
    ("ddpm", "epsilon", 100, {}, WARP),
    ("ddpm", "epsilon", 100, {}, 0.0),
    ("ddpm", "v_prediction", 100, dict(variance_type="fixed_large", timestep_spacing="trailing"), WARP),
    ("ddpm", "sample", 100, dict(variance_type="fixed_small_log", timestep_spacing="leading", steps_offset=1), WARP),
    ("ddpm", "epsilon", 1000, {}, WARP),
    ("euler_ancestral", "epsilon", 50, {}, WARP),
    ("euler_ancestral", "v_prediction", 50, dict(timestep_spacing="leading", steps_offset=1), WARP),
    ("flow_stochastic", "flow", 28, dict(shift=3.0), WARP),
    ("flow_stochastic", "flow", 28, dict(use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15), WARP),
]


@pytest.mark.slow
@pytest.mark.parametrize(
    "kind,prediction,steps,cfg,warp",
    SLOW,
    ids=[f"{k}-{p}-T{t}-{'-'.join(map(str, c.values()))}-{'warped' if w else 'exact'}" for k, p, t, c, w in SLOW],
)
def test_law_matches_the_diffusers_loop_thorough(kind, prediction, steps, cfg, warp):
    # d = 8, n = 10,000 (the path's law), the tree on the first 2,000 (500 at T = 1000; counts equal, samples to
    # rounding); dgrs K=2 L=4, rmc chain L=12; min of 7 p-values > 1e-3; flow with dynamic shifting at mu = 0.8
    mu = 0.8 if cfg.get("use_dynamic_shifting") else None
    report = check_law(kind, prediction, steps, 10_000, tree_n=2_000 if steps < 1000 else 500, warp=warp, mu=mu, **cfg)
    print(kind, prediction, steps, cfg, warp, report)
