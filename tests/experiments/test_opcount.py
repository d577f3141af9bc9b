"""Load-free cost of a sampler round (benchmarks.opcount): ATen operations and host syncs, counted.

The counts are deterministic for a configuration, a seed and a torch version (no timing), so they are
asserted exactly against the targets of the dense round: on the trained digits network at one
trajectory, every arm's round (outside the network, its coupling calls included) makes at most one host
synchronisation, D-GRS (2,3) costs at most 300 ATen operations per round and the x0 draft with the
optimal B=14 tree at most 400. The arms include ``x0_extrap_gated`` with a tree per root step (a draft with
history, step-dependent trees), which the dense round serves too, and the markmax rule on the (2, 3) tree.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks import opcount
from specsamp import inductor

DIGITS_ARMS = ["dgrs 2x3", "dgrs 2x5", "rmc chain14", "rmc chain62", "x0+optimal B14", "x0+optimal B62"]
# counted in the slow test below (about 9 s and 23 s of counting); the default run keeps markmax's no-sync
# guard in tests/core/test_listcoupling.py::test_static_path_asks_the_host_nothing
SLOW_ARMS = ["x0g+per-step B14", "markmax 2x3"]


@pytest.fixture(scope="module")
def digits_rows():
    return {r["arm"]: r for r in opcount.table_rows(("digits",), (1,), ["standard", *DIGITS_ARMS], progress=None)}


def test_counter_sees_ops_syncs_and_regions():
    t = torch.arange(6.0)
    with opcount.counting() as c:
        u = t * 2 + 1
        float(u.sum())  # _local_scalar_dense
        u[u > 3]  # boolean mask: nonzero
        torch.nonzero(u)
        u.tolist()
        torch.unique(u)
    assert c.syncs["round"] == 5, dict(c.by_op)
    assert c.ops["round"] >= 8 and c.ops["coupling"] == 0 and c.network_calls == 0


@pytest.mark.parametrize("inference", [False, True])
def test_counter_sees_syncs_under_inference_mode(inference):
    # the samplers run under torch.inference_mode, where item(), bool(), nonzero(as_tuple=True), argwhere and
    # torch.where(condition) reach the dispatcher undecomposed: each still counts once (and a 3-argument where not)
    with torch.inference_mode(inference):
        t = torch.arange(6.0)
        m = t > 2
        with opcount.counting() as c:
            t[0].item()
            bool(m.any())
            m.nonzero(as_tuple=True)
            torch.argwhere(m)
            torch.where(m)
            torch.where(m, t, 0.0)
    assert c.syncs["round"] == 5, dict(c.by_op)


def test_every_arm_syncs_at_most_once_per_round(digits_rows):
    # the coupling included: every rule, markmax too, asks the host nothing inside the dense round
    for arm in DIGITS_ARMS:
        assert digits_rows[arm]["syncs_round"] + digits_rows[arm]["syncs_coupling"] <= 1.0, (arm, digits_rows[arm])
    assert digits_rows["standard"]["syncs_round"] == 0


def test_one_time_tables_are_counted_apart():
    # markmax's share table is built once per process on first use: its operations go to the setup region (here
    # K = 3, built by this test unless an earlier one did), never to the round or the coupling
    from specsamp import markmax_params

    markmax_params._SHARE_TABLES.pop((3, "cpu"), None)
    with opcount.counting() as c:
        markmax_params.share_table(3, "cpu")
    assert c.ops["setup"] > 1000 and c.ops["round"] == 0 and c.ops["coupling"] == 0, dict(c.ops)


def test_round_ops_targets(digits_rows):
    assert digits_rows["dgrs 2x3"]["ops_round"] <= 300, digits_rows["dgrs 2x3"]
    assert digits_rows["x0+optimal B14"]["ops_round"] <= 400, digits_rows["x0+optimal B14"]
    # the dense round (not the layer-by-layer reference) ran: the ops outside the network stay within
    # a few times the standard sampler's per step, whatever the budget (8 x 110, the standard step's cost when it
    # computed its coefficients per call; gathered from the kernel's table it costs 73)
    step = max(digits_rows["standard"]["ops_round"], 110)
    assert digits_rows["x0+optimal B62"]["ops_round"] <= 8 * step


@pytest.mark.slow
def test_slow_arms_sync_once_and_keep_their_pins():
    # the arms left out of the default run: x0_extrap_gated with a tree per root step and markmax (2, 3)
    rows = {r["arm"]: r for r in opcount.table_rows(("digits",), (1,), ["standard", *SLOW_ARMS], progress=None)}
    for arm in SLOW_ARMS:
        assert rows[arm]["syncs_round"] + rows[arm]["syncs_coupling"] <= 1.0, (arm, rows[arm])
    # the general lever (a draft with history, a tree per root step): the dense round, not the reference
    step = max(rows["standard"]["ops_round"], 110)
    assert rows["x0g+per-step B14"]["ops_round"] <= 8 * step
    test_round_and_coupling_ops_pinned(rows)


def test_round_and_coupling_ops_pinned(digits_rows):
    # what the dense round costs today with torch's dispatch of this version (round, coupling): a regression
    # guard. The targets (round + coupling <= 300 for D-GRS (2,3), <= 400 for x0 + optimal B=14) are not met:
    # drafting layer by layer (about 9 operations per layer for x0) and the residual sampler (about 110 per
    # coupling call) keep the bits, and are most of what is left; markmax: every row through both rules and both
    # residual branches with fixed-step bisections, the price of asking the host nothing (13.8k, where its
    # per-row branches and on-demand bin shares cost about 45k and 13 syncs per round). Counted under
    # torch.inference_mode, where the samplers run: there composite calls (reshape, to, conv2d, &) reach the
    # counter as themselves rather than as what they decompose into, and a no-op .to(dtype) is seen, so the same
    # round counts 2-10 more than it did with autograd's bookkeeping on (dgrs 2x3: 185 + 211 then)
    # (the couplings' counts rose by 45 per D-GRS call, 216 to 261 for dgrs 2x3, and markmax's 13.8k to 15.5k, when the
    # residual's grid and logaddexp became elementwise so that each row rounds the same in any batch)
    pins = {
        "dgrs 2x3": (189, 261),
        "x0+optimal B14": (319, 241),
        "rmc chain14": (271, 68),
        "x0g+per-step B14": (590, 375),
        "markmax 2x3": (189, 15525),
    }
    for arm, (ops_round, ops_coupling) in pins.items():
        if arm not in digits_rows:
            continue  # a slow arm: pinned in test_slow_arms_sync_once_and_keep_their_pins
        assert digits_rows[arm]["ops_round"] <= ops_round, digits_rows[arm]
        assert digits_rows[arm]["ops_coupling"] <= ops_coupling, digits_rows[arm]


def test_random_numbers_are_drawn_once_per_run_not_per_round():
    # where the tables are small, a run draws every (row, root, node) draft noise and coupling uniform once:
    # the coupling hashes no key and the rounds draw no normals (a normal draw is one cos per block of keys)
    r = opcount.count_config(opcount.arm_overrides("digits", "dgrs 2x3", 1))
    by_op = r["counts"].by_op
    hashing = ("bitwise_xor", "bitwise_right_shift")
    assert not any(reg == "coupling" and op.startswith(hashing) for reg, op in by_op), dict(by_op)
    assert by_op[("round", "cos")] < r["rounds"] / 4, (by_op[("round", "cos")], r["rounds"])


def test_chain_cost_grows_by_a_few_ops_per_drafted_layer(digits_rows):
    # drafting stays layer by layer (the path execution's operations, so both draw the same bits):
    # each further layer of the chain costs at most 7 operations (the draft's mean, the add of the noise)
    extra = digits_rows["rmc chain62"]["ops_round"] - digits_rows["rmc chain14"]["ops_round"]
    assert 0 < extra <= 7 * (62 - 14), extra


@pytest.mark.xfail(
    strict=True,
    reason="layer-by-layer drafting with the path's operations costs ~6 ops per layer; "
    "bit-equal tree and path states (tested in test_sampler) rule out a one-product draft",
)
def test_chain62_within_one_and_a_half_chain14(digits_rows):
    assert digits_rows["rmc chain62"]["ops_round"] <= 1.5 * digits_rows["rmc chain14"]["ops_round"]


def test_profiler_counter_agrees_with_the_dispatch_counter_on_an_eager_round(digits_rows):
    # counting_compiled reads torch.profiler's record (ATen calls from Python, outside the network range):
    # on an eager run it counts what the dispatch counter counts (round + coupling) to within 5% (measured
    # +2.0% to +2.2%: the profiler records a composite call such as reshape once where the dispatch mode sees
    # what it decomposes into), the network's calls to within one operation each, and the same one sync per round
    ov = opcount.arm_overrides("digits", "dgrs 2x3", 1)
    ref = digits_rows["dgrs 2x3"]  # the same overrides, counted by the dispatch counter
    got = opcount.count_config(ov, profiler=True)
    dispatch = ref["ops_round"] + ref["ops_coupling"]
    assert dispatch <= got["ops_round"] <= 1.05 * dispatch, (got["ops_round"], dispatch)
    assert abs(got["ops_network_call"] - ref["ops_network_call"]) <= 1.0
    assert got["syncs_round"] == ref["syncs_round"] and got["network_calls"] == ref["network_calls"]
    assert got["rounds"] == ref["rounds"] and got["ops_coupling"] == 0


@pytest.mark.slow
@pytest.mark.skipif(
    inductor.unavailable("cpu") is not None, reason=f"torch.compile unavailable: {inductor.unavailable('cpu')}"
)
def test_compiled_round_meets_the_operation_targets():
    # compile=true (specsamp.round.compiled): the round's tensor maths fused into inductor kernels, each launch one
    # operation, plus every ATen call left outside them (the commit, the loop, the wrappers); the network
    # excluded. At one image on the digits network: D-GRS (2,3) <= 300 per round, x0 + optimal B=14 <= 400,
    # a chain of 62 within 1.5x a chain of 14 (the fused drafting does not grow with depth), one sync per round
    rows = {
        r["arm"]: r
        for r in opcount.table_rows(
            ("digits",),
            (1,),
            ["dgrs 2x3", "x0+optimal B14", "rmc chain14", "rmc chain62"],
            progress=None,
            compiled=True,
        )
    }
    assert rows["dgrs 2x3"]["ops_round"] <= 300, rows["dgrs 2x3"]
    assert rows["x0+optimal B14"]["ops_round"] <= 400, rows["x0+optimal B14"]
    assert rows["rmc chain62"]["ops_round"] <= 1.5 * rows["rmc chain14"]["ops_round"], rows
    for r in rows.values():
        assert r["syncs_round"] + r["syncs_coupling"] <= 1.0 and r["kernels_round"] >= 1, r
