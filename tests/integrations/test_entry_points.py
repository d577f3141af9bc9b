"""The Python entry points' edge (specsamp.arguments): every bad argument refused before the first network call, in one
paragraph naming it; the model's keys reach it under any name; a wrong network output named at the first call; a tree
too large refused at once; the calls a run made and the calls it is charged, both reported."""

from __future__ import annotations

import time

import pytest
import tiny_diffusers as td
import torch

from specsamp import arguments
from specsamp.errors import ConfigError
from specsamp.integrations.diffusers import speculative
from specsamp.integrations.k_diffusion import sample_euler_ancestral
from specsamp.trees import DraftTree


def karras(n: int, lo: float = 0.05, hi: float = 14.0, rho: float = 7.0) -> torch.Tensor:
    ramp = torch.linspace(0, 1, n, dtype=torch.float64)
    s = (hi ** (1 / rho) + ramp * (lo ** (1 / rho) - hi ** (1 / rho))) ** rho
    return torch.cat([s, s.new_zeros(1)]).float()


class Denoiser:
    """A k-diffusion denoiser of a Gaussian target N(0, I), counting its calls and keeping the keywords of each."""

    def __init__(self, out=None):
        self.calls, self.kwargs, self.out = 0, [], out

    def __call__(self, x, sigma, /, **kwargs):  # positional-only, so that a key named x or sigma reaches it
        self.calls += 1
        self.kwargs.append(kwargs)
        if self.out is not None:
            return self.out(x)
        return x / (1.0 + sigma.reshape(-1, *[1] * (x.ndim - 1)) ** 2)


X = torch.randn(3, 2, 4, 4, generator=torch.Generator().manual_seed(0)) * 14.0


def _one_paragraph(e: BaseException, *names: str) -> str:
    text = str(e)
    assert "\n" not in text and len(text) < 400, text
    for name in names:
        assert name in text, text
    return text


# ---------------------------------------------------------------------------------------------------------------
# k-diffusion


def test_every_extra_args_key_reaches_the_model_under_its_own_name():
    # the sampler's own names (x, sigma, t, y, max_batch, cond, row) must not collide with the model's keywords
    labels = torch.arange(3)
    extra = {
        "y": labels,
        "t": torch.tensor([0.5, 1.5, 2.5]),
        "x": "static",
        "sigma": 7,
        "max_batch": None,
        "cond": [{"c": 1}],
        "row": torch.ones(3, 5),
        "model_options": {"k": 1},
    }
    model = Denoiser()
    stats = {}
    sample_euler_ancestral(model, X, karras(8), extra, disable=True, seed=3, stats=stats)
    assert model.calls == stats["calls"] > 0
    for kw in model.kwargs:
        assert set(kw) == set(extra)
        assert kw["x"] == "static" and kw["sigma"] == 7 and kw["max_batch"] is None and kw["cond"] == [{"c": 1}]
        rows = kw["y"]  # per-row tensors: the rows of the trajectories in this call, consistently across keys
        assert rows.dtype == torch.long and set(rows.tolist()) <= {0, 1, 2}
        assert torch.equal(kw["t"], torch.tensor([0.5, 1.5, 2.5])[rows]) and kw["row"].shape == (rows.numel(), 5)


def test_a_key_that_names_the_models_positional_parameter_is_refused_before_the_first_call():
    from specsamp.sampler import sample_speculative
    from specsamp.schedule import Schedule

    calls = []

    def net(x, sigma, **kw):
        calls.append(1)
        return x

    for key in ("x", "sigma"):
        with pytest.raises(ConfigError) as e:
            sample_euler_ancestral(net, X, karras(8), {key: torch.arange(3)}, disable=True)
        _one_paragraph(e.value, f"extra_args key {key!r}", "positional-only", "def model(x, sigma, /, **kwargs)")
    net.event_shape, net.dtype = (4,), torch.float32
    with pytest.raises(ConfigError, match="cond key 'x' is invalid"):
        sample_speculative(
            net, Schedule.make(steps=6, eps=0.1), DraftTree.uniform(2, 2), n_samples=2, cond={"x": torch.zeros(2)}
        )
    assert not calls


def test_a_class_conditional_model_taking_y():
    calls = []

    def net(x, sigma, y=None):
        calls.append(y)
        return x / (1.0 + sigma.reshape(-1, 1) ** 2) + y[:, None].to(x.dtype)

    out = sample_euler_ancestral(
        net, torch.zeros(4, 2), karras(6), {"y": torch.tensor([0, 1, 2, 3])}, disable=True, seed=0
    )
    assert out.shape == (4, 2) and all(y is not None for y in calls)


BAD_KDIFF = [
    ({"x": torch.full((3, 2, 4, 4), float("nan"))}, ["x=<tensor of shape (3, 2, 4, 4), float32", "NaN or inf"]),
    ({"x": X.clone().index_fill_(0, torch.tensor([1]), float("inf"))}, ["x=", "row 1 holds NaN or inf"]),
    ({"x": torch.empty(3, 2, 4, 4, device="meta")}, ["x=", "meta"]),
    ({"x": X.long()}, ["x=<tensor", "floating-point"]),
    ({"x": [1.0, 2.0]}, ["x=[1.0, 2.0]", "tensor"]),
    ({"model": None}, ["model=None", "callable"]),
    ({"max_batch": 0}, ["max_batch=0", ">= 1"]),
    ({"max_batch": "4"}, ["max_batch='4'", "integer"]),
    ({"stats": []}, ["stats=[]", "dict"]),
    ({"stats": "abc"}, ["stats='abc'", "dict"]),
    ({"tree": "abc"}, ["tree='abc'", "DraftTree"]),
    ({"callback": 3}, ["callback=3", "callable"]),
    ({"disable": "yes"}, ["disable='yes'", "True or False"]),
    ({"seed": -1}, ["seed=-1"]),
    ({"seed": 1.5}, ["seed=1.5"]),
    ({"K": "2"}, ["K='2'", "integer"]),
    ({"L": 0}, ["L=0", ">= 1"]),
    ({"budget": 2.5}, ["budget=2.5"]),
    ({"coupling": 5}, ["coupling=5"]),
    ({"draft": None}, ["draft=None"]),
    ({"execution": "graph"}, ["execution='graph'", "tree, path"]),
    ({"prefetch": 1}, ["prefetch=1", "nearest"]),
    ({"evaluate_leaves": "no"}, ["evaluate_leaves='no'"]),
    ({"warmup": "none"}, ["warmup='none'", "call, step0"]),
    ({"check_contract": "yes"}, ["check_contract='yes'"]),
    ({"refine": -1}, ["refine=-1"]),
    ({"refine": 1, "execution": "path"}, ["refine=1", "execution=path"]),
    ({"compile": "yes"}, ["compile='yes'"]),
    ({"eta": float("nan")}, ["eta=nan"]),
    ({"s_noise": "1"}, ["s_noise='1'"]),
    ({"extra_args": [1, 2]}, ["extra_args", "dict"]),
    ({"sigmas": torch.tensor([3.0, 1.0, 2.0, 0.0])}, ["sigmas=", "decrease"]),
    ({"nosuch": 1}, ["nosuch=1 is not an option of sample_euler_ancestral"]),
    ({"tree": DraftTree.uniform(2, 2), "K": 2}, ["tree=", "together with K"]),
    ({"coupling": "rmc", "tree": DraftTree.uniform(2, 2)}, ["rmc", "K=1"]),
]


@pytest.mark.parametrize(
    "kwargs,needles", BAD_KDIFF, ids=lambda v: "-".join(map(str, v))[:40] if isinstance(v, dict) else ""
)
def test_bad_arguments_are_refused_before_the_first_call(kwargs, needles):
    model = Denoiser()
    args = {"model": model, "x": X, "sigmas": karras(8), "disable": True, "seed": 0}
    args.update(kwargs)
    with pytest.raises(ConfigError) as e:
        sample_euler_ancestral(**args)
    _one_paragraph(e.value, *needles)
    assert model.calls == 0


@pytest.mark.parametrize(
    "out,got",
    [
        (lambda x: (x, None), "returned a tuple"),
        (lambda x: x[:, :1], "returned <tensor of shape (3, 1, 4, 4)"),
        (lambda x: x.long(), "int64"),
        (lambda x: x.tolist(), "returned a list"),
        (lambda x: None, "returned a NoneType"),
    ],
    ids=["tuple", "shape", "dtype", "list", "none"],
)
def test_a_wrong_network_output_is_named_at_the_first_call(out, got):
    model = Denoiser(out)
    with pytest.raises(arguments.ModelOutputError) as e:
        sample_euler_ancestral(model, X, karras(8), disable=True, seed=0, K=2, L=3)
    _one_paragraph(e.value, got, "expected a floating-point tensor of shape (3, 2, 4, 4)")
    assert model.calls == 1
    model = Denoiser(out)  # auto: its first call is its measurement's (or its pilot's), checked alike
    with pytest.raises(arguments.ModelOutputError) as e:
        sample_euler_ancestral(model, X, karras(8), disable=True, seed=0)
    _one_paragraph(e.value, got.split("(")[0], "expected a floating-point tensor of shape (")
    assert model.calls == 1


@pytest.mark.parametrize("K,L", [(2, 60), (8, 8), (3, 20)])
def test_a_huge_tree_is_refused_at_once(K, L):
    model = Denoiser()
    start = time.perf_counter()
    with pytest.raises(ConfigError) as e:
        sample_euler_ancestral(model, X, karras(30), K=K, L=L, disable=True, seed=0)
    assert time.perf_counter() - start < 5.0  # sized, not built (building K=8, L=8 alone takes seconds)
    _one_paragraph(e.value, "GiB", "lower K or L")
    assert model.calls == 0


def test_the_calls_made_and_the_calls_charged_are_both_reported():
    counts = {}
    for execution in ("tree", "path"):
        model, stats = Denoiser(), {}
        sample_euler_ancestral(model, X, karras(20), execution=execution, disable=True, seed=5, stats=stats, K=2, L=3)
        assert stats["calls"] == model.calls  # what the network was asked for, max_batch splits included
        counts[execution] = stats
    assert counts["tree"]["calls"] == counts["tree"]["charged_calls"]  # one batched call a round
    assert counts["path"]["charged_calls"] == counts["tree"]["charged_calls"]  # both executions are charged alike
    assert counts["path"]["calls"] > counts["path"]["charged_calls"]  # the walk calls per depth


# ---------------------------------------------------------------------------------------------------------------
# diffusers


@pytest.fixture(scope="module")
def ddpm():
    pipe = td.tiny_ddpm()
    pipe.set_progress_bar_config(disable=True)
    pipe.calls = [0]
    pipe.unet.register_forward_hook(lambda *a: pipe.calls.__setitem__(0, pipe.calls[0] + 1))
    return pipe


BAD_OPTIONS = [
    ({"max_batch": 0}, ["max_batch=0", ">= 1"]),
    ({"max_batch": "4"}, ["max_batch='4'"]),
    ({"tree": "abc"}, ["tree='abc'", "DraftTree"]),
    ({"refine": -1}, ["refine=-1"]),
    ({"compile": "yes"}, ["compile='yes'"]),
    ({"evaluate_leaves": "no"}, ["evaluate_leaves='no'"]),
    ({"prefetch": None}, ["prefetch=None"]),
    ({"K": 0}, ["K=0"]),
    ({"L": "3"}, ["L='3'"]),
    ({"dtype": "float8"}, ["dtype"]),
    ({"latents": torch.zeros(2, 1, 8, 8)}, ["latents=<tensor of shape (2, 1, 8, 8)"]),
]


@pytest.mark.parametrize(
    "options,needles", BAD_OPTIONS, ids=lambda v: "-".join(map(str, v))[:30] if isinstance(v, dict) else ""
)
def test_speculative_refuses_bad_options_at_once(ddpm, options, needles):
    before = ddpm.calls[0]
    with pytest.raises(ConfigError) as e:
        speculative(ddpm, **options)
    _one_paragraph(e.value, *needles)
    assert ddpm.calls[0] == before


BAD_CALLS = [
    ({"generator": 0}, ["generator=0", "torch.Generator"]),
    ({"output_type": "jpeg"}, ["output_type='jpeg'", "pil, np, pt"]),
    ({"return_dict": "yes"}, ["return_dict='yes'"]),
    ({"seed": "3"}, ["seed='3'"]),
    ({"batch_size": 0}, ["batch_size=0"]),
    ({"num_inference_steps": "20"}, ["num_inference_steps='20'"]),
    (
        {"latents": torch.zeros(2, 1, 8, 8)},
        ["latents=<tensor of shape (2, 1, 8, 8), float32, on cpu> is not supported"],
    ),
    ({"prompt_embeds": torch.zeros(2, 77, 768)}, ["prompt_embeds=<tensor of shape (2, 77, 768)"]),
]


@pytest.mark.parametrize(
    "kwargs,needles", BAD_CALLS, ids=lambda v: "-".join(map(str, v))[:30] if isinstance(v, dict) else ""
)
def test_the_speculative_pipeline_refuses_bad_arguments_before_any_call(ddpm, kwargs, needles):
    before = ddpm.calls[0]
    with pytest.raises(ConfigError) as e:
        speculative(ddpm)(**{"num_inference_steps": 6, **kwargs})
    _one_paragraph(e.value, *needles)
    assert ddpm.calls[0] == before


@pytest.mark.parametrize("K,L", [(2, 60), (8, 8)])
def test_the_speculative_pipeline_refuses_a_huge_tree_at_once(ddpm, K, L):
    before, start = ddpm.calls[0], time.perf_counter()
    with pytest.raises(ConfigError) as e:
        speculative(ddpm, K=K, L=L)(batch_size=4, num_inference_steps=20)
    assert time.perf_counter() - start < 5.0
    _one_paragraph(e.value, "GiB", "max_batch" if K == 2 else "lower K or L")
    assert ddpm.calls[0] == before


def test_a_long_chain_runs_within_its_steps(ddpm):
    # a one-child rule's chain of B = 2 + ... + 2^60 is cut to the speculative steps, as run.py does
    out = speculative(ddpm, K=2, L=60, coupling="rmc")(batch_size=1, num_inference_steps=8, output_type="pt")
    assert out.speculative.attempts.shape[1] == 6


# ---------------------------------------------------------------------------------------------------------------
# the helpers themselves


def test_describe_never_prints_a_tensor_or_a_long_value():
    assert arguments.describe(torch.zeros(1000, 1000)) == "<tensor of shape (1000, 1000), float32, on cpu>"
    assert len(arguments.describe("a" * 10_000)) == arguments.SHOWN
    assert arguments.describe([torch.zeros(3)] * 50).startswith("<list of 50 items: <tensor of shape (3,)")


def test_uniform_tree_sizes_match_the_built_trees():
    for K, L, h in [(2, 3, 10), (2, 9, 4), (3, 2, 1), (1, 5, 3)]:
        assert arguments.uniform_nodes(K, L, h) == len(DraftTree.uniform(K, min(L, h)))
        built = DraftTree.uniform(K, L).restrict(h)
        assert torch.equal(torch.as_tensor(built.parent), torch.as_tensor(DraftTree.uniform(K, min(L, h)).parent))
    assert (
        arguments.uniform_nodes(2, 3, 20, chain=True) == 15
        and arguments.uniform_nodes(2, 3, 10, chain=True) == 11
        and arguments.uniform_nodes(2, 60, 18, chain=True) == 19
    )


def test_the_node_maxima_follow_the_memory_estimate():
    from specsamp.integrations.k_diffusion import node_maxima

    K, L = node_maxima()
    assert (K, L) == (4, 4)  # one 512x512 SD1.x latent, float32, 24 GiB
    fits = dict(
        event_shape=(4, 64, 64),
        dtype=torch.float32,
        device="cpu",
        steps=20,
        available=24 * 2**30,
        row_bytes=arguments.activation_bytes((4, 64, 64), torch.float32),
    )
    arguments.check_sampler_memory(DraftTree.uniform(K, L), 1, **fits)  # the corner the node offers fits
    with pytest.raises(ConfigError, match="lower K or L"):
        arguments.check_sampler_memory(DraftTree.uniform(K + 1, L + 1), 1, **fits)
    assert node_maxima(available=80 * 2**30) > node_maxima() > node_maxima((4, 128, 128))


@pytest.mark.parametrize("pipe, shown", [(None, "None"), ("sd3", "'sd3'"), (object(), "'object'")])
def test_speculative_names_what_it_was_handed_in_place_of_a_pipeline(pipe, shown):
    with pytest.raises(
        ConfigError, match=rf"pipeline={shown} is not supported: speculative\(\) drives DDIMPipeline, DDPMPipeline"
    ):
        speculative(pipe)


@pytest.mark.parametrize("which", ["speculative", "standard"])
def test_the_samplers_refuse_an_unknown_keyword_by_name_listing_theirs(which):
    from specsamp.models import GaussianMixture
    from specsamp.sampler import sample_speculative, sample_standard
    from specsamp.schedule import Schedule

    gmm = GaussianMixture(dim=4, components=2, layout_seed=1)
    sch = Schedule(torch.linspace(1, 0, 11, dtype=torch.float64), 1.0)
    call = (
        (lambda **kw: sample_speculative(gmm, sch, DraftTree.uniform(2, 2), "dgrs", 2, **kw))
        if which == "speculative"
        else (lambda **kw: sample_standard(gmm, sch, 2, **kw))
    )
    with pytest.raises(ConfigError, match=rf"generator=0 is not an option of sample_{which}: valid are model, sch"):
        call(generator=0)
