"""``auto`` as it runs: the choice's law in both executions, what it records and caches, its refusals, and the same
samples as the sampler it chose."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import MODEL, N_SPEC, P_MIN, SCHED, law_pvalues, law_reference

from specsamp.auto import HostCost
from specsamp.autosample import AutoCache, plan_auto, sample_auto
from specsamp.errors import ConfigError
from specsamp.hostcost import measure_host_cost
from specsamp.sampler import sample_speculative, sample_standard
from specsamp.schedule import Schedule

FLAT = {1: 5.0, 4096: 5.0}  # a device below its knee: every call 5 ms, whatever its rows
NO_HOST = HostCost(0.0, 0.0, 0.0)
# displacement per root step 1 .. 6, then per depth: the trees differ from root to root
PROFILE = [[0.2, 0.4, 0.8], [0.3, 0.5, 0.9], [0.6, 1.0, 1.5], [1.5, 2.0, 2.5], [0.1, 0.2, 0.3], [0.2, 0.3, 0.4]]


class Counted:
    """The mixture, counting its calls."""

    def __init__(self, model):
        self.model, self.event_shape, self.dtype, self.calls = model, model.event_shape, model.dtype, 0

    def __call__(self, x, sigma, **cond):
        self.calls += 1
        return self.model(x, sigma)


@pytest.fixture(scope="module")
def reference():
    return law_reference()


def _choice(coupling: str, **kw):
    return plan_auto(
        MODEL,
        SCHED,
        N_SPEC,
        call_cost=FLAT,
        host_cost=NO_HOST,
        delta_profile=PROFILE,
        couplings=(coupling,),
        cache=AutoCache(),
        **kw,
    )


@pytest.mark.parametrize("coupling", ["dgrs", "rmc"])
def test_the_chosen_trees_keep_the_law_in_both_executions_with_the_same_counts(coupling, reference):
    """Seed 31, 2000 trajectories, the plan's trees per root (which differ across roots); against the standard
    sampler's 4000 (seed 10000): KS on 3 projections and the chi-square of the components, each p > 1e-3."""
    choice = _choice(coupling)
    assert choice.plan.coupling == coupling and len({o.name for o in choice.plan.by_root}) > 1
    res = sample_auto(
        MODEL,
        SCHED,
        N_SPEC,
        seed=31,
        call_cost=FLAT,
        host_cost=NO_HOST,
        delta_profile=PROFILE,
        couplings=(coupling,),
        cache=AutoCache(),
    )
    assert res.extra["auto"]["choice"] == coupling
    p = law_pvalues(res.samples, reference)
    assert min(p) > P_MIN, p
    path = sample_speculative(MODEL, SCHED, choice.tree_rule(), coupling, N_SPEC, seed=31, execution="path")
    for name in ("nfe", "target_rows", "accepts", "attempts"):
        assert torch.equal(getattr(res, name), getattr(path, name)), name
    assert (res.accepts < res.attempts).any()  # residuals were drawn


def test_the_law_test_rejects_a_wrong_churn_on_the_same_trees(reference):
    """Power check of the statistic above: the chosen trees on a grid with churn 0.4 in place of 1 (seed 32, 2000
    trajectories) are rejected, p < 1e-6."""
    wrong = Schedule.make(8, 0.4)
    choice = _choice("dgrs")
    r = sample_speculative(MODEL, wrong, choice.tree_rule(), "dgrs", N_SPEC, seed=32, execution="tree")
    assert min(law_pvalues(r.samples, reference)) < 1e-6


def test_the_loop_choice_is_the_standard_sampler_bit_for_bit():
    res = sample_auto(MODEL, SCHED, 16, seed=5, call_cost={1: 1.0, 64: 64.0}, host_cost=HostCost(0.05, 0, 0),
                      delta_profile=[2.0], cache=AutoCache())  # fmt: skip
    a = res.extra["auto"]
    assert a["choice"] == "loop" and a["predicted_speedup"] == 1.0 and a["by_root"] == []
    assert torch.equal(res.samples, sample_standard(MODEL, SCHED, 16, seed=5).samples)


def test_a_speculative_choice_is_that_sampler_on_those_trees_bit_for_bit():
    res = sample_auto(MODEL, SCHED, 8, seed=6, call_cost=FLAT, host_cost=NO_HOST, delta_profile=PROFILE,
                      cache=AutoCache())  # fmt: skip
    choice = _choice(res.extra["auto"]["choice"])
    ref = sample_speculative(MODEL, SCHED, choice.tree_rule(), choice.plan.coupling, 8, seed=6, execution="tree")
    assert torch.equal(res.samples, ref.samples) and torch.equal(res.nfe, ref.nfe)


def test_the_first_run_measures_and_pilots_and_the_second_reuses_and_the_file_keeps_them(tmp_path):
    model = Counted(MODEL)
    cache = AutoCache(tmp_path)
    first = sample_auto(model, SCHED, 2, seed=1, cache=cache).extra["auto"]
    assert first["curve_source"] == "measured" and first["profile_source"] == "pilot"
    assert first["pilot"]["trajectories"] == 4 and first["pilot"]["calls"] > 0
    assert first["call_cost"]["rows"][0] == 2 and first["call_cost"]["source"] == "measured"
    assert set(first) >= {"choice", "rates", "by_root", "host_cost_ms", "predicted_seconds", "realised_seconds"}
    calls = model.calls
    second = sample_auto(model, SCHED, 2, seed=2, cache=cache).extra["auto"]
    assert second["curve_source"] == "cached" and second["profile_source"] == "cached" and second["pilot"] is None
    assert model.calls - calls <= SCHED.steps  # the run alone: nothing measured again
    again = AutoCache(tmp_path)  # a later process
    assert again.profiles and again.hosts and again.costs.curves
    assert json.loads((tmp_path / "profiles.json").read_text())["profiles"]


def test_the_plan_reads_no_draw_of_the_run():
    """With the curve, host cost and profile given, the plan is the same whatever the run's seed or trajectories."""
    a = plan_auto(MODEL, SCHED, 4, seed=1, call_cost=FLAT, host_cost=NO_HOST, delta_profile=PROFILE, cache=AutoCache())
    b = plan_auto(MODEL, SCHED, 4, seed=9, call_cost=FLAT, host_cost=NO_HOST, delta_profile=PROFILE, cache=AutoCache())
    assert [o.name for o in a.plan.by_root] == [o.name for o in b.plan.by_root]


@pytest.mark.parametrize(
    "kw,name",
    [
        ({"call_cost": {0: 1.0}}, "call_cost"),
        ({"call_cost": "fast"}, "call_cost"),
        ({"host_cost": 3.0}, "host_cost"),
        ({"pilot": 0}, "pilot"),
        ({"couplings": ["markmax"]}, "couplings"),
        ({"budgets": []}, "budgets"),
        ({"margin": -1}, "margin"),
        ({"delta_profile": [[-1.0]]}, "delta_profile"),
        ({"delta_profile": [[0.1]] * 3}, "delta_profile"),
        ({"cache": "here"}, "cache"),
        ({"compile": "yes"}, "compile"),
        ({"generator": 1}, "generator"),
    ],
)
def test_bad_arguments_are_refused_by_name_before_any_call(kw, name):
    model = Counted(MODEL)
    with pytest.raises(ConfigError) as e:
        sample_auto(model, SCHED, 2, **{"cache": AutoCache(), **kw})
    assert name in str(e.value) and "\n" not in str(e.value)
    assert model.calls == 0


def test_the_host_cost_is_measured_on_a_network_that_costs_nothing():
    h = measure_host_cost(SCHED, MODEL.event_shape, MODEL.dtype, "cpu", 2, events=4)
    assert h.fixed >= 0 and h.per_row >= 0 and h.loop_step > 0 and h(32) >= h(4)


def test_a_model_too_large_for_any_round_runs_the_loop_without_measuring():
    from specsamp.memory import available_bytes

    model = Counted(MODEL)
    model.row_bytes = int(0.3 * available_bytes("cpu"))  # the loop's 2 rows fit, a round's 4 do not
    res = sample_auto(model, SCHED, 2, seed=0, cache=AutoCache())
    assert res.extra["auto"]["choice"] == "loop" and res.extra["auto"]["curve_source"] == "none"
    assert model.calls == SCHED.steps  # the loop's calls alone


def test_the_pilot_shrinks_to_what_the_memory_admits():
    from specsamp.autosample import _pilot_size

    model = Counted(MODEL)
    assert _pilot_size(4, 32, model, SCHED, None) == (4, 6)  # the chain is cut at T - 2 = 6
    model.row_bytes = 2**40
    assert _pilot_size(4, 32, model, SCHED, None) == (0, 0)
