"""Exactness of every registered coupling over delta in [0, 300], K up to 32, float32 and float64.

The law test is :func:`specsamp.testing.check_exactness` with its defaults: seed 1234, n = 3000
parent nodes in d = 8, deltas 0, 1e-9, 0.1, 1, 3, 10, 50, 300, K in 1, 2, 7, 32 (up to the rule's
``max_children``); KS tests of the output's projection on the displacement direction, of a
projection orthogonal to it, and of the orthogonal part's squared norm (chi^2_7). Tolerance: every
p-value > 1e-4 (with ~400 tests, a false alarm has probability ~4%, and the seed is fixed so the run
is deterministic). The other tests compare acceptance rates with theory within 4 standard errors.
"""

import math

import pytest
import torch

from specsamp import theory
from specsamp.coupling import COUPLINGS, Coupling, dgrs, get_coupling, register_coupling, rmc
from specsamp.testing import check_exactness, law_pvalues, make_problem

P_MIN = 1e-4


@pytest.mark.parametrize("name", list(COUPLINGS))
def test_output_law_is_target(name):
    if name == "markmax":  # 21 s on the full grid (below, -m slow); by default K = 2 and 7, same seed, n, alpha
        check_exactness(name, Ks=(2, 7)).raise_if_failed()
        return
    check_exactness(name).raise_if_failed()


@pytest.mark.slow
def test_markmax_output_law_is_target_on_the_full_grid():
    check_exactness("markmax").raise_if_failed()


def test_check_exactness_detects_a_biased_rule():
    # D-GRS with its residual's projection moved by 0.2: the KS test of the projection fails
    def biased(children, mean_p, mean_q, sigma, generator=None):
        v = dgrs(children, mean_p, mean_q, sigma, generator)
        shift = (mean_q - mean_p) / (mean_q - mean_p).norm(dim=1, keepdim=True).clamp_min(1e-30)
        v.sample = torch.where(v.accepted[:, None], v.sample, v.sample + 0.2 * 0.37 * shift)
        return v

    report = check_exactness(biased, deltas=(1.0, 3.0), Ks=(2,), dtypes=(torch.float64,))
    assert not report.ok and all("parallel" in f for f in report.failures())
    with pytest.raises(AssertionError, match="failed 2 of 2 cases"):
        report.raise_if_failed()


def test_registry_and_contract_object():
    assert isinstance(dgrs, Coupling) and COUPLINGS["rmc"] is rmc and rmc.max_children == 1
    with pytest.raises(ValueError, match="already registered"):
        register_coupling("dgrs")(dgrs.verify)
    rmc.check_tree(None)
    from specsamp.trees import DraftTree

    rmc.check_tree(DraftTree.chain(3))
    with pytest.raises(ValueError, match=r"'rmc' accepts at most K=1 .* node with 2; a K=1 rule runs a chain"):
        rmc.check_tree(DraftTree.uniform(2, 2))


@pytest.mark.parametrize("K", [1, 2, 4, 7, 16])
@pytest.mark.parametrize("delta", [0.05, 0.5, 1.0, 2.0, 4.0])
def test_dgrs_acceptance_matches_eq19(K, delta):
    # seed 7, n = 20000: |measured - (1 - G_{K+1})| < 4 standard errors
    children, mean_p, mean_q, sigma, _, g = make_problem(delta, K, torch.float64, n=20000, dim=3, seed=7)
    acc = dgrs(children, mean_p, mean_q, sigma, generator=g).accepted.double().mean().item()
    ref = float(theory.dgrs_acceptance(delta, K))
    se = math.sqrt(max(ref * (1 - ref), 1e-12) / 20000)
    assert abs(acc - ref) < 4 * se + 1e-12


@pytest.mark.parametrize("K", [2, 4])
def test_dgrs_positional_probabilities(K):
    # seed 11, n = 40000, delta = 1: each P(J = k) within 4 standard errors
    n = 40000
    children, mean_p, mean_q, sigma, _, g = make_problem(1.0, K, torch.float64, n=n, dim=3, seed=11)
    v = dgrs(children, mean_p, mean_q, sigma, generator=g)
    ref = theory.dgrs_positional(1.0, K)
    for k in range(K):
        got = (v.index == k).double().mean().item()
        se = math.sqrt(ref[k] * (1 - ref[k]) / n)
        assert abs(got - ref[k]) < 4 * se


@pytest.mark.parametrize("delta", [0.1, 1.0, 3.0])
def test_rmc_acceptance_matches_eq20_and_dgrs_k1(delta):
    # seed 3, n = 20000 each: both within 4 standard errors of 2 Phibar(delta / 2)
    n = 20000
    ref = float(theory.rmc_acceptance(delta))
    se = math.sqrt(ref * (1 - ref) / n)
    for rule in (rmc, dgrs):
        children, mean_p, mean_q, sigma, _, g = make_problem(delta, 1, torch.float64, n=n, dim=3, seed=3)
        acc = rule(children, mean_p, mean_q, sigma, generator=g).accepted.double().mean().item()
        assert abs(acc - ref) < 4 * se, rule.name


def test_delta_zero_accepts_first_child():
    children, mean_p, mean_q, sigma, _, g = make_problem(0.0, 5, torch.float64, n=100)
    v = dgrs(children, mean_p, mean_q, sigma, generator=g)
    assert v.accepted.all() and (v.index == 0).all()


def test_batched_over_image_events():
    # [n, K, C, H, W] children: event shape is kept, law still exact (seed 5, n = 3000)
    g = torch.Generator().manual_seed(5)
    n, K, shape = 3000, 3, (2, 3, 3)
    mean_p = torch.zeros(n, *shape, dtype=torch.float64)
    e = torch.randn(*shape, generator=g, dtype=torch.float64)
    e = e / e.norm()
    mean_q = mean_p + 0.5 * 1.5 * e
    children = mean_p[:, None] + 0.5 * torch.randn(n, K, *shape, generator=g, dtype=torch.float64)
    v = dgrs(children, mean_p, mean_q, torch.full((n,), 0.5, dtype=torch.float64), generator=g)
    assert v.sample.shape == (n, *shape)
    assert min(law_pvalues(v.sample, mean_q, 0.5, e).values()) > P_MIN


def test_bad_inputs_raise_value_error_naming_the_problem():
    children, mean_p, mean_q, sigma, _, _ = make_problem(1.0, 2, torch.float64, n=10)
    with pytest.raises(ValueError, match="K=2"):
        rmc(children, mean_p, mean_q, sigma)
    with pytest.raises(ValueError, match="mean_q"):
        dgrs(children, mean_p, mean_q[:, :3], sigma)
    with pytest.raises(ValueError, match="sigma"):
        dgrs(children, mean_p, mean_q, 0.0)
    with pytest.raises(ValueError, match="sigma"):
        dgrs(children, mean_p, mean_q, -1.0)
    with pytest.raises(ValueError, match="K=0"):
        dgrs(children[:, :0], mean_p, mean_q, sigma)
    with pytest.raises(
        ValueError, match=r"coupling='nope' is not registered; valid: (\w+, )*dgrs, (\w+, )*rmc(, \w+)* \(registered\)"
    ):
        get_coupling("nope")


def _tiny_sigma_problem(name, dtype, sigma, delta=0.7, n=20000, d=256, seed=77):
    """States near zero at a kernel scale deep in float16's subnormal range; means and children are
    rounded to ``dtype`` as a sampler holding ``dtype`` states would. Returns the problem and the
    direction and displacement that the rounded means actually define (the law to check against)."""
    g = torch.Generator().manual_seed(seed)
    e = torch.randn(d, generator=g, dtype=torch.float64)
    e = e / e.norm()
    mean_p = torch.zeros(n, d, dtype=torch.float64)
    mean_q = (mean_p + sigma * delta * e).to(dtype)
    K = 1 if name == "rmc" else 3
    children = (sigma * torch.randn(n, K, d, generator=g, dtype=torch.float64)).to(dtype)
    disp = (mean_q[0].double() - mean_p[0]) / sigma
    return children, mean_p.to(dtype), mean_q, disp.norm().item(), disp / disp.norm(), g


@pytest.mark.parametrize(
    "name,dtype,sigma",
    [("rmc", torch.float16, 2.0**-14), ("dgrs", torch.float16, 2.0**-14), ("rmc", torch.bfloat16, 2.0**-20)],
)
def test_16bit_states_at_small_sigma_keep_the_law(name, dtype, sigma):
    # seed 77, n = 20000, d = 256, delta = 0.7, states near zero. The coupling used to compute e and
    # the residual's shift in float16, where sigma * delta / sqrt(d) falls below the subnormal spacing
    # (rmc at 2^-20: acceptance 0.7195 instead of 0.7263, KS p = 3e-9). Now the d-dimensional work runs
    # in float32: KS of the output's projection (float64, against the rounded means) p > 1e-4, and
    # the acceptance within 5 standard errors of eq. 20 / eq. 19 for the displacement the rounded
    # means define.
    children, mean_p, mean_q, delta, e, g = _tiny_sigma_problem(name, dtype, sigma)
    v = get_coupling(name)(children, mean_p, mean_q, sigma, generator=g)
    assert v.sample.dtype == dtype and torch.isfinite(v.sample).all()
    p = law_pvalues(v.sample, mean_q, sigma, e)
    assert p["parallel"] > P_MIN, p
    K = children.shape[1]
    want = float(theory.rmc_acceptance(delta)) if K == 1 else float(theory.dgrs_acceptance(delta, K))
    got = v.accepted.double().mean().item()
    assert abs(got - want) < 5 * math.sqrt(want * (1 - want) / children.shape[0]), (got, want)


def test_sigma_is_not_rounded_to_the_state_dtype():
    from specsamp.coupling import check_inputs

    children, mean_p, mean_q, _, _, _ = _tiny_sigma_problem("rmc", torch.bfloat16, 1e-6, n=4)
    s = check_inputs(children, mean_p, mean_q, 1e-6)
    assert s.dtype == torch.float64 and bool((s == 1e-6).all())


def test_float16_sigma_below_its_resolution_is_refused():
    # the failing case above (float16, sigma = 2^-20, d = 256) cannot be served in float16 states at
    # all: the residual's shift is below the subnormal spacing. It is refused with the limit named.
    from specsamp.coupling import min_sigma

    children, mean_p, mean_q, _, _, _ = _tiny_sigma_problem("rmc", torch.float16, 2.0**-20, n=4)
    assert 2.0**-20 < min_sigma(torch.float16, 256) < 2.0**-14
    with pytest.raises(ValueError, match=r"sigma=9.537e-07 .*float16 states of 256 coordinates.*float32"):
        rmc(children, mean_p, mean_q, 2.0**-20)


@pytest.mark.parametrize("where", ["children", "mean_p", "mean_q"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_inputs_are_refused_naming_the_rows(where, bad):
    from specsamp.coupling import NonFiniteError

    children, mean_p, mean_q, sigma, _, _ = make_problem(1.0, 2, torch.float32, n=10)
    {"children": children[3, 1], "mean_p": mean_p[3], "mean_q": mean_q[3]}[where][2] = bad
    with pytest.raises(NonFiniteError, match=r"row\(s\) \[3\]") as err:
        dgrs(children, mean_p, mean_q, sigma)
    assert err.value.rows == [3]


def test_deferred_checks_collect_instead_of_raising():
    """Inside deferred_checks a NaN child or a bad sigma sets the flag (no exception); outside it raises."""
    from specsamp.coupling import NonFiniteError, active_checks, deferred_checks, dgrs

    gen = torch.Generator().manual_seed(0)
    children = torch.randn(3, 2, 4, generator=gen, dtype=torch.float64)
    mp, mq = torch.zeros(3, 4, dtype=torch.float64), torch.ones(3, 4, dtype=torch.float64)
    with deferred_checks() as checks:
        dgrs(children, mp, mq, 0.5, gen)
        assert not checks.failed()
        bad = children.clone()
        bad[1, 0, 2] = float("nan")
        dgrs(bad, mp, mq, 0.5, gen)
        assert checks.failed()
    assert active_checks() is None
    with deferred_checks() as checks:
        dgrs(children, mp, mq, torch.tensor([0.5, -1.0, 0.5], dtype=torch.float64), gen)
        assert checks.failed()
    with pytest.raises(NonFiniteError):
        dgrs(bad, mp, mq, 0.5, gen)
    with pytest.raises(ValueError, match="finite and > 0"):
        dgrs(children, mp, mq, -1.0, gen)
