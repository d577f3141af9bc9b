"""The sampler's run-time contract check (``check_contract``): an accepted verdict must be the child its index names.

Setup: ``GaussianMixture(dim=4, components=3, layout_seed=1)``, ``Schedule.make(8, 1.0)`` (acceptance about
0.4-0.75 per depth, so accepts and rejects both occur in the first rounds), 8 trajectories, seed 0. The lying
couplings below are defined here, outside the library, so the check is on by default for them.
"""

from __future__ import annotations

import pytest
import torch
from helpers import ROWWISE

from specsamp.coupling import Verdict, dgrs
from specsamp.models import GaussianMixture
from specsamp.runner import compose, run_config
from specsamp.sampler import ContractError, sample_speculative
from specsamp.schedule import Schedule
from specsamp.trees import DraftTree

MODEL = GaussianMixture(dim=4, components=3, layout_seed=1)
SCHED = Schedule.make(8, 1.0)
TREE = DraftTree.uniform(2, 3)


def shifted_accept(children, mean_p, mean_q, sigma, generator=None):
    """D-GRS, but an accepted sample is moved by 1e-6 (no longer the child its index names)."""
    v = dgrs(children, mean_p, mean_q, sigma, generator)
    moved = v.sample + 1e-6 * v.accepted.reshape(-1, *([1] * (v.sample.ndim - 1)))
    return Verdict(moved, v.accepted, v.index)


def wrong_index(children, mean_p, mean_q, sigma, generator=None):
    """D-GRS, but an accept is reported with index K (the residual's index)."""
    v = dgrs(children, mean_p, mean_q, sigma, generator)
    return Verdict(v.sample, v.accepted, torch.where(v.accepted, torch.full_like(v.index, children.shape[1]), v.index))


def honest(children, mean_p, mean_q, sigma, generator=None):
    return dgrs(children, mean_p, mean_q, sigma, generator)


@pytest.mark.parametrize("execution", ["tree", "path"])
@pytest.mark.parametrize("liar", [shifted_accept, wrong_index])
def test_a_lying_coupling_raises_naming_coupling_step_and_node(execution, liar):
    with pytest.raises(
        ContractError,
        match=rf"coupling '{liar.__name__}' broke its contract at trajectory \d+, step \d+, "
        r"node \d+ \(depth \d\)",
    ):
        sample_speculative(MODEL, SCHED, TREE, liar, 8, execution=execution, seed=0)


@pytest.mark.parametrize("execution", ["tree", "path"])
def test_check_off_runs_the_liar_silently_and_an_honest_outside_rule_passes(execution):
    sample_speculative(MODEL, SCHED, TREE, shifted_accept, 8, execution=execution, seed=0, check_contract=False)
    a = sample_speculative(MODEL, SCHED, TREE, honest, 8, execution=execution, seed=0)  # checked by default
    b = sample_speculative(MODEL, SCHED, TREE, "dgrs", 8, execution=execution, seed=0)  # the library's: not checked
    assert torch.equal(a.nfe, b.nfe) and torch.equal(a.committed, b.committed) and torch.equal(a.samples, b.samples)


def test_library_couplings_can_be_checked_on_demand():
    a = sample_speculative(MODEL, SCHED, TREE, "dgrs", 8, execution="tree", seed=0, check_contract=True)
    b = sample_speculative(MODEL, SCHED, DraftTree.chain(3), "rmc", 8, execution="tree", seed=0, check_contract=True)
    assert int(a.nfe.sum()) > 0 and int(b.nfe.sum()) > 0


def test_config_key_check_contract(tmp_path):
    base = ["model=gmm", "model.dim=4", "steps=8", "n_samples=4", "progress=false", f"hydra.run.dir={tmp_path}"]
    for value in ("auto", "true", "false"):
        rec, _ = run_config(compose([*base, "sampler=dgrs", "K=2", "L=2", "execution=tree", f"check_contract={value}"]))
        assert rec["status"] == "ok"


def _per_step(n):
    return [DraftTree.uniform(2, 3), DraftTree.chain(3)][n % 2]


@pytest.mark.parametrize("liar", [shifted_accept, wrong_index])
def test_a_lying_coupling_raises_with_a_tree_per_step(liar):
    # the dense round of step-dependent trees flags the broken verdict and repeats the round with the
    # per-root reference rounds, which raise naming coupling, trajectory, step and node
    with pytest.raises(
        ContractError,
        match=rf"coupling '{liar.__name__}' broke its contract at trajectory \d+, step \d+, "
        r"node \d+ \(depth \d\)",
    ):
        sample_speculative(MODEL, SCHED, _per_step, liar, 8, execution="tree", seed=0, draft="x0_extrap_gated")
    # against the path execution, bitwise: a target evaluated row by row (the executions batch a node differently)
    a = sample_speculative(ROWWISE, SCHED, _per_step, honest, 8, execution="tree", seed=0, draft="x0_extrap_gated")
    b = sample_speculative(ROWWISE, SCHED, _per_step, "dgrs", 8, execution="path", seed=0, draft="x0_extrap_gated")
    assert torch.equal(a.nfe, b.nfe) and torch.equal(a.committed, b.committed) and torch.equal(a.samples, b.samples)
