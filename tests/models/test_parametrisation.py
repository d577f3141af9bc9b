"""Adapters from epsilon, x0, v and flow networks to the velocity interface; guidance charged in target_rows."""

import pytest
import torch

from specsamp.errors import ConfigError
from specsamp.models.gmm import GaussianMixture
from specsamp.models.parametrisation import (
    PREDICTIONS,
    GridTimesteps,
    Guided,
    Parametrised,
    from_velocity,
    level_scale,
    to_velocity,
    vp_alpha_sigma,
)
from specsamp.sampler import sample_speculative, sample_standard
from specsamp.schedule import Schedule
from specsamp.trees import DraftTree


@pytest.mark.parametrize("coords", sorted(PREDICTIONS))
def test_each_prediction_converts_to_the_velocity_and_back(coords):
    # float64, 3 rows at levels 0.05, 0.5, 0.95: the round trip to 1e-12 (a division by s or 1 - s >= 0.05)
    g = torch.Generator().manual_seed(0)
    x, v = torch.randn(2, 3, 4, generator=g, dtype=torch.float64)
    s = torch.tensor([0.05, 0.5, 0.95], dtype=torch.float64)
    for pred in PREDICTIONS[coords]:
        out = from_velocity(v, x, s, pred, coords)
        assert torch.allclose(to_velocity(out, x, s, pred, coords), v, rtol=0, atol=1e-12), pred


def test_the_coordinates_hold_the_same_data_and_noise():
    # y = k x: VP has alpha^2 + sigma^2 = 1 and y = alpha x0 + sigma xi; VE has y = x0 + sigma_ve xi
    s = torch.tensor([0.1, 0.6, 0.99], dtype=torch.float64)
    alpha, sig = vp_alpha_sigma(s)
    assert torch.allclose(alpha**2 + sig**2, torch.ones(3, dtype=torch.float64), atol=1e-15)
    k = level_scale(s, "vp")
    assert torch.allclose(k * (1 - s), alpha, atol=1e-15) and torch.allclose(k * s, sig, atol=1e-15)
    kv = level_scale(s, "ve")
    assert torch.allclose(kv * (1 - s), torch.ones(3, dtype=torch.float64)) and torch.allclose(kv * s, s / (1 - s))


def test_a_parametrised_network_is_the_velocity_it_wraps():
    # the mixture's exact epsilon in VP coordinates, behind the adapter, gives back the mixture's velocity
    gmm = GaussianMixture(dim=6, components=3, layout_seed=2)
    s_grid = torch.tensor([0.9, 0.5, 0.2, 0.0], dtype=torch.float64)
    steps = torch.tensor([900, 500, 200])

    def eps_net(y, t):
        idx = torch.tensor([int((steps == ti).nonzero()[0, 0]) for ti in t])
        s = s_grid[idx]
        x = y / level_scale(s, "vp")[:, None]
        return from_velocity(gmm(x, s), x, s, "epsilon", "vp")

    model = Parametrised(eps_net, "eps", "vp", (6,), torch.float64, time=GridTimesteps(s_grid, steps))
    x = torch.randn(3, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    s = s_grid[:3]
    assert torch.allclose(model(x, s), gmm(x, s), rtol=1e-10, atol=1e-10)
    with pytest.raises(ValueError, match="not a level of this grid"):
        model(x, torch.tensor([0.9, 0.5, 0.3], dtype=torch.float64))


def test_a_prediction_the_coordinates_lack_is_refused():
    with pytest.raises(
        ConfigError, match="prediction_type='flow' is invalid for vp coordinates: supported are epsilon"
    ):
        Parametrised(lambda y, t: y, "flow", "vp", (2,), torch.float32)
    with pytest.raises(ConfigError, match="coordinates='edm' is invalid"):
        Parametrised(lambda y, t: y, "epsilon", "edm", (2,), torch.float32)


class _Conditional:
    """A velocity that depends on a class label: the mixture plus a label-sized offset."""

    event_shape, dtype = (4,), torch.float64

    def __init__(self):
        self.gmm = GaussianMixture(dim=4, components=2, layout_seed=3)
        self.rows = 0

    def __call__(self, x, sigma, label):
        self.rows += x.shape[0]
        return self.gmm(x, sigma) + 0.1 * label[:, None].to(x.dtype)


def test_guidance_is_one_call_of_twice_the_rows_and_counts_them():
    # w = 3 on 5 trajectories, T = 8: target_rows doubles in both samplers; w = 1 is the model alone
    base = _Conditional()
    guided = Guided(base, 3.0, torch.zeros(1, dtype=torch.long), cond_key="label")
    x = torch.randn(5, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    sig = torch.full((5,), 0.5, dtype=torch.float64)
    lab = torch.arange(5)
    v = guided(x, sig, label=lab)
    want = base(x, sig, label=torch.zeros(5, dtype=torch.long)) + 3.0 * 0.1 * lab[:, None].double()
    assert torch.allclose(v, want, atol=1e-12)
    sch = Schedule.make(8, 0.5)
    cond = {"label": lab}
    std = sample_standard(guided, sch, 5, cond=cond)
    assert std.target_rows.tolist() == [2 * 6] * 5
    # the same velocity declaring two rows per state: the same samples, target_rows exactly doubled
    doubled = _Conditional()
    doubled.rows_per_state = 2
    one = sample_speculative(_Conditional(), sch, DraftTree.uniform(2, 2), "dgrs", 5, cond=cond)
    two = sample_speculative(doubled, sch, DraftTree.uniform(2, 2), "dgrs", 5, cond=cond)
    assert torch.equal(one.samples, two.samples) and torch.equal(two.target_rows, 2 * one.target_rows)
    assert Guided(base, 1.0, torch.zeros(1, dtype=torch.long), cond_key="label").rows_per_state == 1
