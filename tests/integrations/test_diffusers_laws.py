"""``speculative(pipe)`` has the law of ``pipe(...)``'s own loop, for every pipeline x scheduler pair it accepts,
and it refuses, before any network call, the pairs whose own loop is not their scheduler's sampler.

The pairs (diffusers 0.42's loops, tiny random pipelines built offline by :mod:`tiny_diffusers`):

============================  ==================  ================================  ==================================
pipeline                      ``DDPMScheduler``   ``EulerAncestralDiscreteScheduler``  ``FlowMatchEuler...(stochastic)``
============================  ==================  ================================  ==================================
``DDPMPipeline``              accepted            refused (no scaling: another law)   accepted
``StableDiffusionPipeline``   accepted            accepted                            refused (pipe(...) itself fails)
``StableDiffusion3Pipeline``  accepted            refused (no scaling: another law)   accepted
============================  ==================  ================================  ==================================

Statistic (:func:`min_p`): two-sample KS on 5 fixed random projections (direction seed 7) and on the norm of the
returned images (latents for the text pipelines); a sample passes when the smallest of the six p-values is
above ``P_MIN = 1e-3``. Seeds: the pipeline's own loop runs with generator 0 after ``torch.manual_seed(1000)``
(``StableDiffusion3Pipeline`` draws its step noise from torch's global generator: had that one the generator's
seed, the first step's noise would repeat the first latents), the speculative pipeline with generator 1.

Quick tests (the default run; n, T and the tree in :data:`QUICK`): each pair's speculative sample passes against
the pipeline's, and, in the same test, the pipeline's own loop under a perturbation (seeds 2 and 1001) fails the
same statistic at the same n: DDPM's variance ``fixed_large`` for ``fixed_small``, the flow's shift 1 (DDPM) or
2 (SD3) for 3, or first latents 10% wider (``latents=1.1 * noise``, what a lost ``init_noise_sigma`` does). The
refused Euler-ancestral pairs, run through the speculative sampler anyway (the refusal bypassed), fail it too:
that is the law the refusal keeps users from. Slow tests: the same statistic at larger n (:data:`SLOW`), and
DDPM's options (couplings, executions, clipping) at n = 1000, T = 20.

Measured with these seeds: the quick speculative samples give min p 0.10 to 0.56; the perturbed loops 1e-5
(DDPM x flow, shift 1) to 3e-28 (first latents 10% wider in SD); the forced Euler ancestral pairs 9e-31
(``DDPMPipeline``) and 8e-38 (``StableDiffusion3Pipeline``); the slow samples 0.15 to 0.40.
"""

from __future__ import annotations

import pytest
import tiny_diffusers as td
import torch
from helpers import min_ks_p

from specsamp.errors import ConfigError
from specsamp.integrations import diffusers as integration
from specsamp.integrations.diffusers import speculative

P_MIN = 1e-3
DDPM, EA, FLOW = "DDPMScheduler", "EulerAncestralDiscreteScheduler", "FlowMatchEulerDiscreteScheduler"
ACCEPTED = [("ddpm", DDPM), ("ddpm", FLOW), ("sd", DDPM), ("sd", EA), ("sd3", DDPM), ("sd3", FLOW)]
REFUSED = [("ddpm", EA), ("sd3", EA), ("sd", FLOW)]


def pipeline(kind: str, scheduler: str, variance_type: str = "fixed_small", shift: float = 3.0):
    """The tiny ``kind`` pipeline (``ddpm``, ``sd``, ``sd3``) under ``scheduler``, progress bar off: DDPM with
    diffusers' defaults (``clip_sample`` for ``ddpm`` only, as latent pipelines configure it; for ``sd``, SD's
    betas, :func:`tiny_diffusers.tiny_sd`); Euler ancestral from DDPM's config; the flow scheduler with ``shift``
    and stochastic sampling."""
    from diffusers import DDPMScheduler, EulerAncestralDiscreteScheduler, FlowMatchEulerDiscreteScheduler

    if kind == "sd" and scheduler != FLOW:
        pipe = td.tiny_sd("ddpm" if scheduler == DDPM else "euler_ancestral")
    else:
        pipe = {"ddpm": td.tiny_ddpm, "sd": td.tiny_sd, "sd3": td.tiny_sd3}[kind]()
        if scheduler == DDPM:
            pipe.scheduler = DDPMScheduler(variance_type=variance_type, clip_sample=kind == "ddpm")
        elif scheduler == EA:
            pipe.scheduler = EulerAncestralDiscreteScheduler.from_config(DDPMScheduler().config)
        else:
            pipe.scheduler = FlowMatchEulerDiscreteScheduler(shift=shift, stochastic_sampling=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def arguments(kind: str, n: int, steps: int, guidance: float = 3.0) -> dict:
    """The call's arguments: ``n`` images (of one prompt, with a negative one, for the text pipelines) at
    ``steps`` steps, as tensors (``pt``; ``latent`` for the text pipelines)."""
    if kind == "ddpm":
        return dict(batch_size=n, num_inference_steps=steps, output_type="pt")
    kw = dict(
        prompt="a red cube",
        negative_prompt="blue",
        num_inference_steps=steps,
        guidance_scale=guidance,
        num_images_per_prompt=n,
        output_type="latent",
    )
    return {**kw, "max_sequence_length": 8} if kind == "sd3" else kw


def own(pipe, kind: str, n: int, steps: int, seed: int = 0, latents_scale: float | None = None, **kw):
    """``n`` images of the pipeline's own loop: generator ``seed``, torch's global generator ``1000 + seed``;
    ``latents_scale``: first latents ``scale * N(0, I)`` passed as ``latents`` (text pipelines)."""
    a = {**arguments(kind, n, steps), **kw}
    if latents_scale is not None:
        c = pipe.unet.config if kind == "sd" else pipe.transformer.config
        side = 8  # the tiny pipelines' latent side
        a["latents"] = latents_scale * torch.randn(
            n, c.in_channels, side, side, generator=torch.Generator().manual_seed(seed)
        )
    torch.manual_seed(1000 + seed)
    return pipe(generator=torch.Generator().manual_seed(seed), **a).images


def spec(pipe, kind: str, n: int, steps: int, tree=(2, 2, "dgrs"), **kw):
    """``n`` images of ``speculative(pipe, *tree)``, generator 1."""
    out = speculative(pipe, *tree)(generator=torch.Generator().manual_seed(1), **{**arguments(kind, n, steps), **kw})
    return out.images, out.speculative


QUICK = {  # (kind, scheduler): n, T, guidance, (K, L, coupling), the perturbation of the pipeline's own loop
    ("ddpm", DDPM): (150, 6, 1.0, (2, 2, "dgrs"), {"variance_type": "fixed_large"}),
    ("ddpm", FLOW): (200, 8, 1.0, (1, 3, "rmc"), {"shift": 1.0}),
    ("sd", DDPM): (48, 5, 3.0, (2, 2, "dgrs"), {"latents_scale": 1.1}),
    ("sd", EA): (48, 5, 3.0, (1, 3, "rmc"), {"latents_scale": 1.1}),
    ("sd3", DDPM): (64, 5, 1.0, (2, 2, "dgrs"), {"latents_scale": 1.1}),
    ("sd3", FLOW): (64, 5, 3.0, (1, 3, "rmc"), {"shift": 2.0}),
}


@pytest.mark.parametrize("kind, scheduler", ACCEPTED)
def test_law_matches_the_pipelines_own_loop_and_the_test_rejects_a_perturbed_loop(kind, scheduler):
    # seeds: module docstring; n, T, tree: QUICK; tolerance: min p > 1e-3 (speculative), < 1e-3 (perturbed loop)
    n, steps, w, tree, perturbed = QUICK[kind, scheduler]
    kw = {} if kind == "ddpm" else {"guidance_scale": w}
    pipe = pipeline(kind, scheduler)
    ref = own(pipe, kind, n, steps, **kw)
    out, r = spec(pipe, kind, n, steps, tree, **kw)
    assert min_ks_p(out, ref) > P_MIN
    assert 0 < int(r.accepts.sum()) < int(r.attempts.sum())  # both verdicts were drawn
    loop_cfg = {k: v for k, v in perturbed.items() if k != "latents_scale"}
    alt = own(
        pipeline(kind, scheduler, **loop_cfg),
        kind,
        n,
        steps,
        seed=2,
        latents_scale=perturbed.get("latents_scale"),
        **kw,
    )
    assert min_ks_p(alt, ref) < P_MIN, perturbed


@pytest.mark.parametrize("kind", ["ddpm", "sd3"])
def test_the_refused_euler_ancestral_pairs_forced_through_fail_the_law_test(kind, monkeypatch):
    # seeds: module docstring; n=64, T=5, no guidance, tree (2, 2, dgrs); tolerance: min p < 1e-3 (another law)
    pipe = pipeline(kind, EA)
    kw = {} if kind == "ddpm" else {"guidance_scale": 1.0}
    ref = own(pipe, kind, 64, 5, **kw)
    monkeypatch.setattr(integration, "check_loop", lambda *a: None)  # the refusal bypassed
    out, _ = spec(pipe, kind, 64, 5, **kw)
    assert min_ks_p(out, ref) < P_MIN


def _count_calls(pipe) -> list:
    """Every forward call of the pipeline's networks (UNet or transformer, text encoders, VAE), recorded."""
    calls = []
    for name in ("unet", "transformer", "text_encoder", "text_encoder_2", "vae"):
        module = getattr(pipe, name, None)
        if module is not None:
            module.register_forward_hook(lambda m, a, o, name=name: calls.append(name))
    return calls


@pytest.mark.parametrize("kind, scheduler", REFUSED)
def test_a_pair_whose_own_loop_is_not_its_schedulers_sampler_is_refused_before_any_network_call(kind, scheduler):
    pipe = pipeline(kind, scheduler)
    calls = _count_calls(pipe)
    with pytest.raises(ConfigError) as e:
        speculative(pipe)
    msg = str(e.value)
    assert f"scheduler={scheduler!r} is refused with pipeline={type(pipe).__name__!r}" in msg and "\n" not in msg
    assert ("init_noise_sigma" in msg) and "Instead use" in msg
    # swapped in after speculative(): refused at the call, still before any network runs
    sp = speculative(pipeline(kind, DDPM))
    sp.pipe.scheduler = pipe.scheduler
    calls_after = _count_calls(sp.pipe)
    with pytest.raises(ConfigError, match="is refused with pipeline"):
        sp(**arguments(kind, 2, 6))
    assert not calls and not calls_after


def test_the_flow_scheduler_with_dynamic_shifting_is_refused_where_the_loop_passes_no_mu():
    from diffusers import FlowMatchEulerDiscreteScheduler

    pipe = pipeline("ddpm", FLOW)
    pipe.scheduler = FlowMatchEulerDiscreteScheduler(stochastic_sampling=True, use_dynamic_shifting=True)
    calls = _count_calls(pipe)
    with pytest.raises(ConfigError, match="use_dynamic_shifting=True is refused with pipeline='DDPMPipeline'"):
        speculative(pipe)
    with pytest.raises(ValueError):  # the pipeline's own loop fails there too
        pipe(batch_size=1, num_inference_steps=4, output_type="pt")
    assert calls == []


def test_the_premises_of_the_refusals_hold_in_diffusers_own_loops():
    from diffusers import DDPMScheduler

    # StableDiffusionPipeline's loop cannot run the flow scheduler at all (it has no init_noise_sigma) ...
    with pytest.raises(AttributeError, match="init_noise_sigma"):
        own(pipeline("sd", FLOW), "sd", 1, 4)
    # ... only StableDiffusionPipeline's loop scales the network's input (integration.LOOP_SCALES) ...
    for kind in ("ddpm", "sd", "sd3"):
        pipe = pipeline(kind, EA)
        own(pipe, kind, 1, 4)
        assert pipe.scheduler.is_scale_input_called is integration.LOOP_SCALES[kind], kind
    # ... which DDPM's scheduler does not need: its first scale is 1 and its input scaling the identity
    sch, x = DDPMScheduler(), torch.randn(1, 3, 8, 8)
    assert sch.init_noise_sigma == 1.0 and sch.scale_model_input(x, 10) is x


# --- slow: larger n ------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("coupling, K, L", [("dgrs", 2, 3), ("rmc", 1, 6)])
@pytest.mark.parametrize("execution", ["path", "tree"])
@pytest.mark.parametrize("clip", [True, False])
def test_law_of_ddpm_matches_its_own_loop_in_every_execution(coupling, K, L, execution, clip):
    # seeds: generators 0 (pipeline) and 1 (speculative); n=1000, T=20; tolerance min p > 1e-3
    pipe = td.tiny_ddpm(clip_sample=clip)
    pipe.set_progress_bar_config(disable=True)
    ref = own(pipe, "ddpm", 1000, 20)
    out = speculative(pipe, K, L, coupling, execution=execution)(
        **arguments("ddpm", 1000, 20), generator=torch.Generator().manual_seed(1)
    )
    assert min_ks_p(out.images, ref) > P_MIN


SLOW = {  # (kind, scheduler): n, T, (K, L, coupling); guidance 3 for the text pipelines
    ("ddpm", FLOW): (1000, 16, (2, 2, "dgrs")),
    ("sd", DDPM): (400, 12, (2, 3, "dgrs")),
    ("sd", EA): (400, 12, (2, 3, "dgrs")),
    ("sd3", DDPM): (300, 8, (2, 3, "dgrs")),
    ("sd3", FLOW): (300, 8, (2, 3, "dgrs")),
}


@pytest.mark.slow
@pytest.mark.parametrize("kind, scheduler", list(SLOW))
def test_law_matches_the_pipelines_own_loop_at_larger_n(kind, scheduler):
    # seeds: module docstring; n, T, tree: SLOW; tolerance min p > 1e-3
    n, steps, tree = SLOW[kind, scheduler]
    pipe = pipeline(kind, scheduler)
    ref = own(pipe, kind, n, steps)
    out, _ = spec(pipe, kind, n, steps, tree)
    assert min_ks_p(out, ref) > P_MIN
