"""The README's "Adding a coupling" example runs as written and is exact (seed 0, n=3000, KS p > 1e-4)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from helpers import law_pvalues
from specsamp import coupling as cp
from specsamp.models import GaussianMixture
from specsamp.sampler import sample_speculative
from specsamp.schedule import Schedule
from specsamp.trees import DraftTree

README = Path(__file__).resolve().parents[1] / "README.md"


@pytest.fixture()
def mine():
    text = README.read_text()
    section = text[text.index("## Adding a coupling"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    try:
        ns: dict = {}
        exec(compile(code, "README.md", "exec"), ns)  # registers "mine"
        yield ns["mine"]
    finally:
        cp.COUPLINGS.pop("mine", None)


@pytest.mark.parametrize("delta", [0.0, 0.7, 3.0, 300.0])
def test_readme_coupling_is_exact(mine, delta):
    n, d = 3000, 16
    g = torch.Generator().manual_seed(0)
    mean_p = torch.zeros(n, d, dtype=torch.float64)
    e = torch.zeros(d, dtype=torch.float64)
    e[0] = 1.0
    mean_q = mean_p + delta * e
    children = mean_p[:, None] + torch.randn(n, 3, d, generator=g, dtype=torch.float64)
    v = mine(children, mean_p, mean_q, 1.0, g)
    assert v.sample.shape == (n, d) and v.accepted.dtype == torch.bool
    assert torch.equal(v.sample[v.accepted], children[v.accepted, 0])
    assert min(law_pvalues(v.sample, mean_q, 1.0, e).values()) > 1e-4


def test_readme_coupling_runs_in_the_sampler(mine):
    model = GaussianMixture(dim=8, components=3, layout_seed=1)
    res = sample_speculative(model, Schedule.make(8, 0.3), DraftTree.uniform(2, 2), "mine", seed=0, n_samples=4)
    assert res.samples.shape == (4, 8) and bool(torch.isfinite(res.samples).all())


def test_a_coupling_that_returns_nothing_is_named():
    def broken(children, mean_p, mean_q, sigma, generator=None):
        return None

    with pytest.raises(TypeError, match="must return a specsamp.coupling.Verdict"):
        sample_speculative(GaussianMixture(dim=8, components=3, layout_seed=1), Schedule.make(8, 0.3), DraftTree.uniform(2, 2), broken, seed=0, n_samples=2)
