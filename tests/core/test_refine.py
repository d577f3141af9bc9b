"""Picard-refined drafts (``refine=J``): the output law, the verifier's delta at ``J >= L``, accounting, refusals.

Law setup as in ``tests/core/test_sampler.py``: ``GaussianMixture(dim=4, components=3, layout_seed=1)``,
``Schedule.make(8, 1.0)``; reference: the standard sampler, seed 10000, 4000 trajectories; each refined
case 2000 trajectories with its own seed (200 + case number). Statistics: two-sample KS on projections onto
3 fixed random directions (seed 0), KS on the squared norm of the part orthogonal to those directions,
and a chi-square test on the mixture component. Tolerance: every p-value > 1e-3 (5 p-values x 6 cases:
a false alarm under exactness has probability ~3%; the seeds are fixed, so the outcome is deterministic).
"""

import pytest
import torch
from helpers import CountingModel, chi2_same_counts, two_sample_pvalues
from scipy import stats

from specsamp.coupling import Coupling, dgrs, rmc
from specsamp.errors import ConfigError
from specsamp.models import GaussianMixture
from specsamp.sampler import sample_speculative, sample_standard
from specsamp.schedule import Schedule
from specsamp.trees import DraftTree
from specsamp.treesearch import TreesByRoot

P_MIN = 1e-3
MODEL = GaussianMixture(dim=4, components=3, layout_seed=1)
SCHED = Schedule.make(8, 1.0)


@pytest.fixture(scope="module")
def reference():
    r = sample_standard(MODEL, SCHED, 4000, seed=10_000)
    return r.samples, MODEL.component(r.samples).numpy()


def orthogonal_pvalue(a, b, directions=3, seed=0):
    """KS p-value on the squared norm of ``a``'s and ``b``'s parts orthogonal to the projection directions."""
    g = torch.Generator().manual_seed(seed)
    w = torch.stack([torch.randn(a.shape[1], generator=g, dtype=torch.float64) for _ in range(directions)], 1)
    q, _ = torch.linalg.qr(w)
    res = lambda x: ((x.double() - x.double() @ q @ q.T) ** 2).sum(1).numpy()  # noqa: E731
    return stats.ks_2samp(res(a), res(b)).pvalue


# (tree, coupling, draft, prefetch, J): J = 1 and J = depth, on both couplings; a draft that is not
# exact at depth 1 (x0), prefetch=parent (an inexact root velocity) and step-dependent trees appear too.
CASES = [
    (DraftTree.uniform(2, 3), "dgrs", "velocity", "nearest", 1),
    (DraftTree.uniform(2, 3), "dgrs", "x0", "parent", 3),
    (DraftTree.chain(3), "rmc", "velocity", "nearest", 1),
    (DraftTree.chain(3), "rmc", "x0", "parent", 3),
    (DraftTree.from_widths([3, 2]), "dgrs", "drift", "none", 1),
    (
        TreesByRoot(
            {
                1: DraftTree.uniform(2, 3),
                2: DraftTree.from_widths([3, 1, 2]),
                3: DraftTree.chain(2),
                4: DraftTree.uniform(2, 2),
                5: DraftTree.uniform(1, 1),
                6: DraftTree.uniform(3, 2),
            }
        ),
        "dgrs",
        "x0",
        "parent",
        2,
    ),
]


@pytest.mark.parametrize("i,case", list(enumerate(CASES)))
def test_refined_drafts_keep_the_output_law(i, case, reference):
    tree, coupling, draft, prefetch, J = case
    r = sample_speculative(
        MODEL, SCHED, tree, coupling, 2000, draft=draft, prefetch=prefetch, execution="tree", refine=J, seed=200 + i
    )
    assert torch.isfinite(r.samples).all()
    ref, lab = reference
    p = two_sample_pvalues(r.samples, ref, directions=3, seed=0)
    p.append(orthogonal_pvalue(r.samples, ref))
    p.append(chi2_same_counts(MODEL.component(r.samples).numpy(), lab, MODEL.means.shape[0]))
    assert min(p) > P_MIN, p
    assert r.extra["refine"] == J


def spy(rule):
    """A coupling that records ``|mean_p - mean_q|`` relative to ``sigma`` for every verification."""
    seen = []

    def verify(children, mean_p, mean_q, sigma, generator=None):
        s = torch.as_tensor(sigma, dtype=torch.float64).reshape(-1)
        seen.append(((mean_p - mean_q).double().reshape(len(mean_p), -1).norm(dim=1) / s).max().item())
        return rule(children, mean_p, mean_q, sigma, generator)

    return Coupling(rule.name, verify, rule.max_children), seen


@pytest.mark.parametrize(
    "tree,rule", [(DraftTree.uniform(2, 3), dgrs), (DraftTree.chain(3), rmc)], ids=["dgrs-2x3", "rmc-chain3"]
)
@pytest.mark.parametrize("draft,prefetch", [("velocity", "nearest"), ("x0", "parent")])
def test_refine_at_depth_hands_the_verifier_the_target_mean(tree, rule, draft, prefetch):
    # J = L: every proposal mean is the target kernel mean at its parent, so delta / sigma vanishes to the
    # rounding of float64 states (|x| ~ 1: a few 1e-16, divided by sigma >= 0.05 here); every draft accepted
    coupling, seen = spy(rule)
    r = sample_speculative(
        MODEL,
        SCHED,
        tree,
        coupling,
        64,
        draft=draft,
        prefetch=prefetch,
        execution="tree",
        refine=3,
        seed=5,
        check_contract=False,
    )
    assert seen and max(seen) < 1e-12, max(seen)
    assert torch.equal(r.accepts, r.attempts)
    # without refinement the same setup does not coincide
    coupling, seen = spy(rule)
    sample_speculative(
        MODEL, SCHED, tree, coupling, 64, draft=draft, prefetch=prefetch, execution="tree", seed=5, check_contract=False
    )
    assert max(seen) > 1e-3


@pytest.mark.parametrize("J", [1, 2])
@pytest.mark.parametrize(
    "tree,prefetch",
    [(DraftTree.uniform(2, 3), "nearest"), (DraftTree.chain(3), "parent"), (DraftTree.uniform(2, 2), "none")],
    ids=["2x3-nearest", "chain3-parent", "2x2-none"],
)
def test_every_sweep_is_charged_to_nfe_and_rows(J, tree, prefetch):
    # recorded nfe_total = invocations each trajectory took part in; target_rows = the rows it sent to the
    # speculative calls (the sweeps included); with the same seed, each round costs what the plain round costs
    # plus J calls
    m = 6
    model = CountingModel(MODEL)
    r = sample_speculative(
        model,
        SCHED,
        tree,
        "dgrs",
        m,
        execution="tree",
        prefetch=prefetch,
        refine=J,
        seed=3,
        cond={"tid": torch.arange(m)},
    )
    calls = torch.zeros(m, dtype=torch.long)
    rows = torch.zeros(m, dtype=torch.long)
    for t in model.log:
        calls += torch.bincount(t.unique(), minlength=m)
        rows += torch.bincount(t, minlength=m)
    final = r.nfe_total - 1 - r.nfe
    assert torch.equal(calls, r.nfe_total)
    assert torch.equal(rows - 1 - final, r.target_rows)
    warm = 0 if prefetch == "none" else 1  # the warm-up call; prefetch=none pays a root call every round
    root_calls = r.rounds if prefetch == "none" else torch.zeros_like(r.rounds)
    assert torch.equal(r.nfe, warm + root_calls + (1 + J) * r.rounds)
    assert r.batch_nfe == int(r.nfe.max())


def test_refine_zero_is_the_plain_sampler_bit_for_bit():
    for execution in ("tree", "path"):
        a = sample_speculative(MODEL, SCHED, DraftTree.uniform(2, 3), "dgrs", 32, execution=execution, seed=4)
        b = sample_speculative(MODEL, SCHED, DraftTree.uniform(2, 3), "dgrs", 32, execution=execution, seed=4, refine=0)
        assert torch.equal(a.samples, b.samples) and torch.equal(a.nfe, b.nfe) and torch.equal(a.accepts, b.accepts)


def test_refine_lifts_acceptance_on_the_mixture():
    # deterministic counts at a fixed seed: depth-2 acceptance of the velocity draft is exact-at-depth-1 after
    # one sweep (the root velocity is exact), so refine=1 accepts every depth-1 verification and more at depth 2
    plain = sample_speculative(
        MODEL, SCHED, DraftTree.uniform(2, 3), "dgrs", 200, execution="tree", prefetch="none", seed=3
    )
    ref = sample_speculative(
        MODEL, SCHED, DraftTree.uniform(2, 3), "dgrs", 200, execution="tree", prefetch="none", seed=3, refine=1
    )
    rate = lambda r: r.accepts.sum(0).double() / r.attempts.sum(0).double()  # noqa: E731
    assert torch.equal(ref.accepts[:, 0], ref.attempts[:, 0])
    assert rate(ref)[1] > rate(plain)[1]


@pytest.mark.parametrize("value", [-1, 1.5, True, "2"])
def test_bad_refine_is_refused(value):
    with pytest.raises(ConfigError, match=r"refine=.* is invalid: the number of Picard sweeps"):
        sample_speculative(MODEL, SCHED, DraftTree.uniform(2, 2), "dgrs", 4, execution="tree", refine=value)


def test_refine_on_the_path_execution_is_refused():
    with pytest.raises(ConfigError, match=r"refine=1 is invalid with execution=path: .* use execution=tree"):
        sample_speculative(MODEL, SCHED, DraftTree.uniform(2, 2), "dgrs", 4, execution="path", refine=1)


def test_experiment_matches_a_refined_rounds_rows_with_a_plain_tree():
    from experiments.refine import main, matched_widths, rows_per_round

    assert rows_per_round([2, 2, 2]) == (15, 7)
    # refine=1 on (2, 3): 7 + 15 = 22 rows a round; refine=2: 29; on the chain (1, 8): 8 + 9 = 17
    assert matched_widths(22, 3) == [7, 1, 1] and rows_per_round([7, 1, 1])[0] == 22
    assert matched_widths(29, 3) == [4, 3, 1] and rows_per_round([4, 3, 1])[0] == 29
    assert matched_widths(17, 8) == [2] + [1] * 7
    assert main(["--n", "1"]) == 2


def test_memory_check_counts_the_sweeps_buffers(monkeypatch):
    # 10 MiB available, 80% usable; 12 trajectories of d = 1000 float64 on the (2, 3) tree: about 4.9 MB plain,
    # about 9.2 MB with the sweeps' three extra states per node
    from specsamp.runner import memory

    class Model:
        event_shape, dtype = (1000,), torch.float64

    monkeypatch.setattr(memory, "available_bytes", lambda device: 10 * 2**20)
    memory.check_tree_memory(DraftTree.uniform(2, 3), 12, Model(), "cpu", execution="tree", n_total=12, steps=30)
    with pytest.raises(ConfigError, match=r"batch_size=\d+ or less, or fewer Picard sweeps") as err:
        memory.check_tree_memory(
            DraftTree.uniform(2, 3), 12, Model(), "cpu", execution="tree", n_total=12, steps=30, refine=1
        )
    assert "execution=path" not in str(err.value)  # refine needs every internal node: path execution refuses it
