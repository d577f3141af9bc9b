"""Counter-based random numbers (specsamp.rng).

Statistical checks use fixed keys (seed 2024) and state sample size and tolerance inline; KS
p-values must exceed 1e-4 and moments lie within 5 standard errors.
"""

import math

import pytest
import torch
from helpers import ROOT, python
from scipy import stats

from specsamp import rng


def keys(n, seed=2024, stream="step"):
    return rng.base_key(seed, torch.arange(n), stream)


def test_determinism_and_key_dependence():
    k = keys(100)
    torch.testing.assert_close(rng.uniform(k, 7), rng.uniform(keys(100), 7), rtol=0, atol=0)
    torch.testing.assert_close(rng.normal(k, (3, 4)), rng.normal(keys(100), (3, 4)), rtol=0, atol=0)
    # different seed, stream or trajectory -> different numbers
    assert not torch.equal(rng.uniform(k, 7), rng.uniform(keys(100, seed=2025), 7))
    assert not torch.equal(rng.uniform(k, 7), rng.uniform(keys(100, stream="draft"), 7))
    u = rng.uniform(k, 3)
    assert torch.unique(u[:, 0]).numel() == 100
    # keys are distinct across streams and trajectories
    all_keys = torch.cat([rng.base_key(0, torch.arange(1000), s) for s in rng.STREAMS])
    assert torch.unique(all_keys).numel() == all_keys.numel()


def test_row_depends_only_on_its_key_and_index():
    k = keys(50)
    full = rng.uniform(k, 9)
    # a subset of keys gives the same rows; a shorter draw is a prefix (entry j depends on key and j)
    torch.testing.assert_close(rng.uniform(k[[3, 17, 40]], 9), full[[3, 17, 40]], rtol=0, atol=0)
    torch.testing.assert_close(rng.uniform(k, 4), full[:, :4], rtol=0, atol=0)
    # base_key of trajectory i does not depend on the batch it is computed in
    assert torch.equal(rng.base_key(7, [5, 6], "init"), rng.base_key(7, torch.arange(10), "init")[5:7])
    # broadcasting over a key grid, as the sampler uses it
    grid = rng.fold(k[:, None], torch.arange(4)[None])
    assert grid.shape == (50, 4)
    assert torch.equal(rng.normal(grid, (2,))[:, 2], rng.normal(rng.fold(k, 2), (2,)))


def test_uniform_open_interval_and_law():
    # n = 200000 uniforms from 2000 keys x 100; KS against U(0, 1): p > 1e-4; never 0 or 1
    u = rng.uniform(keys(2000), 100)
    assert u.dtype == torch.float64 and u.shape == (2000, 100)
    assert bool((u > 0).all()) and bool((u < 1).all())
    assert stats.kstest(u.reshape(-1).numpy(), "uniform").pvalue > 1e-4
    # mean 1/2 within 5 standard errors (sd 1/sqrt(12))
    assert abs(u.mean().item() - 0.5) < 5 * math.sqrt(1 / 12 / u.numel())
    # lag-1 correlation along the counter and across keys: |r| < 5 / sqrt(n)
    a, b = u[:, :-1].reshape(-1), u[:, 1:].reshape(-1)
    assert abs(torch.corrcoef(torch.stack([a, b]))[0, 1].item()) < 5 / math.sqrt(a.numel())
    a, b = u[:-1].reshape(-1), u[1:].reshape(-1)
    assert abs(torch.corrcoef(torch.stack([a, b]))[0, 1].item()) < 5 / math.sqrt(a.numel())


_M64 = (1 << 64) - 1


def _key_with_hash(h: int) -> torch.Tensor:
    """The key whose ``fold(key, 0) = mix64(key)`` equals the 64-bit word ``h`` (SplitMix64 inverted)."""

    def unshift(y, s):
        x = y
        for _ in range(64 // s + 2):
            x = y ^ (x >> s)
        return x & _M64

    z = unshift(h, 31)
    z = (z * pow(rng._MIX2 & _M64, -1, 1 << 64)) & _M64
    z = unshift(z, 27)
    z = (z * pow(rng._MIX1 & _M64, -1, 1 << 64)) & _M64
    z = unshift(z, 30)
    key = torch.tensor([rng._signed((z - (rng._GOLDEN & _M64)) & _M64)])
    assert rng.mix64(key).item() & _M64 == h
    return key


def test_uniform_smallest_word_is_positive():
    # the hash word 0 maps to 2^-53 > 0
    u = rng.uniform(_key_with_hash(0), 1)
    assert 0 < u.item() < 1e-15


def test_uniform_largest_word_stays_below_one():
    # the hash word with 53 leading ones is the largest value uniform() can see
    u = rng.uniform(_key_with_hash(((1 << 53) - 1) << 11), 1)
    assert u.item() < 1.0


@pytest.mark.parametrize("shape", [(1,), (7,), (3, 5), (16, 4, 4)])
def test_normal_moments(shape):
    # 4000 keys x numel(shape) normals; mean within 5 SE of 0, variance within 5 SE of 1,
    # KS against N(0, 1) with p > 1e-4; odd event sizes exercise the Box--Muller tail
    z = rng.normal(keys(4000, seed=11), shape)
    assert z.shape == (4000, *shape) and z.dtype == torch.float64
    assert torch.isfinite(z).all()
    flat = z.reshape(-1)
    n = flat.numel()
    assert abs(flat.mean().item()) < 5 / math.sqrt(n)
    assert abs(flat.var().item() - 1) < 5 * math.sqrt(2 / n)
    assert abs(stats.kurtosis(flat.numpy())) < 5 * math.sqrt(24 / n)
    assert stats.kstest(flat.numpy(), "norm").pvalue > 1e-4


def test_normal_components_uncorrelated():
    # 20000 keys, event (2, 3): all 15 pairwise correlations |r| < 5 / sqrt(20000)
    z = rng.normal(keys(20000, seed=3), (2, 3)).reshape(20000, 6)
    c = torch.corrcoef(z.T)
    off = c[~torch.eye(6, dtype=torch.bool)]
    assert off.abs().max().item() < 5 / math.sqrt(20000)


def test_keyed_rows_successive_calls_independent():
    # 50000 rows: call 1 and call 2 differ, are uncorrelated (|r| < 5/sqrt(n)) and each is U(0, 1)
    k = keys(50000, seed=9)
    rows = rng.KeyedRows(k)
    a = rows.uniform(3)
    b = rows.uniform(1)
    assert a.shape == (50000, 3) and b.shape == (50000, 1)
    assert not torch.equal(a[:, :1], b)
    n = a.shape[0]
    for j in range(3):
        r = torch.corrcoef(torch.stack([a[:, j], b[:, 0]]))[0, 1].item()
        assert abs(r) < 5 / math.sqrt(n)
    assert stats.kstest(b[:, 0].numpy(), "uniform").pvalue > 1e-4
    # reproducible: a fresh KeyedRows on the same keys replays the same sequence
    again = rng.KeyedRows(k)
    assert torch.equal(again.uniform(3), a) and torch.equal(again.uniform(1), b)
    # row i depends only on keys[i]
    sub = rng.KeyedRows(k[[10, 20]])
    assert torch.equal(sub.uniform(3), a[[10, 20]])


def test_generator_rows():
    g = torch.Generator().manual_seed(0)
    rows = rng.GeneratorRows(1000, "cpu", g)
    u = rows.uniform(4)
    assert u.shape == (1000, 4) and u.dtype == torch.float64
    assert bool((u > 0).all()) and bool((u < 1).all())


def test_mix64_is_injective_on_a_sample():
    x = torch.arange(-50000, 50000, dtype=torch.int64)
    assert torch.unique(rng.mix64(x)).numel() == x.numel()


def test_seed_range_and_unknown_stream():
    assert rng.base_key(rng.MAX_SEED, [0, 1], "verify").shape == (2,)
    for bad in (-1, rng.MAX_SEED + 1, 2**64 - 1, 2**70, True, 1.0):
        with pytest.raises(ValueError, match="seed=.*invalid"):
            rng.base_key(bad, [0, 1], "verify")
    with pytest.raises(ValueError, match="stream='nope'"):
        rng.base_key(0, [0], "nope")


def test_streams_of_different_seeds_never_meet():
    # XOR of seed and stream index made base_key(1, 'step') == base_key(2, 'init'); now every
    # (seed, stream, trajectory) triple of 4000 seeds x all streams x 3 trajectories has its own
    # key, and so does every (step, node) folded below it (4000 x 5 x 3 x 3 x 3 = 540000 keys)
    assert not torch.equal(rng.base_key(1, [0], "step"), rng.base_key(2, [0], "init"))
    assert not torch.equal(rng.base_key(5, [0], "draft"), rng.base_key(2, [0], "verify"))
    per_seed = [torch.stack([rng.base_key(s, torch.arange(3), st) for st in rng.STREAMS]) for s in range(4000)]
    k = torch.stack(per_seed)  # [seed, stream, trajectory]
    assert torch.unique(k).numel() == k.numel()
    deep = rng.fold(k[..., None, None], torch.arange(3)[:, None], torch.arange(3)[None])
    assert torch.unique(deep).numel() == deep.numel()
    # the numbers differ too, not only the keys: first uniforms of (1, step) and (2, init)
    assert not torch.equal(rng.uniform(k[1, 1], 4), rng.uniform(k[2, 0], 4))
    # large seeds near the top of the range keep their streams apart
    top = torch.stack([rng.base_key(rng.MAX_SEED - s, [0], st) for s in range(50) for st in rng.STREAMS])
    assert torch.unique(top).numel() == top.numel()


def _reference_normal(keys, shape):
    """The documented formula, element by element from mix64 (no blocking, no in-place work)."""
    numel = math.prod(shape)
    half = (numel + 1) // 2
    j = torch.arange(2 * half)
    h = rng.mix64(keys[:, None] ^ j[None])
    u = (((h >> 12) & ((1 << 52) - 1)).double() + 0.5) * 2.0**-52
    r = torch.sqrt(-2.0 * torch.log(u[:, :half]))
    theta = 2.0 * torch.pi * u[:, half:]
    return torch.cat([r * torch.cos(theta), r * torch.sin(theta)], -1)[:, :numel].reshape(-1, *shape)


@pytest.mark.parametrize("shape", [(1,), (5,), (3, 7), (40000,)])
def test_blocked_normal_matches_the_formula(shape):
    # the fast blocked generator equals the plain formula bit for bit, for any number of keys
    k = keys(5 if shape == (40000,) else 3000, seed=5)
    ref = _reference_normal(k, shape)
    assert torch.equal(rng.normal(k, shape), ref)
    assert torch.equal(rng.normal(k[2:4], shape), ref[2:4])
    assert torch.equal(rng.normal(k, shape, dtype=torch.float32), ref.float())


def test_runner_refuses_seeds_outside_the_key_range():
    # the runner checks the range up front (exit 2 with the one-paragraph message, no traceback)
    import sys

    root = ROOT
    for bad in (str(2**70),):  # sampled bit-identically to seed=0 when seeds were reduced mod 2**64
        p = python(
            [sys.executable, "run.py", f"seed={bad}", "n_samples=2", "model.dim=4", "steps=6"],
            cwd=root,
            capture_output=True,
            text=True,
        )
        assert p.returncode == 2 and "seed=" in p.stderr + p.stdout and "Traceback" not in p.stderr


def test_uniform_table_and_drawn_rows_give_the_keyed_numbers():
    # KeyedRows(keys, drawn) serves each call from its table entry (the first m columns, contiguous) and any
    # other call from the keys: the numbers of KeyedRows(keys) bit for bit; the keys are asked for only then
    keys = rng.base_key(5, torch.arange(7), "verify")
    table = rng.uniform_table(keys, (3, 1))
    assert [t.shape for t in table] == [(7, 3), (7, 1)]
    plain = rng.KeyedRows(keys)
    want = [plain.uniform(3), plain.uniform(1), plain.uniform(2)]
    for c, t in enumerate(table):
        assert torch.equal(t, want[c])
    asked = []
    rows = rng.KeyedRows(lambda: asked.append(1) or keys, table)
    assert torch.equal(rows.uniform(3), want[0]) and torch.equal(rows.uniform(1), want[1]) and not asked
    assert torch.equal(rows.uniform(2), want[2]) and asked == [1]  # beyond the table: drawn from the keys
    short = rng.KeyedRows(keys, [table[0]])
    u = short.uniform(2)
    assert u.is_contiguous() and torch.equal(u, rng.KeyedRows(keys).uniform(3)[:, :2])
    wide = rng.KeyedRows(keys, [table[1]])
    assert torch.equal(wide.uniform(3), want[0])  # wider than the table: drawn from the keys


def test_round_numbers_are_those_of_the_node_key():
    """The round's keyed numbers (one statement for both layouts and the per-run tables): node ``v`` of the
    round of row ``i`` at root step ``n`` draws its noise and uniforms from ``fold(fold(k_i, n), v)``, however
    the keys are batched (per row, node-major, or a per-run (row, root, node) table)."""
    k = rng.base_key(3, torch.arange(4), "draft")
    n, v = torch.tensor([0, 5, 2, 9]), torch.tensor([1, 2, 3])
    per_run = rng.node_keys(rng.round_keys(k[:, None], torch.arange(10)[None])[:, :, None], v[None, None])  # [4, 10, 3]
    node_major = rng.node_keys(rng.round_keys(k, n)[None], v[:, None])  # [3, 4]
    assert torch.equal(per_run[torch.arange(4), n], node_major.T)
    assert torch.equal(node_major, rng.fold(k[None], n[None], v[:, None]))
    z = rng.draft_noise(node_major, (5,), torch.float32)
    out = torch.empty(3, 4, 5, dtype=torch.float32)
    rng.draft_noise(node_major, (5,), out=out)
    assert torch.equal(z, out) and torch.equal(z, rng.normal(node_major, (5,)).float())
    assert rng.verify_widths([0, 3, 1, 0]) == (3, 1) and rng.verify_widths([0]) == (1, 1)
    drawn = rng.verify_uniforms(node_major.reshape(-1), (3, 1))
    rows = rng.KeyedRows(node_major.reshape(-1))
    assert torch.equal(drawn[0], rows.uniform(3)) and torch.equal(drawn[1], rows.uniform(1))
