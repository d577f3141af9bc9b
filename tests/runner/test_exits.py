"""Exit statuses (specsamp.runner.exits) on the real path: run.py in a subprocess, single runs and sweeps.

0 ok, 1 bug, 2 wrong input, 3 the machine (disk full, read-only directory, no SLURM), 130 Ctrl-C.
Every case checks the status, the message's key words, that no traceback is printed and that nothing
already written changed. The disk-full cases use a file-size limit (``resource.setrlimit``, any user)
and, where the tests run as root, a small tmpfs that really fills (ENOSPC).
"""

from __future__ import annotations

import errno
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import ROOT, Forked, python
from omegaconf import OmegaConf

from specsamp.runner import exits as exitcodes, jobs, report

TINY = ["model.dim=8", "steps=6", "n_samples=4"]
# a job that runs for minutes (interrupted or killed within seconds by the tests), in small batches
LONG = ["model.dim=64", "steps=30", "n_samples=200000", "batch_size=50", "progress=false"]


def _env(**extra):
    return dict(os.environ, WANDB_MODE="offline", HYDRA_FULL_ERROR="0", **extra)


def _env_unmeasured():
    """The environment without coverage's subprocess measurement, for a child whose writes must fail:
    coverage's own data file would hit the same limit at exit and print its traceback."""
    return {k: v for k, v in _env().items() if not k.startswith("COVERAGE_")}


def run(args, cwd, env=None, preexec_fn=None, timeout=300):
    cmd = [sys.executable, str(ROOT / "run.py"), *args]
    if preexec_fn is None:  # forked (tests/helpers.py:python); a resource limit needs a fresh process
        p = python(cmd, cwd=cwd, env=_env() if env is None else env, timeout=timeout)
    else:
        p = subprocess.run(
            cmd, cwd=cwd, capture_output=True, text=True, env=env, timeout=timeout, preexec_fn=preexec_fn
        )
    p.out = p.stdout + p.stderr
    return p


def start(args, cwd):
    """``python run.py ARGS`` forked in the background (tests/helpers.py:Forked): poll, send_signal, communicate."""
    return Forked([sys.executable, str(ROOT / "run.py"), *args], cwd=cwd, env=_env())


def wait_for(path: Path, proc, timeout=120.0):
    t0 = time.monotonic()
    while not path.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() - t0 < timeout, f"{path} never appeared"
        time.sleep(0.05)


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# ------------------------------------------------------------------------------------------------
# the policy


def test_exit_policy_is_one_table():
    assert (exitcodes.OK, exitcodes.BUG, exitcodes.USAGE, exitcodes.INFRASTRUCTURE, exitcodes.INTERRUPTED) == (
        0,
        1,
        2,
        3,
        130,
    )
    doc = exitcodes.__doc__  # the one table (run.py points to it)
    readme = (ROOT / "README.md").read_text()
    for status in ("130", "  3 ", "  2 "):
        assert status in doc
    assert "## Exit status" in readme and "| 3 |" in readme and "| 130 |" in readme
    assert exitcodes.NOT_FINISHED == 75 and " 75 " in doc and "| 75 |" in readme
    state = {"kinds": ["config"]}
    assert exitcodes.sweep_exit_status(state) == 2
    assert exitcodes.sweep_exit_status({"kinds": ["config", "exception"]}) == 1
    assert exitcodes.sweep_exit_status({"kinds": ["config", "infrastructure"]}) == 3
    assert exitcodes.sweep_exit_status({"kinds": ["infrastructure"], "interrupted": True}) == 130
    assert exitcodes.sweep_exit_status({"kinds": []}) == 0
    assert exitcodes.NON_FINITE == 4 and "  4 " in doc and "| 4 |" in readme
    assert exitcodes.sweep_exit_status({"kinds": ["config", "non_finite"]}) == 4
    assert exitcodes.sweep_exit_status({"kinds": ["non_finite", "exception"]}) == 1
    assert exitcodes.sweep_exit_status({"kinds": ["config"], "unfinished": 2}) == 2
    assert (
        "130, then 3, then 1, then 4, then 2, then 75" in doc
        and "130, then 3, then 1, then 4, then 2, then 75" in readme
    )


# ------------------------------------------------------------------------------------------------
# infrastructure: full disk, read-only directory, no SLURM -> 3


def _fsize_limit(nbytes):
    return lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, nbytes))


def test_file_size_limit_at_the_record_prints_the_result_then_names_the_path(tmp_path):
    """samples.pt (33 KB) exceeds a 16 KB file-size limit: EFBIG, like a disk that fills at the record."""
    out = tmp_path / "run"
    (tmp_path / "keep.txt").write_text("precious")
    p = run(
        ["model.dim=500", "n_samples=8", "steps=6", "save_samples=true", f"hydra.run.dir={out}"],
        tmp_path,
        env=_env_unmeasured(),
        preexec_fn=_fsize_limit(16 * 1024),
    )
    assert p.returncode == 3, p.out
    assert p.stdout.startswith("model=gmm sampler=dgrs") and "speedup" in p.stdout  # the numbers came first
    assert f"could not write {out / 'samples.pt'}" in p.stderr and "File too large" in p.stderr
    assert "not of the configuration" in p.stderr and "Traceback" not in p.out
    assert not (out / "result.json").exists() and not list(out.glob(".samples.pt.*"))  # no torn file left
    assert (tmp_path / "keep.txt").read_text() == "precious"


def test_file_size_limit_in_sweep_jobs_is_recorded_and_the_sweep_exits_3(tmp_path):
    p = run(
        ["-m", "model.dim=500", "n_samples=8", "steps=6", "save_samples=true", "K=1,2", "sweep_name=full"],
        tmp_path,
        env=_env_unmeasured(),
        preexec_fn=_fsize_limit(16 * 1024),
    )
    assert p.returncode == 3, p.out
    assert "2 jobs, 0 ran, 0 skipped (done before), 2 failed" in p.stdout and "Traceback" not in p.out
    for f in (tmp_path / "multirun" / "full").glob("*/failed.json"):
        rec = json.loads(f.read_text())
        assert rec["kind"] == "infrastructure" and "samples.pt" in rec["error"], rec["error"]
    assert len(list((tmp_path / "multirun" / "full").glob("*/failed.json"))) == 2


@pytest.mark.parametrize("mode", ["run", pytest.param("sweep", marks=pytest.mark.slow)])
def test_file_size_limit_at_hydras_own_files_names_the_file_and_leaves_no_torn_one(tmp_path, mode):
    """Under a 2 KB file-size limit Hydra's ``.hydra/hydra.yaml`` (a run's, ~3.8 KB) and ``multirun.yaml`` (a
    sweep's, ~4.8 KB) hit EFBIG half-way: Hydra writes them in place, and its OSError names no file. The
    message names the file, and the torn file is removed (what fitted before it is kept whole)."""
    limit = 2 * 1024
    if mode == "run":
        out = tmp_path / "run"
        args, torn = [*TINY, f"hydra.run.dir={out}"], out / ".hydra" / "hydra.yaml"
    else:
        out = tmp_path / "sweep"
        args, torn = ["-m", *TINY, "K=1,2", f"hydra.sweep.dir={out}"], out / "multirun.yaml"
    p = run(args, tmp_path, env=_env_unmeasured(), preexec_fn=_fsize_limit(limit))
    assert p.returncode == 3, p.out
    assert f"error: could not write {torn}: File too large" in p.stderr, p.stderr
    assert "unknown path" not in p.out and "Traceback" not in p.out
    assert not torn.exists()
    for f in out.rglob("*"):  # what is left was written whole: Hydra's config.yaml (~1 KB) and an empty run.log
        if f.is_file():
            assert f.stat().st_size < limit, f
            if f.suffix == ".yaml":
                assert OmegaConf.load(f) is not None


def test_a_torn_file_is_named_and_removed_only_when_it_was_written_from_empty(tmp_path):
    """In process: an EFBIG raised while a frame holds one file open for writing names that file; the file is
    removed when it was opened with "w" (its old content was truncated anyway), kept when appended to."""

    def fail_writing(path, mode):
        with open(path, mode) as f:
            f.write("partial")
            raise OSError(errno.EFBIG, os.strerror(errno.EFBIG))

    for mode, removed in (("w", True), ("a", False)):
        path = tmp_path / f"out-{mode}.yaml"
        path.write_text("old\n")
        with pytest.raises(OSError) as info:
            fail_writing(path, mode)
        assert exitcodes.infrastructure_message(info.value).startswith(f"could not write {path}: File too large")
        assert exitcodes.discard_torn_file(info.value) == (str(path) if removed else None)
        assert path.exists() is not removed
    # a full disk with no file object in reach, and one whose OSError names its file itself: nothing removed
    assert "(unknown path)" in exitcodes.infrastructure_message(OSError(errno.ENOSPC, "No space left on device"))
    named = OSError(errno.EFBIG, "File too large", str(tmp_path / "x"))
    assert exitcodes.discard_torn_file(named) is None


def _mount_tmpfs(path: Path, opts: str) -> bool:
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    path.mkdir(parents=True, exist_ok=True)
    return subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)], capture_output=True).returncode == 0


def _umount(path: Path) -> None:
    subprocess.run(["umount", str(path)], capture_output=True)


@pytest.mark.slow
def test_full_disk_exits_3_and_names_the_path(tmp_path):
    """A 64 KB tmpfs, filled to 16 KB free: Hydra's .hydra/ files fit, the 33 KB samples.pt does not (ENOSPC)."""
    disk = tmp_path / "disk"
    if not _mount_tmpfs(disk, "size=64k"):
        pytest.skip("needs root to mount a small tmpfs")
    try:
        (disk / "filler").write_bytes(b"\0" * (48 * 1024))
        out = disk / "run"
        p = run(["model.dim=500", "n_samples=8", "steps=6", "save_samples=true", f"hydra.run.dir={out}"], tmp_path)
        assert p.returncode == 3, p.out
        assert "speedup" in p.stdout
        assert f"could not write {out / 'samples.pt'}: No space left on device" in p.stderr, p.stderr
        assert "Traceback" not in p.out and (disk / "filler").stat().st_size == 48 * 1024
    finally:
        _umount(disk)


def _read_only_dir(tmp_path: Path) -> Path:
    ro = tmp_path / "ro"
    if os.geteuid() == 0:
        if not _mount_tmpfs(ro, "ro,size=64k"):
            pytest.skip("root cannot be denied a write without a read-only mount")
    else:
        ro.mkdir()
        ro.chmod(0o555)
    return ro


@pytest.mark.parametrize("mode", ["run", pytest.param("sweep", marks=pytest.mark.slow)])
def test_read_only_output_directory_exits_3_and_names_it(tmp_path, mode):
    ro = _read_only_dir(tmp_path)
    try:
        if mode == "run":
            p = run([*TINY, f"hydra.run.dir={ro / 'out'}"], tmp_path)
        else:
            p = run(["-m", *TINY, "K=1,2", f"hydra.sweep.dir={ro / 'sweep'}"], tmp_path)
        assert p.returncode == 3, p.out
        assert f"could not write {ro}" in p.stderr and (
            "Read-only file system" in p.stderr or "Permission denied" in p.stderr
        )
        assert "hydra.run.dir=DIR" in p.stderr and "Traceback" not in p.out
    finally:
        if os.geteuid() == 0:
            _umount(ro)
        else:
            ro.chmod(0o755)


@pytest.mark.parametrize("where", ["file", "below_file"])
def test_an_output_directory_blocked_by_a_file_exits_3_and_names_it(tmp_path, where):
    """hydra.run.dir naming a file, or a path below one, cannot be created: exit 3, no traceback."""
    blocker = tmp_path / "blocker"
    blocker.write_text("precious")
    target = blocker if where == "file" else blocker / "out"
    p = run([*TINY, f"hydra.run.dir={target}"], tmp_path)
    assert p.returncode == 3, p.out
    err = p.stderr.strip()
    assert err.startswith(f"error: could not create the directory {target}") and "\n" not in err, err
    assert "hydra.run.dir=DIR" in err and "Traceback" not in p.out
    assert blocker.read_text() == "precious"


def test_slurm_launcher_off_a_cluster_exits_3_naming_the_commands(tmp_path):
    bindir = tmp_path / "bin"  # a PATH with python but no sbatch/srun
    bindir.mkdir()
    (bindir / "python").symlink_to(sys.executable)
    p = run(["-m", "hydra/launcher=slurm", *TINY, "K=1,2", "sweep_name=s"], tmp_path, env=_env(PATH=str(bindir)))
    assert p.returncode == 3, p.out
    assert "hydra/launcher=slurm needs the SLURM commands sbatch and srun" in p.stderr
    assert "hydra/launcher=local" in p.stderr and "Traceback" not in p.out
    assert not list((tmp_path / "multirun" / "s").glob("K=*"))  # nothing launched


# ------------------------------------------------------------------------------------------------
# Ctrl-C -> 130, one line (+ the sweep's summary), finished records intact


@pytest.mark.slow
def test_ctrl_c_on_a_single_run_prints_one_line_and_writes_nothing(tmp_path):
    out = tmp_path / "run"
    proc = start([*LONG, f"hydra.run.dir={out}"], tmp_path)
    wait_for(out / ".hydra" / "overrides.yaml", proc)
    time.sleep(1.0)  # inside the sampler
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stdout + stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("interrupted (Ctrl-C)"), stderr
    assert "Traceback" not in stdout + stderr and not (out / "result.json").exists()


def _long_sweep(tmp_path, name):
    """A 2-job sweep: a tiny job, then a long one; returns (proc, first job dir, second job dir)."""
    args = [
        "-m",
        "model.dim=64",
        "steps=30",
        "batch_size=50",
        "progress=false",
        "n_samples=4,200000",
        f"sweep_name={name}",
    ]
    proc = start(args, tmp_path)
    sweep = tmp_path / "multirun" / name
    first = sweep / "batch_size=50,model.dim=64,n_samples=4,steps=30"  # progress does not name directories
    second = sweep / "batch_size=50,model.dim=64,n_samples=200000,steps=30"
    wait_for(second / jobs.RUNNING, proc)
    return proc, sweep, first, second


def test_ctrl_c_on_a_sweep_prints_one_line_and_the_summary(tmp_path):
    proc, sweep, first, second = _long_sweep(tmp_path, "int")
    before = (first / "result.json").read_bytes()
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stdout + stderr
    assert "Traceback" not in stdout + stderr
    assert stderr.startswith("interrupted (Ctrl-C): finished records are kept"), stderr
    assert (
        f"sweep {sweep.relative_to(tmp_path)}: 2 jobs, 1 ran, 0 skipped (done before), 0 failed, 1 killed" in stderr
    ), stderr
    assert (first / "result.json").read_bytes() == before and json.loads(before)["status"] == "ok"
    assert not (second / "result.json").exists()
    df = report.collect(sweep).set_index("n_samples")
    assert df.loc[4, "status"] == "ok" and df.loc[200000, "status"] == "killed"


@pytest.mark.slow
def test_collect_tells_a_running_job_from_a_killed_one(tmp_path):
    proc, sweep, first, second = _long_sweep(tmp_path, "kill")
    try:
        df = report.collect(sweep).set_index("n_samples")
        assert df.loc[200000, "status"] == "running"
    finally:
        proc.kill()  # SIGKILL: no handler runs, running.json stays behind
        proc.communicate(timeout=60)
    df = report.collect(sweep).set_index("n_samples")
    assert df.loc[200000, "status"] == "killed" and df.loc[4, "status"] == "ok"
    p = subprocess.run(
        [sys.executable, "-m", "specsamp.runner.report", "collect", str(sweep)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert "2 jobs: 1 ok, 0 failed, 0 running, 1 killed, 0 missing" in p.stdout, p.stdout


def test_liveness_on_another_host_follows_the_heartbeat(tmp_path):
    job = tmp_path / "job"
    job.mkdir()
    marker = {**jobs.running_marker(), "host": "another-node"}
    (job / jobs.RUNNING).write_text(json.dumps(marker))
    now = time.time()
    os.utime(job / jobs.RUNNING, (now, now))
    assert jobs.job_liveness(job, now=now + jobs.STALE_S / 2) == "running"
    assert jobs.job_liveness(job, now=now + jobs.STALE_S + 1) == "killed"
    (job / jobs.RUNNING).write_text(json.dumps({**jobs.running_marker(), "pid": 2**22 + 7}))  # no such process here
    assert jobs.job_liveness(job) == "killed"
    (job / jobs.RUNNING).write_text(json.dumps(jobs.running_marker()))  # this very process: alive
    assert jobs.job_liveness(job) == "running"


def _bare(args, cwd):
    """run.py with its default output directory (outputs/DATE/TIME under ``cwd``)."""
    return python([sys.executable, str(ROOT / "run.py"), *args], cwd=cwd, env=_env())


@pytest.mark.parametrize(
    "args, needles, absent",
    [
        (["K=2,3"], ["K=2,3 is a sweep over K", "python run.py -m K=2,3", "(K=2)"], "key=[value1"),
        (["L=range(2,4)"], ["L=range(2,4) is a sweep over L", "-m"], "key=[value1"),
        (["widths=3,2"], ["widths takes a list, written widths=[3,2]", "-m"], "key=[value1"),
        (
            ["model=digits", "model.dtype=float16"],
            ["model.dtype='float16' is invalid for an EDM network", "model.net_dtype=float16"],
            "valid values are float32, float64.",
        ),
        (["K=0"], ["K=0 is invalid"], "Traceback"),
        (
            ["model=nosuch"],
            [
                "model=nosuch is not an option of the config group model",
                "valid: cifar10, diffusers, digits, digits_cfg, ffhq, gmm, patches32, sd3 (conf/model/)",
                "hydra.searchpath=",
            ],
            "_schema",
        ),
        (
            ["sampler=nosuch"],
            ["sampler=nosuch is not an option", "valid: auto, dgrs, markmax, rmc, standard"],
            "Available options",
        ),
        ([*TINY, "logger=wandb", "logger.mode=bogus"], ["logger.mode='bogus' is invalid"], "Traceback"),
    ],
)
def test_refused_commands_say_what_to_do_and_leave_no_run_directory(tmp_path, args, needles, absent):
    """A refused single run exits 2 with one paragraph (a sweep override without -m says to add -m, not
    Hydra's key=[value1,value2]), and leaves no outputs/DATE/TIME/ holding only Hydra's own files."""
    p = _bare(args, tmp_path)
    err = p.stderr.strip()
    assert p.returncode == 2 and err.startswith("error: ") and "\n" not in err, err
    for needle in needles:
        assert needle in err, (needle, err)
    assert absent not in err
    assert not list(tmp_path.rglob("*")), list(tmp_path.rglob("*"))


def test_a_refused_run_keeps_a_directory_that_holds_a_record(tmp_path):
    """Only a directory this process created and that holds nothing but Hydra's files is removed."""
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "keep.txt").write_text("precious")
    p = _bare(["K=0", f"hydra.run.dir={tmp_path / 'mine'}"], tmp_path)
    assert p.returncode == 2 and (tmp_path / "mine" / "keep.txt").read_text() == "precious"
    (tmp_path / "empty").mkdir()
    assert _bare(["K=0", f"hydra.run.dir={tmp_path / 'empty'}"], tmp_path).returncode == 2
    assert (tmp_path / "empty").is_dir()  # named by the user: left where it is


def test_help_lists_models_not_their_schemas(tmp_path):
    p = _bare(["--help"], tmp_path)
    assert p.returncode == 0
    line = next(x for x in p.stdout.splitlines() if x.startswith("model: "))
    assert "_schema" not in p.stdout and {"gmm", "digits", "cifar10", "ffhq", "sd3"} <= set(line[7:].split(", "))


def test_half_precision_states_get_a_note(capsys):
    from specsamp.runner import compose, run_config

    run_config(compose(["model.dim=4", "steps=5", "n_samples=2", "model.dtype=bfloat16", "progress=false"]))
    assert (
        "note: model.dtype=bfloat16 holds the states and velocities with 8 significant bits" in capsys.readouterr().err
    )
    run_config(compose(["model.dim=4", "steps=5", "n_samples=2", "progress=false"]))
    assert "note: model.dtype" not in capsys.readouterr().err
