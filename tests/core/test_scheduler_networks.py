"""The scheduler kernels with real networks, against diffusers' own loop: the shipped digits network (an EDM
denoiser, valid at any noise level through its preconditioning) served as a variance-preserving epsilon or x0
network, and a tiny random ``UNet2DModel`` built offline as the epsilon network.

The loop is a pipeline's (``latents * init_noise_sigma``, ``scheduler.step`` with a ``torch.Generator``, float32;
:func:`scheduler_models.pipeline_loop`); specsamp runs the same network through
:class:`~specsamp.models.parametrisation.Parametrised` on the plan of
:func:`~specsamp.integrations.schedulers.from_scheduler`, in float32. Statistic: KS on 5 fixed random projections of
the 64 pixels and on the norm; a case passes when the smallest of the 6 p-values is above ``P_MIN = 1e-3``. Seeds:
the loop's generator 0, specsamp seed 5. Path and tree: equal counts, samples equal to the network's batched
rounding (``16 T eps`` of float32 relative to pixels of scale 2).
"""

import time

import pytest
import torch
from scheduler_models import PredictionNet, edm_denoiser, law_pvalues, pipeline_loop, scheduler_levels

from specsamp.integrations.schedulers import from_scheduler
from specsamp.models.parametrisation import GridTimesteps, Parametrised
from specsamp.sampler import sample_speculative
from specsamp.trees import DraftTree

pytest.importorskip("diffusers")
from diffusers import DDPMScheduler, UNet2DModel  # noqa: E402

P_MIN = 1e-3
LOOP_SEED, SPEC_SEED = 0, 5
EVENT = (1, 8, 8)
DIGIT = 3  # every row is conditioned on this class


def digits_net():
    from specsamp.models.edm import load_edm

    return load_edm("edm-digits-8x8-cond")  # the shipped file, checked by its SHA-256 before unpickling


def tiny_unet(seed: int = 0) -> UNet2DModel:
    """A random 1x8x8 UNet2DModel (two blocks of 8 and 16 channels), built from its config offline."""
    torch.manual_seed(seed)
    return UNet2DModel(
        sample_size=8,
        in_channels=1,
        out_channels=1,
        layers_per_block=1,
        block_out_channels=(8, 16),
        down_block_types=("DownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "UpBlock2D"),
        norm_num_groups=4,
    ).eval()


def unet_call(unet):
    def net(y, t, **cond):
        with torch.no_grad():
            return unet(y.float(), torch.as_tensor(t).expand(y.shape[0])).sample

    return net


def digits_pair(sch, prediction: str, edm):
    """The digits network as ``sch``'s network (``sch`` after ``set_timesteps``)."""
    return PredictionNet(edm_denoiser(edm, DIGIT, 10), prediction, sch.timesteps, scheduler_levels(sch))


def run_pair(make_sch, steps: int, make_net, n: int, trees: dict, tree_n: int):
    """The loop's ``n`` samples, and per coupling the path execution's ``n`` and the tree's first ``tree_n``; counts
    equal and samples to rounding. Returns ``(loop samples, {coupling: path result}, report)``."""
    sch = make_sch()
    sch.set_timesteps(steps)
    g = torch.Generator().manual_seed(LOOP_SEED)
    t0 = time.time()
    ref = pipeline_loop(sch, make_net(sch), torch.randn(n, *EVENT, generator=g), g)
    report = {"loop_s": round(time.time() - t0, 1)}
    plan = from_scheduler(make_sch(), steps, event_ndim=3)
    fresh = make_sch()
    fresh.set_timesteps(steps)
    model = Parametrised(
        make_net(fresh),
        plan.prediction,
        plan.coords,
        EVENT,
        torch.float32,
        time=GridTimesteps(plan.schedule.sigmas, plan.timesteps),
    )
    out = {}
    for coupling, tree in trees.items():
        runs = {}
        for ex, rows in (("path", n), ("tree", tree_n)):
            t0 = time.time()
            r = sample_speculative(model, plan.schedule, tree, coupling, rows, draft="x0", execution=ex, seed=SPEC_SEED)
            assert bool(torch.isfinite(r.samples).all()) and r.samples.shape == (rows, *EVENT)
            assert bool((r.nfe_total >= 1).all()) and bool((r.nfe_total <= steps).all())
            runs[ex] = r
            report[(coupling, ex)] = dict(
                n=rows, nfe=round(float(r.nfe_total.double().mean()), 2), s=round(time.time() - t0, 1)
            )
        a, b = runs["path"], runs["tree"]
        for field in ("nfe", "nfe_total", "rounds", "accepts", "attempts", "target_rows"):
            assert torch.equal(getattr(a, field)[:tree_n], getattr(b, field)), field
        assert torch.allclose(
            a.samples[:tree_n], b.samples, rtol=0, atol=16 * steps * torch.finfo(torch.float32).eps * 2
        )
        out[coupling] = a
    return ref, out, report


def test_digits_ddpm_smoke():
    # 6 images, DDPM T = 12 (x0 prediction, clip_sample on): both couplings, path and tree, finite, counts sane
    edm = digits_net()
    make = lambda: DDPMScheduler(num_train_timesteps=1000, prediction_type="sample")  # noqa: E731
    ref, runs, report = run_pair(
        make,
        12,
        lambda s: digits_pair(s, "sample", edm),
        6,
        {"dgrs": DraftTree.uniform(2, 3), "rmc": DraftTree.uniform(1, 5)},
        6,
    )
    print(report)
    assert bool(torch.isfinite(ref).all())
    for r in runs.values():
        assert (
            float(r.samples.abs().max()) <= 1.0 + 1e-6
        )  # the x0 clip keeps the last step's mean in [-1, 1]; no noise there
        assert float(r.nfe_total.double().mean()) < 12


@pytest.mark.slow
def test_digits_ddpm_law():
    # DDPM T = 50 (epsilon prediction, clip_sample on), n = 1,500, rmc chain L=4 and dgrs K=2 L=2; tree on 100
    edm = digits_net()
    make = lambda: DDPMScheduler(num_train_timesteps=1000, prediction_type="epsilon")  # noqa: E731
    ref, runs, report = run_pair(
        make,
        50,
        lambda s: digits_pair(s, "epsilon", edm),
        1500,
        {"rmc": DraftTree.uniform(1, 4), "dgrs": DraftTree.uniform(2, 2)},
        100,
    )
    for coupling, r in runs.items():
        p = law_pvalues(r.samples, ref)
        report[coupling] = min(p.values())
        assert min(p.values()) > P_MIN, (coupling, p)
    print(report)


@pytest.mark.slow
def test_tiny_unet_ddpm_law():
    # a random UNet2DModel as the epsilon network, DDPM T = 30 (clip_sample on), n = 1,500, rmc chain L=4 and
    # dgrs K=2 L=2; tree on 100
    unet = tiny_unet()
    make = lambda: DDPMScheduler(num_train_timesteps=1000, prediction_type="epsilon")  # noqa: E731
    ref, runs, report = run_pair(
        make,
        30,
        lambda s: unet_call(unet),
        1500,
        {"rmc": DraftTree.uniform(1, 4), "dgrs": DraftTree.uniform(2, 2)},
        100,
    )
    for coupling, r in runs.items():
        p = law_pvalues(r.samples, ref)
        report[coupling] = min(p.values())
        assert min(p.values()) > P_MIN, (coupling, p)
    print(report)
