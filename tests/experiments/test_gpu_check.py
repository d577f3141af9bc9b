"""The GPU check's entry and its bare-image rehearsal; import hygiene of the core; EDM's CIFAR-10 layout."""

from __future__ import annotations

import json

import pytest
import torch
from bare_env import DEVICE_LACKS, NOT_CORE, run_blocked

CORE = (
    "specsamp",
    "specsamp.sampler",
    "specsamp.coupling",
    "specsamp.listcoupling",
    "specsamp.drafts",
    "specsamp.trees",
    "specsamp.treesearch",
    "specsamp.schedule",
    "specsamp.rng",
    "specsamp.theory",
    "specsamp.testing",
    "specsamp.models",
    "specsamp.models.edm",
    "specsamp.models.gmm",
    "benchmarks.stand_in",
    "benchmarks.ddpmpp",
    "benchmarks.gpu_check",
)


def test_core_edm_adapter_and_stand_ins_import_with_torch_numpy_scipy_only():
    # every package beyond torch, numpy and scipy blocked; the shipped digits pickle loads by its table hash
    # and answers one call; nothing blocked was even attempted in a way that got through
    code = f"""
import importlib, torch
for m in {CORE!r}:
    importlib.import_module(m)
from specsamp.models.edm import CHECKPOINTS, EDMVelocity, load_edm
ck = CHECKPOINTS["edm-digits-8x8-cond"]
model = EDMVelocity(load_edm(ck.url, sha256=ck.sha256, download=False))
v = model(torch.zeros(2, 1, 8, 8), torch.full((2,), 0.5), class_labels=torch.tensor([1, 2]))
assert v.shape == (2, 1, 8, 8) and bool(torch.isfinite(v).all())
leaked = sorted(m for m in sys.modules if m.partition('.')[0] in _Blocker.blocked)
assert not leaked, leaked
print("ok")
"""
    p = run_blocked(code, NOT_CORE, timeout=180)
    assert p.returncode == 0 and p.stdout.strip().endswith("ok"), p.stderr[-3000:]


def test_models_missing_marker_is_omegaconf_missing():
    # the runner's schemas keep their mandatory keys: the models' marker is OmegaConf's own
    omegaconf = pytest.importorskip("omegaconf")
    from specsamp.models import base

    assert base.MISSING == omegaconf.MISSING
    from specsamp.runner.config import compose, load_config

    with pytest.raises(Exception, match="name|paper|MISSING|missing|mandatory"):
        from omegaconf import OmegaConf

        OmegaConf.to_object(OmegaConf.structured(base.TargetConfig))
    assert load_config(compose(["model=digits"]))[0].model.name == "edm-digits-8x8-cond"


@pytest.mark.slow  # 12-28 s: kept out of the default run's 15 minutes; CI runs it with -m slow
def test_rehearsal_of_the_device_run_in_a_bare_environment(tmp_path):
    # `python3 -m benchmarks.gpu_check --device cpu --tiny` as the device runs it: the packages its image lacks
    # blocked, the output folder from $OUT; every section's JSON appears, each ran, and the exit status is 0
    code = "import runpy; sys.argv[0] = 'gpu_check'; runpy.run_module('benchmarks.gpu_check', run_name='__main__')"
    p = run_blocked(code, DEVICE_LACKS, args=("--device", "cpu", "--tiny"), env={"OUT": str(tmp_path)}, timeout=240)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    from benchmarks.gpu_check import SECTIONS

    assert sorted(f.name for f in tmp_path.iterdir()) == sorted([f"{s}.json" for s in SECTIONS] + ["summary.txt"])
    for s in SECTIONS:
        rec = json.loads((tmp_path / f"{s}.json").read_text())
        assert rec["section"] == s and rec["status"] == "ok" and rec["passed"], (s, rec.get("error"))
        assert rec["elapsed_s"] >= rec["seconds"] >= 0
    wc = json.loads((tmp_path / "wallclock.json").read_text())["result"]
    arms = {r["arm"] for r in wc["rows"]}
    assert arms == {"standard", "dgrs (2,3)", "dgrs (2,5)", "rmc chain 14", "x0+optimal B=14", "x0+optimal B=62"}
    assert {r["batch"] for r in wc["rows"]} == {1, 2} and all(r["wall_s"]["n"] == 2 for r in wc["rows"])
    cc = json.loads((tmp_path / "call_cost.json").read_text())["result"]["networks"]
    assert [c["rows"] for c in cc["cifar10_ddpmpp"]["curves"]["bfloat16"]] == [1, 2, 4, 8]
    summary = (tmp_path / "summary.txt").read_text()
    assert "every section ran" in summary and "elapsed" in summary and "projection" in summary
    assert "## call_cost: ok" in p.stdout  # elapsed time printed as each section ends


def test_a_failing_section_is_recorded_and_the_next_still_runs(tmp_path, monkeypatch):
    from benchmarks import gpu_check

    def broken(ctx):
        raise RuntimeError("planted failure")

    monkeypatch.setitem(gpu_check.SECTION_FNS, "call_cost", broken)
    rc = gpu_check.main(
        ["--device", "cpu", "--tiny", "--sections", "call_cost,projection,compile", "--out", str(tmp_path)]
    )
    assert rc == 1
    rec = {s: json.loads((tmp_path / f"{s}.json").read_text()) for s in ("call_cost", "projection", "compile")}
    assert rec["call_cost"]["status"] == "error" and "planted failure" in rec["call_cost"]["traceback"]
    assert rec["projection"]["status"] == "error" and "needs the call_cost" in rec["projection"]["error"]
    assert rec["compile"]["status"] == "ok"
    assert "call_cost error" in (tmp_path / "summary.txt").read_text()


def test_a_spent_budget_skips_sections_and_exits_1(tmp_path):
    from benchmarks import gpu_check

    rc = gpu_check.main(
        ["--device", "cpu", "--tiny", "--sections", "compile", "--budget-s", "1e-9", "--out", str(tmp_path)]
    )
    rec = json.loads((tmp_path / "compile.json").read_text())
    assert rc == 1 and rec["status"] == "skipped" and "budget" in rec["reason"]


@pytest.mark.parametrize(
    "argv, key",
    [
        (["--sections", "wallclock,nope"], "--sections"),
        (["--repeats", "0"], "--repeats"),
        (["--batches", "1,x"], "--batches"),
        (["--device", "tpu"], "--device"),
        (["--budget-s", "0"], "--budget-s"),
    ],
)
def test_bad_arguments_exit_2_naming_the_key(argv, key, capsys):
    from benchmarks import gpu_check

    with pytest.raises(SystemExit) as e:
        gpu_check.main(["--tiny", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert key in err and "is invalid" in err and "Traceback" not in err


def test_edm_cifar10_layout_has_edms_parameter_count_and_shapes():
    # Karras et al. (2022) give 55.7M parameters for the DDPM++ CIFAR-10 network; the layout must land within 5%
    from benchmarks.ddpmpp import ddpmpp_cifar10

    net = ddpmpp_cifar10(seed=0)
    n = sum(p.numel() for p in net.parameters())
    assert abs(n / 55.7e6 - 1) < 0.05, n
    attn = [k for k, m in net.model.named_modules() if getattr(m, "attention", False)]
    assert len(attn) == 4 + 1 + 1 and all(k.startswith(("enc.r16", "dec.r16", "dec.r8_in0")) for k in attn), attn
    with torch.no_grad():
        d = net(torch.randn(2, 3, 32, 32), torch.tensor([0.5, 20.0]), torch.eye(10)[:2])
    assert d.shape == (2, 3, 32, 32) and d.dtype == torch.float32 and bool(torch.isfinite(d).all())


def test_x0_optimal_arms_are_the_runners_tree_optimal():
    # the wall-clock arms search the same tree that `tree=optimal budget=B delta_profile=<shipped>` builds
    from benchmarks.gpu_check.wallclock import x0_optimal_tree
    from specsamp.coupling import get_coupling
    from specsamp.runner.build import build_tree, given_profile
    from specsamp.runner.config import compose, load_config

    for B in (14, 62):
        run = load_config(
            compose(
                [
                    "model=digits",
                    "sampler=dgrs",
                    "draft=x0",
                    "tree=optimal",
                    f"budget={B}",
                    "delta_profile=edm-digits-8x8-cond_x0",
                ]
            )
        )[0]
        tree, budget = build_tree(run, get_coupling("dgrs"), run.steps - 2, given_profile(run))
        assert budget == B and torch.equal(
            torch.as_tensor(tree.parent), torch.as_tensor(x0_optimal_tree(B, run.steps).parent)
        )


def test_timed_model_records_rows_and_projection_prices_them():
    from benchmarks.common import TimedModel
    from benchmarks.gpu_check.projection import _interp
    from specsamp.models.gmm import GaussianMixture

    m = TimedModel(GaussianMixture(4, 2, 0))
    m(torch.zeros(3, 4, dtype=torch.float64), torch.full((3,), 0.5))
    m(torch.zeros(5, 4, dtype=torch.float64), torch.full((5,), 0.5))
    assert m.rows == [3, 5] and m.network_s() > 0
    curve = [
        {"rows": 1, "seconds": {"median": 1.0}},
        {"rows": 4, "seconds": {"median": 2.5}},
        {"rows": 8, "error": "oom"},
    ]
    assert [_interp(curve, r) for r in (1, 2, 4, 8)] == [1.0, 1.5, 2.5, 5.0]


def test_cuda_vs_cpu_comparison_sees_a_perturbed_run():
    # the comparison is not vacuous: a run whose velocities carry a 1e-3 relative error is caught
    from benchmarks.gpu_check.cuda_vs_cpu import _compare, _Scaled
    from benchmarks.gpu_check.support import run_arm
    from specsamp.models.gmm import GaussianMixture
    from specsamp.schedule import Schedule
    from specsamp.trees import DraftTree

    gmm = GaussianMixture(8, 3, 0)
    sched = Schedule.make(12, 0.3)
    arm = {"name": "dgrs", "tree": DraftTree.uniform(2, 3), "coupling": "dgrs", "draft": "velocity"}
    a = run_arm(gmm, arm, sched, 32, 0)
    same, diff = _compare(a, run_arm(gmm, arm, sched, 32, 0))
    assert bool(same.all()) and float(diff.max()) == 0.0
    same, diff = _compare(a, run_arm(_Scaled(gmm, 1e-3), arm, sched, 32, 0))
    assert float(diff.max()) > 1e-6


def test_stand_in_preset_of_edms_layout_needs_no_diffusers():
    from benchmarks.stand_in import stand_in_velocity

    model, params = stand_in_velocity("ddpmpp-cifar10")
    assert params == sum(p.numel() for p in model.net.parameters()) and abs(params / 55.7e6 - 1) < 0.05
    assert model.event_shape == (3, 32, 32) and model.label_dim == 10


def test_sampler_compile_keyword_is_used_when_the_sampler_takes_it(monkeypatch):
    # another module may add sample_speculative(..., compile=...): the check then times both settings
    from benchmarks import gpu_check
    from benchmarks.gpu_check import compile_check

    seen = []

    def with_compile(*args, compile=False, **kw):
        seen.append(compile)
        return real(*args, **kw)

    real = compile_check.sample_speculative
    monkeypatch.setattr(compile_check, "sample_speculative", with_compile)
    ctx = gpu_check.Context(gpu_check._args(["--device", "cpu", "--tiny"]))
    rows = compile_check._sampler_compiled(ctx)
    assert [r["variant"] for r in rows] == ["sampler compile=False", "sampler compile=True"]
    assert rows[1]["counts_equal"] is True and rows[1]["speedup_vs_eager"] > 0
    assert sorted(set(seen)) == [False, True] and len(seen) == 2 * (1 + ctx.repeats)


def test_a_terminated_run_keeps_what_the_running_section_finished(tmp_path, monkeypatch):
    # `timeout` sends SIGTERM: the running section's finished measurements are written, the rest marked skipped
    import os
    import signal

    from benchmarks import gpu_check

    def cut(ctx):
        ctx.partial.setdefault("rows", []).append({"arm": "standard", "batch": 1})
        os.kill(os.getpid(), signal.SIGTERM)
        raise AssertionError("not reached")

    monkeypatch.setitem(gpu_check.SECTION_FNS, "wallclock", cut)
    rc = gpu_check.main(["--device", "cpu", "--tiny", "--sections", "wallclock,compile", "--out", str(tmp_path)])
    wc, comp = (json.loads((tmp_path / f"{s}.json").read_text()) for s in ("wallclock", "compile"))
    assert rc == 1 and wc["status"] == "error" and "SIGTERM" in wc["error"]
    assert wc["partial"]["rows"] == [{"arm": "standard", "batch": 1}]
    assert comp["status"] == "skipped" and "SIGTERM" in comp["reason"]
    assert signal.getsignal(signal.SIGTERM) is not gpu_check._on_sigterm


def test_host_syncs_are_counted_by_source_line(monkeypatch):
    # torch's sync debug mode (CUDA only) warns at each synchronising operation; here a model warns the same
    # words at every call, so the count is the number of calls, all at one line of this file
    import warnings

    from benchmarks.common import TimedModel
    from benchmarks.gpu_check.wallclock import host_syncs
    from specsamp.models.gmm import GaussianMixture
    from specsamp.schedule import Schedule
    from specsamp.trees import DraftTree

    modes = []
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)

    class Syncing(TimedModel):
        def __call__(self, x, sigma, **cond):
            warnings.warn("called a synchronizing CUDA operation", stacklevel=1)  # attributed to this line
            return super().__call__(x, sigma, **cond)

    model = Syncing(GaussianMixture(4, 2, 0))
    arm = {"name": "dgrs", "tree": DraftTree.uniform(2, 3), "coupling": "dgrs", "draft": "velocity"}
    out = host_syncs(model, arm, Schedule.make(10, 0.3), 3, 0)
    assert out["total"] == len(model.rows) > 0 and modes == ["warn", 0]
    assert len(out["where"]) == 1 and out["where"][0][0].startswith("tests/experiments/test_gpu_check.py:")


def test_the_command_runs_the_package_and_writes_each_record_once(tmp_path):
    # `python3 -m benchmarks.gpu_check` runs the package's __main__; one section's record and the summary,
    # written atomically (no temporary file left), the record's fields as results/gpu/README.md documents them
    import sys

    from helpers import ROOT, python

    p = python(
        [
            sys.executable,
            "-m",
            "benchmarks.gpu_check",
            "--device",
            "cpu",
            "--tiny",
            "--sections",
            "compile",
            "--out",
            str(tmp_path),
        ],
        cwd=ROOT,
        timeout=120,
    )
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert sorted(f.name for f in tmp_path.iterdir()) == ["compile.json", "summary.txt"]
    rec = json.loads((tmp_path / "compile.json").read_text())
    assert list(rec) == ["section", "env", "tiny", "seed", "status", "passed", "result", "seconds", "elapsed_s"]
    assert rec["env"]["device"] == "cpu" and {"torch", "python", "cpu_threads", "matmul_allow_tf32", "date"} <= set(
        rec["env"]
    )
    assert "# every section ran: compile ok" in (tmp_path / "summary.txt").read_text()
