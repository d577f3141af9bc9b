"""The benchmarks in benchmarks/ run and report what they claim (no timed assertions)."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest
import torch

from specsamp.models import GaussianMixture


def test_gpu_check_run_rows_on_analytic_denoiser():
    from benchmarks import gpu_check
    from specsamp.models.edm import EDMVelocity
    from test_edm import GMMPrecond

    gmm = GaussianMixture(dim=6, components=2, layout_seed=2)
    model = EDMVelocity(GMMPrecond(gmm, (6,)), event_shape=(6,))
    rows = gpu_check.run(model, batch_sizes=(3,), configs=((2, 3),), steps=10, eps=0.3, max_batch=5)
    assert [(r["method"], r["budget"]) for r in rows] == [("standard", 1), ("dgrs", 14), ("rmc", 14)]
    std, dgrs, rmc = rows
    assert std["calls_mean"] == 8 and std["nfe_speedup"] == 1.0 and std["wall_speedup"] == 1.0
    assert dgrs["rows_per_image"] > dgrs["calls_mean"] and all(r["wall_s"] > 0 for r in rows)
    assert all(math.isclose(r["realised_fraction"], r["wall_speedup"] / r["batch_speedup"]) for r in rows)
    assert gpu_check._configs("2x3, 4x4") == [(2, 3), (4, 4)]
    cost = gpu_check.batch_cost(model, (1, 4))
    assert [c["rows"] for c in cost] == [1, 4] and cost[0]["relative"] == 1.0


def test_gpu_check_tiny_cpu_mode_writes_every_section(tmp_path, capsys):
    # the check `make gpu-check` runs on a GPU, in its tiny CPU mode: one table, JSON with the four
    # sections, exit 0 (every exactness p-value > 1e-4)
    pytest.importorskip("diffusers")
    from benchmarks import gpu_check

    out = tmp_path / "g.json"
    assert gpu_check.main(["--device", "cpu", "--tiny", "--json", str(out)]) == 0
    rep = json.loads(out.read_text())
    assert {"wallclock", "batch_cost", "exactness_f32", "exactness_bf16"} <= set(rep)
    assert {r["method"] for r in rep["wallclock"]} == {"standard", "dgrs", "rmc"}
    assert {r["rule"] for r in rep["exactness_f32"]} >= {"dgrs", "rmc"}
    assert len(rep["exactness_bf16"]) == 2
    text = capsys.readouterr().out
    assert "exactness_bf16" in text and "batch_cost" in text


def test_gpu_check_tiny_cpu_mode_on_the_trained_digits_network(tmp_path):
    # `make gpu-check`'s second run: the shipped, trained network loaded by its table hash
    from benchmarks import gpu_check

    out = tmp_path / "d.json"
    assert gpu_check.main(["--device", "cpu", "--tiny", "--network", "edm-digits-8x8-cond", "--json", str(out)]) == 0
    rep = json.loads(out.read_text())
    assert {r["method"] for r in rep["wallclock"]} == {"standard", "dgrs", "rmc"} and len(rep["exactness_bf16"]) == 2


def test_numpy_baseline_matches_our_protocol_in_law():
    # seed 0, 300 trajectories each of the (2, 2) D-GRS cell on the section 5.1 mixture: mean speedups
    # agree within 4 combined standard errors (the baseline draws its own random numbers)
    from benchmarks.numpy_lazy import NumpyGMM, run_cell
    from specsamp.sampler import sample_speculative
    from specsamp.schedule import Schedule
    from specsamp.trees import DraftTree

    gmm = GaussianMixture(dim=500, components=5, layout_seed=0, dtype=torch.float64)
    x = torch.randn(3, 500, dtype=torch.float64)
    np_model = NumpyGMM(gmm.means.numpy(), gmm.stds.numpy())
    assert abs(np_model(x[0].numpy(), 0.3) - gmm(x[:1], torch.tensor([0.3]))[0].numpy()).max() < 1e-5
    n = 300
    ours = sample_speculative(gmm, Schedule.make(30, 0.1), DraftTree.uniform(2, 2), "dgrs", n, seed=0).speedup
    theirs = run_cell(np_model, 30, 0.1, 2, 2, "dgrs", n, seed=0)
    se = float(ours.std()) / math.sqrt(n)
    assert abs(float(ours.mean()) - theirs) < 4 * math.sqrt(2) * se, (float(ours.mean()), theirs, se)


def test_overhead_and_memory_benchmarks_report_rows():
    from benchmarks.common import LinearVelocity
    from benchmarks.overhead import overhead_table, round_overhead

    r = round_overhead((3, 8, 8), 14, trajectories=2, steps=8, repeats=1)
    assert r["overhead_s"] > 0 and r["rounds"] >= 1 and r["budget"] == 14
    rows = overhead_table(LinearVelocity((3, 8, 8)), "proxy", budgets=(14,), probe=2, progress=None)
    assert rows[0]["fraction"] == pytest.approx(rows[0]["overhead_s"] / rows[0]["call_s"])
    out = subprocess.run(["python", "-m", "benchmarks.memory", "--one", "coupling", "3x32x32", "--trajectories", "2"],
                         capture_output=True, text=True, check=True).stdout
    assert json.loads(out)["what"] == "coupling"


def test_make_targets_point_at_the_benchmarks():
    out = subprocess.run(["make", "-n", "bench", "gpu-check"], capture_output=True, text=True, check=True).stdout
    assert "benchmarks.bench" in out and "benchmarks.gpu_check" in out


def test_overhead_module_has_a_command_line(monkeypatch):
    """``python -m benchmarks.overhead`` runs the overhead and scaling sections of ``make bench`` (it used
    to define no entry point and print nothing); checked without running them."""
    import benchmarks.bench
    from benchmarks import overhead

    seen = []
    monkeypatch.setattr(benchmarks.bench, "main", lambda argv: seen.append(argv) or 0)
    assert overhead.main(["--preset", "tiny"]) == 0
    assert seen == [["--only", "overhead,scaling", "--preset", "tiny"]]
    src = (Path(overhead.__file__)).read_text()
    assert 'if __name__ == "__main__":' in src
