"""The choice of round for time: priced from a cost curve, a host cost and a displacement profile; never the loop's
loser by its own prediction."""

from __future__ import annotations

import pytest

from specsamp.auto import HostCost, choose, loop_option, options_at
from specsamp.cost import call_cost_from
from specsamp.profiles import profile_positional
from specsamp.theory import expected_steps

FLAT = call_cost_from({1: 5.0, 64: 5.0})  # a GPU below its knee: 5 ms whatever the rows
LINEAR = call_cost_from({1: 1.0, 64: 64.0})  # rows cost alike: 1 ms each
NO_HOST = HostCost(0.0, 0.0, 0.0)


def test_an_option_is_priced_as_its_expected_steps_over_its_call_and_host_time():
    host = HostCost(1e-3, 1e-5, 2e-4)
    opts = options_at([0.3], FLAT, host, max_depth=10, budgets=(4,))
    loop, chain, tree = opts
    assert loop.name == "loop" and loop.steps == 1 and loop.seconds == pytest.approx(5e-3 + 2e-4)
    assert chain.name == "rmc chain 4" and chain.rows == 4
    assert chain.steps == pytest.approx(expected_steps(chain.tree, profile_positional([0.3], "rmc")))
    assert chain.seconds == pytest.approx(5e-3 + 1e-3 + 4e-5)
    assert tree.coupling == "dgrs" and tree.rows <= 4 and tree.rate == tree.steps / tree.seconds
    assert options_at([0.3], FLAT, host, max_depth=2, budgets=(8,))[1].rows == 2  # no deeper than the steps left


def test_a_flat_call_and_high_acceptance_choose_speculation_with_long_rounds():
    plan = choose([[0.05]] * 30, FLAT, NO_HOST)
    assert not plan.use_loop and plan.speedup() > 5
    assert plan.by_root[0].rows >= 20 and plan.tree(1) is plan.by_root[0].tree
    # a tree deeper than the steps left is priced as the sampler cuts it, and kept whole (one tree's tables)
    assert all(o.steps <= 30 - i + 1 for i, o in enumerate(plan.by_root))
    assert len({id(o.tree) for o in plan.by_root}) <= 4
    s = plan.summary()
    assert (
        s["choice"] == plan.coupling
        and s["predicted_speedup"] > 5
        and s["by_root"][0][1] == 1
        and s["by_root"][-1][2] == 30
    )


def test_an_expensive_round_or_low_acceptance_keeps_the_plain_loop():
    assert choose([[0.3]] * 20, LINEAR, HostCost(20e-3, 0.0, 0.0)).use_loop  # a round's host work dwarfs a call
    plan = choose([[8.0]] * 20, LINEAR, NO_HOST)  # nothing is accepted: a round commits one step, like the loop
    assert plan.use_loop and plan.speedup() == 1.0 and plan.by_root == []
    assert plan.summary()["choice"] == "loop"


@pytest.mark.parametrize("delta", [0.05, 0.5, 2.0])
@pytest.mark.parametrize("curve", [FLAT, LINEAR])
def test_the_plan_never_predicts_less_than_the_loop(delta, curve):
    plan = choose([[delta]] * 12, curve, HostCost())
    assert plan.predicted_rate() >= loop_option(curve, HostCost()).rate
    assert plan.rates["loop"] == pytest.approx(plan.loop.rate)


def test_an_empty_profile_is_refused():
    with pytest.raises(ValueError, match="deltas_by_root is empty"):
        choose([], FLAT)
