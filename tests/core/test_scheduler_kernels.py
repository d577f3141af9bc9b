"""The scheduler kernels (ddpm, euler_ancestral, flow_stochastic) against diffusers' own ``scheduler.step``.

Every step of a grid, one at a time: the state ``y`` in the scheduler's coordinates and the network's output go
to ``scheduler.step(out, t, y, generator=g)``; the same step is taken by specsamp on the linear path
(``x = y / k(s)``, the output as a velocity, the kernel's mean + std * the generator's noise replayed, times ``k``
at the next level) and the two must agree to diffusers' float32 rounding. Then the plans ``from_scheduler``
makes: the grid, the timesteps, the initial scale, and the schedulers it refuses.

Tolerance (float32): diffusers computes the step in float32 (its coefficients from float32 tables, each product
and sum rounded, unit roundoff ``u = 2^-24``); specsamp computes it in float64 from the same float32 inputs. Per
element the two differ by at most ``C u M`` with ``M = |A| |y| + |B| X + S |z|`` the step's terms in absolute value
(``X`` the data prediction's magnitude before cancellation, e.g. ``(|y| + sigma_vp |eps|) / alpha`` for epsilon) and
``C = 16`` (the longest chain of roundings in a step is below 10). Two coefficients cancel, and their relative
error grows by the condition number: DDPM's ``beta = 1 - a_t / a_p`` (``a_t / (a_p - a_t)``, on the data and noise
terms) and Euler ancestral's ``sigma_up`` (``s^2 / (s^2 - s'^2)``, on every term).
"""

import pytest
import torch
from scheduler_models import mixture_net

from specsamp.errors import ConfigError
from specsamp.integrations.schedulers import from_scheduler
from specsamp.models.gmm import GaussianMixture
from specsamp.models.parametrisation import level_scale, to_velocity

diffusers = pytest.importorskip("diffusers")
from diffusers import (  # noqa: E402
    DDIMScheduler,
    DDPMScheduler,
    DPMSolverMultistepScheduler,
    EulerAncestralDiscreteScheduler,
    EulerDiscreteScheduler,
    FlowMatchEulerDiscreteScheduler,
    UniPCMultistepScheduler,
)

U32 = 2.0**-24
C_ROUND = 16
VERBOSE = False
STATE_COORDS = {
    "DDPMScheduler": "vp",
    "EulerAncestralDiscreteScheduler": "ve",
    "FlowMatchEulerDiscreteScheduler": "linear",
}


def gmm8(dtype=torch.float64):
    return GaussianMixture(dim=8, components=3, layout_seed=1, dtype=dtype)


def magnitude(sch, n: int, t, y: torch.Tensor, out: torch.Tensor, z: torch.Tensor | None) -> torch.Tensor:
    """``M`` of the module docstring, per element, float64 (the step's terms in the scheduler's coordinates)."""
    y, out = y.double().abs(), out.double().abs()
    name = type(sch).__name__
    pred = sch.config.get("prediction_type", "epsilon")
    zz = z.double().abs() if z is not None else torch.zeros_like(y)
    if name == "DDPMScheduler":
        a_t = float(sch.alphas_cumprod[int(t)])
        a_p = float(sch.alphas_cumprod[int(sch.timesteps[n + 1])]) if n + 1 < len(sch.timesteps) else 1.0
        X = {
            "epsilon": (y + (1 - a_t) ** 0.5 * out) / a_t**0.5,
            "sample": out,
            "v_prediction": a_t**0.5 * y + (1 - a_t) ** 0.5 * out,
        }[pred]
        beta = 1 - a_t / a_p
        A, B = (a_t / a_p) ** 0.5 * (1 - a_p) / (1 - a_t), a_p**0.5 * beta / (1 - a_t)
        kappa = a_t / (a_p - a_t)  # beta = 1 - a_t / a_p cancels: its relative error is u a_t / (a_p - a_t)
        return A * y + (1 + kappa) * (B * X + beta**0.5 * zz)
    if name == "EulerAncestralDiscreteScheduler":
        s0, s1 = float(sch.sigmas[n]), float(sch.sigmas[n + 1])
        X = y + s0 * out if pred == "epsilon" else s0 / (1 + s0 * s0) ** 0.5 * out + y / (1 + s0 * s0)
        kappa = s0 * s0 / (s0 * s0 - s1 * s1)
        return kappa * (y + X + s1 * zz)
    s0, s1 = float(sch.sigmas[n]), float(sch.sigmas[n + 1])
    return y + s0 * out + s1 * zz


def one_step_check(sch, steps: int, *, event=(8,), b=64, seed=0, perturb=0.3, make_plan=None, **plan_kw):
    """Every step of ``sch`` at ``steps``: diffusers' step against the plan's kernel with the same noise.

    States are diffusers' own chain (float32) from ``init_noise_sigma * N(0, I)``; the network's output is the
    mixture's exact prediction plus ``perturb * N(0, I)`` (so clipping and thresholding act on arbitrary outputs).
    Returns the largest error over the bound (must be <= 1) and the number of steps that drew noise.
    """
    plan = (make_plan or from_scheduler)(sch, steps, **plan_kw)
    sch.set_timesteps(steps, **({"mu": plan_kw["mu"]} if plan_kw.get("mu") is not None else {}))
    name = type(sch).__name__
    assert torch.equal(torch.as_tensor(plan.timesteps).double(), sch.timesteps.double())
    gmm = gmm8()
    if gmm.event_shape[0] != int(torch.tensor(event).prod()):
        gmm = GaussianMixture(dim=int(torch.tensor(event).prod()), components=3, layout_seed=1)
    net = mixture_net(gmm, sch, plan.prediction)
    s = plan.schedule.sigmas
    K = level_scale(s, STATE_COORDS[name])
    assert torch.allclose(K, plan.schedule.kernel.level_scale(), rtol=1e-14, atol=0)
    gen = torch.Generator().manual_seed(seed)
    y = torch.randn(b, *event, generator=gen) * getattr(sch, "init_noise_sigma", 1.0)
    assert abs(float(getattr(sch, "init_noise_sigma", 1.0)) / float(K[0]) - plan.init_scale) <= 1e-6 * plan.init_scale
    worst, noisy = 0.0, 0
    for n, t in enumerate(sch.timesteps):
        y_net = sch.scale_model_input(y, t) if hasattr(sch, "scale_model_input") else y
        out = net(y_net, t) + perturb * torch.randn(y.shape, generator=gen)
        draws = not (name == "DDPMScheduler" and int(t) == 0)  # DDPM draws where t > 0; the others always
        want = sch.step(out, t, y, generator=torch.Generator().manual_seed(1000 + n)).prev_sample
        # specsamp: the linear path, the velocity, the kernel's Gaussian with the replayed noise
        zdtype = torch.float32 if name == "FlowMatchEulerDiscreteScheduler" else out.dtype
        z = torch.randn(y.shape, generator=torch.Generator().manual_seed(1000 + n), dtype=zdtype) if draws else None
        sn = s[n].expand(b)
        x = y.double() / K[n]
        v = to_velocity(out.double(), x, sn, plan.prediction, plan.coords)
        idx = torch.full((b,), n)
        mean = plan.schedule.mean(x, v, idx)
        std = plan.schedule.std(idx).reshape((-1,) + (1,) * len(event))
        if not draws:
            assert bool((std == 0).all()), f"step {n}: the kernel adds noise where diffusers adds none"
            got = mean * K[n + 1]
        else:
            noisy += int(bool((std > 0).all()))
            got = (mean + std * z.double()) * K[n + 1]
        bound = C_ROUND * U32 * magnitude(sch, n, t, y, out, z) + 1e-30
        err = ((got - want.double()).abs() / bound).max().item()
        assert err <= 1.0, f"{name} step {n} (t={float(t)}): error {err:.3g} x the float32 bound"
        worst = max(worst, err)
        if VERBOSE:
            print(f"{name} step {n}: error/bound {err:.3g}")
        y = want
    return worst, noisy


DDPM_CASES = [
    dict(prediction_type="epsilon"),
    dict(prediction_type="v_prediction"),
    dict(prediction_type="sample"),
    dict(prediction_type="epsilon", variance_type="fixed_small_log"),
    dict(prediction_type="epsilon", variance_type="fixed_large"),
    dict(prediction_type="v_prediction", variance_type="fixed_large", clip_sample=False),
    dict(prediction_type="epsilon", clip_sample=True, clip_sample_range=1.5),
    dict(prediction_type="sample", clip_sample=False),
    dict(prediction_type="epsilon", thresholding=True, dynamic_thresholding_ratio=0.8, sample_max_value=1.6),
    dict(prediction_type="epsilon", timestep_spacing="trailing"),
    dict(prediction_type="epsilon", timestep_spacing="linspace", beta_schedule="scaled_linear", beta_end=0.012),
    dict(prediction_type="v_prediction", timestep_spacing="leading", steps_offset=1, variance_type="fixed_large"),
    dict(prediction_type="epsilon", timestep_spacing="leading", steps_offset=1, beta_schedule="squaredcos_cap_v2"),
]


@pytest.mark.parametrize("cfg", DDPM_CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_ddpm_one_step_equals_diffusers_every_step(cfg):
    # T = 10, b = 64, d = 8; states diffusers' chain; seed 0 (states), 1000 + n (step n's noise)
    sch = DDPMScheduler(num_train_timesteps=1000, **cfg)
    # diffusers' thresholding needs [b, C, ...] states: [b, 2, 4] there (its quantile over C * 4 = event_ndim 2)
    event, e = ((2, 4), 2) if cfg.get("thresholding") else ((8,), 1)
    worst, noisy = one_step_check(sch, 10, event=event, event_ndim=e)
    last_noisy = int(sch.timesteps[-1]) > 0
    assert noisy == (10 if last_noisy else 9)


def test_ddpm_thresholding_on_images_matches_diffusers():
    # dynamic thresholding takes its quantile per sample over C*H*W (event_ndim=3): [b, 2, 2, 2] states, T = 10
    sch = DDPMScheduler(
        num_train_timesteps=1000,
        thresholding=True,
        dynamic_thresholding_ratio=0.7,
        sample_max_value=1.8,
        prediction_type="v_prediction",
    )
    one_step_check(sch, 10, event=(2, 2, 2), event_ndim=3)


def test_threshold_with_leading_dims_is_per_sample():
    # the dense round calls the kernel on [c, M, *event] (c steps, M rows each): the quantile stays per sample
    sch = DDPMScheduler(
        num_train_timesteps=1000, thresholding=True, dynamic_thresholding_ratio=0.75, sample_max_value=2.0
    )
    plan = from_scheduler(sch, 10, event_ndim=3)
    g = torch.Generator().manual_seed(3)
    c, M, event = 3, 5, (1, 4, 4)
    x = torch.randn(c, M, *event, generator=g, dtype=torch.float64) * 2
    v = torch.randn(c, M, *event, generator=g, dtype=torch.float64) * 2
    n = torch.tensor([1, 4, 7])
    k = plan.schedule.kernel
    batched = k.mean(x, v, k.coefs(n, x))
    rows = k.mean(
        x.reshape(c * M, *event), v.reshape(c * M, *event), k.coefs(n.repeat_interleave(M), x.reshape(c * M, *event))
    )
    assert torch.equal(batched, rows.reshape(batched.shape))
    # and each row's threshold is diffusers' own _threshold_sample of that row's data prediction
    sch.set_timesteps(10)
    sig = plan.schedule.sigmas[n].reshape(c, 1, 1, 1, 1)
    x0 = (x - sig * v).reshape(c * M, *event)
    ref = sch._threshold_sample(x0).reshape(batched.shape)
    tab = k.table("cpu", torch.float64)
    want = tab[n, k.col("c_x")].reshape(c, 1, 1, 1, 1) * x + tab[n, k.col("c_x0")].reshape(c, 1, 1, 1, 1) * ref
    assert torch.allclose(batched, want, rtol=1e-14, atol=1e-14)


class _Elementwise(torch.nn.Module):
    """A velocity network computed element by element (no reduction or product across rows): its bits do not
    depend on the batch a row is evaluated in."""

    event_shape, dtype = (1, 4, 4), torch.float64

    def forward(self, x, sigma):
        return 0.2 * x - 0.3 * (1 - sigma).reshape(-1, 1, 1, 1) * x / (1 + x * x)


@pytest.mark.parametrize("tree,coupling", [("uniform", "dgrs"), ("chain", "rmc")])
def test_thresholding_is_per_sample_in_both_executions(tree, coupling):
    # the dense round holds states flat and stacked ([nodes, rows, D]): the threshold's quantile must still be one
    # sample's C*H*W, so the tree execution's counts and samples equal the path execution's bit for bit (an
    # elementwise network; DDPM T = 12 with thresholding, 20 trajectories of [1, 4, 4] scaled so it acts, seed 1)
    from specsamp.sampler import sample_speculative
    from specsamp.trees import DraftTree

    sch = DDPMScheduler(
        num_train_timesteps=1000, thresholding=True, dynamic_thresholding_ratio=0.75, sample_max_value=1.5
    )
    plan = from_scheduler(sch, 12, event_ndim=3)
    init = torch.randn(20, 1, 4, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    init *= torch.linspace(0.5, 4.0, 20, dtype=torch.float64).reshape(20, 1, 1, 1)
    t = DraftTree.uniform(2, 3) if tree == "uniform" else DraftTree.chain(3)
    runs = [
        sample_speculative(_Elementwise(), plan.schedule, t, coupling, 20, execution=ex, seed=1, draft="x0", init=init)
        for ex in ("path", "tree")
    ]
    for f in ("nfe", "rounds", "committed", "attempts", "accepts"):
        assert torch.equal(getattr(runs[0], f), getattr(runs[1], f)), f
    assert torch.equal(runs[0].samples, runs[1].samples)


EA_CASES = [
    dict(prediction_type="epsilon"),
    dict(prediction_type="v_prediction"),
    dict(prediction_type="epsilon", timestep_spacing="leading", steps_offset=1),
    dict(prediction_type="v_prediction", timestep_spacing="trailing", beta_schedule="scaled_linear", beta_end=0.012),
]


@pytest.mark.parametrize("cfg", EA_CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_euler_ancestral_one_step_equals_diffusers_every_step(cfg):
    # T = 10, b = 64, d = 8; the first state init_noise_sigma * N(0, I), scale_model_input before the network
    sch = EulerAncestralDiscreteScheduler(num_train_timesteps=1000, **cfg)
    worst, noisy = one_step_check(sch, 10)
    assert noisy == 9  # the last step's sigma_up is 0 (diffusers draws and multiplies by 0)


FLOW_CASES = [dict(shift=1.0), dict(shift=3.0), dict(use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15)]


@pytest.mark.parametrize("cfg", FLOW_CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_flow_stochastic_one_step_equals_diffusers_every_step(cfg):
    # T = 10, b = 64, d = 8, stochastic_sampling=True; dynamic shifting at mu = 0.9
    sch = FlowMatchEulerDiscreteScheduler(stochastic_sampling=True, **cfg)
    kw = {"mu": 0.9} if cfg.get("use_dynamic_shifting") else {}
    worst, noisy = one_step_check(sch, 10, **kw)
    assert noisy == 9


# ---------------------------------------------------------------------------------------------------- the plans


def test_plans_follow_the_schedulers_grids_and_initial_scale():
    for sch, T in [
        (DDPMScheduler(timestep_spacing="trailing"), 25),
        (DDPMScheduler(steps_offset=1), 50),
        (EulerAncestralDiscreteScheduler(timestep_spacing="leading", steps_offset=1), 30),
        (EulerAncestralDiscreteScheduler(), 7),
        (FlowMatchEulerDiscreteScheduler(stochastic_sampling=True, shift=3.0), 28),
    ]:
        plan = from_scheduler(sch, T)
        assert getattr(sch, "num_inference_steps", None) is None  # the caller's scheduler is untouched
        sch.set_timesteps(T)
        s = plan.schedule.sigmas
        assert s.dtype == torch.float64 and s.numel() == T + 1 and float(s[-1]) == 0.0 and bool((s[1:] < s[:-1]).all())
        assert torch.equal(torch.as_tensor(plan.timesteps).double(), sch.timesteps.double())
        name = type(sch).__name__
        if name == "DDPMScheduler":
            a = sch.alphas_cumprod.double()[sch.timesteps.long()]
            want = (1 - a).sqrt() / (a.sqrt() + (1 - a).sqrt())
            init = 1.0
        elif name == "EulerAncestralDiscreteScheduler":
            sig = sch.sigmas.double()[:-1]
            want, init = sig / (1 + sig), float(sch.init_noise_sigma)
        else:
            want, init = sch.sigmas.double()[:-1], 1.0
        assert torch.allclose(s[:-1], want, rtol=1e-15, atol=0)
        # the first linear state is init_scale * N(0, I): the scheduler's init_noise_sigma * N(0, I) over k(s_0)
        k0 = float(level_scale(s[:1], STATE_COORDS[name]))
        assert plan.init_scale == pytest.approx(init / k0, rel=1e-6)
        assert plan.schedule.initial_scale() == pytest.approx(plan.init_scale, rel=1e-15)


REFUSED = [
    (lambda: DDIMScheduler(), "DDIMScheduler"),  # at eta=0, as every case here is planned: deterministic
    (lambda: DPMSolverMultistepScheduler(), "DPMSolverMultistepScheduler"),
    (lambda: UniPCMultistepScheduler(), "UniPCMultistepScheduler"),
    (lambda: EulerDiscreteScheduler(), "EulerDiscreteScheduler"),
    (lambda: DDPMScheduler(variance_type="learned_range"), "learned_range"),
    (lambda: DDPMScheduler(variance_type="learned"), "learned"),
    (lambda: FlowMatchEulerDiscreteScheduler(), "stochastic_sampling=False"),
]


@pytest.mark.parametrize("make,named", REFUSED, ids=[r[1] for r in REFUSED])
def test_unreproduced_schedulers_are_refused_naming_the_kernels(make, named):
    with pytest.raises(ConfigError) as e:
        from_scheduler(make(), 10, eta=0.0)
    msg = str(e.value)
    assert named in msg and "\n" not in msg
    for kernel in ("ddpm", "euler_ancestral", "flow_stochastic", "ddim", "dpmsolver_sde"):
        assert kernel in msg


def test_dynamic_shifting_without_mu_is_refused():
    sch = FlowMatchEulerDiscreteScheduler(stochastic_sampling=True, use_dynamic_shifting=True)
    with pytest.raises(ConfigError, match="mu") as e:
        from_scheduler(sch, 10)
    assert "\n" not in str(e.value)
    from_scheduler(sch, 10, mu=1.0)  # with mu it plans
