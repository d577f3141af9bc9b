"""The coupling example of ``docs/extending.md`` ("A coupling") runs as written and passes
:func:`specsamp.testing.check_exactness` (K = 3, d = 16, float64, deltas 0, 0.7, 3, 300; seed 1234,
n = 3000, KS p > 1e-4); its positional theory is the acceptance it measures."""

from __future__ import annotations

import re

import pytest
import torch
from helpers import ROOT

from specsamp import coupling as cp
from specsamp.models import GaussianMixture
from specsamp.sampler import sample_speculative
from specsamp.schedule import Schedule
from specsamp.testing import check_exactness
from specsamp.trees import DraftTree

DOC = ROOT / "docs" / "extending.md"


@pytest.fixture()
def mine():
    text = DOC.read_text()
    section = text[text.index("## A coupling") :]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    try:
        ns: dict = {}
        exec(compile(code, "extending.md", "exec"), ns)  # registers "mine"
        yield ns["mine"]
    finally:
        cp.COUPLINGS._entries.pop("mine", None)  # the registry has no public removal


def test_readme_coupling_is_exact(mine):
    check_exactness(mine, deltas=(0.0, 0.7, 3.0, 300.0), Ks=(3,), dtypes=(torch.float64,), dim=16).raise_if_failed()


def test_readme_coupling_runs_in_the_sampler(mine):
    model = GaussianMixture(dim=8, components=3, layout_seed=1)
    res = sample_speculative(model, Schedule.make(8, 0.3), DraftTree.uniform(2, 2), "mine", seed=0, n_samples=4)
    assert res.samples.shape == (4, 8) and bool(torch.isfinite(res.samples).all())


def test_readme_coupling_theory_is_its_acceptance(mine):
    """``positional`` against the rule's measured acceptance of the first child (and none other):
    delta = 1, K = 3, 20,000 rows, seed 7; 5 standard errors (sqrt(p (1 - p) / n) <= 0.0036)."""
    n, d = 20_000, 4
    g = torch.Generator().manual_seed(7)
    mean_p = torch.zeros(n, d, dtype=torch.float64)
    mean_q = mean_p.clone()
    mean_q[:, 0] = 1.0  # delta = 1 at sigma = 1
    children = torch.randn(n, 3, d, generator=g, dtype=torch.float64)
    verdict = mine(children, mean_p, mean_q, 1.0, g)
    rate = [float((verdict.index == k).double().mean()) for k in range(3)]
    theory = mine.positional(1.0, 3)
    assert abs(rate[0] - theory[0]) < 5 * 0.0036 and rate[1:] == [0.0, 0.0] and list(theory[1:]) == [0.0, 0.0]


def test_a_coupling_that_returns_nothing_is_named():
    def broken(children, mean_p, mean_q, sigma, generator=None):
        return None

    with pytest.raises(TypeError, match="must return a specsamp.coupling.Verdict"):
        sample_speculative(
            GaussianMixture(dim=8, components=3, layout_seed=1),
            Schedule.make(8, 0.3),
            DraftTree.uniform(2, 2),
            broken,
            seed=0,
            n_samples=2,
        )
