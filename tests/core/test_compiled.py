"""``compile=True``: the dense round under ``torch.compile`` keeps the law, the counts and (to rounding) the samples.

Setup: the law tests' ``GaussianMixture(dim=4, components=3, layout_seed=1)`` and ``Schedule.make(8, 1.0)``
(acceptance about 0.4-0.75 per depth: rejections, so residual draws, in most rounds).

Tolerance of the samples: the compiled kernels may fuse and reorder float operations (a fused multiply-add
rounds once where eager rounds twice), so a drafted state may differ from eager's in its last bits. Accepted
drafts carry that difference on; a residual draw amplifies it, since its direction is ``mean_q - mean_p``
normalised, which a change of eps * |mean| turns by eps * |mean| / (delta * sigma). Bound: about 32 roundings
per coordinate and step, T = 8 steps, |x| <= 10, and an amplification 1 / delta <= 1e2 for the residual draws of
this setup (a rejection at delta is about as likely as delta, so smaller deltas almost never draw one): 32 * 8 *
10 * 1e2 ~ 2**18 units of eps, i.e. 5.8e-11 in float64 and 3.1e-2 in float32 (measured: 9e-15 and 3.2e-5). The
counts must be identical (no verdict flips on these seeds). Compiling takes 10-30 s per tree on a CPU, so the
default run compiles one small case (its second test reuses the graphs); float32 and the law test per coupling
are marked slow.
"""

from __future__ import annotations

import pytest
import torch
from helpers import BY_ROOT, N_SPEC, P_MIN, NaNBelow, law_pvalues, law_reference, tree_of

from specsamp import inductor, sampler
from specsamp.errors import ConfigError
from specsamp.models import GaussianMixture
from specsamp.round import compiled
from specsamp.schedule import Schedule
from specsamp.trees import DraftTree

SCHED = Schedule.make(8, 1.0)
MODEL = GaussianMixture(dim=4, components=3, layout_seed=1)
FIELDS = ("nfe", "nfe_total", "target_rows", "rounds", "committed", "attempts", "accepts")
TOL_EPS = 2.0**18  # sample tolerance in units of the dtype's eps (module docstring)
ATOL = TOL_EPS * torch.finfo(torch.float64).eps

needs_inductor = pytest.mark.skipif(
    inductor.unavailable("cpu") is not None, reason=f"torch.compile unavailable: {inductor.unavailable('cpu')}"
)


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


@needs_inductor
def test_compiled_round_equals_eager_and_compiles_once_per_tree():
    # D-GRS on the (2, 3) tree, x0 draft, 40 trajectories, seeds 3 and 4: identical counts, samples to ATOL;
    # the second seed (other rows finish at other rounds, so other call plans) compiles nothing new
    tree, kw = DraftTree.uniform(2, 3), dict(draft="x0", execution="tree")
    before = _graphs()
    for seed in (3, 4):
        ref = sampler.sample_speculative(MODEL, SCHED, tree, "dgrs", 40, seed=seed, **kw)
        got = sampler.sample_speculative(MODEL, SCHED, tree, "dgrs", 40, seed=seed, compile=True, **kw)
        for f in FIELDS:
            assert torch.equal(getattr(got, f), getattr(ref, f)), (seed, f)
        assert got.batch_nfe == ref.batch_nfe
        assert (got.accepts < got.attempts).any()  # rejections: the residual draws ran compiled
        torch.testing.assert_close(got.samples, ref.samples, rtol=0, atol=ATOL)
        if seed == 3:
            first = _graphs()
            assert first > before  # it did compile (the drafting graph and the verification/walk graph)
    assert _graphs() == first


@needs_inductor
def test_compiled_round_defers_checks_and_falls_back_to_the_precise_error():
    # a target that turns NaN below sigma 0.5 (test_sampler's): the compiled round's deferred check fails, the
    # reference round repeats it and raises the precise error; afterwards no deferred-check context is left active
    from specsamp.coupling import NonFiniteError, active_checks

    # (the first test's tree, draft, dtype and batch: its compiled graphs serve, nothing new compiles)
    with pytest.raises(NonFiniteError, match=r"non-finite states at trajectory \d+, step \d+, children of node \d+"):
        sampler.sample_speculative(
            NaNBelow(), SCHED, DraftTree.uniform(2, 3), "dgrs", 40, draft="x0", execution="tree", seed=4, compile=True
        )
    assert active_checks() is None


def test_compiled_round_is_built_without_inductor_buffer_reuse(monkeypatch):
    # the dense round's pieces (drafting, one verification chunk, walk and commit) are compiled with inductor's buffer
    # reuse and in-place buffers off (compiled.INDUCTOR_OPTIONS): with them on, a verification in several chunks of
    # equal shape read buffers a later kernel had reused (the several-chunk tests below show the wrong law it gave);
    # nothing is compiled here, torch.compile's arguments are recorded
    from specsamp.round import dense

    seen = []
    monkeypatch.setattr(compiled, "ROUND", {})
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: seen.append((fn, kw)) or fn)
    compiled.compiled_round()
    kw = dict(dynamic=False, options={"allow_buffer_reuse": False, "inplace_buffers": False})
    assert seen == [(dense.DenseRound.draft, kw), (dense.DenseRound.verify_chunk, kw), (compiled.finish, kw)]
    # on CUDA the same pieces with the same options, and CUDA-graph capture (the CPU's graphs stay as they were)
    seen.clear()
    compiled.compiled_round("cuda")
    kw["options"] = {**kw["options"], "triton.cudagraphs": True}
    assert seen == [(dense.DenseRound.draft, kw), (dense.DenseRound.verify_chunk, kw), (compiled.finish, kw)]


def _chunk_graphs() -> int:
    """How many graphs TorchDynamo holds for the compiled verification chunk (its cache entries)."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from specsamp.round import dense

    return len(_debug_get_cache_entry_list(dense.DenseRound.verify_chunk.__code__))


@pytest.mark.parametrize("floor,run_tables", [(1, True), (1600, False)], ids=["one-node-chunks", "chunks-of-5-and-2"])
def test_compiled_round_hands_every_chunk_the_same_constants(monkeypatch, floor, run_tables):
    # the compiled round's pieces run here uncompiled (torch.compile recorded, not applied): the (2, 3) tree's 7
    # internal nodes verified in chunks by the dense tables' memory rule (floor 1: one node per chunk, as at 50,000
    # trajectories; 1,600 elements: chunks of 5 and 2 nodes, as at 10,000), D-GRS, 16 trajectories, seed 7. The chunk
    # piece is called with 7 chunks of one node per round, each with the same Python values (no slice, no root flag,
    # the same K), so that TorchDynamo, which guards on those, serves every chunk from one graph; and the pieces
    # composed as the compiled round composes them give the eager round's counts and samples bit for bit. Without
    # the run's tables (keys, noise, uniforms and verdict samples drawn in the round, the walk's residual drawn
    # again, as at 75,000 trajectories and more) and with the contract checked, the same
    from specsamp.round import dense, draws, tables

    calls = []

    def spy(fn, **kw):
        if fn is not dense.DenseRound.verify_chunk:
            return fn
        return lambda *a: (
            calls.append([a[1][1].numel(), *(x for x in a[1] if not isinstance(x, torch.Tensor))]) or fn(*a)
        )

    monkeypatch.setattr(compiled, "ROUND", {})
    monkeypatch.setattr(torch, "compile", spy)
    monkeypatch.setattr(tables, "VERIFY_FLOOR", floor)
    monkeypatch.setattr(tables, "VERIFY_MEMORY", 0.0)
    chunks = tables.plan_chunks(DraftTree.uniform(2, 3), 16, 2, "cpu")[0]
    assert [len(c[1]) for c in chunks] == ([1] * 7 if floor == 1 else [5, 2])
    if not run_tables:
        for module, name in (
            (draws, "KEY_CACHE"),
            (draws, "NOISE_CACHE"),
            (draws, "UNIFORM_CACHE"),
            (tables, "RESIDUAL_CACHE"),
        ):
            monkeypatch.setattr(module, name, 0)
    kw = dict(execution="tree", seed=7, check_contract=not run_tables)
    got = sampler.sample_speculative(SMALL, SMALL_SCHED, DraftTree.uniform(2, 3), "dgrs", 16, compile=True, **kw)
    ref = sampler.sample_speculative(SMALL, SMALL_SCHED, DraftTree.uniform(2, 3), "dgrs", 16, **kw)
    for f in (*FIELDS, "samples"):
        assert torch.equal(getattr(got, f), getattr(ref, f)), f
    assert len(calls) == 7 * int(got.rounds.max()) and all(c == [1, 2, None, None, None] for c in calls), calls[:8]


@pytest.mark.slow
@needs_inductor
def test_compiled_round_does_not_grow_with_the_verification_chunks(monkeypatch):
    # RMC on a chain of 4 nodes below the root, 24 trajectories, seed 5 (25-40 s on one core, mostly compiling):
    # the verification in one chunk of 4 internal nodes, then (the dense tables' memory rule set to one node per chunk, as
    # it splits the (2, 3) tree at 50,000 trajectories) in 4 chunks of one node. The 4 chunks run one compiled graph
    # (the chunk piece is handed no slice and no root flag), so the split adds one graph, no larger than the whole
    # first round's. Before, the round was one graph with its chunks unrolled in it: the split compiled the round
    # again with 4 copies of the coupling (traced operations 4364 against 404 for the (2, 3) tree, a compile
    # ten times longer, past 20 minutes at 50,000 trajectories). TorchDynamo's counters are deterministic.
    from torch._dynamo.utils import counters

    from specsamp.round import tables

    model = GaussianMixture(dim=4, components=3, layout_seed=1)
    kw = dict(draft="x0", prefetch="none", execution="tree")

    def compiled_run(seed=5):
        graphs, ops = _graphs(), counters["stats"]["calls_captured"]
        got = sampler.sample_speculative(model, SCHED, DraftTree.chain(4), "rmc", 24, compile=True, seed=seed, **kw)
        ref = sampler.sample_speculative(model, SCHED, DraftTree.chain(4), "rmc", 24, seed=seed, **kw)
        for f in FIELDS:
            assert torch.equal(getattr(got, f), getattr(ref, f)), f
        torch.testing.assert_close(got.samples, ref.samples, rtol=0, atol=ATOL)
        return _graphs() - graphs, counters["stats"]["calls_captured"] - ops

    chunks = _chunk_graphs()
    _, ops_whole = compiled_run()
    assert _chunk_graphs() <= chunks + 1
    monkeypatch.setattr(tables, "VERIFY_FLOOR", 1)
    monkeypatch.setattr(tables, "VERIFY_MEMORY", 0.0)
    assert len(tables.plan_chunks(DraftTree.chain(4), 24, 4, "cpu")[0]) == 4
    graphs, ops = compiled_run()
    assert graphs == 1 and _chunk_graphs() <= chunks + 2, (graphs, _chunk_graphs())  # the chunk of one node, once
    assert 0 < ops <= ops_whole, (ops, ops_whole)
    assert compiled_run(seed=6) == (0, 0)  # nothing compiles again (no guard on a chunk, a seed, or the checks' slot)


def test_compile_refusals_name_the_key():
    tree = DraftTree.uniform(2, 3)
    with pytest.raises(ConfigError, match=r"compile='yes' is invalid: must be true or false"):
        sampler.sample_speculative(MODEL, SCHED, tree, "dgrs", 2, execution="tree", compile="yes")
    with pytest.raises(ConfigError, match=r"compile=true is invalid with execution=path"):
        sampler.sample_speculative(MODEL, SCHED, tree, "dgrs", 2, execution="path", compile=True)
    with pytest.raises(ConfigError, match=r"compile=true is invalid here: refine=1"):
        sampler.sample_speculative(MODEL, SCHED, tree, "dgrs", 2, execution="tree", refine=1, compile=True)


def test_no_compiler_is_reported(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CXX", raising=False)
    assert "C/C++ compiler" in inductor.unavailable("cpu")
    with pytest.raises(ConfigError, match=r"compile=true is invalid here: .*compiler.*compile=false"):
        sampler.sample_speculative(MODEL, SCHED, DraftTree.uniform(2, 3), "dgrs", 2, execution="tree", compile=True)


@pytest.mark.slow
@needs_inductor
def test_compiled_round_equals_eager_in_float32():
    # float32, seed 3, 60 trajectories (test_sampler's float32 tree-vs-path case): identical counts, samples to
    # 2**18 float32 eps (3.1e-2; the module docstring)
    model = GaussianMixture(dim=4, components=3, layout_seed=1, dtype=torch.float32)
    kw = dict(seed=3, execution="tree")
    ref = sampler.sample_speculative(model, SCHED, DraftTree.uniform(2, 3), "dgrs", 60, **kw)
    got = sampler.sample_speculative(model, SCHED, DraftTree.uniform(2, 3), "dgrs", 60, compile=True, **kw)
    assert got.samples.dtype == torch.float32
    for f in FIELDS:
        assert torch.equal(getattr(got, f), getattr(ref, f)), f
    torch.testing.assert_close(got.samples, ref.samples, rtol=0, atol=TOL_EPS * torch.finfo(torch.float32).eps)


# one law case per coupling, compiled: a fixed tree with the x0 draft (dgrs), a chain with a history draft
# (rmc), step-dependent trees with the local-affine draft (markmax: one dense round per distinct tree)
LAW_CASES = [
    (("uniform", (2, 3)), "dgrs", "x0", "nearest", True),
    (("chain", 4), "rmc", "x0_extrap", "none", False),
    (("by_root", None), "markmax", "x0_affine", "nearest", True),
]


@pytest.mark.slow
@needs_inductor
@pytest.mark.parametrize("i,case", list(enumerate(LAW_CASES)), ids=[c[1] for c in LAW_CASES])
def test_compiled_output_law_equals_standard_sampler(i, case, reference):
    # the law tests' statistics (test_sampler.py): 2000 trajectories, seed 300 + i, every p-value > 1e-3
    spec, coupling, draft, prefetch, leaves = case
    tree = tree_of(("by_root", BY_ROOT) if spec[0] == "by_root" else spec)
    r = sampler.sample_speculative(
        MODEL,
        SCHED,
        tree,
        coupling,
        N_SPEC,
        draft=draft,
        prefetch=prefetch,
        evaluate_leaves=leaves,
        execution="tree",
        seed=300 + i,
        compile=True,
    )
    assert torch.isfinite(r.samples).all()
    assert (r.accepts < r.attempts).any()
    p = law_pvalues(r.samples, reference)
    assert min(p) > P_MIN, p


@pytest.fixture(scope="module")
def reference():
    return law_reference()


def test_latency_compile_arm_refuses_without_a_compiler(monkeypatch, tmp_path, capsys):
    from benchmarks import latency

    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CXX", raising=False)
    assert latency.main(["--compile", "--n", "1", "--pad", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --compile is invalid here") and "C/C++ compiler" in err


def test_compile_batch_benchmark_rows(monkeypatch, capsys):
    # benchmarks.compile_batch (make bench, section compile): four rows, each with its ratio to eager and the CPU's
    # model; the arms' processes are stood in for (they compile for minutes), the child's own entry runs 8 eager
    # trajectories and prints their seconds as JSON
    import json

    from benchmarks import compile_batch
    from benchmarks.common import cpu_model

    seen = []

    def child(n, compile, runs, cache=None):
        seen.append((n, compile, runs, cache is not None))
        return [2.0, 1.0][:runs] if not compile else ([60.0, 3.0] if runs == 2 else [12.0])

    monkeypatch.setattr(compile_batch, "_child", child)
    rows = compile_batch.compile_rows(5000, progress=None)
    assert seen == [(5000, False, 2, False), (5000, True, 2, True), (5000, True, 1, True)]
    assert [(r["arm"], r["seconds"], r["ratio"]) for r in rows] == [
        ("eager (best of 2)", 1.0, 1.0),
        ("compiled, first run, empty cache", 60.0, 60.0),
        ("compiled, second run", 3.0, 3.0),
        ("compiled, first run, warm cache", 12.0, 12.0),
    ]
    assert all(r["cpu"] == cpu_model() and r["n"] == 5000 for r in rows)
    assert compile_batch.main(["--child", "eager", "--n", "8"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert len(out) == 1 and out[0] > 0


def test_cuda_home_notice_is_dropped_and_nothing_else():
    import logging

    quiet = compiled.QuietCudaHome()

    def rec(msg):
        return logging.LogRecord("torch.utils.cpp_extension", logging.WARNING, __file__, 1, msg, ("/usr/local",), None)

    assert not quiet.filter(rec("No CUDA runtime is found, using CUDA_HOME='%s'"))
    assert quiet.filter(rec("Error building extension '%s'"))


# ----------------------------------------------------------------------------------------------
# inductor's cache directory: a machine fault (exit 3) naming the directory, before and while compiling


def _blocked_cache(tmp_path, monkeypatch):
    """TORCHINDUCTOR_CACHE_DIR below a regular file: no user, root included, can create it (ENOTDIR)."""
    blocker = tmp_path / "blocker"
    blocker.write_text("a file")
    cache = blocker / "inductor"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache))
    return cache


def test_an_unusable_inductor_cache_is_refused_before_sampling(tmp_path, monkeypatch):
    import errno
    import sys
    import types

    from specsamp.errors import InfrastructureError
    from specsamp.runner.exits import infrastructure_message, is_infrastructure

    cache = _blocked_cache(tmp_path, monkeypatch)

    class Unimportable(types.ModuleType):  # importing TorchDynamo creates the cache directory, and fails as it does
        def __getattr__(self, name):
            raise NotADirectoryError(errno.ENOTDIR, "Not a directory", str(cache))

    with monkeypatch.context() as m:
        m.setitem(sys.modules, "torch._dynamo.eval_frame", Unimportable("torch._dynamo.eval_frame"))
        why = inductor.unavailable("cpu")  # was: "torch.compile does not support Python 3.11.7 with torch ..."
    assert (
        why.startswith(f"compile=true cannot use inductor's cache directory {cache}: Not a directory")
        and "does not support" not in why
    )
    monkeypatch.setattr(inductor, "unavailable", lambda device: None)  # a compiler need not be present here
    with pytest.raises(InfrastructureError) as e:
        sampler.sample_speculative(MODEL, SCHED, DraftTree.uniform(2, 3), "dgrs", 2, execution="tree", compile=True)
    msg = str(e.value)
    assert (
        f"cache directory {cache}: Not a directory" in msg
        and "TORCHINDUCTOR_CACHE_DIR" in msg
        and "compile=false" in msg
    )
    assert "does not support" not in msg and is_infrastructure(e.value) and infrastructure_message(e.value) == msg
    # a cache on a noexec file system: the .so files inductor builds there could not be loaded
    import os

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "noexec"))
    real = os.statvfs
    monkeypatch.setattr(
        os, "statvfs", lambda p: os.statvfs_result((*real(p)[:8], real(p).f_flag | os.ST_NOEXEC, real(p)[9]))
    )
    with pytest.raises(InfrastructureError, match=r"cache directory .*noexec: its file system is mounted noexec"):
        inductor.check_compile(True, "tree", "cpu")
    monkeypatch.setattr(os, "statvfs", real)
    assert inductor.check_compile(True, "tree", "cpu") is True  # the same directory, exec allowed: accepted
    assert not list((tmp_path / "noexec").iterdir())  # the probe file is gone


def _fake_round_failing(error):
    def fake(*args, **kwargs):
        raise error

    return fake


def _dlopen_failure(cache) -> Exception:
    """What inductor raises when dlopen refuses a kernel library on a noexec mount: its InductorError repeats
    the OSError's text, with the OSError as its cause."""
    so = f"{cache}/kw/ckwh6cjc.main.so"
    try:
        try:
            raise OSError(
                f"{so}: failed to map segment from shared object.  The most common reason this may occur is "
                "if the /tmp folder is mounted with noexec"
            )
        except OSError as inner:
            raise RuntimeError(f"OSError: {inner}") from inner
    except RuntimeError as outer:
        return outer


def test_a_kernel_that_cannot_be_loaded_exits_3_naming_the_cache(tmp_path, monkeypatch, capsys):
    """The compiled round failing as a noexec cache makes it fail (simulated: the real failure needs a noexec mount
    and a compile): exit 3 with one paragraph naming the directory and TORCHINDUCTOR_CACHE_DIR, no traceback.
    Another error raised by the round is not the cache's: it stays what it was."""
    from specsamp.runner import compose
    from specsamp.runner.task import run_task

    cache = tmp_path / "cache"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache))
    monkeypatch.setattr(inductor, "unavailable", lambda device: None)
    monkeypatch.setattr(compiled, "ROUND", {"cpu": _fake_round_failing(_dlopen_failure(cache))})
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        run_task(compose(["model.dim=4", "steps=6", "n_samples=2", "execution=tree", "compile=true", "progress=false"]))
    err = capsys.readouterr().err
    assert e.value.code == 3 and err.count("\n") == 1 and "Traceback" not in err, err
    assert (
        err.startswith(f"error: compile=true cannot use inductor's cache directory {cache}: a compiled kernel")
        and "failed to map segment" in err
        and "TORCHINDUCTOR_CACHE_DIR" in err
    )
    import errno

    # a full disk while inductor writes (no file named), a read-only file inside the cache: the cache's; elsewhere: not
    assert "No space left on device [errno 28]" in str(inductor.classify_compile_error(OSError(errno.ENOSPC, "full")))
    assert str(cache) in str(inductor.classify_compile_error(OSError(errno.EROFS, "ro", str(cache / "ab" / "k.cpp"))))
    assert inductor.classify_compile_error(OSError(errno.EROFS, "ro", str(tmp_path / "elsewhere"))) is None
    monkeypatch.setattr(compiled, "ROUND", {"cpu": _fake_round_failing(ValueError("a bug of the round"))})
    with pytest.raises(ValueError, match="a bug of the round"):
        sampler.sample_speculative(MODEL, SCHED, DraftTree.uniform(2, 3), "dgrs", 2, execution="tree", compile=True)


@pytest.mark.slow
def test_run_py_with_an_uncreatable_inductor_cache_exits_3(tmp_path):
    """run.py end to end: the cache directory cannot be created (it was reported as torch.compile not supporting
    this Python, exit 2); now exit 3 before sampling, naming the directory and TORCHINDUCTOR_CACHE_DIR (a
    subprocess: 4-10 s)."""
    import os
    import subprocess
    import sys

    from helpers import ROOT

    (tmp_path / "blocker").write_text("a file")
    cache = tmp_path / "blocker" / "inductor"
    env = dict(os.environ, WANDB_MODE="offline", TORCHINDUCTOR_CACHE_DIR=str(cache))
    p = subprocess.run(
        [
            sys.executable,
            str(ROOT / "run.py"),
            "model.dim=4",
            "steps=6",
            "n_samples=2",
            "execution=tree",
            "compile=true",
            f"hydra.run.dir={tmp_path / 'out'}",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    err = p.stderr.strip()
    assert p.returncode == 3, p.stdout + p.stderr
    assert (
        err.startswith(f"error: compile=true cannot use inductor's cache directory {cache}: Not a directory")
        and "\n" not in err
        and "TORCHINDUCTOR_CACHE_DIR" in err
        and "does not support" not in err
    )
    assert p.stdout == "" and not (tmp_path / "out" / "result.json").exists()


# the setup where compiled D-GRS was biased: the d=2 mixture of five components (layout 0), T=8, eps=0.1, the
# (2, 3) tree, seed 104. Before inductor's buffer reuse was turned off, a verification split into several chunks of
# equal shape made compiled and eager part: with one chunk per internal node and the uniforms drawn in the round,
# 190 of 500 trajectories differed (by up to 2.2) and 27 NFE more were charged; at 50,000 trajectories (seven chunks
# of one node by the memory rule alone) 17,980 rows differed and the law was plainly off
SMALL = GaussianMixture(dim=2, components=5, layout_seed=0)
SMALL_SCHED = Schedule.make(8, 0.1)


@pytest.mark.slow
@needs_inductor
def test_compiled_round_with_several_verification_chunks_equals_eager(monkeypatch):
    # 500 trajectories, one internal node per verification chunk (VERIFY_FLOOR = 1), no per-run uniform table:
    # identical counts and samples to ATOL (measured after the fix: 2.1e-15; before it, 190 rows off by up to 2.2)
    from specsamp.round import draws, tables

    monkeypatch.setattr(tables, "VERIFY_FLOOR", 1)
    monkeypatch.setattr(tables, "VERIFY_MEMORY", 0.0)
    monkeypatch.setattr(draws, "UNIFORM_CACHE", 0)
    kw = dict(execution="tree", seed=104)
    ref = sampler.sample_speculative(SMALL, SMALL_SCHED, DraftTree.uniform(2, 3), "dgrs", 500, **kw)
    got = sampler.sample_speculative(SMALL, SMALL_SCHED, DraftTree.uniform(2, 3), "dgrs", 500, compile=True, **kw)
    for f in FIELDS:
        assert torch.equal(getattr(got, f), getattr(ref, f)), f
    assert (got.accepts < got.attempts).any()
    torch.testing.assert_close(got.samples, ref.samples, rtol=0, atol=ATOL)


@pytest.mark.slow
@needs_inductor
def test_compiled_dgrs_law_with_several_verification_chunks():
    # 50,000 compiled D-GRS trajectories (the memory rule splits the verification into seven chunks of one node),
    # seed 104, against 50,000 of the standard sampler, seed 10_104: two-sample KS on 5 fixed projections and on
    # the norm, chi-square of the mixture components; every p-value > 1e-3 (7 tests: a false alarm below 0.7%).
    # The biased round gave p = 0 on every one of them at this n.
    from helpers import chi2_same_counts, two_sample_pvalues
    from scipy import stats

    from specsamp.round import tables

    n = 50_000
    assert (
        len(tables.plan_chunks(DraftTree.uniform(2, 3), n, 2, "cpu")[0]) > 1
    )  # the case that failed: several chunks of one shape
    r = sampler.sample_speculative(
        SMALL, SMALL_SCHED, DraftTree.uniform(2, 3), "dgrs", n, execution="tree", seed=104, compile=True
    )
    ref = sampler.sample_standard(SMALL, SMALL_SCHED, n, seed=10_104).samples
    p = two_sample_pvalues(r.samples, ref, directions=5, seed=0)
    p.append(stats.ks_2samp(r.samples.norm(dim=1).numpy(), ref.norm(dim=1).numpy()).pvalue)
    p.append(chi2_same_counts(SMALL.component(r.samples).numpy(), SMALL.component(ref).numpy(), 5))
    assert min(p) > 1e-3, p


@pytest.mark.slow
@needs_inductor
def test_compiled_round_equals_eager_on_the_default_cell():
    # `python run.py execution=tree` with compile=true against compile=false: the d=500 mixture, T=30, eps=0.1, D-GRS
    # on the (2, 3) tree, velocity draft, 100 trajectories, seed 0 (the verification in chunks of 2, 2, 2 and 1 nodes).
    # Identical counts and samples to ATOL (measured: 4.4e-15). Before buffer reuse was turned off, 16 of the 100
    # trajectories changed their NFE and samples differed by up to 0.17, equal NFE or not.
    model = GaussianMixture(dim=500, components=5, layout_seed=0)
    sched, tree, kw = Schedule.make(30, 0.1, shift=1.0), DraftTree.uniform(2, 3), dict(execution="tree", seed=0)
    ref = sampler.sample_speculative(model, sched, tree, "dgrs", 100, **kw)
    got = sampler.sample_speculative(model, sched, tree, "dgrs", 100, compile=True, **kw)
    for f in FIELDS:
        assert torch.equal(getattr(got, f), getattr(ref, f)), f
    torch.testing.assert_close(got.samples, ref.samples, rtol=0, atol=ATOL)
