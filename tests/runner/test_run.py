"""The main job: Hydra composition of every config group, run.py end to end, bad input -> exit 2."""

import json
import os
import subprocess
import sys

import pytest
from helpers import ROOT, TINY, Forked, python, run, run_inprocess
from omegaconf import OmegaConf

from specsamp.runner.config import compose

CONF = ROOT / "conf"


def group_options(group):
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


@pytest.mark.parametrize("group", ["model", "sampler", "logger"])
def test_every_config_option_composes(group):
    for opt in group_options(group):
        cfg = compose([f"{group}={opt}"])
        OmegaConf.to_container(cfg, resolve=True)  # every interpolation resolves
        assert cfg[group] is not None


def test_every_experiment_composes():
    for opt in group_options("experiment"):
        OmegaConf.to_container(compose([f"+experiment={opt}"]), resolve=True)


def test_defaults_are_the_paper_gmm_cell():
    cfg = compose()
    assert (cfg.model._target_, cfg.model.dim, cfg.model.components) == ("specsamp.models.gmm.GMMConfig", 500, 5)
    assert (cfg.steps, cfg.eps, cfg.n_samples, cfg.sampler.name) == (30, 0.1, 100, "dgrs")


@pytest.mark.parametrize("sampler", ["standard", "rmc", "dgrs"])
def test_run_writes_record_and_prints_one_line(tmp_path, sampler):
    p = run([*TINY, f"sampler={sampler}"], tmp_path)
    lines = [l for l in p.stdout.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"model=gmm sampler={sampler}")
    assert (
        "speedup" in lines[0] and "(8 trajectories" in lines[0] and lines[0].endswith("record: result.json")
    )  # cwd is the run dir here
    rec = json.loads((tmp_path / "result.json").read_text())
    for key in (
        "budget",
        "nfe",
        "speedup",
        "target_rows",
        "acceptance_per_depth",
        "wall_seconds",
        "config",
        "versions",
    ):
        assert key in rec
    assert rec["speedup"]["mean"] > 0 and rec["speedup"]["sem"] >= 0
    assert rec["config"]["sampler"]["name"] == sampler
    if sampler == "rmc":
        assert rec["budget"] == 14 and rec["tree"] == "chain(6)"  # B=14 chain capped at T-2=6
    if sampler == "standard":
        assert rec["speedup"]["mean"] == 1.0


def test_rerun_with_same_config_is_skipped(tmp_path):
    run(TINY, tmp_path)
    first = (tmp_path / "result.json").read_text()
    p = run(TINY, tmp_path)
    assert p.stdout.startswith("skipped")
    assert (tmp_path / "result.json").read_text() == first


BAD = [
    (["K=0"], "K=0"),
    (["L=0"], "L=0"),
    (["eps=0"], "eps=0"),
    (["eps=1.5"], "eps=1.5"),
    (["steps=2"], "steps=2"),
    (["n_samples=0"], "n_samples=0"),
    (["model=nope"], "model=nope is not an option of the config group model"),
    (["sampler=nope"], "sampler=nope is not an option of the config group sampler"),
    (["nokey=1"], "nokey"),
    (["draft=nope"], "draft='nope'"),
    (["prefetch=nope"], "prefetch='nope'"),
    (["execution=nope"], "execution='nope'"),
    (["device=cuda"], "device='cuda'"),
    (["+nokey2=1"], "nokey2=1 is not a key"),
    (["metrics=[fid]"], "metrics=[fid] is invalid for model=gmm"),
    (["metrics=fid"], "metrics"),
    (["execution=tree", "K=60", "L=3", "model.dim=500", "n_samples=100"], "use batch_size="),
]


# run.py as a forked child for these (a config key's refusal and a config group's); in this process
# (helpers.run_inprocess: run.py as __main__, the same code path) for the rest
BAD_CLI = ("K=0", "model=nope is not an option of the config group model")


@pytest.mark.parametrize("args,needle", BAD, ids=[b[1] for b in BAD])
def test_bad_input_exits_2_with_message_and_no_traceback(tmp_path, monkeypatch, args, needle):
    if args == ["device=cuda"]:
        import torch

        if torch.cuda.is_available():
            pytest.skip("a CUDA device is present")
    (tmp_path / "keep.txt").write_text("precious")
    if needle in BAD_CLI:
        p = run([*TINY, *args], tmp_path, check=False)
        code, stdout, stderr = p.returncode, p.stdout, p.stderr
    else:
        monkeypatch.chdir(tmp_path)
        code, stdout, stderr = run_inprocess([*TINY, *args], tmp_path, monkeypatch)
    assert code == 2, (stdout, stderr)
    assert needle in stderr
    assert "Traceback" not in stderr and "Traceback" not in stdout
    assert not (tmp_path / "result.json").exists()
    assert (tmp_path / "keep.txt").read_text() == "precious"


def test_optimal_tree_calibrates_and_records_its_profile(tmp_path):
    p = run([*TINY, "tree=optimal", "budget=6", "draft=x0"], tmp_path)
    assert "tree=" in p.stdout
    rec = json.loads((tmp_path / "result.json").read_text())
    assert rec["budget"] == 6 and len(rec["delta_profile"]) >= 1 and rec["tree_parent"][0] == -1
    (tmp_path / "bad").mkdir()
    bad = run([*TINY, "tree=optimal", "budget=6", "delta_profile=[-1.0]"], tmp_path / "bad", check=False)
    assert bad.returncode == 2 and "delta_profile" in bad.stderr and "Traceback" not in bad.stderr


def test_optimal_per_step_calibrates_records_its_cost_and_takes_given_profiles(tmp_path):
    p = run([*TINY, "tree=optimal_per_step", "budget=6", "draft=x0"], tmp_path)
    assert "per-root(6 trees" in p.stdout
    rec = json.loads((tmp_path / "result.json").read_text())
    # the result line shows the uncharged calibration beside the speedup
    assert f"x with the calibration's {rec['calibration']['nfe']} calls)" in p.stdout
    assert rec["budget"] == 6 and len(rec["delta_profile"]) == 6 and len(rec["delta_profile"][0]) == 6
    assert set(rec["trees_by_root"]) == {str(n) for n in range(1, 7)}
    for parent in rec["trees_by_root"].values():  # <= B drafted states, no deeper than the steps left
        assert 2 <= len(parent) <= 7
    cal = rec["calibration"]
    assert cal["trajectories"] == 64 and cal["nfe"] > 0 and cal["target_rows"] >= cal["nfe"] and cal["charged"] is False
    assert 0 < rec["speedup_with_calibration"] < rec["speedup"]["mean"]
    # like with like: the calibration's speculative calls shared by the run's trajectories (both without the
    # endpoints), in the estimator of ``speedup`` (a mean of ratios, SampleResult.speedup_charged): by Jensen
    # (1 / (nfe + c) is convex) at least the ratio of the totals
    n, spec = rec["n_samples"], rec["steps"] - 2
    assert rec["speedup_with_calibration"] >= n * spec / (n * rec["nfe"]["mean"] + cal["nfe"]) * (1 - 1e-12)
    assert cal["nfe_total"] > cal["nfe"]
    # a given table (rows per root step 1..T-2) or one profile for every root: no calibration
    table = "[" + ",".join(["[0.3,0.6,0.9]"] * 6) + "]"
    for i, prof in enumerate([table, "[0.3,0.6,0.9]"]):
        (tmp_path / str(i)).mkdir()
        run([*TINY, "tree=optimal_per_step", "budget=6", f"delta_profile={prof}"], tmp_path / str(i))
        r = json.loads((tmp_path / str(i) / "result.json").read_text())
        assert "calibration" not in r and len(r["trees_by_root"]) == 6
    # a shipped profile is found by name; its 28 rows do not fit T=8's 6 root steps
    (tmp_path / "bad").mkdir()
    bad = run([*TINY, "tree=optimal_per_step", "budget=6", "delta_profile=gmm_x0"], tmp_path / "bad", check=False)
    assert bad.returncode == 2 and "root step" in bad.stderr and "Traceback" not in bad.stderr
    bad = run([*TINY, "tree=optimal", "budget=6", f"delta_profile={table}"], tmp_path / "bad", check=False)
    assert bad.returncode == 2 and "optimal_per_step" in bad.stderr and "Traceback" not in bad.stderr


def test_calibrate_command_writes_a_profile_that_runs_use(tmp_path):
    import sys

    out = tmp_path / "prof.json"
    p = python(
        [
            sys.executable,
            "-m",
            "experiments.calibrate",
            *TINY,
            "draft=x0",
            "threads=1",
            f"out={out}",
            "trajectories=16",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("delta_profile=[")
    data = json.loads(out.read_text())
    assert data["config"]["steps"] == 8 and data["calibration"]["trajectories"] == 16 and len(data["per_root"]) == 6
    (tmp_path / "r").mkdir()
    run([*TINY, "tree=optimal_per_step", "budget=6", f"delta_profile={out}"], tmp_path / "r")
    assert "calibration" not in json.loads((tmp_path / "r" / "result.json").read_text())


@pytest.mark.parametrize(
    "args, needle",
    [
        (["Kk=3"], "Kk=3 is not a key of specsamp's config; did you mean K?"),
        (["model=nosuch"], "model=nosuch is not an option of the config group model"),
        (["trajectories=abc"], "trajectories=abc is invalid: must be an integer >= 1"),
    ],
)
def test_calibrate_command_refuses_bad_input_in_one_paragraph(tmp_path, args, needle):
    """The calibration command exits 2 with run.py's paragraph for overrides that do not compose, and
    writes nothing."""
    p = python(
        [sys.executable, "-m", "experiments.calibrate", *args, f"out={tmp_path / 'p.json'}"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    err = p.stderr.strip()
    assert p.returncode == 2 and err.startswith("error: " + needle) and "\n" not in err, p.stderr
    assert not list(tmp_path.iterdir())


def test_calibrate_command_help_prints_its_usage():
    p = python([sys.executable, "-m", "experiments.calibrate", "--help"], capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 0 and "out=PATH" in p.stdout and "trajectories=N" in p.stdout and not p.stderr


def test_result_line_names_a_coupling_set_apart_from_the_sampler():
    """sampler.coupling.name on a shipped sampler YAML runs that coupling: the line says so."""
    from specsamp.runner import run_config, summary_line

    small = ["model.dim=8", "steps=6", "n_samples=2"]
    line = summary_line(run_config(compose([*small, "sampler.coupling.name=markmax"]))[0])
    assert line.startswith("model=gmm sampler=dgrs coupling=markmax K=2 L=3 "), line
    line = summary_line(run_config(compose([*small, "sampler=markmax"]))[0])
    assert line.startswith("model=gmm sampler=markmax K=2 L=3 ") and "coupling=" not in line, line


def _record(name, overrides=None, **model):
    """A record as the summary line reads it (a dgrs run's fields), for ``model.name=name``."""
    rec = {
        "model": name,
        "sampler": "dgrs",
        "K": 2,
        "L": 3,
        "eps": 0.3,
        "budget": 14,
        "steps": 6,
        "n_samples": 2,
        "tree": "uniform",
        "speedup": {"mean": 1.5, "sem": 0.1},
        "nfe": {"mean": 4.0},
        "wall_seconds": 0.4,
        "config": {"model": {"name": name, "path": None, **model}, "sampler": {"name": "dgrs"}, "tree": "uniform"},
    }
    return rec if overrides is None else {**rec, "overrides": overrides}


@pytest.mark.parametrize(
    "rec, head",
    [
        # the option typed, not the checkpoint's name; the same option found from the name when none was typed
        # (the default model, an experiment's, a run composed in-process)
        (_record("edm-digits-8x8-cond", ["model=digits", "steps=6"]), "model=digits sampler=dgrs K=2 L=3"),
        (_record("edm-digits-8x8-cond", ["+experiment=digits_fid"]), "model=digits sampler=dgrs"),
        (_record("edm-digits-8x8-cond"), "model=digits sampler=dgrs"),
        (_record("gmm", []), "model=gmm sampler=dgrs"),
        # a local pipeline folder or checkpoint is named (quoted where the shell needs it)
        (
            _record("diffusers", ["model=diffusers", "model.path=/data/pipe"], path="/data/pipe"),
            "model=diffusers model.path=/data/pipe sampler=dgrs",
        ),
        (_record("diffusers", path="/data/my pipe"), "model=diffusers model.path='/data/my pipe' sampler=dgrs"),
        (
            _record("edm-cifar10-32x32-cond-vp", ["model=cifar10"], path="tiny.pkl"),
            "model=cifar10 model.path=tiny.pkl sampler=dgrs",
        ),
        # another checkpoint of an option's family is named; a YAML of one's own is named as typed
        (
            _record("edm-cifar10-32x32-uncond-vp", ["model=cifar10", "model.name=edm-cifar10-32x32-uncond-vp"]),
            "model=cifar10 model.name=edm-cifar10-32x32-uncond-vp sampler=dgrs",
        ),
        (_record("edm-own", ["model=own"]), "model=own sampler=dgrs"),
        (_record("edm-own"), "model=edm-own sampler=dgrs"),
    ],
)
def test_result_line_names_the_model_option_and_its_folder(rec, head):
    from specsamp.runner import summary_line

    line = summary_line(rec)
    assert line.startswith(head + " "), line
    assert line.endswith("speedup 1.50x ± 0.10  NFE 4.0  (2 trajectories, 0.4 s)"), line


def test_markmax_sampler_runs(tmp_path):
    p = run([*TINY, "sampler=markmax", "K=3", "L=2"], tmp_path)
    assert p.stdout.startswith("model=gmm sampler=markmax K=3 L=2")


def test_atomic_writes_respect_the_umask(tmp_path):
    import stat

    from specsamp.io import write_json_atomic

    old = os.umask(0o022)
    try:
        write_json_atomic(tmp_path / "r.json", {"a": 1})
    finally:
        os.umask(old)
    mode = stat.S_IMODE((tmp_path / "r.json").stat().st_mode)
    assert mode == 0o644, oct(mode)


def test_schema_keys_match_config_yaml():
    # every key of conf/config.yaml has a typed field in the schema, and the other way round
    import dataclasses

    from specsamp.runner.config import RunConfig

    assert set(OmegaConf.load(CONF / "config.yaml")) - {"defaults", "hydra"} == {
        f.name for f in dataclasses.fields(RunConfig)
    } - {"model", "sampler", "kernel", "logger"}  # the groups


def test_two_runs_in_the_same_second_get_two_directories(tmp_path):
    """The default run dir is claimed with an exclusive mkdir; a second run of the same second gets TIME_2."""
    env = dict(os.environ, WANDB_MODE="offline", HYDRA_FULL_ERROR="0")
    py = [sys.executable, str(ROOT / "run.py"), *TINY]
    first = python(py, cwd=tmp_path, capture_output=True, text=True, env=env, timeout=300)
    assert first.returncode == 0, first.stderr
    (rec1,) = list(tmp_path.glob("outputs/*/*/result.json"))
    assert first.stdout.rstrip().endswith(f"record: {rec1.relative_to(tmp_path)}")  # the line says where
    before = rec1.read_bytes(), (rec1.parent / ".hydra" / "overrides.yaml").read_bytes()
    base = rec1.parent.relative_to(tmp_path)
    # the second run starts "in the same second": same base directory, given the same way Hydra's config does
    second = subprocess.run(
        [*py, "K=3", f"hydra.run.dir=${{specsamp.fresh_dir:{base}}}"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert second.returncode == 0, second.stderr
    rec2 = tmp_path / f"{base}_2" / "result.json"
    assert json.loads(rec2.read_text())["K"] == 3 and second.stdout.rstrip().endswith(f"record: {base}_2/result.json")
    assert (rec1.read_bytes(), (rec1.parent / ".hydra" / "overrides.yaml").read_bytes()) == before
    from hydra import compose as hydra_compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = hydra_compose(config_name="config", return_hydra_config=True)
    assert "specsamp.fresh_dir" in OmegaConf.to_container(cfg.hydra.run, resolve=False)["dir"]


def test_concurrent_runs_never_share_a_directory(tmp_path):
    from specsamp.runner.jobs import fresh_dir

    (tmp_path / "o").mkdir()
    env = dict(os.environ, WANDB_MODE="offline", HYDRA_FULL_ERROR="0")
    # three children forked at once (tests/helpers.py: no interpreter start-up between them), all claiming o/t
    procs = [
        Forked(
            [sys.executable, str(ROOT / "run.py"), *TINY, f"seed={s}", "hydra.run.dir=${specsamp.fresh_dir:o/t}"],
            cwd=tmp_path,
            env=env,
        )
        for s in range(3)
    ]
    outs = [p.wait(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in outs), [(p.stdout, p.stderr) for p in outs]
    seeds = sorted(json.loads(f.read_text())["config"]["seed"] for f in (tmp_path / "o").glob("t*/result.json"))
    assert seeds == [0, 1, 2]
    assert fresh_dir(str(tmp_path / "o" / "t")) == str(tmp_path / "o" / "t_4")  # the next free one


def test_missing_profile_file_is_named_with_the_directory_it_was_read_from(tmp_path, monkeypatch):
    """A .json delta_profile that does not exist says so, with the absolute path looked at; a relative one
    is read from the launch directory, and the message names it."""
    from specsamp.errors import ConfigError
    from specsamp.runner.config import load_config

    with pytest.raises(ConfigError, match=r"/nope/prof\.json does not exist\. "):
        load_config(compose([*TINY, "tree=optimal", "delta_profile=/nope/prof.json"]))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(
        ConfigError, match=f"{tmp_path}/rel/prof.json does not exist, relative paths are read from {tmp_path}"
    ):
        load_config(compose([*TINY, "tree=optimal", "delta_profile=rel/prof.json"]))


def test_per_root_profile_for_another_T_is_refused_before_the_model_is_built(monkeypatch, capsys):
    """gmm_x0 holds 28 root steps (T=30): a T=8 run with tree=optimal_per_step is refused, naming both T,
    before the target is built, and without announcing the profile as used."""
    from specsamp.errors import ConfigError
    from specsamp.runner import build, loop

    def no_build(run):
        raise AssertionError("the target was built before the profile was checked")

    monkeypatch.setattr(build, "build_target", no_build)
    with pytest.raises(ConfigError, match=r"calibrated for steps=30 \(28 root steps\).*6 root steps"):
        loop.run_config(compose([*TINY, "tree=optimal_per_step", "budget=6", "delta_profile=gmm_x0"]))
    with pytest.raises(ConfigError, match="it has 3 rows.*one per root step 1..6"):
        loop.run_config(compose([*TINY, "tree=optimal_per_step", "budget=6", "delta_profile=[[0.3],[0.4],[0.5]]"]))
    assert "used as given" not in capsys.readouterr().err


def test_reused_run_directory_with_another_config_is_refused_untouched(tmp_path):
    """A second config in the same hydra.run.dir exits 2 naming the directory and the differing key;
    the first run's record, samples, images and grid stay byte for byte; the same config is skipped."""
    first = run(["model=digits", "steps=6", "n_samples=3", "save_samples=true", "progress=false"], tmp_path)
    assert first.stdout.startswith("model=digits sampler=dgrs K=2 L=3 eps=0.3 B=14 "), first.stdout  # the option typed
    files = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file() and ".hydra" not in p.parts}
    assert {"result.json", "samples.pt", "grid.png"} <= {p.name for p in files} and (tmp_path / "images").is_dir()
    p = run(["model=digits", "steps=7", "n_samples=3", "save_samples=true", "progress=false"], tmp_path, check=False)
    err = p.stderr.strip()
    assert p.returncode == 2 and "Traceback" not in err and "\n" not in err, err
    assert f"{tmp_path} already holds the record of another configuration" in err and "steps: 6 -> 7" in err
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file() and ".hydra" not in p.parts} == files
    again = run(["model=digits", "steps=6", "n_samples=3", "save_samples=true", "progress=false"], tmp_path)
    assert again.stdout.startswith("skipped (done")


def test_relative_profile_path_is_read_from_the_launch_directory_under_chdir(tmp_path):
    """hydra.job.chdir=true moves the job into its output directory; a relative delta_profile is still read
    from where the command was launched."""
    import shutil

    shutil.copy(CONF / "profiles" / "gmm_x0.json", tmp_path / "prof.json")
    out = tmp_path / "out"
    env = dict(os.environ, WANDB_MODE="offline", HYDRA_FULL_ERROR="0")
    p = python(
        [
            sys.executable,
            str(ROOT / "run.py"),
            *TINY,
            "tree=optimal",
            "budget=6",
            "draft=x0",
            "delta_profile=prof.json",
            "hydra.job.chdir=true",
            f"hydra.run.dir={out}",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr
    rec = json.loads((out / "result.json").read_text())
    assert "calibration" not in rec and rec["config"]["delta_profile"] == "prof.json"


def test_refine_runs_on_the_tree_execution_records_its_sweeps_and_keeps_plain_hashes(tmp_path):
    (tmp_path / "plain").mkdir()
    (tmp_path / "ref").mkdir()
    plain = run([*TINY, "execution=tree"], tmp_path / "plain")
    rec0 = json.loads((tmp_path / "plain" / "result.json").read_text())
    assert "refine" not in rec0 and "refine" not in rec0["config"]  # refine=0 records and hashes as before the key
    assert run([*TINY, "execution=tree", "refine=0"], tmp_path / "plain").stdout.startswith(
        "skipped"
    )  # the same config
    assert plain.returncode == 0
    run([*TINY, "execution=tree", "refine=2"], tmp_path / "ref")
    rec = json.loads((tmp_path / "ref" / "result.json").read_text())
    assert rec["refine"] == 2 and rec["config"]["refine"] == 2 and rec["config_hash"] != rec0["config_hash"]
    assert rec["nfe"]["mean"] > rec0["nfe"]["mean"]  # every sweep is a charged call


@pytest.mark.parametrize(
    "args,needle",
    [
        (["refine=1"], "refine=1 is invalid with execution=path"),
        (["refine=-1", "execution=tree"], "refine=-1 is invalid"),
    ],
    ids=["path", "negative"],
)
def test_bad_refine_exits_2_with_one_paragraph(tmp_path, args, needle):
    p = run([*TINY, *args], tmp_path, check=False)
    assert p.returncode == 2 and needle in p.stderr, (p.stdout, p.stderr)
    assert "Traceback" not in p.stderr and not (tmp_path / "result.json").exists()
