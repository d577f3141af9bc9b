"""The call-cost curve: measured with a simulated clock (deterministic), interpolated, given by a user, cached."""

from __future__ import annotations

import json

import pytest
import torch

from specsamp.cost import CallCost, CostCache, call_cost_from, cost_key, measure_call_cost
from specsamp.errors import ConfigError


class SimulatedNet:
    """A network whose call of ``r`` rows advances a simulated clock by ``fixed + per_row * max(r - knee, 0)``
    seconds (a device flat up to its knee, then a cost per row); the first call of each row count costs ``warm``
    more (what a warm-up absorbs)."""

    def __init__(self, fixed=1e-3, per_row=5e-4, knee=8, warm=0.05):
        self.t, self.fixed, self.per_row, self.knee, self.warm = 0.0, fixed, per_row, knee, warm
        self.seen, self.calls = set(), []

    def clock(self) -> float:
        return self.t

    def cost(self, r: int) -> float:
        return self.fixed + self.per_row * max(r - self.knee, 0)

    def __call__(self, x, sigma, **cond):
        r = x.shape[0]
        assert sigma.shape == (r,) and all(v.shape[0] == r for v in cond.values())
        self.calls.append(r)
        self.t += self.cost(r) + (self.warm if r not in self.seen else 0.0)
        self.seen.add(r)
        return x


def test_measured_curve_is_the_devices_cost_after_warm_up_and_interpolates_between_points():
    net = SimulatedNet()
    c = measure_call_cost(net, (3, 4), cond={"y": torch.arange(5)}, clock=net.clock)
    assert c.rows == (1, 2, 4, 8, 16, 32, 64) and c.source == "measured" and c.device == "cpu"
    for r, s in zip(c.rows, c.seconds):
        assert s == pytest.approx(net.cost(r), rel=1e-9)  # warm-up costs are not in the medians
    assert c(12) == pytest.approx(net.cost(12)) and c(0.5) == c.seconds[0]
    assert c(128) == pytest.approx(net.cost(128))  # past the last point: the last segment's cost per row
    assert c.knee() == 8
    assert len(net.calls) == 7 * 4  # one warm-up and three timed calls per row count
    assert net.calls[7:14] == list(c.rows)  # interleaved: every row count in turn, per repeat


def test_measurement_stops_at_max_rows_at_a_slow_call_and_within_its_budget_of_calls():
    net = SimulatedNet()
    assert measure_call_cost(net, (2,), max_rows=10, clock=net.clock).rows == (1, 2, 4, 8)
    net = SimulatedNet(per_row=0.02, warm=0.0)  # a call of 64 rows takes 1.1 s: the growth stops there
    assert measure_call_cost(net, (2,), clock=net.clock, max_call_seconds=0.5).rows[-1] == 64
    assert measure_call_cost(net, (2,), clock=net.clock, max_call_seconds=0.2).rows[-1] == 32
    net = SimulatedNet()
    assert measure_call_cost(net, (2,), clock=net.clock, max_calls=12).rows == (1, 2, 4)
    assert len(net.calls) == 12


def test_a_given_curve_reads_in_milliseconds_and_bad_ones_name_the_argument():
    c = call_cost_from({1: 1.6, 15: 3.2, 62: 10.0})
    assert c.rows == (1, 15, 62) and c.seconds == pytest.approx((1.6e-3, 3.2e-3, 10e-3)) and c.source == "given"
    assert call_cost_from([(4, 2.0), (1, 1.0)]).rows == (1, 4)
    assert call_cost_from(c.as_dict()).seconds == pytest.approx(c.seconds)
    for bad, why in [
        ({}, "at least one point"),
        ({0: 1.0}, "rows=0 must be an integer >= 1"),
        ({1: -1.0}, "the cost -1.0 at rows=1"),
        ({1: float("nan")}, "the cost nan at rows=1"),
        ([(1, 1.0), (1, 2.0)], "a row count appears twice"),
        ("fast", "must be a mapping"),
    ]:
        with pytest.raises(ConfigError, match="call_cost=.* is invalid: .*" + why.replace("(", r"\(")):
            call_cost_from(bad)


def test_the_cache_reuses_a_curve_in_the_process_and_from_its_file(tmp_path):
    path = tmp_path / "costs.json"
    key = cost_key("digits", "cpu", torch.float32, (1, 8, 8))
    assert key == "digits|cpu|float32|1x8x8"
    measured = []

    def measure():
        measured.append(1)
        return CallCost((1, 8), (1e-3, 2e-3), "measured", "cpu")

    cache = CostCache(path)
    first = cache.curve(key, measure)
    assert cache.curve(key, measure) is first and len(measured) == 1
    again = CostCache(path).curve(key, measure)  # a second run: read from the file, not measured
    assert len(measured) == 1 and again.seconds == pytest.approx(first.seconds) and again.source == "measured"
    assert json.loads(path.read_text())[key]["ms"] == [1.0, 2.0]
    path.write_text("{not json")
    assert CostCache(path).get(key) is None  # an unreadable cache is a miss, never an error
