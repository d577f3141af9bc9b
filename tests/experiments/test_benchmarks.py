"""The benchmarks in benchmarks/ run and report what they claim (no timed assertions)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specsamp.models import GaussianMixture


def test_numpy_baseline_matches_our_protocol_in_law():
    # seed 0, 300 trajectories each of the (2, 2) D-GRS cell on the section 5.1 mixture: mean speedups
    # agree within 4 combined standard errors (the baseline draws its own random numbers)
    from benchmarks.numpy_lazy import NumpyGMM, run_cell
    from specsamp.sampler import sample_speculative
    from specsamp.schedule import Schedule
    from specsamp.trees import DraftTree

    gmm = GaussianMixture(dim=500, components=5, layout_seed=0, dtype=torch.float64)
    x = torch.randn(3, 500, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    np_model = NumpyGMM(gmm.means.numpy(), gmm.stds.numpy())
    # both in float64 (sigma too: a float32 0.3 moves the posterior by ~1e-6): the baseline expands |x - alpha m|^2,
    # cancelling terms of ~|x|^2 = 500, so its log-weights carry ~4 * 500 eps / sigma^2 = 2.5e-12 and the velocity
    # ~1e-11 of its size; measured at most 2.6e-13 over 300 seeds
    v = gmm(x[:1], torch.tensor([0.3], dtype=torch.float64))[0].numpy()
    assert abs(np_model(x[0].numpy(), 0.3) - v).max() < 1e-10 * abs(v).max()
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
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.memory", "--one", "coupling", "3x32x32", "--trajectories", "2"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert json.loads(out)["what"] == "coupling"


def test_make_targets_point_at_the_benchmarks():
    out = subprocess.run(
        ["make", "-n", "bench", "gpu-check", "bench-samplers"], capture_output=True, text=True, check=True
    ).stdout
    assert "benchmarks.bench" in out and "benchmarks.gpu_check" in out and "benchmarks.samplers" in out


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


def test_gmm_batch1_reports_every_arm_and_refuses_bad_sizes(tmp_path, capsys):
    # one repeat of the RMC (2,3) cell, one single-trajectory call and a batch of 2: a row per arm (numpy
    # loop, tree and path at n=1 and n=2) with the numpy loop's ratio 1 and counted ops for the n=1 arms
    from benchmarks import gmm_batch1

    rows = gmm_batch1.measure(repeats=1, single=1, batch=2, cells=(("rmc", 2, 3),), progress=None)
    assert [r["arm"] for r in rows] == [
        "numpy loop",
        "specsamp tree n=1",
        "specsamp tree n=2",
        "specsamp path n=1",
        "specsamp path n=2",
    ]
    assert rows[0]["ratio"] == 1.0 and all(r["median_s"] > 0 for r in rows)
    assert all((r["ops_per_traj"] or 0) > 0 for r in rows if r["arm"].endswith("n=1"))
    assert gmm_batch1.main(["--repeats", "0"]) == 2
    assert "--repeats=0" in capsys.readouterr().err


def test_timings_name_the_cpu_and_roundcost_refuses_bad_arguments(capsys):
    """Every timing table names its CPU (model, vector ISA, CPU count); benchmarks.roundcost (which splits a
    sampler call into network, per-run tables, ATen operators, allocation and Python) refuses bad arguments."""
    from benchmarks import roundcost
    from benchmarks.common import cpu_model

    name = cpu_model()
    assert name and f"{__import__('os').cpu_count()} CPUs)" in name and "(" in name
    assert (
        roundcost.main(["--arms", "nope"]) == 2
        and "--arms='nope' --n=1 --repeats=5 is invalid" in capsys.readouterr().err
    )


@pytest.mark.slow
def test_roundcost_parts_add_up_to_the_wall_time():
    """A sampler call's split (one arm, one repeat: about 6 s) adds up to its uninstrumented wall time."""
    from benchmarks import roundcost

    rows = roundcost.measure(("rmc chain14",), n=1, repeats=1, progress=None)
    (rmc,) = rows
    assert rmc["rounds"] > 0 and rmc["ops"] > 0
    for r in rows:  # the parts add up to the uninstrumented wall time
        parts = r["network_ms"] + r["tables_ms"] + r["aten_ms"] + r["alloc_ms"] + r["python_ms"]
        assert (
            math.isclose(parts, r["wall_ms"], rel_tol=1e-9) and min(r["network_ms"], r["aten_ms"], r["python_ms"]) >= 0
        )
    assert rmc["tables_ms"] > 0


def test_golden_compare_sees_a_changed_bit_and_ignores_wall_time(tmp_path):
    """benchmarks.golden: records equal minus volatile keys, samples bitwise (one flipped ulp is a difference)."""
    import json

    import torch

    from benchmarks import golden

    for side, wall in (("a", 0.5), ("b", 0.7)):
        d = tmp_path / side / "cfg"
        d.mkdir(parents=True)
        (d / "result.json").write_text(
            json.dumps({"nfe": {"mean": 3.0}, "wall_seconds": wall, "versions": {"git": side}, "output_dir": str(d)})
        )
        torch.save(torch.tensor([1.0, -0.0, float("nan")], dtype=torch.float64), d / "samples.pt")
    assert golden.compare(tmp_path / "a", tmp_path / "b") == []
    x = torch.tensor([1.0, 0.0, float("nan")], dtype=torch.float64)  # -0.0 -> 0.0: equal under ==, not bitwise
    torch.save(x, tmp_path / "b" / "cfg" / "samples.pt")
    assert golden.compare(tmp_path / "a", tmp_path / "b") == ["cfg: samples.pt differs"]
    assert set(golden.CONFIGS) >= {
        "gmm_dgrs_path",
        "gmm_dgrs_tree",
        "gmm_markmax",
        "gmm_refine1",
        "digits_x0_optimal14",
        "patches32_dgrs",
    }


def test_samplers_benchmark_keeps_counts_apart_from_timings_and_refuses_bad_arguments(tmp_path, capsys):
    # the mixture at d = 8, DDPM at 12 steps and flow matching at 6, one image for the counts, one timed repeat:
    # every configuration has a counts row (no timing in it) and a timing row beside the loop's, the estimate
    # is there, the CSV has one row per counts row
    import csv

    from benchmarks import samplers

    out = tmp_path / "s.json"
    assert (
        samplers.main(
            [
                "--tiny",
                "--n",
                "1",
                "--repeats",
                "1",
                "--cases",
                "ddpm:12,flow_stochastic:6",
                "--targets",
                "gmm",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    res = json.loads(out.read_text())
    assert res["n"] == 1 and (len(res["commit"]) == 40 or res["commit"] == "unknown")
    names = [c.name for c in samplers.CONFIGS]
    for case in ("ddpm 12", "flow_stochastic 6"):
        counts = [c for c in res["counts"] if c["case"] == case]
        assert [c["config"] for c in counts] == names
        for c in counts:
            assert not {"median_s", "wall_speedup"} & set(c)
            assert c["loop_calls_per_image"] / c["calls_per_image"] == pytest.approx(c["nfe_speedup"])
            assert c["calls_per_image"] <= c["rows_per_image"] and all(
                0 <= a <= 1 for a in c["acceptance_by_depth"] if a is not None
            )
        timed = [t["arm"] for t in res["timings"] if t["case"] == case]
        assert timed == ["loop", *names]
    assert {"chain 14", "chain 62", "chain 14 walk", "chain 62 walk"} <= set(res["estimate"][0])
    with open(out.with_suffix(".csv"), newline="") as f:
        assert len(list(csv.DictReader(f))) == len(res["counts"])
    rows = samplers.search(("gmm",), configs=samplers.SEARCH[:1], n=1, steps=12, tiny=True, progress=None)
    assert rows[0]["config"] == samplers.SEARCH[0].name and rows[0]["calls_per_image"] >= 1
    capsys.readouterr()
    assert samplers.main(["--cases", "ddim:50"]) == 2
    assert "--cases='ddim:50'" in capsys.readouterr().err
    assert samplers.main(["--targets", "cifar"]) == 2
    assert "--targets='cifar'" in capsys.readouterr().err


@pytest.mark.parametrize("kernel,steps", [("ddpm", 20), ("euler_ancestral", 10), ("flow_stochastic", 8)])
def test_samplers_benchmark_loop_samples_the_kernels_law(kernel, steps):
    """The benchmark's baseline (diffusers' own loop on the mixture presented in the scheduler's parametrisation)
    and specsamp's standard sampler of the same plan draw the same law. Seed 0 for the loop's torch.Generator and
    for specsamp, n = 2000 per side, d = 8; the smallest two-sample KS p over 4 fixed projections and the norm must
    exceed 1e-3 (a fixed draw, so the test is deterministic; under the null, min of 5 is below 1e-3 with
    probability about 0.005)."""
    from scipy import stats

    from benchmarks import samplers
    from specsamp.sampler import sample_standard

    target = samplers.make_target("gmm", tiny=True)
    plan = samplers.plan_of(kernel, steps, target)
    net = samplers.SchedulerNetwork(target.model, plan)
    n = 2000
    ref = samplers.scheduler_loop(samplers.scheduler(kernel, "gmm"), steps, net, (8,), torch.float64, seed=0, batch=n)
    ours = sample_standard(target.model, plan.schedule, n, seed=0).samples
    g = torch.Generator().manual_seed(7)
    dirs = torch.randn(4, 8, generator=g, dtype=torch.float64)
    p = [stats.ks_2samp((ref @ d).numpy(), (ours @ d).numpy()).pvalue for d in dirs]
    p.append(stats.ks_2samp(ref.norm(dim=1).numpy(), ours.norm(dim=1).numpy()).pvalue)
    assert min(p) > 1e-3, p


def test_revlatency_refuses_unknown_arms_before_it_checks_anything_out(capsys):
    from benchmarks.revlatency import main

    with pytest.raises(SystemExit) as e:
        main(["HEAD", "--arms", "standard,nope"])
    assert e.value.code == 2 and "['nope'] unknown" in capsys.readouterr().err


def test_presets_counts_and_timings_run_every_sampler_at_a_tiny_size():
    """The presets benchmark's code path (``benchmarks.presets``) on an 8-d mixture at 6 steps: each sampler's counts
    and one-image timings against its loop, and the table."""
    import torch
    from helpers import wide_denoiser

    from benchmarks import presets

    arms = {"rmc chain 4": presets.ARMS["rmc chain 4"], "dgrs 2x3": presets.ARMS["dgrs 2x3"]}
    rows = []
    for sampler in ("euler_a", "dpmpp_2m_sde", "ddim", "euler_a_rf"):
        model = presets.as_flow(wide_denoiser) if presets.SAMPLERS[sampler][3] else wide_denoiser
        row = {"target": "tiny", "sampler": sampler, "steps": 6, "arms": {}}
        for name, arm in arms.items():
            c = presets.counts(model, (8,), torch.float64, sampler, 6, arm, 2, {})
            assert 1 <= c["calls"] <= 6 + 1 and c["rows"] > 0 and len(c["acceptance"]) >= 1
            row["arms"][name] = c
        t = presets.timings(model, (8,), torch.float64, sampler, 6, arms, 0.0, 1, {})
        assert set(t) == {"loop", *arms} and all(v["median_s"] > 0 for v in t.values())
        row["time_pad0ms"] = t
        rows.append(row)
    text = presets.markdown({"rows": rows})
    assert "ddim 6" in text and "wall 0ms" in text


def test_bench_auto_runs_every_arm_at_a_tiny_size_and_refuses_bad_cells(tmp_path, capsys):
    # the mixture at d = 8, DDPM at 8 steps, one image, real calls, one repeat: every arm is timed, the ratios and
    # auto's plan and first-run setup are recorded, the CSV has the cell; a bad cell is refused before any run
    import csv

    from benchmarks import auto

    out = tmp_path / "auto.json"
    argv = ["--tiny", "--cells", "gmm/ddpm:8/1/real", "--repeats", "1", "--search-repeats", "1", "--out", str(out)]
    assert auto.main(argv) == 0
    doc = json.loads(out.read_text())
    assert doc["threads"] == 1 and doc["cpu"] and len(doc["cells"]) == 1
    cell = doc["cells"][0]
    assert list(cell["arms"]) == ["loop", "paradigms", "grid", "auto"]
    assert cell["arms"]["loop"]["calls"] == 8 and cell["arms"]["paradigms"]["sequential_calls"] >= 1
    assert cell["grid"]["best"] in doc["grid"] and set(cell["ratios"]) == {
        "auto_vs_loop",
        "auto_vs_paradigms",
        "auto_vs_grid",
    }
    assert cell["setup"]["curve_source"] == "measured" and cell["auto"]["sources"] == ["cached/cached"]
    with open(out.with_suffix(".csv"), newline="") as f:
        assert len(list(csv.DictReader(f))) == 1
    assert "| gmm | ddpm 8 | 1 | real |" in auto.markdown(doc)
    assert auto.main(["--cells", "gmm/ddpm:8/1/gpu"]) == 2 and "invalid" in capsys.readouterr().err
    assert ("digits", "ddpm:1000", 1, "pad20") in auto.COMMITTED and make_target_runs("bench-auto", "benchmarks.auto")


def make_target_runs(target: str, module: str) -> bool:
    out = subprocess.run(["make", "-n", target], capture_output=True, text=True, check=True).stdout
    return module in out


def test_bench_auto_paradigms_with_a_tight_tolerance_is_the_sequential_chain():
    # ParaDiGMS' Picard windows converge to the chain on the same noise: at tolerance 1e-9 the window of 64 ends
    # where the window of one (the sequential chain) does; at the pipeline's tolerance, in fewer sequential calls
    from diffusers import DDPMParallelScheduler

    from benchmarks import auto
    from benchmarks.samplers import make_target, plan_of

    target = make_target("gmm", tiny=True)
    plan = plan_of("ddpm", 20, target)
    net = auto.BatchedSchedulerNetwork(target.model, plan)
    kw = dict(net=net, event_shape=(8,), dtype=torch.float64, seed=3, batch=2)
    seq, calls1 = auto.paradigms(DDPMParallelScheduler(), 20, window=1, **kw)
    par, calls64 = auto.paradigms(DDPMParallelScheduler(), 20, tolerance=1e-9, **kw)
    _, calls_default = auto.paradigms(DDPMParallelScheduler(), 20, **kw)
    assert calls1 == 20 and calls64 <= 20 and calls_default < 20
    torch.testing.assert_close(par, seq, rtol=1e-6, atol=1e-6)
