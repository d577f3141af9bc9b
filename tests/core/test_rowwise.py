"""Every function on the paths the docs call bitwise equal computes a row independently of its batch.

The tree and path executions, ``max_batch``, ``batch_size``, shards and ``indices=`` subsets give a
trajectory's rows to the sampler's own functions in batches of other sizes and at other positions
(docs/architecture.md, "What is equal across splits"). With a target that evaluates a row alone, their
samples are equal bitwise only if those functions compute each row from its own inputs with operations whose
rounding depends on nothing else: no matrix product or reduction across rows, and no float kernel that rounds
an element one way in its vectorised body and another in its scalar tail (``torch.logaddexp``, ``pow``,
``exp2``, ``sigmoid`` on AVX2/AVX-512 builds), where an element's rounding depends on where it sits in the
tensor, i.e. on the batch's layout; nor a BLAS product, which rounds a row by the batch's size and its own
kernel choice.

Each function here is evaluated on rows alone, inside batches of 7 at two alignments, inside a batch of
several thousand rows, and inside that batch shifted by a few rows (each shift moves every row against the
vector lanes and against the split of a large tensor between threads); every evaluation must give the same
bits. Inputs are random with fixed seeds (stated per test); nothing here is statistical. On a CPU whose vector
width or kernels differ from the one these functions were checked on, a new batch dependence fails here
first.
"""

from __future__ import annotations

import math

import pytest
import torch

from specsamp.coupling import get_coupling, grs_levels, sample_grs_residual
from specsamp.drafts import DRAFTS, DraftHistory, DraftRoot
from specsamp.grs import logaddexp
from specsamp.rng import KeyedRows, base_key, fold, normal, uniform, uniform_table
from specsamp.schedule import Schedule

F64 = torch.float64
BIG = 4000  # rows of the large batch: [BIG, 63] grids are split between threads, unlike a row alone
SHIFTS = (1, 5, 13)  # the large batch without its first rows: every row in other lanes and another split


def _take(x, rows):
    """Rows ``rows`` (a slice or a long tensor) of ``x``: a tensor, a tuple of tensors, or None."""
    if x is None:
        return None
    if isinstance(x, (tuple, list)):
        return type(x)(_take(t, rows) for t in x)
    if hasattr(x, "__dataclass_fields__"):  # a Verdict
        return tuple(_take(getattr(x, f), rows) for f in x.__dataclass_fields__)
    return x[rows]


def _flat(out):
    """The outputs of a function as a list of tensors (a Verdict's fields, a tuple's members)."""
    if isinstance(out, torch.Tensor):
        return [out]
    if out is None:
        return []
    if hasattr(out, "__dataclass_fields__"):
        return [t for t in (getattr(out, f) for f in out.__dataclass_fields__) if isinstance(t, torch.Tensor)]
    return [t for o in out for t in _flat(o)]


def _same(a, b, what):
    for x, y in zip(_flat(a), _flat(b), strict=True):
        assert x.shape == y.shape, what
        both_nan = torch.isnan(x) & torch.isnan(y) if x.is_floating_point() else torch.zeros_like(x, dtype=torch.bool)
        differ = (x != y) & ~both_nan
        if differ.any():
            idx = differ.reshape(differ.shape[0], -1).any(1).nonzero()[:5, 0].tolist()
            raise AssertionError(
                f"{what}: rows {idx} differ (first values {x[idx[0]].flatten()[:4].tolist()} vs "
                f"{y[idx[0]].flatten()[:4].tolist()})"
            )


def assert_rowwise(fn, inputs, n: int = BIG, alone: int = 48, sevens: int = 40):
    """``fn(*inputs_rows)`` row ``i`` equals ``fn`` of row ``i`` alone, inside batches of 7 (two alignments),
    inside the batch of all ``n`` rows and inside that batch shifted by :data:`SHIFTS` rows: bitwise.
    A batch of 7 is shorter than two vectors of AVX2 or AVX-512, so a flat kernel rounds it all in its scalar
    tail, and the large batch mostly in its vectorised body: ``sevens`` such batches per alignment.

    ``inputs``: tensors (or tuples of tensors) whose first dimension is the row. ``alone``: how many rows are
    also evaluated one at a time (spread over the batch, the last rows included, where a flat kernel's scalar
    tail falls)."""
    full = fn(*inputs)
    picks = sorted(set(torch.linspace(0, n - 1, alone).round().long().tolist()) | {n - 1, n - 2, n - 3})
    for i in picks:
        _same(fn(*_take(inputs, slice(i, i + 1))), _take(full, slice(i, i + 1)), f"row {i} alone")
    if sevens:
        for start in (0, 3):
            for a in range(start, min(n, start + 7 * sevens), 7):
                rows = slice(a, min(a + 7, n))
                _same(fn(*_take(inputs, rows)), _take(full, rows), f"rows {a}.. in a batch of 7")
    for k in SHIFTS:
        rows = slice(k, n)
        _same(fn(*_take(inputs, rows)), _take(full, rows), f"the batch shifted by {k}")


def _log_uniform(n, lo, hi, g):
    return torch.exp(math.log(lo) + (math.log(hi) - math.log(lo)) * torch.rand(n, dtype=F64, generator=g))


# ---------------------------------------------------------------------------------------------------------
# the scalar machinery of the couplings


def test_logaddexp_is_rowwise_and_agrees_with_torch():
    # seed 0: 4000 pairs, normal of scale 2 (gaps where log1p(exp(-gap)) counts) with infinities and equal pairs
    # mixed in; torch.logaddexp's values within 2 ulps (the same formula, exp and log1p rounded by other kernels).
    # torch.logaddexp itself fails the first check on AVX2 and AVX-512 builds (about one element in 80 differs
    # between its vectorised body and its scalar tail)
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(2, BIG, dtype=F64, generator=g) * 2
    a[:20], b[10:20] = -math.inf, -math.inf
    a[20:30], b[20:30] = math.inf, math.inf
    b[30:40] = a[30:40]
    assert_rowwise(logaddexp, (a, b))
    assert_rowwise(lambda x, y: logaddexp(x, y[:, None]), (torch.randn(BIG, 63, dtype=F64, generator=g), b))
    ref = torch.logaddexp(a, b)
    ours = logaddexp(a, b)
    assert torch.equal(torch.isnan(ours), torch.isnan(ref)) and torch.equal(ours[ref.isinf()], ref[ref.isinf()])
    fin = ref.isfinite()
    assert ((ours[fin] - ref[fin]).abs() <= 2 * torch.finfo(F64).eps * ref[fin].abs().clamp_min(1.0)).all()


def test_residual_sampler_is_rowwise():
    # seed 1: 4000 rows, delta log-uniform in [1e-6, 300], K = 1..8, u uniform in (0, 1) with its extremes
    g = torch.Generator().manual_seed(1)
    delta = _log_uniform(BIG, 1e-6, 300.0, g)
    ks = torch.randint(1, 9, (BIG,), generator=g)
    lam, mass = torch.empty(BIG, dtype=F64), torch.empty(BIG, dtype=F64)
    for k in range(1, 9):
        lv, gm = grs_levels(delta[ks == k], k)
        lam[ks == k], mass[ks == k] = lv[:, k], gm[:, k]
    u = torch.rand(BIG, dtype=F64, generator=g).clamp_min(1e-300)
    u[:8] = torch.tensor([1e-300, 1e-30, 1e-10, 0.5, 1 - 1e-6, 1 - 1e-10, 1 - 2.0**-52, 1 - 2.0**-53], dtype=F64)
    assert_rowwise(sample_grs_residual, (delta, lam, mass, u))
    assert_rowwise(lambda d: grs_levels(d, 5), (delta,))


def _problem(n, k, d, seed, dtype=F64, spread=3.0):
    """``n`` verification problems: children [n, k, d] about mean_p, mean_q displaced by delta log-uniform
    in [1e-3, 30], sigma log-uniform in [1e-3, 1], and one verify key per row."""
    g = torch.Generator().manual_seed(seed)
    sigma = _log_uniform(n, 1e-3, 1.0, g)
    mean_p = torch.randn(n, d, dtype=F64, generator=g) * spread
    direction = torch.randn(n, d, dtype=F64, generator=g)
    direction /= direction.norm(dim=1, keepdim=True)
    delta = _log_uniform(n, 1e-3, 30.0, g)
    mean_q = mean_p + (delta * sigma)[:, None] * direction
    children = mean_p[:, None] + sigma[:, None, None] * torch.randn(n, k, d, dtype=F64, generator=g)
    keys = base_key(seed, torch.arange(n), "verify")
    return children.to(dtype), mean_p.to(dtype), mean_q.to(dtype), sigma, keys


def _verify(name, decide=False):
    rule = get_coupling(name)

    def run(children, mean_p, mean_q, sigma, keys):
        gen = KeyedRows(keys)
        return (
            rule.choice(children, mean_p, mean_q, sigma, gen) if decide else rule(children, mean_p, mean_q, sigma, gen)
        )

    return run


@pytest.mark.parametrize("name,k,d", [("dgrs", 3, 4), ("dgrs", 1, 16), ("rmc", 1, 4), ("dgrs", 2, 500)])
def test_couplings_verdicts_are_rowwise(name, k, d):
    # seed 2: problems as _problem states (rows: 4000 at d <= 16, 600 at d = 500), float64; verify and its choice
    n = BIG if d <= 16 else 600
    prob = _problem(n, k, d, seed=2)
    assert_rowwise(_verify(name), prob, n=n)
    if get_coupling(name).decide is not None:
        assert_rowwise(_verify(name, decide=True), prob, n=n, sevens=False)


def test_couplings_verdicts_are_rowwise_float32():
    # seed 3: 4000 problems in float32, d = 8, K = 2
    assert_rowwise(_verify("dgrs"), _problem(BIG, 2, 8, seed=3, dtype=torch.float32))


@pytest.mark.slow
def test_markmax_verdicts_are_rowwise():
    # seed 4: 1500 problems, K = 3, d = 4 (delta to 30: the share table's certificates and both residuals)
    assert_rowwise(_verify("markmax"), _problem(1500, 3, 4, seed=4), n=1500, alone=24, sevens=False)


@pytest.mark.slow
def test_markmax_parameters_are_rowwise():
    # seed 5: 4000 deltas log-uniform in [1e-3, 500], K = 3: the static share (table, certificate) and the
    # parameters a row's sampling uses (slow: the share table is built first, 5-40 s)
    from specsamp.markmax_params import static_share

    delta = _log_uniform(BIG, 1e-3, 500.0, torch.Generator().manual_seed(5))

    def fn(d):
        p, ok = static_share(d, 3)
        return p.t, p.c, p.log_R, p.log_A, ok

    assert_rowwise(fn, (delta,), alone=8, sevens=30)


# ---------------------------------------------------------------------------------------------------------
# the drafts' means and the random numbers


SCHED = Schedule.make(30, 0.1)


def _root(n, d, seed, history=3):
    """A round's roots: states, velocities, root indices 2..28, exactness, and ``history`` records at earlier steps."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, dtype=F64, generator=g)
    v = torch.randn(n, d, dtype=F64, generator=g)
    nr = torch.randint(2, 29, (n,), generator=g)
    exact = torch.rand(n, generator=g) < 0.5
    back = torch.randint(1, 3, (n, history), generator=g).cumsum(1)
    hn = (nr[:, None] - back).clamp(min=-1)
    hn[torch.rand(n, history, generator=g) < 0.05] = -1  # a few empty slots
    hist = DraftHistory(
        torch.randn(n, history, d, dtype=F64, generator=g), hn, torch.randn(n, history, d, dtype=F64, generator=g)
    )
    nodes = x[:, None] + 0.1 * torch.randn(n, 3, d, dtype=F64, generator=g)
    return x, v, nr, exact, hist.x0, hist.n, hist.x, nodes


@pytest.mark.parametrize("name", sorted(DRAFTS))
def test_drafts_means_are_rowwise(name):
    # seed 6: 4000 roots (1500 for x0_affine; d = 6), 3 nodes each, at the root's next step: freeze, then the
    # proposal means
    draft = DRAFTS.get(name)

    def fn(x, v, nr, exact, h0, hn, hx, nodes):
        hist = DraftHistory(h0, hn, hx) if draft.history else None
        frozen = draft.freeze(DraftRoot(x, v, nr, exact, hist), SCHED)
        return frozen, draft.mean(frozen, nodes, nr + 1, SCHED)

    n = 1500 if name == "x0_affine" else BIG  # its fit scans [n, 241] grids five times: still split between threads
    assert_rowwise(fn, _root(n, 6, seed=6), n=n, sevens=20 if draft.history else 40)


def test_x0_affine_fit_is_rowwise_at_the_mixtures_dimension():
    # seed 7: 600 roots at d = 500 (the section 5.1 mixture's dimension): the per-trajectory fit's Gram matrices
    draft = DRAFTS.get("x0_affine")

    def fn(x, v, nr, exact, h0, hn, hx, nodes):
        return draft.freeze(DraftRoot(x, v, nr, exact, DraftHistory(h0, hn, hx)), SCHED)

    assert_rowwise(fn, _root(600, 500, seed=7), n=600, sevens=False)


def test_random_numbers_are_rowwise():
    # seed 8: 4000 keys; uniforms (m = 1, 3, 64), normals of 1, 5 and 3x8x8 coordinates, the per-row sources
    keys = base_key(8, torch.arange(BIG), "draft")
    for m in (1, 3, 64):
        assert_rowwise(lambda k, m=m: uniform(k, m), (keys,), sevens=m == 3)
    for shape in ((1,), (5,), (3, 8, 8)):
        assert_rowwise(lambda k, shape=shape: normal(k, shape), (keys,), sevens=shape == (5,))
    assert_rowwise(lambda k: normal(k, (6,), dtype=torch.float32), (keys,), sevens=False)
    assert_rowwise(lambda k: uniform_table(k, [3, 1, 2]), (keys,), sevens=False)
    assert_rowwise(lambda k: KeyedRows(k).uniform(4), (fold(keys, 3),), sevens=False)
