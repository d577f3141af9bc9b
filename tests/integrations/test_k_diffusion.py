"""k-diffusion's Euler ancestral sampler through :func:`specsamp.integrations.k_diffusion.sample_euler_ancestral`.

The reference is k-diffusion's loop as it is written (``kd_euler_ancestral`` below: its ``get_ancestral_step``,
``to_d`` and Euler step, noise from a ``torch.Generator``); k-diffusion itself is not a dependency. The law tests
compare the speculative sampler's samples with that loop's by two-sample Kolmogorov--Smirnov tests on 5 fixed random
projections and the norm (the smallest p-value is asserted above a stated tolerance), at fixed seeds.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from helpers import karras, min_ks_p

from specsamp.errors import ConfigError
from specsamp.integrations.k_diffusion import sample_euler_ancestral
from specsamp.models.gmm import GaussianMixture
from specsamp.schedule import Schedule
from specsamp.trees import DraftTree

GMM = GaussianMixture(dim=8, components=3, layout_seed=1)


def gmm_denoiser(x, sigma, **extra):
    """The mixture's exact posterior mean as a k-diffusion denoiser: ``x = x0 + sigma * noise`` is the linear-path
    state ``x / (1 + sigma)`` at level ``sigma / (1 + sigma)``, and ``E[x0 | x]`` is the same in both coordinates."""
    s = sigma.to(torch.float64)
    return GMM.denoise(x / (1.0 + s[:, None]), s / (1.0 + s)).to(x.dtype)


def ancestral_step(sigma_from, sigma_to, eta=1.0):
    """k-diffusion's ``get_ancestral_step``: ``(sigma_down, sigma_up)``."""
    up = min(sigma_to, eta * (sigma_to**2 * (sigma_from**2 - sigma_to**2) / sigma_from**2) ** 0.5)
    return (sigma_to**2 - up**2) ** 0.5, up


def kd_euler_ancestral(model, x, sigmas, generator, extra_args=None, eta=1.0, s_noise=1.0):
    """k-diffusion's ``sample_euler_ancestral`` loop, its noise from ``generator``."""
    extra_args = extra_args or {}
    s_in = x.new_ones([x.shape[0]])
    for i in range(len(sigmas) - 1):
        denoised = model(x, sigmas[i] * s_in, **extra_args)
        sigma_down, sigma_up = ancestral_step(float(sigmas[i]), float(sigmas[i + 1]), eta)
        d = (x - denoised) / sigmas[i]
        x = x + d * (sigma_down - sigmas[i])
        if sigmas[i + 1] > 0:
            x = x + torch.randn(x.shape, generator=generator, dtype=x.dtype) * s_noise * sigma_up
    return x


def reference_and_start(n: int, sigmas, shape=(8,), dtype=torch.float64, model=gmm_denoiser, extra_args=None):
    """k-diffusion's samples (generator seed 0) and an independent start for the speculative sampler."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, *shape, generator=g, dtype=dtype) * sigmas[0]
    with torch.no_grad():
        ref = kd_euler_ancestral(model, x, sigmas.to(dtype), g, extra_args)
    return ref, torch.randn(n, *shape, generator=g, dtype=dtype) * sigmas[0]


# ----------------------------------------------------------------------------------------------------------------
# the kernel is k-diffusion's step


@pytest.mark.parametrize("eta,s_noise", [(1.0, 1.0), (0.5, 1.003)])
def test_the_kernel_is_k_diffusions_ancestral_step_on_a_karras_grid(eta, s_noise):
    sig = karras(12)
    lin = sig / (1 + sig)
    lin[-1] = 0.0
    kernel = Schedule(lin, 1.0, "euler_ancestral", {"eta": eta, "s_noise": s_noise}).kernel
    c = kernel.columns64("cpu")
    g = torch.Generator().manual_seed(1)
    for n in range(12):
        s0, s1 = float(sig[n]), float(sig[n + 1])
        down, up = ancestral_step(s0, s1, eta)
        x_ve = torch.randn(3, 8, generator=g, dtype=torch.float64) * (1 + s0)
        x0 = torch.randn(3, 8, generator=g, dtype=torch.float64)
        kd_mean = x_ve + (x_ve - x0) / s0 * (down - s0)
        x_lin, v = x_ve / (1 + s0), (x_ve / (1 + s0) - x0) / float(lin[n])
        mean = kernel.mean(x_lin, v, {**{k: col[n] for k, col in c.items()}, "kernel": kernel})
        torch.testing.assert_close(mean * (1 + s1), kd_mean, rtol=1e-12, atol=1e-12)
        assert float(c["std"][n]) * (1 + s1) == pytest.approx(s_noise * up, rel=1e-12, abs=1e-15)


# ----------------------------------------------------------------------------------------------------------------
# the law: the speculative sampler against k-diffusion's loop


@pytest.mark.parametrize("coupling", ["dgrs", "rmc"])
def test_law_against_k_diffusions_loop_on_the_mixture_and_identical_counts_in_both_executions(coupling):
    """seed 0 (reference), 11 (speculative); n = 400; tolerance: min KS p > 1e-3; d = 8, 10 Karras steps."""
    sig = karras(10)
    ref, x = reference_and_start(400, sig)
    runs = {}
    for execution in ("path", "tree"):
        info = {}
        out = sample_euler_ancestral(
            gmm_denoiser, x, sig, disable=True, coupling=coupling, K=2, L=3, execution=execution, seed=11, stats=info
        )
        runs[execution] = (out, info["result"])
        assert min_ks_p(out, ref) > 1e-3
    (a, ra), (b, rb) = runs["path"], runs["tree"]
    for field in ("nfe", "nfe_total", "target_rows", "rounds", "committed", "attempts", "accepts"):
        assert torch.equal(getattr(ra, field), getattr(rb, field)), field
    torch.testing.assert_close(a, b, rtol=0, atol=1e-9)  # the mixture's batched matmul rounds rows with their batch
    assert float(ra.nfe_total.double().mean()) < 10


@pytest.mark.slow
@pytest.mark.parametrize("coupling", ["dgrs", "rmc"])
@pytest.mark.parametrize("execution", ["path", "tree"])
@pytest.mark.parametrize("eta,s_noise", [(1.0, 1.0), (0.7, 1.01)])
def test_law_against_k_diffusions_loop_on_the_mixture_large(coupling, execution, eta, s_noise):
    """seed 0 (reference), 12 (speculative); n = 4000; tolerance: min KS p > 1e-3; d = 8, 8 Karras steps (coarse:
    the sampler's law is far from the data law there, so it depends on the kernel; see the test below)."""
    sig = karras(8)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4000, 8, generator=g, dtype=torch.float64) * sig[0]
    ref = kd_euler_ancestral(gmm_denoiser, x, sig, g, eta=eta, s_noise=s_noise)
    x = torch.randn(4000, 8, generator=g, dtype=torch.float64) * sig[0]
    out = sample_euler_ancestral(
        gmm_denoiser, x, sig, disable=True, eta=eta, s_noise=s_noise, coupling=coupling, execution=execution, seed=12
    )
    assert min_ks_p(out, ref) > 1e-3


@pytest.mark.slow
def test_the_mixture_law_test_tells_a_wrong_eta():
    """The test above has the power to see a kernel off by eta = 0.5 instead of 1 (seeds, n and grid as above):
    min KS p < 1e-3 (measured 1.4e-6)."""
    sig = karras(8)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4000, 8, generator=g, dtype=torch.float64) * sig[0]
    ref = kd_euler_ancestral(gmm_denoiser, x, sig, g)
    x = torch.randn(4000, 8, generator=g, dtype=torch.float64) * sig[0]
    out = sample_euler_ancestral(gmm_denoiser, x, sig, disable=True, eta=0.5, coupling="rmc", seed=12)
    assert min_ks_p(out, ref) < 1e-3


# ----------------------------------------------------------------------------------------------------------------
# the shipped digits network as a k-diffusion denoiser (EDM preconditioning: x0 at any sigma)


@pytest.fixture(scope="module")
def digits():
    from specsamp.models.edm import load_edm

    net = load_edm("edm-digits-8x8-cond", download=False)

    def denoiser(x, sigma, class_labels=None):
        return net(x, sigma, class_labels=class_labels)

    return denoiser


def test_digits_network_as_a_k_diffusion_denoiser(digits):
    sig = karras(12, sigma_min=0.02).float()
    labels = torch.nn.functional.one_hot(torch.arange(6) % 10, 10).float()
    x = torch.randn(6, 1, 8, 8, generator=torch.Generator().manual_seed(0)) * sig[0]
    info = {}
    out = sample_euler_ancestral(
        digits, x, sig, {"class_labels": labels}, disable=True, execution="tree", seed=3, stats=info, K=2, L=3
    )
    r = info["result"]
    assert out.shape == x.shape and out.dtype == torch.float32 and bool(torch.isfinite(out).all())
    assert info["steps"] == 12 and info["calls"] < 12
    endpoint_calls = r.nfe_total - r.nfe  # step 0, and step T - 1 unless the last round left its velocity
    assert bool((r.nfe < 10).all()) and bool(((endpoint_calls >= 1) & (endpoint_calls <= 2)).all())
    assert float(out.abs().max()) < 3  # images in [-1, 1] (the network's data), not noise at sigma 80


@pytest.mark.slow
@pytest.mark.parametrize("coupling", ["dgrs", "rmc"])
def test_digits_law_against_k_diffusions_loop(digits, coupling):
    """seed 0 (reference), 13 (speculative); n = 1000 (labels i mod 10); tolerance: min KS p > 1e-3 over 5
    projections of the 64 pixels and the norm; 12 Karras steps from 80 to 0.02."""
    sig = karras(12, sigma_min=0.02).float()
    labels = torch.nn.functional.one_hot(torch.arange(1000) % 10, 10).float()
    ref, x = reference_and_start(1000, sig, (1, 8, 8), torch.float32, digits, {"class_labels": labels})
    info = {}
    out = sample_euler_ancestral(
        digits, x, sig, {"class_labels": labels}, disable=True, coupling=coupling, execution="tree", seed=13, stats=info
    )
    assert min_ks_p(out, ref) > 1e-3
    assert float(info["result"].nfe_total.double().mean()) < 12


# ----------------------------------------------------------------------------------------------------------------
# k-diffusion's conventions


def test_callback_reports_every_step_once_in_order_during_the_run():
    sig = karras(10)
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(2), dtype=torch.float64) * sig[0]
    calls, seen = [0], []

    def model(x, sigma, **kw):
        calls[0] += 1
        return gmm_denoiser(x, sigma)

    out = sample_euler_ancestral(model, x, sig, callback=lambda d: seen.append((calls[0], d)), disable=True, seed=4)
    assert [d["i"] for _, d in seen] == list(range(10))
    assert all(set(d) == {"x", "i", "sigma", "sigma_hat", "denoised"} for _, d in seen)
    assert all(float(d["sigma"]) == float(sig[d["i"]]) and float(d["sigma_hat"]) == float(sig[d["i"]]) for _, d in seen)
    assert all(d["x"].shape == x.shape and d["denoised"].dtype == x.dtype for _, d in seen)
    assert seen[0][0] < calls[0]  # the first steps are reported before the network's last call
    last = seen[-1][1]
    assert torch.equal(last["denoised"], out)  # the last step returns its data prediction, as k-diffusion's
    assert not last["x"].is_inference() and not last["denoised"].is_inference()
    last["x"].add_(0)  # ordinary tensors, the caller's to keep


def test_callback_of_a_run_too_short_for_rounds_and_of_one_step():
    for n in (2, 1):
        sig = karras(n)
        x = torch.randn(3, 8, generator=torch.Generator().manual_seed(2), dtype=torch.float64) * sig[0]
        seen = []
        info = {}
        out = sample_euler_ancestral(gmm_denoiser, x, sig, callback=seen.append, disable=True, seed=4, stats=info)
        assert [d["i"] for d in seen] == list(range(n))
        assert torch.equal(seen[-1]["denoised"], out) and info["steps"] == n and info["calls"] == n


def test_progress_bar_unless_disabled(capsys):
    sig = karras(6)
    x = torch.randn(2, 8, dtype=torch.float64) * sig[0]
    sample_euler_ancestral(gmm_denoiser, x, sig, disable=False, seed=1)
    assert "6/6" in capsys.readouterr().err
    sample_euler_ancestral(gmm_denoiser, x, sig, disable=True, seed=1)
    assert capsys.readouterr().err == ""


def test_no_seed_draws_from_torchs_global_generator():
    sig = karras(8)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(5), dtype=torch.float64) * sig[0]
    runs = []
    for s in (3, 3, 4):
        torch.manual_seed(s)
        info = {}
        runs.append((sample_euler_ancestral(gmm_denoiser, x, sig, disable=True, stats=info), info["seed"]))
    assert torch.equal(runs[0][0], runs[1][0]) and runs[0][1] == runs[1][1]
    assert runs[0][1] != runs[2][1] and not torch.equal(runs[0][0], runs[2][0])
    again = sample_euler_ancestral(gmm_denoiser, x, sig, disable=True, seed=runs[0][1])
    assert torch.equal(again, runs[0][0])  # the seed in stats reproduces the run


def test_noise_sampler_is_refused_in_one_sentence():
    sig = karras(6)
    with pytest.raises(ConfigError, match=r"noise_sampler is not supported: .*by key .*seed=") as e:
        sample_euler_ancestral(gmm_denoiser, torch.zeros(2, 8), sig, noise_sampler=lambda s, t: torch.zeros(2, 8))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "sigmas,why",
    [
        ([3.0, 1.0, 0.5], "ends at 0.5"),
        ([1.0, 3.0, 0.0], "decrease strictly"),
        ([3.0, 3.0, 0.0], "decrease strictly"),
        ([3.0, float("nan"), 0.0], "not finite"),
        ([0.0], "at least two levels"),
        ([[3.0, 0.0]], "1-D"),
    ],
)
def test_bad_sigmas_are_refused_naming_the_argument(sigmas, why):
    with pytest.raises(ConfigError, match=r"sigmas=.* is invalid: .*" + why):
        sample_euler_ancestral(gmm_denoiser, torch.zeros(2, 8), torch.tensor(sigmas), disable=True)


@pytest.mark.parametrize(
    "kwargs,key",
    [
        (dict(eta=0.0), "eta=0.0"),
        (dict(s_noise=-1.0), "s_noise=-1.0"),
        (dict(K=0), "K=0"),
        (dict(L=1.5), "L=1.5"),
        (dict(execution="gpu"), "execution='gpu'"),
        (dict(seed=-1), "seed=-1"),
        (dict(seed=2**60), "seed="),
        (dict(coupling="nope"), "coupling"),
        (dict(draft="nope"), "draft"),
        (dict(frobnicate=1), "frobnicate=1"),
        (dict(budget=6), "budget=6 with coupling='dgrs' needs delta_profile"),
        (dict(tree=DraftTree.chain(2), K=2), "tree="),
        (dict(tree="wide"), "tree='wide'"),
    ],
)
def test_bad_options_are_refused_naming_the_key(kwargs, key):
    sig = karras(6)
    with pytest.raises(ConfigError, match=key.replace("(", r"\(").replace("[", r"\[")):
        sample_euler_ancestral(gmm_denoiser, torch.zeros(2, 8, dtype=torch.float64), sig, disable=True, **kwargs)


def test_budget_runs_a_chain_for_rmc_and_a_searched_tree_with_a_profile():
    sig = karras(10)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(2), dtype=torch.float64) * sig[0]
    info = {}
    sample_euler_ancestral(gmm_denoiser, x, sig, disable=True, coupling="rmc", budget=5, seed=1, stats=info)
    assert info["result"].attempts.shape[1] == 5  # a chain of 5 drafted states
    out = sample_euler_ancestral(
        gmm_denoiser, x, sig, disable=True, budget=6, delta_profile=[0.3, 0.5, 0.8], seed=1, stats=info
    )
    assert bool(torch.isfinite(out).all()) and info["result"].attempts.shape[1] >= 1


def test_extra_args_per_row_tensors_follow_their_rows_and_the_rest_reach_every_call_unchanged():
    sig = karras(8)
    b = 5
    x = torch.randn(b, 8, generator=torch.Generator().manual_seed(2), dtype=torch.float64) * sig[0]
    options, cond_list = {"transformer_options": {}}, [{"a": 1}]
    shift = torch.arange(b, dtype=torch.float64)  # row i's data are moved by i: the sampler must keep rows apart
    got = []

    def model(x, sigma, row_shift, model_options, cond, cond_scale, seed):
        assert model_options is options and cond is cond_list and cond_scale == 7.5 and seed == 42
        assert row_shift.shape[0] == x.shape[0]
        got.append(row_shift.clone())
        return gmm_denoiser(x - row_shift[:, None], sigma) + row_shift[:, None]

    extra = {"row_shift": shift, "model_options": options, "cond": cond_list, "cond_scale": 7.5, "seed": 42}
    out = sample_euler_ancestral(model, x, sig, extra, disable=True, execution="tree", seed=3)
    assert any(len(r) != b for r in got)  # the tree execution's calls hold other rows than the batch
    plain = sample_euler_ancestral(gmm_denoiser, x - shift[:, None], sig, disable=True, execution="tree", seed=3)
    torch.testing.assert_close(out - shift[:, None], plain, rtol=0, atol=1e-6)


def test_returns_x_dtype_shape_and_device_and_hands_the_model_sigmas_as_k_diffusion_does():
    sig = karras(6).float()
    x = torch.randn(3, 2, 4, 4, generator=torch.Generator().manual_seed(2)) * sig[0]
    levels = []

    def model(x, sigma):
        levels.append(sigma)
        assert x.dtype == torch.float32 and sigma.dtype == torch.float32 and sigma.shape == (x.shape[0],)
        return x * 0.5 / (1 + sigma[:, None, None, None])

    out = sample_euler_ancestral(model, x, sig, disable=True, seed=1)
    assert out.shape == x.shape and out.dtype == x.dtype and out.device == x.device
    assert {float(v) for s in levels for v in s} <= {float(v) for v in sig[:-1]}  # exactly the caller's levels


def docs_node(monkeypatch):
    """The ComfyUI node of ``docs/integrations.md``, run against a stand-in ``comfy.samplers.KSAMPLER`` that keeps
    what ComfyUI's keeps: the function and its ``extra_options``."""
    import re
    import sys
    import types
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "integrations.md").read_text()
    (code,) = [b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "KSAMPLER" in b]

    class KSAMPLER:
        def __init__(self, sampler_function, extra_options={}, inpaint_options={}):  # noqa: B006  (ComfyUI's own signature)
            self.sampler_function, self.extra_options, self.inpaint_options = (
                sampler_function,
                extra_options,
                inpaint_options,
            )

    samplers = types.ModuleType("comfy.samplers")
    samplers.KSAMPLER = KSAMPLER
    monkeypatch.setitem(sys.modules, "comfy", types.ModuleType("comfy"))
    monkeypatch.setitem(sys.modules, "comfy.samplers", samplers)
    sys.modules["comfy"].samplers = samplers
    namespace = {}
    exec(compile(code, "docs/integrations.md", "exec"), namespace)
    (node,) = namespace["NODE_CLASS_MAPPINGS"].values()
    defaults = {k: v[1]["default"] if len(v) > 1 else v[0][0] for k, v in node.INPUT_TYPES()["required"].items()}
    return getattr(node(), node.FUNCTION)(**defaults)[0]


def test_ksamplers_call_binds_and_runs(monkeypatch):
    """ComfyUI's ``KSAMPLER(sampler_function, extra_options)`` calls ``sampler_function(model_k, noise, sigmas,
    extra_args=..., callback=..., disable=..., **extra_options)``; its model wrapper takes ``denoise_mask``,
    ``model_options`` and ``seed`` keywords (``denoise_mask=None`` without inpainting). The sampler is the docs' node's."""
    sampler = docs_node(monkeypatch)
    assert sampler.sampler_function is sample_euler_ancestral  # the node's default: ComfyUI's first name
    sig = karras(8)
    noise = torch.randn(2, 8, generator=torch.Generator().manual_seed(2), dtype=torch.float64) * sig[0]
    info = {}
    extra_options = {**sampler.extra_options, "stats": info}
    extra_args = {"cond": [], "uncond": [], "cond_scale": 5.0, "model_options": {}, "seed": 7, "denoise_mask": None}
    previews = []

    def model_k(x, sigma, denoise_mask, model_options={}, seed=None, **rest):  # noqa: B006  (ComfyUI's own signature)
        assert denoise_mask is None and seed == 7
        return gmm_denoiser(x, sigma)

    args = (model_k, noise, sig)
    kwargs = dict(extra_args=extra_args, callback=lambda d: previews.append(d["i"]), disable=True, **extra_options)
    inspect.signature(sample_euler_ancestral).bind(*args, **kwargs)
    out = sample_euler_ancestral(*args, **kwargs)
    assert out.shape == noise.shape and previews == list(range(8)) and info["steps"] == 8


def test_comfyui_flow_models_go_to_the_flow_form_or_are_refused_and_inpainting_masks_are_refused():
    class CONST:
        pass

    class Inner:
        model_sampling = CONST()

    class Wrapper:
        def __init__(self):
            self.inner_model = type("Guider", (), {"inner_model": Inner()})()

        def __call__(self, x, sigma, **kw):
            return x

    sig = karras(6)
    with pytest.raises(ConfigError, match=r"sigmas=.* is invalid: it starts at 80.0: a flow model's levels lie in"):
        sample_euler_ancestral(Wrapper(), torch.zeros(2, 8), sig, disable=True)  # runs the flow form: levels <= 1
    from specsamp.integrations.k_diffusion import sample_dpmpp_2m_sde

    with pytest.raises(ConfigError, match="model is a flow model .* sample_dpmpp_2m_sde takes variance-exploding"):
        sample_dpmpp_2m_sde(Wrapper(), torch.zeros(2, 8), sig, disable=True)
    with pytest.raises(ConfigError, match=r"denoise_mask"):
        sample_euler_ancestral(gmm_denoiser, torch.zeros(2, 8), sig, {"denoise_mask": torch.ones(2, 8)}, disable=True)


def test_the_driver_refuses_bad_coords_and_an_unknown_option_names_the_sampler_and_its_options():
    from specsamp.integrations.k_diffusion import sample_with_kernel

    x = torch.randn(2, 8, dtype=torch.float64) * 80.0
    with pytest.raises(ConfigError, match=r"coords='vp' is invalid.*ve, linear"):
        sample_with_kernel("euler_ancestral", gmm_denoiser, x, karras(6), coords="vp")
    with pytest.raises(ConfigError, match=r"Kk=2 is not an option of sample_euler_ancestral: valid are K, L, coupling"):
        sample_euler_ancestral(gmm_denoiser, x, karras(6), Kk=2)
    with pytest.raises(ConfigError, match=r"sigmas=\[1\.5, 0\.5, 0\.0\] is invalid: it starts at 1\.5"):
        sample_with_kernel("flow_stochastic", gmm_denoiser, x, torch.tensor([1.5, 0.5, 0.0]), coords="linear")


def test_the_docs_node_offers_every_sampler_by_comfyuis_name_and_each_takes_ksamplers_call(monkeypatch):
    import re
    from pathlib import Path

    docs_node(monkeypatch)  # the stand-in comfy.samplers module, installed for the node's import
    text = (Path(__file__).resolve().parents[2] / "docs" / "integrations.md").read_text()

    (code,) = [b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "KSAMPLER" in b]
    namespace = {}
    exec(compile(code, "docs/integrations.md", "exec"), namespace)
    node = namespace["SpeculativeSampler"]
    names = node.INPUT_TYPES()["required"]["sampler_name"][0]
    assert names == [
        "euler_ancestral",
        "dpmpp_2m_sde",
        "dpmpp_2m_sde_gpu",
        "dpmpp_3m_sde",
        "dpmpp_3m_sde_gpu",
        "ddpm",
        "lcm",
        "er_sde",
        "res_multistep_ancestral",
    ]
    sig = karras(6, sigma_max=20.0)
    noise = torch.randn(2, 8, generator=torch.Generator().manual_seed(2), dtype=torch.float64) * sig[0]
    extra_args = {"cond": [], "model_options": {}, "seed": 7, "denoise_mask": None}

    def model_k(x, sigma, denoise_mask, model_options={}, seed=None, **rest):  # noqa: B006  (ComfyUI's own signature)
        return gmm_denoiser(x, sigma)

    assert node.INPUT_TYPES()["required"]["coupling"][0][0] == "auto"  # ComfyUI's default: the first entry
    for name in names:
        for coupling in ("rmc", "auto"):
            sampler = node().get_sampler(name, 2, 2, coupling, 0.9, 1.01)[0]
            info = {}
            out = sampler.sampler_function(
                model_k,
                noise,
                sig,
                extra_args=extra_args,
                callback=None,
                disable=True,
                **sampler.extra_options,
                stats=info,
            )
            assert out.shape == noise.shape and info["steps"] == 6, name
            assert ("auto" in info) == (coupling == "auto"), name
