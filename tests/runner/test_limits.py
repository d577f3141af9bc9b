"""Resource limits: sizes that follow from the config are estimated and refused (exit 2, the numbers in
the message) before anything is allocated; the tree search's tables scale with what a tree of the
allowed depth and width can hold; progress moves per round or step and reaches log files.

The command-line cases run ``python run.py`` under an address-space cap (``resource.setrlimit(RLIMIT_AS)``,
:data:`CAP`): without the checks they die there with a MemoryError traceback (or the kernel's OOM killer)
instead of a message. One capped interpreter per test process imports torch once and forks each command from
there (:func:`helpers.python`), so every command runs under the cap, with its own arguments, directory, output
and exit status, without starting an interpreter per command.
"""

import json
import resource
import subprocess
import sys

import numpy as np
import pytest
import torch
from helpers import ROOT, TINY

from specsamp import treesearch as ts
from specsamp.errors import ConfigError
from specsamp.runner import build, loop, memory, treerules
from specsamp.runner.config import compose, load_config
from specsamp.sampler import sample_speculative, sample_standard
from specsamp.schedule import Schedule
from specsamp.trees import DraftTree

CAP = 6 * 2**30  # python + torch + hydra map about 3.5 GiB of address space before any work


# the capped interpreter: reads one JSON line [directory, args] per command, forks run.py there, answers one
# JSON line [exit status, stdout, stderr]
_SERVER = """
import json, os, sys
sys.path.insert(0, {tests!r})
from helpers import python
for line in sys.stdin:
    cwd, args = json.loads(line)
    p = python([sys.executable, {run_py!r}, *args, 'hydra.run.dir=' + cwd], cwd=cwd, env=dict(os.environ), timeout=120)
    print(json.dumps([p.returncode, p.stdout, p.stderr]), flush=True)
"""


@pytest.fixture(scope="module")
def capped():
    """The capped interpreter of this module (started once, stopped at its end)."""

    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (CAP, CAP))

    env = {"PATH": "/usr/bin:/bin", "HYDRA_FULL_ERROR": "0", "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1"}
    code = _SERVER.format(tests=str(ROOT / "tests"), run_py=str(ROOT / "run.py"))
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=cap,
    )
    yield proc
    proc.stdin.close()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def run_capped(capped, args, tmp_path):
    """``python run.py ARGS hydra.run.dir=tmp_path`` in ``tmp_path`` under :data:`CAP`: the completed process."""
    capped.stdin.write(json.dumps([str(tmp_path), [str(a) for a in args]]) + "\n")
    capped.stdin.flush()
    line = capped.stdout.readline()
    assert line, f"the capped interpreter died: {capped.stderr.read()[-2000:]}"
    code, out, err = json.loads(line)
    return subprocess.CompletedProcess(["run.py", *args], code, out, err)


RESOURCE = [
    (["tree=optimal", "budget=1000000000"], ["budget=1000000000", "too large to search", "or less fits"]),
    (["tree=optimal", "budget=137256", "steps=30"], ["budget=137256", "max_width=32", "max-plus updates"]),
    (["K=7", "L=100", "steps=30"], ["K=7, L=100", "GiB", "lower K or L"]),
    (["n_samples=100000", "model.dim=500"], ["n_samples=100000 in one batch", "GiB", "batch_size="]),
    (["n_samples=100000", "model.dim=500", "batch_size=50000"], ["n_samples=100000 with batch_size=50000", "GiB"]),
    # the trajectory ids alone would be 8 TB: refused before they are allocated
    (["n_samples=1000000000000"], ["n_samples=1000000000000", "GiB", "num_shards"]),
    (["n_samples=1000000000000", "sampler=standard"], ["n_samples=1000000000000", "GiB", "num_shards"]),
    (["steps=1000000000000"], ["steps=1000000000000", "GiB", "lower steps"]),  # the schedule's arrays
    (["model.dim=1000000000000"], ["model.dim=1000000000000", "GiB", "the mixture's means"]),
]


@pytest.mark.parametrize("args,needles", RESOURCE, ids=[" ".join(a) for a, _ in RESOURCE])
def test_oversized_config_is_refused_under_a_memory_cap(capped, tmp_path, args, needles):
    (tmp_path / "keep.txt").write_text("precious")
    p = run_capped(capped, [*TINY, *args], tmp_path)
    assert p.returncode == 2, (p.stdout, p.stderr[-2000:])
    err = p.stderr.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, (needle, err)
    assert not (tmp_path / "result.json").exists() and (tmp_path / "keep.txt").read_text() == "precious"


def test_small_width_search_runs_under_the_cap(capped, tmp_path):
    # a huge nominal budget is fine when depth and width bound the tree: 2 + 4 + 8 = 14 states at most
    p = run_capped(
        capped,
        [*TINY, "tree=optimal", "budget=1000000000", "max_width=2", "max_depth=3", "delta_profile=[0.5,1.0,1.5]"],
        tmp_path,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    assert "B=1000000000" in p.stdout


# ----------------------------------------------------------------------------------------------
# the tree search


def test_search_tables_are_capped_by_depth_and_width():
    pos = ts.profile_positional([0.5, 1.0, 1.5], "dgrs")
    assert ts.search_cost(10**9, 3, 2)["budget"] == 14
    big = ts.optimal_tree(10**9, pos, 3, 2)
    assert big.budget <= 14 and big.num_children.max() <= 2
    assert ts.optimal_value(10**9, pos, 3, 2) == pytest.approx(ts.optimal_value(14, pos, 3, 2), abs=1e-12)


def test_blocked_maxplus_matches_the_full_table(monkeypatch):
    rng = np.random.default_rng(0)
    for na, nb in ((1, 1), (7, 3), (40, 40), (33, 50)):
        a = rng.integers(0, 4, na).astype(float)  # integer values: many ties, first argmax must win
        b = rng.integers(0, 4, nb).astype(float)
        full = np.array([[a[r - x] + b[x] if x <= r else -np.inf for x in range(nb)] for r in range(na)])
        for block in (1, 5, 1 << 21):
            monkeypatch.setattr(ts, "_BLOCK", block)
            c, arg = ts._maxplus(a, b)
            np.testing.assert_array_equal(c, full.max(1))
            np.testing.assert_array_equal(arg, full.argmax(1))


def test_search_memory_is_linear_in_the_budget(monkeypatch):
    import tracemalloc

    monkeypatch.setattr(ts, "_BLOCK", 1 << 12)
    pos = ts.profile_positional([0.4, 0.9, 1.4, 2.0], "dgrs")
    B = 1500
    tracemalloc.start()
    tree = ts.optimal_tree(B, pos, 4, 3)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert tree.budget <= B
    assert peak < (B + 1) ** 2 * 8 / 10, peak  # the old (B+1) x (B+1) table alone was 18 MB


def test_hopeless_search_is_refused_at_once_with_a_budget_that_fits():
    pos = ts.profile_positional([1.0], "dgrs")
    with pytest.raises(
        ValueError, match=r"budget=137256, max_depth=28, max_width=32 .* budget=(\d+) or less fits"
    ) as e:
        ts.optimal_tree(137256, pos, 28, 32)
    fits = int(str(e.value).split(" or less fits")[0].rsplit("budget=", 1)[1])
    assert ts.search_cost(fits, 28, 32)["pairs"] <= ts.MAX_PAIRS < ts.search_cost(fits + 1, 28, 32)["pairs"]
    # a rule whose positional vectors are not prefixes of each other (markmax) costs W^2, not W
    assert ts.search_cost(500, 5, 8, False)["pairs"] > 3 * ts.search_cost(500, 5, 8, True)["pairs"]


def test_search_reports_progress_per_depth():
    seen = []
    ts.optimal_tree(30, ts.profile_positional([0.5, 1.0], "dgrs"), 4, 3, callback=lambda d, n: seen.append((d, n)))
    assert seen == [(1, 4), (2, 4), (3, 4), (4, 4)]


def test_max_depth_is_capped_at_the_horizon():
    run, _ = load_config(compose([*TINY, "steps=10", "max_depth=100", "max_width=200"]))
    assert treerules.search_limits(run, 50) == (8, 50)
    run, _ = load_config(compose([*TINY, "steps=10"]))
    assert treerules.search_limits(run, 50) == (8, 32)


# ----------------------------------------------------------------------------------------------
# memory checks in the runner


class _Model:
    event_shape = (1000,)
    dtype = torch.float64


def test_every_execution_is_checked(monkeypatch):
    monkeypatch.setattr(memory, "available_bytes", lambda device: 10 * 2**20)  # 10 MiB
    tree = DraftTree.uniform(2, 3)
    memory.check_tree_memory(tree, 10, _Model(), "cpu", execution="path", n_total=10, steps=30)  # ~2 MiB: fits
    for execution, t in (("path", tree), ("tree", tree), ("path", None)):
        with pytest.raises(ConfigError, match=r"batch_size=\d+ or less"):
            memory.check_tree_memory(t, 200, _Model(), "cpu", execution=execution, n_total=200, steps=30)
    with pytest.raises(ConfigError, match="n_samples=100000 .*num_shards"):
        memory.check_tree_memory(tree, 1, _Model(), "cpu", execution="path", n_total=100000, steps=30)


def test_tree_nodes_are_counted_within_the_horizon():
    def run(*overrides):
        run, _ = load_config(compose([*TINY, *overrides]))
        return run, build.build_coupling(run)

    assert memory.tree_nodes(*run("K=7", "L=100"), 3) == 1 + 7 + 49 + 343
    assert memory.tree_nodes(*run("K=7", "L=100", "sampler=rmc"), 28) == 29
    assert memory.tree_nodes(*run("tree=widths", "widths=[3,2,2,5]"), 3) == 1 + 3 + 6 + 12
    tree, B = build.build_tree(*run("K=2", "L=9"), 4)
    assert tree.describe() == "uniform(2,4)" and B == 2**10 - 2


def test_available_bytes_sees_the_address_space_limit():
    code = (
        "import resource, specsamp.runner.memory as m; "
        "resource.setrlimit(resource.RLIMIT_AS, (6 * 2**30, 6 * 2**30)); print(m.available_bytes('cpu'))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)},
    )
    assert 0 < int(out.stdout) < 6 * 2**30, out.stderr


# ----------------------------------------------------------------------------------------------
# progress


def _gmm():
    from specsamp.models import GaussianMixture

    return GaussianMixture(dim=8, components=3)


def test_samplers_report_progress_per_round_and_step():
    model, schedule = _gmm(), Schedule.make(12, 0.3)
    seen = []
    sample_speculative(model, schedule, DraftTree.uniform(2, 2), "dgrs", 6, callback=seen.append)
    done = [s["steps_done"] for s in seen]
    assert len(done) > 3 and done == sorted(done) and done[-1] == 6 * 10
    seen.clear()
    sample_standard(model, schedule, 6, callback=seen.append)
    assert [s["steps_done"] for s in seen] == [6 * min(n, 10) for n in range(12)]


def test_log_file_gets_periodic_lines_and_bar_moves_per_round(monkeypatch, capsys):
    monkeypatch.setattr(loop, "LOG_INTERVAL", 0.0)  # a line at every update (30 s in real runs)
    loop.run_config(compose([*TINY, "progress=auto"]))  # capsys: stderr is not a terminal
    lines = [l for l in capsys.readouterr().err.splitlines() if l.startswith("sampling:")]
    assert len(lines) >= 3 and "\r" not in "".join(lines)  # one batch of 8, yet the line moves per round
    assert lines[-1].startswith("sampling: 100% (48/48 traj-step)")
    loop.run_config(compose([*TINY, "progress=false"]))
    assert "sampling" not in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------
# upper bounds of the size keys that no memory estimate covers


def test_refine_beyond_the_trees_depth_is_refused_with_the_largest_that_helps():
    """refine=100000 ran without end even at n_samples=2: sweeps beyond the tree's depth change nothing."""
    with pytest.raises(ConfigError, match=r"refine=100000 is invalid with steps=8: .* use refine=6 or less"):
        load_config(compose([*TINY, "n_samples=2", "execution=tree", "refine=100000"]))
    with pytest.raises(
        ConfigError, match=r"refine=4 is invalid for this tree \(uniform\(2,3\), 3 level\(s\) .* use refine=3 or less"
    ):
        loop.run_config(compose([*TINY, "n_samples=2", "execution=tree", "L=3", "refine=4"]))
    rec, _ = loop.run_config(compose([*TINY, "n_samples=2", "execution=tree", "L=3", "refine=3"]))
    assert rec["refine"] == 3


def test_a_nominal_budget_beyond_64_bits_is_refused_before_it_is_computed():
    """sampler=rmc L=20000 printed a traceback (B had 6021 digits); L=2**62 computed K^L for ever."""
    assert [memory.capped_budget(K, L) for K, L in ((1, 5), (2, 3), (3, 4))] == [5, 14, 120]
    assert (
        memory.capped_budget(2, 2**62) == memory.MAX_BUDGET + 1
        and memory.capped_budget(1, 2**70) == memory.MAX_BUDGET + 1
    )
    with pytest.raises(ConfigError, match=r"K=2, L=20000 is invalid: the nominal budget .* L=62 or less fits with K=2"):
        loop.run_config(compose([*TINY, "n_samples=2", "sampler=rmc", "L=20000"]))
    with pytest.raises(ConfigError, match=rf"K={2**63}, L=3 is invalid: .* lower K\."):
        loop.run_config(compose([*TINY, "n_samples=2", "sampler=rmc", f"K={2**63}"]))
    with pytest.raises(ConfigError, match=r"K=2, L=99999 is invalid: the nominal budget"):
        loop.run_config(compose([*TINY, "n_samples=2", "tree=optimal", "L=99999", "delta_profile=[0.5]"]))
