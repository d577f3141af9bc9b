"""Gaussian mixture target (section 5.1): exact velocity, denoiser, component labels, layout.

The velocity is checked against the score of the closed-form mixture marginal
``p_sigma = sum_i w_i N((1 - sigma) mu_i, ((1 - sigma)^2 s_i^2 + sigma^2) I)``, differentiated with
autograd, through ``s = -(x + (1 - sigma) v) / sigma`` (eq. 34). Inputs use ``torch.Generator`` seeds
stated inline; comparisons are float64 with relative tolerance 1e-9.
"""

import math

import pytest
import torch

from specsamp.models import GaussianMixture, VelocityModel, batched


def log_marginal(model: GaussianMixture, x: torch.Tensor, sigma: float) -> torch.Tensor:
    """log p_sigma(x) of the mixture on the linear path, written from scratch (float64)."""
    alpha = 1.0 - sigma
    var = alpha**2 * model.stds**2 + sigma**2  # [C]
    d = x.shape[1]
    diff = x[:, None, :] - alpha * model.means[None]  # [b, C, d]
    logp = model.log_weights[None] - 0.5 * d * torch.log(2 * math.pi * var)[None] - 0.5 * (diff**2).sum(-1) / var[None]
    return torch.logsumexp(logp, dim=1)


def autograd_score(model, x, sigma):
    x = x.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(log_marginal(model, x, sigma).sum(), x)
    return g


def marginal_points(model, sigma, n, seed):
    """States on the path at ``sigma`` (x0 from the mixture) plus a few far-away points."""
    g = torch.Generator().manual_seed(seed)
    x0 = model.sample(n, generator=g)
    xi = torch.randn(n, model.event_shape[0], generator=g, dtype=torch.float64)
    far = 6.0 * torch.randn(3, model.event_shape[0], generator=g, dtype=torch.float64)
    return torch.cat([(1 - sigma) * x0 + sigma * xi, far])


@pytest.mark.parametrize("dim,components", [(4, 3), (50, 5), (500, 5)])
@pytest.mark.parametrize("sigma", [0.02, 0.1, 0.35, 0.7, 0.95, 0.999])
def test_velocity_matches_autograd_score(dim, components, sigma):
    # seed 3, 64 marginal points + 3 far points; score from the model's velocity vs autograd, rtol 1e-9
    model = GaussianMixture(dim=dim, components=components, layout_seed=1)
    x = marginal_points(model, sigma, 64, seed=3)
    v = model(x, torch.full((x.shape[0],), sigma, dtype=torch.float64))
    score_model = -(x + (1 - sigma) * v) / sigma
    score_ref = autograd_score(model, x, sigma)
    scale = score_ref.abs().max().item()
    torch.testing.assert_close(score_model, score_ref, rtol=1e-9, atol=1e-9 * scale)


def test_velocity_at_sigma_one_is_x_minus_mean_of_means():
    # at sigma = 1 the posterior is the prior (equal weights) and E[x0] = mean of the means
    model = GaussianMixture(dim=6, components=4, layout_seed=2)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(10, 6, generator=g, dtype=torch.float64)
    v = model(x, torch.ones(10, dtype=torch.float64))
    torch.testing.assert_close(v, x - model.means.mean(0), rtol=1e-12, atol=1e-12)


def test_velocity_per_row_sigmas_and_batching():
    # rows at different sigmas in one call equal row-by-row calls; batched() splits without changing values
    model = GaussianMixture(dim=8, components=3, layout_seed=4)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(9, 8, generator=g, dtype=torch.float64)
    sig = torch.linspace(0.05, 0.95, 9, dtype=torch.float64)
    v = model(x, sig)
    for i in range(9):
        torch.testing.assert_close(v[i : i + 1], model(x[i : i + 1], sig[i : i + 1]), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(batched(model, x, sig, max_batch=2), v, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(batched(model, x, sig, max_batch=None), v, rtol=0, atol=0)


@pytest.mark.parametrize("sigma", [1e-9, 1e-7])
def test_denoise_at_small_sigma_is_identity(sigma):
    # seed 5, 32 clean mixture samples: E[x0 | x_sigma = x] = x + O(sigma) for sigma -> 0
    model = GaussianMixture(dim=20, components=5, layout_seed=0)
    x = model.sample(32, generator=torch.Generator().manual_seed(5))
    out = model.denoise(x, torch.full((32,), sigma, dtype=torch.float64))
    torch.testing.assert_close(out, x, rtol=0, atol=1e-5)
    # exactly zero noise: the posterior mean of a clean point is the point
    out0 = model.denoise(x, torch.zeros(32, dtype=torch.float64))
    torch.testing.assert_close(out0, x, rtol=0, atol=1e-12)


def test_denoise_matches_autograd_tweedie():
    # Tweedie: E[x0 | x] = (x + sigma^2 grad log p_sigma(x)) / (1 - sigma)
    model = GaussianMixture(dim=10, components=3, layout_seed=7)
    for sigma in (0.1, 0.5, 0.9):
        x = marginal_points(model, sigma, 16, seed=8)
        want = (x + sigma**2 * autograd_score(model, x, sigma)) / (1 - sigma)
        got = model.denoise(x, torch.full((x.shape[0],), sigma, dtype=torch.float64))
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)


def test_component():
    # each mean belongs to its own component; draws from component c are labelled c (d = 50, seed 6)
    model = GaussianMixture(dim=50, components=5, layout_seed=3)
    assert model.component(model.means).tolist() == list(range(5))
    g = torch.Generator().manual_seed(6)
    c = torch.arange(5).repeat(40)
    x0 = model.means[c] + model.stds[c, None] * torch.randn(200, 50, generator=g, dtype=torch.float64)
    assert torch.equal(model.component(x0), c)


def test_sample_law():
    # 20000 exact draws (seed 9): component frequencies within 5 SE of 1/C; per-component std within 3%
    model = GaussianMixture(dim=30, components=4, layout_seed=5)
    x = model.sample(20000, generator=torch.Generator().manual_seed(9))
    lab = model.component(x)
    freq = torch.bincount(lab, minlength=4).double() / 20000
    assert (freq - 0.25).abs().max().item() < 5 * math.sqrt(0.25 * 0.75 / 20000)
    for c in range(4):
        resid = x[lab == c] - model.means[c]
        assert resid.std().item() == pytest.approx(model.stds[c].item(), rel=0.03)


def test_layout_reproducible_from_seed():
    a = GaussianMixture(dim=500, components=5, layout_seed=0)
    b = GaussianMixture(dim=500, components=5, layout_seed=0)
    c = GaussianMixture(dim=500, components=5, layout_seed=1)
    assert torch.equal(a.means, b.means) and torch.equal(a.stds, b.stds)
    assert not torch.equal(a.means, c.means)
    # section 5.1 layout: means U([-2, 2]^d), stds U([0.10, 0.25]), equal weights
    assert a.means.shape == (5, 500) and a.stds.shape == (5,)
    assert a.means.abs().max().item() <= 2.0
    assert a.means.abs().max().item() > 1.9 and a.means.abs().min().item() < 0.1
    assert bool(((a.stds >= 0.10) & (a.stds <= 0.25)).all())
    torch.testing.assert_close(a.log_weights.exp(), torch.full((5,), 0.2, dtype=torch.float64))
    # the layout does not depend on the global RNG state
    torch.manual_seed(12345)
    d = GaussianMixture(dim=500, components=5, layout_seed=0)
    assert torch.equal(a.means, d.means)


def test_interface_and_dtype():
    model = GaussianMixture(dim=6, components=2, layout_seed=0, dtype=torch.float32)
    assert isinstance(model, VelocityModel)
    assert model.event_shape == (6,) and model.dtype == torch.float32
    x = torch.randn(3, 6)
    v = model(x, torch.full((3,), 0.5), label=torch.zeros(3))  # conditioning is ignored
    assert v.dtype == torch.float32 and v.shape == (3, 6)
    ref = GaussianMixture(dim=6, components=2, layout_seed=0)(x.double(), torch.full((3,), 0.5, dtype=torch.float64))
    torch.testing.assert_close(v.double(), ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "kwargs,key",
    [
        ({"dim": 0}, "model.dim=0"),
        ({"components": 0}, "model.components=0"),
        ({"dim": 2.5}, "model.dim"),
        ({"std_range": (0.3, 0.1)}, "model.std_range"),
    ],
)
def test_bad_arguments(kwargs, key):
    with pytest.raises(ValueError, match=key):
        GaussianMixture(**kwargs)
