"""``specsamp.integrations.diffusers.speculative`` and ``model=diffusers`` on tiny pipelines built offline.

The pipelines (:mod:`tiny_diffusers`): random weights, a few thousand parameters, no hub. Here: the output
types and counts, the call's arguments (by keyword and by position), the progress bar, the executions' equality,
refusals and ``model=diffusers``. The law tests, pipeline x scheduler, are in :mod:`test_diffusers_laws`.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import tiny_diffusers as td
import torch

from specsamp.errors import ConfigError
from specsamp.integrations.diffusers import speculative
from specsamp.trees import DraftTree

COUNTS = ("nfe", "nfe_total", "target_rows", "rounds", "committed", "attempts", "accepts")


def _quiet(pipe):
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def ddpm():
    return _quiet(td.tiny_ddpm())


# --- output types and counts ------------------------------------------------------------------------
def test_ddpm_pipeline_returns_its_output_type_with_the_counts(ddpm):
    from diffusers.pipelines.pipeline_utils import ImagePipelineOutput

    sp = speculative(ddpm, K=2, L=3)
    out = sp(batch_size=3, num_inference_steps=12, generator=torch.Generator().manual_seed(0), output_type="np")
    assert type(out) is ImagePipelineOutput and out.images.shape == (3, 8, 8, 3)
    assert out.images.dtype == np.float32 and 0 <= out.images.min() and out.images.max() <= 1
    r = out.speculative
    assert r is sp.last and r.samples.shape == (3, 3, 8, 8) and r.speculative_steps == 10
    assert torch.equal(r.nfe_total, r.nfe + 2) and bool((r.nfe < 10).all())  # fewer calls than steps
    g = lambda: torch.Generator().manual_seed(4)  # noqa: E731  (the first latents; seed keys the rest)
    pt = sp(batch_size=2, num_inference_steps=12, seed=4, generator=g(), output_type="pt")
    assert isinstance(pt.images, torch.Tensor) and pt.images.shape == (2, 3, 8, 8)
    pil = sp(batch_size=2, num_inference_steps=12, seed=4, generator=g(), output_type="pil")
    assert len(pil.images) == 2 and pil.images[0].size == (8, 8)
    np.testing.assert_array_equal(
        np.asarray(pil.images[0]), (pt.images[0].permute(1, 2, 0).numpy() * 255).round().astype(np.uint8)
    )
    tup = sp(batch_size=2, num_inference_steps=12, seed=4, generator=g(), output_type="pt", return_dict=False)
    assert isinstance(tup, tuple) and torch.equal(tup[0], pt.images) and sp.last is not r


def test_a_generator_or_seed_reproduces_a_run_and_the_global_generator_without_either(ddpm):
    sp = speculative(ddpm, K=1, L=4, coupling="rmc")

    def run(**kw):
        return sp(batch_size=2, num_inference_steps=10, output_type="pt", **kw)

    a, b = run(generator=torch.Generator().manual_seed(3)), run(generator=torch.Generator().manual_seed(3))
    assert torch.equal(a.images, b.images) and torch.equal(a.speculative.nfe, b.speculative.nfe)
    assert not torch.equal(a.images, run(generator=torch.Generator().manual_seed(4)).images)
    torch.manual_seed(11)
    c = run()
    torch.manual_seed(11)
    assert torch.equal(c.images, run().images)
    s1, s2 = (
        run(seed=5, generator=torch.Generator().manual_seed(3)),
        run(seed=6, generator=torch.Generator().manual_seed(3)),
    )
    assert not torch.equal(s1.images, s2.images)  # same first latents, other keyed noise


@pytest.mark.parametrize(
    "scheduler, prediction",
    [
        ("ddpm", "epsilon"),
        ("ddpm", "v_prediction"),
        ("euler_ancestral", "epsilon"),
        ("euler_ancestral", "v_prediction"),
    ],
)
def test_stable_diffusion_pipeline_returns_its_output_type_with_the_counts(scheduler, prediction):
    from diffusers.pipelines.stable_diffusion import StableDiffusionPipelineOutput

    pipe = _quiet(td.tiny_sd(scheduler, prediction))
    sp = speculative(pipe)
    out = sp(
        prompt=["a red cube", "the sea"],
        negative_prompt=["blurry", "dark"],
        num_inference_steps=8,
        guidance_scale=4.0,
        num_images_per_prompt=2,
        generator=torch.Generator().manual_seed(0),
        output_type="np",
    )
    assert type(out) is StableDiffusionPipelineOutput and out.images.shape == (4, 16, 16, 3)
    assert out.nsfw_content_detected is None and np.isfinite(out.images).all()
    r = out.speculative
    assert r.samples.shape == (4, 4, 8, 8) and r.speculative_steps == 6 and torch.equal(r.nfe_total, r.nfe + 2)
    lat = sp(prompt="a cat", num_inference_steps=8, seed=1, output_type="latent")
    assert lat.images.shape == (1, 4, 8, 8) and torch.equal(lat.images, lat.speculative.samples.to(lat.images.dtype))
    auto = r.extra["auto"]  # no tree given: auto chose, from the tiny UNet's measured cost, and says why
    assert auto["choice"] in ("loop", "rmc", "dgrs") and auto["call_cost"]["rows"][0] <= 4 and "rates" in auto
    assert "auto" not in speculative(pipe, K=2, L=2)(prompt="a", num_inference_steps=4, seed=0).speculative.extra


def test_sd3_pipeline_returns_its_output_type_with_the_counts():
    from diffusers.pipelines.stable_diffusion_3 import StableDiffusion3PipelineOutput

    pipe = _quiet(td.tiny_sd3())
    out = speculative(pipe, K=2, L=2)(
        prompt="a cat",
        num_inference_steps=6,
        guidance_scale=3.0,
        generator=torch.Generator().manual_seed(0),
        output_type="pt",
        max_sequence_length=8,
    )
    assert type(out) is StableDiffusion3PipelineOutput and out.images.shape == (1, 3, 64, 64)
    assert out.speculative.samples.shape == (1, 16, 8, 8) and out.speculative.speculative_steps == 4


def test_guidance_doubles_the_target_rows_and_the_network_sees_them():
    pipe = _quiet(td.tiny_sd("euler_ancestral"))
    seen = []
    pipe.unet.register_forward_hook(lambda mod, args, out: seen.append(args[0].shape[0]))
    sp = speculative(pipe, K=2, L=2, execution="tree")
    for w, per_state in ((1.0, 1), (5.0, 2)):
        seen.clear()
        r = sp(
            prompt=["a", "b", "c"], num_inference_steps=6, guidance_scale=w, seed=2, output_type="latent"
        ).speculative
        # every network row: the speculative calls' target_rows, plus steps 0 and T-1 (one row per image each)
        assert sum(seen) == int(r.target_rows.sum()) + 2 * 3 * per_state
        assert all(n % per_state == 0 for n in seen)
    assert per_state == 2 and int(r.target_rows.sum()) % 2 == 0


# --- the call's arguments -------------------------------------------------------------------------------
def test_the_pipelines_positional_arguments_are_taken_in_its_own_order(ddpm):
    sp = speculative(ddpm, K=1, L=4, coupling="rmc")
    g = lambda: torch.Generator().manual_seed(4)  # noqa: E731
    ref = sp(batch_size=2, generator=g(), num_inference_steps=8, output_type="pt", seed=3).images
    assert torch.equal(sp(2, g(), 8, "pt", seed=3).images, ref)
    assert torch.equal(sp(2, g(), output_type="pt", num_inference_steps=8, seed=3).images, ref)
    tup = sp(2, g(), 8, "pt", False, seed=3)
    assert isinstance(tup, tuple) and torch.equal(tup[0], ref)


def test_a_positional_call_may_pass_the_parameters_it_does_not_take_at_their_defaults():
    pipe = _quiet(td.tiny_sd("euler_ancestral"))
    sp = speculative(pipe, K=2, L=2)
    kw = lambda: dict(seed=1, output_type="latent", generator=torch.Generator().manual_seed(0))  # noqa: E731
    ref = sp(
        prompt="a cat", height=16, width=16, num_inference_steps=5, guidance_scale=3.0, negative_prompt="dog", **kw()
    ).images
    # StableDiffusionPipeline's order: prompt, height, width, num_inference_steps, timesteps, sigmas, guidance_scale,
    # negative_prompt
    assert torch.equal(sp("a cat", 16, 16, 5, None, None, 3.0, "dog", **kw()).images, ref)
    assert torch.equal(
        sp("a cat", 16, 16, 5, guidance_scale=3.0, negative_prompt="dog", eta=0.0, timesteps=None, **kw()).images, ref
    )


@pytest.mark.parametrize(
    "args, kwargs, needle",
    [
        (
            (2, None, 8, "pt", True, 5),
            {},
            (
                "6 positional arguments were given, and DDPMPipeline's __call__ takes at most "
                "5 (batch_size, generator, num_inference_steps, output_type, return_dict)"
            ),
        ),
        ((2,), {"batch_size": 3}, "batch_size is given twice, as positional argument 1 (2) and by keyword (3)"),
    ],
)
def test_what_python_refuses_with_a_type_error_is_a_config_error_before_any_work(args, kwargs, needle):
    pipe = _quiet(td.tiny_ddpm())
    calls = []
    pipe.unet.register_forward_hook(lambda *a: calls.append(1))
    with pytest.raises(ConfigError) as e:
        speculative(pipe)(*args, **kwargs)
    assert needle in str(e.value) and "\n" not in str(e.value) and not calls


def test_a_parameter_it_does_not_take_is_refused_at_another_value_by_position_or_keyword():
    pipe = _quiet(td.tiny_sd())
    calls = []
    for module in (pipe.unet, pipe.text_encoder):
        module.register_forward_hook(lambda *a: calls.append(1))
    sp = speculative(pipe)
    with pytest.raises(
        ConfigError,
        match=r"positional argument 5 is StableDiffusionPipeline's timesteps=\[999, 500\], "
        r"which the speculative StableDiffusionPipeline takes only at its default \(None\)",
    ):
        sp("a cat", 16, 16, 5, [999, 500])
    latents = torch.zeros(1, 4, 8, 8)
    with pytest.raises(ConfigError) as e:  # position 12: latents
        sp("a cat", 16, 16, 5, None, None, 3.0, None, 1, 0.0, None, latents)
    assert "latents=<tensor of shape (1, 4, 8, 8), float32, on cpu>" in str(e.value) and "0., 0." not in str(e.value)
    with pytest.raises(ConfigError) as e:
        sp("a cat", latents=latents)
    assert "latents=<tensor of shape (1, 4, 8, 8), float32, on cpu> is not supported" in str(e.value)
    with pytest.raises(ConfigError, match="eta=0.5 is not supported"):
        sp("a cat", eta=0.5)
    assert not calls


# --- the progress bar -----------------------------------------------------------------------------------------
class _Bar:
    """The pipeline's tqdm bar, recorded: its total and its position ``n``."""

    def __init__(self, iterable=None, total=None):
        self.iterable, self.n, self.disable = iterable, 0, False
        self.total = len(iterable) if iterable is not None else total

    def __iter__(self):
        for x in self.iterable:
            yield x
            self.update(1)

    def update(self, k=1):
        assert k >= 0
        self.n += k

    def __enter__(self):
        return self

    def __exit__(self, *_):
        return False


def test_the_progress_bar_counts_the_loops_steps_as_the_slowest_image_commits_them(monkeypatch):
    from specsamp import sampler

    pipe = td.tiny_ddpm()
    bars, seen = [], []  # seen: (slowest image's state index, fastest's, the bar) after each round
    monkeypatch.setattr(
        pipe, "progress_bar", lambda iterable=None, total=None: bars.append(_Bar(iterable, total)) or bars[-1]
    )
    real = sampler.sample_speculative

    def recording(*args, callback=None, **kw):
        def cb(info):
            callback(info)
            seen.append((int(info["n"].min()), int(info["n"].max()), bars[-1].n))

        return real(*args, callback=cb, **kw)

    monkeypatch.setattr(sampler, "sample_speculative", recording)
    T = 12
    speculative(pipe, K=1, L=4, coupling="rmc")(batch_size=6, num_inference_steps=T, output_type="pt", seed=0)
    assert bars[-1].total == T and bars[-1].n == T
    assert all(at == slowest for slowest, _, at in seen)  # after each round: the steps every image has committed
    assert any(fastest > slowest for slowest, fastest, _ in seen)  # ... which the slowest image sets
    assert len({at for *_, at in seen}) > 2 and seen[-1][2] == T - 1  # round by round; the last step at the end
    pipe(batch_size=2, num_inference_steps=T, output_type="pt")  # the pipeline's own bar, for comparison
    assert bars[-1].total == T and bars[-1].n == T


def test_the_progress_bar_shows_num_inference_steps_as_its_total():
    import io
    import re

    pipe = td.tiny_ddpm()
    text = io.StringIO()
    pipe.set_progress_bar_config(file=text, ascii=True, mininterval=0)
    speculative(pipe, K=1, L=4, coupling="rmc")(batch_size=4, num_inference_steps=12, output_type="pt", seed=0)
    counts = re.findall(r"(\d+)/(\d+) \[", text.getvalue())
    assert counts[-1] == ("12", "12") and {total for _, total in counts} == {"12"}


# --- exactness ----------------------------------------------------------------------------------------
def _per_row(unet):
    """The UNet evaluated one row at a time: each row's output independent of its batch, so two executions
    that batch rows differently see the same bits."""
    from diffusers.models.unets.unet_2d import UNet2DOutput

    forward = unet.forward

    def one_by_one(sample, timestep, *args, **kwargs):
        t = timestep.reshape(-1).expand(sample.shape[0])
        return UNet2DOutput(
            sample=torch.cat([forward(sample[i : i + 1], t[i : i + 1]).sample for i in range(sample.shape[0])])
        )

    unet.forward = one_by_one
    return unet


@pytest.mark.parametrize("coupling, K, L", [("dgrs", 2, 3), ("rmc", 1, 5)])
def test_tree_and_path_executions_give_identical_counts_and_samples(coupling, K, L):
    pipe = _quiet(td.tiny_ddpm())
    _per_row(pipe.unet)
    runs = [
        speculative(pipe, K, L, coupling, execution=ex)(
            batch_size=4, num_inference_steps=12, seed=3, generator=torch.Generator().manual_seed(0), output_type="pt"
        )
        for ex in ("path", "tree")
    ]
    a, b = (o.speculative for o in runs)
    for f in COUNTS:
        assert torch.equal(getattr(a, f), getattr(b, f)), f
    assert torch.equal(a.samples, b.samples)


# --- refusals -------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "name", ["DDIMScheduler", "DPMSolverMultistepScheduler", "UniPCMultistepScheduler", "EulerDiscreteScheduler"]
)
def test_a_scheduler_that_is_not_reproduced_is_refused_before_any_work(ddpm, name):
    import diffusers

    pipe = _quiet(td.tiny_ddpm())
    pipe.scheduler = getattr(diffusers, name).from_config(pipe.scheduler.config)
    calls = []
    pipe.unet.register_forward_hook(lambda *a: calls.append(1))
    with pytest.raises(ConfigError) as e:
        speculative(pipe)
    msg = str(e.value)
    assert name in msg and "\n" not in msg
    if name == "DDIMScheduler":  # reproduced with eta > 0, which DDPMPipeline's loop does not pass
        assert "passes DDIMScheduler.step no eta" in msg and "DDIMPipeline with eta > 0" in msg
    else:
        assert all(k in msg for k in ("ddpm", "euler_ancestral", "flow_stochastic", "ddim", "dpmsolver_sde"))
    assert not calls


def test_the_deterministic_flow_scheduler_is_refused():
    pipe = td.tiny_sd3(stochastic=False)
    with pytest.raises(ConfigError, match="stochastic_sampling=True"):
        speculative(pipe)


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"timesteps": [999, 500]}, "timesteps=[999, 500] is not supported"),
        ({"batch_size": 0}, "batch_size=0 is invalid"),
        ({"num_inference_steps": 2}, "num_inference_steps=2 is invalid"),
        ({"seed": -1}, "seed=-1 is invalid"),
    ],
)
def test_bad_arguments_are_refused_in_one_paragraph(ddpm, kwargs, needle):
    with pytest.raises(ConfigError) as e:
        speculative(ddpm)(**kwargs)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_bad_options_are_refused_before_any_work(ddpm):
    with pytest.raises(ConfigError, match="nosuch=1 is not an option"):
        speculative(ddpm, nosuch=1)
    with pytest.raises(ConfigError):
        speculative(ddpm, coupling="nosuch")
    chain = speculative(ddpm, K=2, L=3, coupling="rmc")  # a one-child rule: the chain of B = 14 within the steps
    assert chain(batch_size=1, num_inference_steps=20, output_type="pt").speculative.attempts.shape[1] == 14
    assert chain(batch_size=1, num_inference_steps=8, output_type="pt").speculative.attempts.shape[1] == 6
    with pytest.raises(ConfigError):
        speculative(ddpm, coupling="rmc", tree=DraftTree.uniform(2, 2))  # a given tree it cannot verify
    assert speculative(ddpm, coupling="rmc", tree=DraftTree.chain(4)).tree.max_depth == 4
    pipe = _quiet(td.tiny_sd())
    with pytest.raises(ConfigError, match="guidance_rescale=0.7 is not supported"):
        speculative(pipe)(prompt="a", guidance_rescale=0.7, num_inference_steps=4)


# --- model=diffusers -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipelines")
    return {
        "ddpm": td.save_pipeline(td.tiny_ddpm(), root / "ddpm"),
        "sd": td.save_pipeline(td.tiny_sd("euler_ancestral", "v_prediction"), root / "sd"),
    }


def _config(path, **kw):
    from specsamp.models import DiffusersConfig

    return DiffusersConfig(path=str(path), **kw)


def test_scheduler_plan_reads_the_folder_without_loading_weights(saved, monkeypatch):
    import diffusers

    monkeypatch.setattr(diffusers.DiffusionPipeline, "from_pretrained", lambda *a, **k: pytest.fail("loaded"))
    cfg = _config(saved["ddpm"])
    plan = cfg.scheduler_plan(50, None)
    assert plan.name == "DDPMScheduler" and plan.kernel == "ddpm" and plan.schedule.steps == 50
    assert plan.schedule.kernel_options.get("clip") == 1.0  # the folder's clip_sample=True
    ea = cfg.scheduler_plan(50, "euler_ancestral")
    assert ea.kernel == "euler_ancestral" and ea.prediction == "epsilon"
    sd = _config(saved["sd"]).scheduler_plan(20, None)
    assert sd.kernel == "euler_ancestral" and sd.prediction == "v_prediction" and sd.coords == "vp"
    for kernel, needle in (
        ("em", "kernel=em is invalid with model=diffusers"),
        ("flow_stochastic", "kernel=flow_stochastic is invalid"),
    ):
        with pytest.raises(ConfigError, match=needle):
            cfg.scheduler_plan(50, kernel)
    assert cfg.rows_per_state() == 1 and _config(saved["sd"], guidance=3.0).rows_per_state() == 2
    assert _config(saved["sd"], guidance=1.0).rows_per_state() == 1


def test_an_unsupported_scheduler_folder_is_refused_from_its_json(tmp_path, saved):
    import shutil

    folder = tmp_path / "p"
    shutil.copytree(saved["ddpm"], folder)
    cfg_file = folder / "scheduler" / "scheduler_config.json"
    data = json.loads(cfg_file.read_text())
    cfg_file.write_text(json.dumps({**data, "_class_name": "DPMSolverMultistepScheduler"}))
    with pytest.raises(ConfigError, match="DPMSolverMultistepScheduler") as e:
        _config(folder).scheduler_plan(20, None)
    assert "\n" not in str(e.value)


def test_a_folder_without_safetensors_is_refused(tmp_path, saved):
    import shutil

    folder = tmp_path / "p"
    shutil.copytree(saved["ddpm"], folder)
    for f in (folder / "unet").glob("*.safetensors"):
        f.rename(f.with_suffix(".bin"))
    with pytest.raises(ConfigError, match=r"unet/ has no \.safetensors weights \(only diffusion_pytorch_model\.bin"):
        _config(folder).load("cpu")
    with pytest.raises(ConfigError, match="does not exist"):
        _config(tmp_path / "none").scheduler_plan(10, None)


def test_build_gives_the_plans_velocity_model_and_the_pipelines_decoding(saved):
    from specsamp.models.parametrisation import Guided
    from specsamp.models.sd3 import PromptsConfig
    from specsamp.sampler import sample_speculative

    cfg = _config(saved["sd"], guidance=3.0, prompts=PromptsConfig(source="demo", n=2))
    plan = cfg.scheduler_plan(6, None)
    target = cfg.build("cpu", plan=plan)
    assert isinstance(target.model, Guided) and target.model.event_shape == (4, 8, 8)
    ids = torch.arange(2)
    r = sample_speculative(
        target.model, plan.schedule, DraftTree.uniform(2, 2), "dgrs", indices=ids, cond=target.cond_for(ids, 0), seed=0
    )
    images = target.decode(r.samples)
    assert images.shape == (2, 3, 16, 16) and images.abs().max() <= 1
    assert len(target.prompts_for(ids)) == 2 and int(r.target_rows.sum()) % 2 == 0
    with pytest.raises(ConfigError, match="scheduler's plan"):
        cfg.build("cpu")
    ddpm = _config(saved["ddpm"])
    t2 = ddpm.build("cpu", plan=ddpm.scheduler_plan(10, None))
    assert t2.cond_for is None and t2.model.event_shape == (3, 8, 8)


def _runner_takes_kernels() -> bool:
    try:
        from specsamp.runner.config import brings_scheduler  # noqa: F401  (the runner's kernel= wiring)
    except ImportError:
        return False
    return True


@pytest.mark.skipif(not _runner_takes_kernels(), reason="the runner has no kernel= key here")
def test_run_py_samples_a_saved_pipeline_folder_on_its_own_scheduler_and_refuses_em(saved, tmp_path):
    from helpers import run

    args = [
        "model=diffusers",
        f"model.path={saved['sd']}",
        "model.guidance=3",
        "steps=6",
        "n_samples=2",
        "K=2",
        "L=2",
        "device=cpu",
        "progress=false",
    ]
    for sub in ("auto", "em"):
        (tmp_path / sub).mkdir()
    p = run(args, tmp_path / "auto")  # model=diffusers selects kernel=auto: the folder's own scheduler
    rec = json.loads((tmp_path / "auto" / "result.json").read_text())
    assert rec["model"] == "diffusers" and rec["status"] == "ok" and rec["steps"] == 6, p.stdout
    assert p.stdout.startswith(
        f"model=diffusers model.path={saved['sd']} sampler=dgrs K=2 L=2 kernel=euler_ancestral B=6 "
    ), p.stdout
    assert rec["config"]["kernel"]["name"] == "auto" and rec["kernel"] == "euler_ancestral"
    bad = run([*args, "kernel=em"], tmp_path / "em", check=False)
    assert bad.returncode == 2 and "kernel=em is invalid with model=diffusers" in bad.stderr
    assert "Traceback" not in bad.stderr
