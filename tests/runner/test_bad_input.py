"""Bad input at the edges of run.py and the calibration command: each exits with its documented status
(2: the user's config, 3: the machine) and one paragraph naming the key, its value and what is valid,
with no traceback and nothing already written lost. In-process where the check is a function; a
subprocess only where the exit status itself is what is checked.
"""

from __future__ import annotations

import errno
import json
import os
import sys
from pathlib import Path

import pytest
import torch
from helpers import ROOT, TINY, python

from specsamp.errors import ConfigError
from specsamp.runner import exits
from specsamp.runner.config import PROFILE_DIR, compose, load_config

NO_GPU = not torch.cuda.is_available()


def run(args, cwd, module=None):
    """``python run.py ARGS`` (or ``python -m MODULE ARGS``) in ``cwd``; ``.err`` is stderr stripped."""
    env = dict(
        os.environ,
        WANDB_MODE="offline",
        HYDRA_FULL_ERROR="0",
        PYTHONPATH=os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
    )
    head = ["-m", module] if module else [str(ROOT / "run.py")]
    p = python([sys.executable, *head, *args], cwd=cwd, capture_output=True, text=True, env=env, timeout=300)
    p.err = p.stderr.strip()
    return p


def one_paragraph(p, status: int) -> str:
    assert p.returncode == status, p.stdout + p.stderr
    assert p.err.startswith("error: ") and "\n" not in p.err and "Traceback" not in p.stdout + p.stderr, p.err
    return p.err


# ------------------------------------------------------------------------------------------------
# a sweep that no job can run is refused once, before launching


@pytest.mark.skipif(not NO_GPU, reason="needs a machine where torch sees no CUDA device")
def test_a_sweep_wide_error_is_refused_once_and_writes_nothing(tmp_path):
    p = run(["-m", *TINY, "device=cuda", "K=1,2", "L=2,3", "sweep_name=gpu"], tmp_path)
    err = one_paragraph(p, 2)
    assert err.startswith(
        "error: none of the sweep's 4 jobs can run, so nothing was launched. Every job: device='cuda'"
    )
    assert err.count("torch sees no CUDA device") == 1 and "failed" not in p.stdout
    assert not (tmp_path / "multirun").exists()


def test_a_bad_value_in_every_cell_names_each_error_once(tmp_path):
    p = run(["-m", *TINY, "K=0,-1", "sweep_name=bad"], tmp_path)
    err = one_paragraph(p, 2)
    assert (
        "none of the sweep's 2 jobs can run" in err
        and "Job K=0: K=0 is invalid" in err
        and "; job K=-1: K=-1 is invalid" in err
    )
    assert not (tmp_path / "multirun").exists()


def test_validate_true_refuses_a_sweep_with_one_bad_value(tmp_path):
    p = run(["-m", "hydra.sweeper.validate=true", *TINY, "K=1,0", "sweep_name=v"], tmp_path)
    err = one_paragraph(p, 2)
    assert "1 of the sweep's 2 jobs cannot run and hydra.sweeper.validate=true" in err and "K=0 is invalid" in err
    assert not (tmp_path / "multirun").exists()


def test_refusal_groups_jobs_by_error():
    from hydra_plugins.specsamp_sweeper import refusal

    text = refusal([("K=1", "device='cuda' is invalid."), ("K=2", "device='cuda' is invalid.")], 2, False)
    assert "Every job: device='cuda' is invalid;" not in text and "Every job: device='cuda' is invalid. Fix" in text
    many = refusal([(f"K={k}", f"K={k} is bad") for k in range(5)], 5, False)
    assert many.count("is bad") == 3 and "2 more distinct errors" in many


def test_machine_checks_can_be_left_to_the_machine_that_runs_the_job():
    """A sweep submitted to SLURM checks everything but the device and compile on the login node."""
    cfg = compose(["device=cuda:7"])
    if torch.cuda.device_count() < 8:
        with pytest.raises(ConfigError, match="device='cuda:7' is invalid"):
            load_config(cfg)
    run_, _ = load_config(cfg, here=False)
    assert run_.device == "cuda:7"
    with pytest.raises(ConfigError, match="K=0 is invalid"):
        load_config(compose(["device=cuda", "K=0"]), here=False)


# ------------------------------------------------------------------------------------------------
# the sweeper's own keys; a launcher given with a dot; -m with --cfg


def test_sweeper_keys_are_checked():
    from hydra_plugins.specsamp_sweeper import check_sweeper_keys

    for args, needle in [
        (("abc", None, False), "hydra.sweeper.max_batch_size='abc' is invalid: must be an integer >= 1"),
        ((-1, None, False), "hydra.sweeper.max_batch_size=-1 is invalid"),
        ((0, None, False), "hydra.sweeper.max_batch_size=0 is invalid"),
        ((True, None, False), "hydra.sweeper.max_batch_size=True is invalid"),
        ((None, "K=1", False), "hydra.sweeper.params='K=1' is invalid: must be a mapping"),
        ((None, None, "maybe"), "hydra.sweeper.validate='maybe' is invalid: must be true"),
    ]:
        with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(")", r"\)")):
            check_sweeper_keys(*args)
    check_sweeper_keys(2, {"K": "1,2"}, True)


def test_a_bad_sweeper_key_exits_2_with_its_paragraph(tmp_path):
    err = one_paragraph(run(["-m", "hydra.sweeper.max_batch_size=abc", *TINY, "K=1,2"], tmp_path), 2)
    assert "hydra.sweeper.max_batch_size='abc' is invalid" in err and "null (the whole grid at once)" in err


def test_a_launcher_given_with_a_dot_names_the_slash():
    text = exits.group_given_as_key(["-m", "hydra.launcher=local", "K=1,2"])
    assert text.startswith("hydra.launcher=local is invalid") and "hydra/launcher=local" in text
    assert "basic, local, slurm, slurm_cpu, slurm_gpu" in text and "hydra.launcher.FIELD=VALUE" in text
    assert "hydra/sweeper=specsamp" in exits.group_given_as_key(["hydra.sweeper=specsamp"])
    assert "hydra/launcher=NAME" in exits.group_given_as_key(["hydra.launcher=nosuch"])
    for fine in (["hydra/launcher=local"], ["hydra.launcher.timeout_min=3"], ["K=1"]):
        assert exits.group_given_as_key(fine) is None


def test_multirun_with_cfg_is_refused_in_one_paragraph(tmp_path):
    assert exits.conflicting_modes(["K=1", "--cfg", "job"]) is None
    assert "--multirun and --info" in exits.conflicting_modes(["--multirun", "--info"])
    err = one_paragraph(run(["-m", *TINY, "K=1,2", "--cfg", "job"], tmp_path), 2)
    assert "-m (--multirun) and --cfg cannot be given together" in err and "python run.py K=1 --cfg job" in err
    err = one_paragraph(run(["-m", "hydra.launcher=local", "K=1,2"], tmp_path), 2)
    assert "hydra/launcher=local" in err


# ------------------------------------------------------------------------------------------------
# an output folder that cannot be created is the machine's; a missing input file the user's


def _raised(fn):
    try:
        fn()
    except OSError as e:
        return e
    raise AssertionError("no error")


def test_enoent_is_infrastructure_only_while_creating_a_directory(tmp_path):
    made = _raised(lambda: Path(tmp_path / "missing" / "out").mkdir())  # Hydra's and specsamp.io's mkdir
    assert made.errno == errno.ENOENT and exits.is_infrastructure(made)
    assert "could not create the directory" in exits.infrastructure_message(
        made
    ) and "hydra.run.dir=DIR" in exits.infrastructure_message(made)
    opened = _raised(lambda: open(tmp_path / "missing.json"))
    assert not exits.is_infrastructure(opened)


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs /proc")
@pytest.mark.parametrize(
    "args",
    [["hydra.run.dir=/proc/specsamp-out"], ["-m", "hydra.sweep.dir=/proc/specsamp-sweep", "K=1,2"]],
    ids=["run", "sweep"],
)
def test_an_output_folder_on_proc_exits_3(tmp_path, args):
    err = one_paragraph(run([*args, *TINY], tmp_path), 3)
    assert "could not create the directory /proc/specsamp-" in err and "No such file or directory" in err


def test_a_missing_profile_file_stays_a_config_error(tmp_path):
    err = one_paragraph(
        run(
            [*TINY, "tree=optimal", f"delta_profile={tmp_path / 'no' / 'p.json'}", f"hydra.run.dir={tmp_path / 'o'}"],
            tmp_path,
        ),
        2,
    )
    assert "delta_profile=" in err and "does not exist" in err


# ------------------------------------------------------------------------------------------------
# the calibration command keeps the shipped profiles


def test_calibrate_refuses_to_replace_a_shipped_profile(tmp_path, monkeypatch):
    import experiments.calibrate as calibrate
    from experiments.calibrate import main

    shipped = tmp_path / "profiles" / "gmm_x0.json"  # a copy, so that a build without the check dirties nothing
    shipped.parent.mkdir()
    shipped.write_bytes((PROFILE_DIR / "gmm_x0.json").read_bytes())
    monkeypatch.setattr(calibrate, "PROFILE_DIR", shipped.parent)
    before = shipped.read_bytes()
    with pytest.raises(
        ConfigError,
        match=r"out=.*gmm_x0.json is invalid: it is the shipped profile delta_profile=gmm_x0.*overwrite=true",
    ):
        main(["model=gmm", "draft=x0", f"out={shipped}"])
    with pytest.raises(ConfigError, match="overwrite=yes is invalid: must be true"):
        main(["draft=x0", "overwrite=yes"])
    assert shipped.read_bytes() == before


def test_calibrate_writes_under_outputs_by_default(tmp_path, monkeypatch, capsys):
    from experiments.calibrate import main

    monkeypatch.chdir(tmp_path)
    out = main([*TINY, "draft=x0", "trajectories=4"])
    assert out.parent.parent.parent == Path("outputs") and out.name == "gmm_x0.json"
    assert json.loads((tmp_path / out).read_text())["calibration"]["trajectories"] == 4
    assert f"-> {out}" in capsys.readouterr().out


def test_calibrate_into_an_uncreatable_folder_exits_3(tmp_path):
    (tmp_path / "blocker").write_text("precious")
    p = run(
        [*TINY, "draft=x0", "trajectories=4", f"out={tmp_path / 'blocker' / 'p.json'}"],
        tmp_path,
        module="experiments.calibrate",
    )
    err = one_paragraph(p, 3)
    assert (
        f"could not create the directory {tmp_path / 'blocker'}" in err
        and "out=PATH" in err
        and "hydra.run.dir" not in err
    )
    assert (tmp_path / "blocker").read_text() == "precious"


def test_the_makefile_and_docs_calibrate_commands_do_not_touch_shipped_profiles():
    for name in ("Makefile", "README.md", "results/README.md", "docs/running.md"):
        for line in (ROOT / name).read_text().splitlines():
            if "experiments.calibrate" in line and "conf/profiles/" in line and "out=conf/profiles" in line:
                assert "overwrite=true" in line, (name, line)


# ------------------------------------------------------------------------------------------------
# messages name the keys the user sets


def test_memory_refusal_names_the_sampler_value():
    from specsamp.runner.loop import run_config

    with pytest.raises(ConfigError, match=r"sampler=dgrs \(execution=path\) needs about"):
        run_config(compose(["K=1000000", "L=1"]))


def test_demo_prompts_count_names_n_samples():
    from specsamp.models.sd3.prompts import demo_prompts, load_prompts

    with pytest.raises(ValueError, match="n_samples=100 is invalid with the demo prompts.*use n_samples<=20"):
        load_prompts("demo", 100, n_key="n_samples")
    with pytest.raises(ValueError, match="n=21 is invalid"):
        demo_prompts(21)


def test_a_checkpoint_not_in_the_cache_says_what_loading_it_needs(tmp_path):
    from specsamp.models.edm import load_edm

    with pytest.raises(FileNotFoundError) as e:
        load_edm("edm-cifar10-32x32-cond-vp", cache_dir=tmp_path, download=False)
    assert "model.sha256=<its SHA-256>" in str(e.value) and "model.trust_checkpoint=true" in str(e.value)
    with pytest.raises(FileNotFoundError) as e:
        load_edm("edm-cifar10-32x32-cond-vp", cache_dir=tmp_path, download=False, trust_checkpoint=True)
    assert "model.sha256" not in str(e.value)


# ------------------------------------------------------------------------------------------------
# resume: what the docs say


def test_an_ad_hoc_sweep_resumes_with_the_sweep_name_its_summary_prints(tmp_path):
    """Without sweep_name a sweep goes to multirun/DATE/TIME; the summary's resume line gives the
    sweep_name that relaunches into it, and that relaunch skips the finished job."""
    from specsamp.runner.report import resume_hint

    assert resume_hint("multirun/2026-01-02/03-04-05").endswith(
        "sweep_name=2026-01-02/03-04-05 (its finished jobs are skipped)"
    )
    assert "hydra.sweep.dir=/x/sw" in resume_hint("/x/sw")
    p = run(["-m", *TINY, "K=1,0"], tmp_path)
    assert p.returncode == 2, p.stdout + p.stderr
    line = next(x for x in p.stdout.splitlines() if x.strip().startswith("resume: "))
    name = line.split("sweep_name=")[1].split()[0]
    again = run(["-m", *TINY, "K=1,0", f"sweep_name={name}"], tmp_path)
    assert again.returncode == 2 and "1 skipped (done before)" in again.stdout, again.stdout
    assert len(list((tmp_path / "multirun").glob("*/*/K=1,*/result.json"))) == 1


# ------------------------------------------------------------------------------------------------
# paths: sweep_name stays below multirun/, output folders hold no control characters


def _inprocess(args, cwd, monkeypatch):
    from helpers import run_inprocess

    monkeypatch.chdir(cwd)
    return run_inprocess(args, cwd / "single", monkeypatch)


BAD_SWEEP_NAMES = [
    ("sweep_name=..", "sweep_name='..' is invalid"),
    ("sweep_name=../../x", "sweep_name='../../x' is invalid"),
    ("sweep_name=", "sweep_name='' is invalid"),
    ("sweep_name=/tmp/abs", "sweep_name='/tmp/abs' is invalid"),
    ("sweep_name=a\nb", r"sweep_name='a\nb' is invalid: it holds the control character(s) '\n'"),
    ("sweep_name=1_1_1", "reads 1_1_1 as the int 111"),
    ("sweep_name=true", "reads true as the bool True"),
    ("sweep_name=null", "reads null as null"),
    ("sweep_name=é", "sweep_name=é is invalid: must be a folder name"),
]


@pytest.mark.parametrize("arg,needle", BAD_SWEEP_NAMES, ids=[a.replace("\n", "NL") for a, _ in BAD_SWEEP_NAMES])
def test_a_sweep_name_that_leaves_multirun_is_refused(tmp_path, monkeypatch, arg, needle):
    code, out, err = _inprocess(["-m", *TINY, "n_samples=2", "K=1,2", arg], tmp_path, monkeypatch)
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    assert needle in err and ("multirun/" in err or "quote it" in err), err
    assert sorted(p.name for p in tmp_path.iterdir()) == [], list(tmp_path.iterdir())  # nothing written, anywhere


def test_sweep_name_is_checked_as_resolved_too():
    """A name from an experiment config or the API (no override to read) is checked by the rule and the sweeper."""
    from omegaconf import OmegaConf

    from hydra_plugins.specsamp_sweeper import check_sweep_name

    for bad in ("..", "a/../b", "", "/abs", None, "a b", "x\ty"):
        with pytest.raises(ConfigError, match="sweep_name=.* is invalid: must be a folder name under multirun/"):
            check_sweep_name(OmegaConf.create({"sweep_name": bad}))
    check_sweep_name(OmegaConf.create({"sweep_name": "2024-05-01/12-00-00"}))
    with pytest.raises(ConfigError, match=r"sweep_name='a/\.\./b' is invalid"):
        load_config(compose([*TINY, "sweep_name=a/../b"]))
    load_config(compose([*TINY, "sweep_name=gmm_grid/v2"]))


def test_overrides_read_otherwise_than_typed_are_refused():
    from specsamp.runner.explain import override_problem

    assert override_problem(["compile=2"]) == "compile=2 is invalid: compile takes true or false, not a number."
    assert "model.trust_checkpoint=1 is invalid" in override_problem(["model.trust_checkpoint=1"])
    assert "hydra.run.dir='out\\nx' is invalid: it holds the control character(s) '\\n'" in override_problem(
        ["hydra.run.dir=out\nx"]
    )
    assert "model.cache_dir='a\\rb' is invalid" in override_problem(["model.cache_dir=a\rb"])
    for fine in (
        ["compile=true"],
        ["compile=yes"],
        ["sweep_name=2024"],
        ["sweep_name='1_1_1'"],
        ["hydra.run.dir=out/x"],
        ["-m", "K=1,2"],
        ["sweep_name=a,b"],
    ):
        assert override_problem(fine) is None, fine


def test_a_path_key_with_a_control_character_is_refused():
    with pytest.raises(ConfigError, match=r"model.cache_dir='a\\nb' is invalid: it holds the control character"):
        load_config(
            {
                **load_config(compose(TINY))[1],
                "model": {"_target_": "specsamp.models.edm.EDMConfig", "name": "x", "cache_dir": "a\nb"},
            }
        )


def test_an_unreadable_override_names_its_key_and_the_quoting():
    with pytest.raises(Exception) as e:
        compose([*TINY, "model.dim=é"])
    text = exits.composition_message(e.value)
    assert (
        text.startswith("model.dim=é could not be read") and "\"model.dim='é'\"" in text and "LexerNoViable" not in text
    )


def test_a_mistyped_sweeper_key_lists_the_valid_ones(tmp_path, monkeypatch):
    code, _, err = _inprocess(["-m", *TINY, "K=1,2", "hydra.sweeper.nope=1"], tmp_path, monkeypatch)
    assert code == 2 and "hydra.sweeper.nope=1 is not a key of specsamp's sweeper" in err, err
    assert "hydra.sweeper.max_batch_size, hydra.sweeper.params, hydra.sweeper.validate" in err


# ------------------------------------------------------------------------------------------------
# a profile file's values, the documented values of model.net_dtype


@pytest.mark.parametrize(
    "values,shown", [('["a"]', "'a'"), ("[NaN]", "nan"), ("[1.0, -1]", "-1"), ("[Infinity]", "inf"), ("[]", "empty")]
)
def test_a_profile_file_with_bad_values_names_the_file_and_the_value(tmp_path, values, shown):
    from specsamp.runner.build import given_profile

    path = tmp_path / "p.json"
    path.write_text(f'{{"profile": {values}, "per_root": [{values}]}}')
    for tree, entry in (("optimal", "'profile'"), ("optimal_per_step", "'per_root'")):
        run_, _ = load_config(compose([*TINY, f"tree={tree}", f"delta_profile={path}"]))
        with pytest.raises(ConfigError) as e:
            given_profile(run_)
        text = str(e.value)
        assert text.startswith(f"delta_profile='{path}' is invalid: the {entry} entry of {path}") and shown in text, (
            text
        )
        assert "array(" not in text and "deltas=" not in text


def test_net_dtype_takes_its_documented_values():
    from specsamp.models.edm import EDMConfig

    for bad in ("float64", "float32", "int8"):
        with pytest.raises(
            ConfigError, match=f"model.net_dtype='{bad}' is invalid: valid values are float16, bfloat16 .* or null"
        ):
            EDMConfig(name="edm-digits-8x8-cond", net_dtype=bad).build("cpu")


# ------------------------------------------------------------------------------------------------
# samples holding NaN or inf are an error (exit 4), recorded in failed.json; nothing else is written

NAN_COUPLING = "sampler.coupling={_target_: helpers.nan_residual_coupling}"


def test_the_contract_check_refuses_a_non_finite_sample():
    from helpers import MODEL, SCHED, nan_residual_coupling

    from specsamp.sampler import NonFiniteSampleError, sample_speculative
    from specsamp.trees import DraftTree

    for execution in ("path", "tree"):
        with pytest.raises(NonFiniteSampleError, match=r"returned a sample holding NaN or inf at trajectory 0, step 1"):
            sample_speculative(
                MODEL,
                SCHED,
                DraftTree.uniform(2, 2),
                nan_residual_coupling(),
                2,
                execution=execution,
                check_contract=True,
            )


@pytest.mark.parametrize("contract", ["true", "false"])
def test_non_finite_samples_exit_4_and_are_recorded(tmp_path, monkeypatch, contract):
    out = tmp_path / "single"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    code, stdout, err = _inprocess(
        [*TINY, "n_samples=3", NAN_COUPLING, f"check_contract={contract}"], tmp_path, monkeypatch
    )
    assert code == exits.NON_FINITE == 4 and err.startswith("error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err and "net_dtype" in err and "check_contract=true" in err, err
    failed = json.loads((out / "failed.json").read_text())
    assert failed["kind"] == "non_finite" and failed["traceback"] is None and failed["non_finite"]
    if contract == "false":  # found by the final check: how many and from which step
        assert "3 of the 3 samples hold NaN or inf (trajectories 0, 1, 2)" in err and "state at step 2 of T=8" in err
        assert failed["non_finite"]["samples"] == 3 and failed["non_finite"]["first_step"] == 2
    else:  # found by the contract check, where it happened
        assert "returned a sample holding NaN or inf at trajectory 0, step 1" in err
    assert sorted(p.name for p in out.iterdir() if p.name != ".hydra") == ["failed.json", "keep.txt", "run.log"]
    assert not (out / "result.json").exists() and not (out / "samples.pt").exists()
    assert (out / "keep.txt").read_text() == "precious"


def test_an_overflowing_network_names_the_step_of_its_first_inf():
    from specsamp.errors import NonFiniteSamplesError
    from specsamp.runner.build import build_target
    from specsamp.runner.loop import run_config

    cfg = compose([*TINY, "n_samples=4", "sampler=standard", "batch_size=2"])
    target = build_target(load_config(cfg)[0])
    inner = target.model

    class Overflows:  # the velocity is inf below sigma 0.3, as a network overflowing in half precision
        def __getattr__(self, name):
            return getattr(inner, name)

        def __call__(self, x, sigma, **cond):
            v = inner(x, sigma, **cond)
            return torch.where((torch.as_tensor(sigma).reshape(-1, 1) < 0.3), torch.full_like(v, float("inf")), v)

    target.model = Overflows()
    with pytest.raises(NonFiniteSamplesError) as e:
        run_config(cfg, target=target)
    d = e.value.details
    assert d == {
        **d,
        "samples": 2,
        "of": 2,
        "batch": 0,
        "batches": 2,
        "trajectories": [0, 1],
        "first_step": 5,
        "first_kind": "velocity",
    }, d
    assert str(e.value).startswith(
        "2 of batch 1 of 2 (2 samples) hold NaN or inf"
    ) and "a velocity at step 5 of T=8" in str(e.value)


def test_a_sweep_with_non_finite_samples_exits_4():
    assert exits.sweep_exit_status({"kinds": ["config", "non_finite"]}) == 4
    assert exits.sweep_exit_status({"kinds": ["non_finite", "exception"]}) == 1
    assert exits.sweep_exit_status({"kinds": ["non_finite"], "infrastructure": True}) == 3


def test_other_sizes_and_paths_of_the_commands_are_bounded():
    from specsamp.models.sd3 import SD3Config

    with pytest.raises(ConfigError, match=r"model.max_sequence_length=100000 is invalid: must be an integer in 1..512"):
        SD3Config(max_sequence_length=100000).build("cpu")
    from experiments.calibrate import main as calibrate_main

    for bad, shown in (
        ("out=", "out='' is invalid: it is empty"),
        ("out=a\nb.json", r"out='a\\nb.json' is invalid: it holds"),
    ):
        with pytest.raises(ConfigError, match=shown):
            calibrate_main([*TINY, bad])
