"""Sweeps on a real SLURM scheduler (``hydra/launcher=slurm_cpu``), and the launcher's pieces without one.

The tests marked ``slurm`` need a cluster (``tests/slurm/cluster.sh start`` brings up a one-node one as
root; CI does) and are skipped with that reason otherwise. Every cell is a tiny GMM (d=16, T=16, 8
trajectories, one thread). Nothing waits on a fixed sleep: a test waits for the queue to hold no task
of an array (``squeue -j``), for a task to be RUNNING, or for ``run.py`` to exit; tasks that must stay
running while the test acts wait in the sbatch script's ``setup`` for a file the test creates (a gate).
Each test asserts the records (``result.json``, ``failed.json``, ``slurm.json``), SLURM's accounting
(``sacct``) and ``run.py``'s exit status and summary.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
from helpers import ROOT, python

from specsamp.runner import report, slurm as queue

sys.path.insert(0, str(ROOT))
from hydra_plugins.specsamp_sweeper.slurm import explain_refusal  # noqa: E402

TINY = ["model.dim=16", "steps=16", "n_samples=8", "threads=1"]
LAUNCH = [
    "hydra/launcher=slurm_cpu",
    "hydra.launcher.poll_s=1",
    "hydra.launcher.timeout_min=10",
]  # mem_gb: the estimate
WAIT_S = 240  # the longest any one wait may take before the test fails (a hung scheduler, not a slow one)


def run(args, cwd, check=True, env=None, timeout=WAIT_S):
    """``python run.py ARGS`` in ``cwd``; the CompletedProcess with ``.out`` (stdout + stderr)."""
    e = dict(
        os.environ, WANDB_MODE="offline", HYDRA_FULL_ERROR="0", OMP_NUM_THREADS="1", SPECSAMP_OFFLINE="1", **(env or {})
    )
    p = python([sys.executable, str(ROOT / "run.py"), *args], cwd=cwd, env=e, timeout=timeout)
    p.out = p.stdout + p.stderr
    if check:
        assert p.returncode == 0, p.out
    return p


def start(args, cwd):
    """``python run.py ARGS`` in the background (stdout and stderr to ``cwd/launch.log``; SIGABRT writes every
    thread's Python stack there: :func:`ctrl_c`)."""
    e = dict(os.environ, WANDB_MODE="offline", HYDRA_FULL_ERROR="0", OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1")
    log = open(cwd / "launch.log", "w")
    return subprocess.Popen(
        [sys.executable, str(ROOT / "run.py"), *args], cwd=cwd, stdout=log, stderr=subprocess.STDOUT, env=e, text=True
    )


def _where(pid: int) -> str:
    """What the kernel says process ``pid`` is doing (state, the call it sleeps in, its children)."""
    proc = Path("/proc") / str(pid)
    try:
        state = next(line for line in (proc / "status").read_text().splitlines() if line.startswith("State:"))
        kids = " ".join((t / "children").read_text().strip() for t in (proc / "task").iterdir())
        return f"{state}; wchan {(proc / 'wchan').read_text() or '-'}; children [{kids}]"
    except (OSError, StopIteration):
        return "not readable"


def ctrl_c(proc, log: Path, timeout: float = 60.0) -> int:
    """Send Ctrl-C (SIGINT) to ``proc``; its exit status. If it has not exited after ``timeout`` seconds, a second
    Ctrl-C, as a user would press, with a warning that says where the first one was lost; if that one does not
    end it within a minute either, its Python stacks (SIGABRT) in the failure."""
    proc.send_signal(signal.SIGINT)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        where = _where(proc.pid)
    proc.send_signal(signal.SIGINT)
    try:
        code = proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGABRT)
        proc.wait(timeout=60)
        pytest.fail(f"two Ctrl-C did not end run.py ({where}); its log and stacks:\n{log.read_text()}")
    warnings.warn(
        f"run.py ignored the first Ctrl-C for {timeout:.0f} s ({where}); the second ended it:\n{log.read_text()}",
        stacklevel=2,
    )
    return code


def wait_until(what, predicate, timeout=WAIT_S, every=0.5):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = predicate()
        if got:
            return got
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def squeue(array: str) -> dict[str, str]:
    """``{A_T: STATE}`` of the array's tasks still in the queue."""
    p = subprocess.run(["squeue", "-h", "-r", "-j", array, "-o", "%i|%T"], capture_output=True, text=True, timeout=30)
    return dict(line.split("|", 1) for line in p.stdout.split() if "|" in line)


def sacct(array: str, n: int) -> dict[str, str]:
    """``{A_T: STATE}`` of the array's ``n`` tasks as the scheduler reports them (queue, then accounting;
    a never-started range such as ``A_[0-1%2]`` expanded)."""
    return {j: st for j, (st, _) in queue.states([f"{array}_{t}" for t in range(n)]).items()}


def queue_empty(array: str) -> None:
    wait_until(f"array {array} to leave the queue", lambda: not squeue(array))


def accounted(array: str, n: int) -> dict[str, str]:
    """The final states of the array's ``n`` tasks once the accounting has them all."""
    final = lambda: (s := sacct(array, n)) and len(s) == n and not set(s.values()) & queue.ALIVE and s  # noqa: E731
    return wait_until(f"sacct to record the {n} tasks of array {array}", final)


def array_of(out: str) -> str:
    """The job id of the submission line (``submitted SLURM array job 43: ...``, or ``submitted SLURM job 43: ...``
    for one cell, a plain job)."""
    m = re.search(r"^submitted SLURM (?:array )?job (\d+)", out, re.M)
    assert m, out
    return m.group(1)


def submitted_array(log: Path) -> str:
    """The (array) job id, once the launcher's log at ``log`` has printed its submission line."""
    return wait_until(
        "the submission line", lambda: "submitted SLURM " in log.read_text() and array_of(log.read_text())
    )


def records(sweep: Path, name: str = "result.json") -> dict[str, dict]:
    return {p.parent.name: json.loads(p.read_text()) for p in sorted(sweep.glob(f"*/{name}"))}


def gate(tmp_path: Path) -> tuple[list[str], Path]:
    """Overrides that hold every task in its sbatch script until ``tmp_path/go`` exists, and that path."""
    go = tmp_path / "go"
    return [f"hydra.launcher.setup=['while [ ! -e {go} ]; do sleep 0.2; done']"], go


@pytest.fixture(autouse=True)
def _no_task_left_behind(request, tmp_path):
    """After a `slurm` test, whatever happened: open its gate and cancel the arrays it submitted."""
    yield
    if request.node.get_closest_marker("slurm") is None:
        return
    (tmp_path / "go").touch()
    arrays = {str((json.loads(p.read_text()) or {}).get("array_job_id") or "") for p in tmp_path.rglob("slurm.json")}
    arrays.discard("")
    if arrays:
        subprocess.run(["scancel", *sorted(arrays)], check=False, timeout=30)


NUMBERS = ("config_hash", "speedup", "nfe", "acceptance_per_depth", "K", "L", "budget")

slurm = pytest.mark.slurm


# ------------------------------------------------------------------------------------------------
# a real scheduler


@slurm
def test_parity_with_the_local_launcher_records_identify_the_task_and_relaunch_submits_nothing(tmp_path):
    grid = [*TINY, "K=1,2", "L=2,3"]
    p = run(["-m", *LAUNCH, *grid, "sweep_name=s"], tmp_path)
    array = array_of(p.stdout)
    assert f"scancel {array}" in p.stdout and f"squeue -j {array}" in p.stdout and f"sacct -j {array}" in p.stdout
    assert "4 jobs, 4 ran, 0 skipped (done before), 0 failed" in p.stdout and "mem_gb=2 per task" in p.stdout
    run(["-m", "hydra/launcher=local", *grid, "sweep_name=l"], tmp_path)
    s, loc = records(tmp_path / "multirun/s"), records(tmp_path / "multirun/l")
    assert sorted(s) == sorted(loc) and len(s) == 4
    for name, rec in s.items():
        assert {k: rec[k] for k in NUMBERS} == {k: loc[name][k] for k in NUMBERS}
        ident = rec["slurm"]
        assert (
            ident["array_job_id"] == array and ident["job_id"] == f"{array}_{ident['array_task_id']}" and ident["host"]
        )
        assert (tmp_path / "multirun/s/.submitit" / ident["job_id"]).is_dir()  # submitit's per-task folder
        assert "slurm" not in loc[name]
    assert (tmp_path / f"multirun/s/.submitit/{array}/{array}_submission.sh").is_file()
    assert set(accounted(array, 4).values()) == {"COMPLETED"}
    again = run(["-m", *LAUNCH, *grid, "sweep_name=s"], tmp_path)
    assert "4 of 4 cells already done" in again.stdout and "submitted SLURM array job" not in again.stdout
    assert "4 jobs, 0 ran, 4 skipped (done before)" in again.stdout


@slurm
def test_a_failing_and_a_non_composing_cell_fail_alone_and_their_tasks_end_failed(tmp_path):
    p = run(["-m", *LAUNCH, *TINY, "L=2,0", "sampler=dgrs,nope", "sweep_name=bad"], tmp_path, check=False)
    assert p.returncode == 2, p.out
    assert "Traceback" not in p.stdout and "4 jobs, 1 ran, 0 skipped (done before), 3 failed" in p.stdout, p.out
    sweep = tmp_path / "multirun/bad"
    failed = records(sweep, "failed.json")
    assert len(failed) == 3 and {f["kind"] for f in failed.values()} == {"config"}
    assert all(f["slurm"]["array_job_id"] == array_of(p.stdout) for f in failed.values())
    states = accounted(array_of(p.stdout), 4)
    ok = next(iter(records(sweep).values()))["slurm"]["job_id"]
    assert states.pop(ok) == "COMPLETED" and set(states.values()) == {"FAILED"}  # sacct: a failed cell is FAILED


@slurm
def test_scancel_of_one_task_waits_for_the_others_and_the_relaunch_reruns_only_that_one(tmp_path):
    held, go = gate(tmp_path)
    proc = start(["-m", *LAUNCH, *held, *TINY, "K=1,2", "sweep_name=c"], tmp_path)
    log = tmp_path / "launch.log"
    array = submitted_array(log)
    wait_until("both tasks running", lambda: list(squeue(array).values()) == ["RUNNING", "RUNNING"])
    subprocess.run(["scancel", f"{array}_1"], check=True)
    wait_until("the cancelled task to leave the queue", lambda: f"{array}_1" not in squeue(array))
    go.touch()
    assert proc.wait(timeout=WAIT_S) == 1  # a killed cell: exit 1 once every task has ended
    out = log.read_text()
    assert "2 jobs, 1 ran, 0 skipped (done before), 0 failed, 1 killed (no record; rerun on relaunch)" in out, out
    sweep = tmp_path / "multirun/c"
    df = report.collect(sweep)
    killed = df[df["status"] == "killed"]
    assert len(killed) == 1 and "CANCELLED" in killed["error"].iloc[0] and "CANCELLED" in killed["slurm"].iloc[0]
    assert len(records(sweep)) == 1
    again = run(["-m", *LAUNCH, *TINY, "K=1,2", "sweep_name=c"], tmp_path)
    assert "1 of 2 cells already done" in again.stdout and ": 1 task" in again.stdout
    assert "2 jobs, 1 ran, 1 skipped (done before), 0 failed" in again.stdout


@slurm
def test_relaunch_while_the_array_runs_after_the_launcher_died_submits_nothing_and_nothing_runs_twice(tmp_path):
    held, go = gate(tmp_path)
    args = ["-m", *LAUNCH, *TINY, "K=1,2", "sweep_name=r"]
    proc = start([*args, *held], tmp_path)
    log = tmp_path / "launch.log"
    array = submitted_array(log)
    wait_until("both tasks running", lambda: list(squeue(array).values()) == ["RUNNING", "RUNNING"])
    proc.kill()  # the launching shell dies; the array does not
    proc.wait()
    sweep = tmp_path / "multirun/r"
    assert set(report.collect(sweep)["status"]) == {"running"}
    again = run(args, tmp_path, check=False)
    assert again.returncode == 75, again.out  # not every job wrote its record: not 0
    assert (
        "2 of 2 cells still pending or running: not submitted again" in again.stdout
        and "submitted SLURM" not in again.stdout
    )
    assert "2 running" in again.stdout and "wait: 2 jobs are still queued or running" in again.stdout, again.out
    go.touch()
    queue_empty(array)
    assert set(accounted(array, 2).values()) == {"COMPLETED"}
    recs = records(sweep)
    assert len(recs) == 2 and {r["slurm"]["array_job_id"] for r in recs.values()} == {array}
    assert sorted(p.name for p in (sweep / ".submitit").iterdir() if not p.name.startswith(".")) == [
        array,
        f"{array}_0",
        f"{array}_1",
    ]
    done = run(args, tmp_path)
    assert "2 of 2 cells already done" in done.stdout and "2 jobs, 0 ran, 2 skipped" in done.stdout


@slurm
def test_ctrl_c_leaves_the_array_running_and_says_how_to_cancel_it_or_cancels_it_when_asked(tmp_path):
    held, go = gate(tmp_path)
    log = tmp_path / "launch.log"
    arrays = []
    for name, extra in (("keep", []), ("cancel", ["hydra.launcher.cancel_on_interrupt=true"])):
        proc = start(["-m", *LAUNCH, *held, *extra, *TINY, "K=1,2", f"sweep_name={name}"], tmp_path)
        array = submitted_array(log)
        # the first array holds both CPUs: the second one's tasks stay pending, which Ctrl-C cancels as well
        wait_until(
            "both tasks queued",
            lambda array=array, extra=extra: (
                len(squeue(array)) == 2 and (extra or set(squeue(array).values()) == {"RUNNING"})
            ),
        )
        assert ctrl_c(proc, log, timeout=WAIT_S) == 130
        out = log.read_text()
        if not extra:
            assert f"SLURM array job {array} keeps running on the cluster" in out and f"scancel {array}" in out, out
            assert list(squeue(array).values()) == ["RUNNING", "RUNNING"]  # Ctrl-C cancelled nothing
        else:
            assert f"cancelled SLURM array job {array}" in out, out
            queue_empty(array)
            assert set(accounted(array, 2).values()) == {"CANCELLED"}
        arrays.append(array)
    go.touch()
    queue_empty(arrays[0])
    assert len(records(tmp_path / "multirun/keep")) == 2 and not records(tmp_path / "multirun/cancel")


@slurm
def test_a_node_lost_mid_sweep_is_requeued_by_slurm_and_the_sweep_waits_for_it(tmp_path):
    held, go = gate(tmp_path)
    proc = start(["-m", *LAUNCH, *held, *TINY, "K=1,2", "sweep_name=node"], tmp_path)
    log = tmp_path / "launch.log"
    array = submitted_array(log)
    wait_until("both tasks running", lambda: list(squeue(array).values()) == ["RUNNING", "RUNNING"])
    node = subprocess.run(["sinfo", "-h", "-N", "-o", "%N"], capture_output=True, text=True, check=True).stdout.split()[
        0
    ]
    try:
        subprocess.run(["scontrol", "update", f"nodename={node}", "state=down", "reason=specsamp-test"], check=True)
        wait_until(
            "the tasks to be requeued", lambda: set(squeue(array).values()) <= {"PENDING", "REQUEUED"} and squeue(array)
        )
    finally:
        subprocess.run(
            ["scontrol", "update", f"nodename={node}", "state=resume"], check=False
        )  # ReturnToService=2 may have
    go.touch()
    assert proc.wait(timeout=WAIT_S) == 0, log.read_text()
    assert "2 jobs, 2 ran, 0 skipped (done before), 0 failed" in log.read_text()
    recs = records(tmp_path / "multirun/node")
    assert len(recs) == 2 and all(
        r["slurm"]["restart_count"] >= 1 for r in recs.values()
    )  # the requeued attempt wrote them
    assert set(accounted(array, 2).values()) == {"COMPLETED"}


# a cell of 15 batches of 4000 trajectories (about 5 s on an idle core), signalled once its first batch is on disk;
# SLURM's time-limit signal is what `scancel -s USR2` sends to the task's steps, here at once instead of
# signal_delay_s before the limit (timeout_min=10 is below 10 minutes, so submitit counts it as a time limit)
LONG = ["model.dim=16", "steps=16", "n_samples=60000", "batch_size=4000", "threads=1"]
RECORD = (
    *NUMBERS,
    "nfe_total",
    "target_rows",
    "rounds",
    "committed_per_round",
    "attempts_per_depth",
    "batch_speedup",
    "tree",
)


def signal_after_first_batch(tmp_path, args, name):
    """Launch ``args`` in the background, send USR2 to its one task once a batch is kept; (proc, array, cell)."""
    proc = start(["-m", *LAUNCH, *LONG, *args, f"sweep_name={name}"], tmp_path)
    log = tmp_path / "launch.log"
    array = submitted_array(log)
    cell = next((tmp_path / f"multirun/{name}").glob("*/slurm.json")).parent
    wait_until("a finished batch", lambda: list((cell / "batches").glob("*.pt")))
    subprocess.run(["scancel", "-s", "USR2", array], check=True)
    return proc, array, cell


def local_record(tmp_path) -> dict:
    run(["-m", "hydra/launcher=local", *LONG, "sweep_name=loc"], tmp_path)
    (rec,) = records(tmp_path / "multirun/loc").values()
    return rec


@slurm
def test_the_time_limit_signal_requeues_a_batch_wise_cell_which_resumes_and_records_it_once(tmp_path):
    proc, array, cell = signal_after_first_batch(tmp_path, [], "rq")
    log = tmp_path / "launch.log"
    assert proc.wait(timeout=WAIT_S) == 0, log.read_text()
    out = log.read_text()
    assert "1 jobs, 1 ran, 0 skipped (done before), 0 failed" in out, out  # the requeue is the same task: counted once
    (rec,) = records(tmp_path / "multirun/rq").values()
    assert rec["slurm"]["restart_count"] == 1 and rec["slurm"]["job_id"] == array  # written by the requeued attempt
    assert 1 <= rec["resumed"]["batches"] < rec["resumed"]["of"] == 15  # it continued from the kept batches
    assert not (cell / "failed.json").exists() and not (cell / "batches").exists()
    final = wait_until(
        "sacct to record the job", lambda: (st := queue.states([array]).get(array)) and st[0] not in queue.ALIVE and st
    )
    assert final[0] == "COMPLETED"
    loc = local_record(tmp_path)
    assert {k: rec[k] for k in RECORD} == {k: loc[k] for k in RECORD} and "resumed" not in loc


@slurm
def test_without_requeues_the_time_limit_signal_records_timed_out_and_the_relaunch_resumes(tmp_path):
    proc, array, cell = signal_after_first_batch(tmp_path, ["hydra.launcher.max_num_timeout=0"], "t")
    log = tmp_path / "launch.log"
    assert proc.wait(timeout=WAIT_S) == 1, log.read_text()
    failed = json.loads((cell / "failed.json").read_text())
    assert failed["kind"] == "timed_out" and "signal_delay_s=120 s before timeout_min=10" in failed["error"]
    assert "was not requeued" in failed["error"] and "a relaunch continues from them" in failed["error"]
    kept = len(list((cell / "batches").glob("*.pt")))
    assert kept >= 1 and not (cell / "result.json").exists() and "1 failed" in log.read_text()
    final = wait_until(
        "sacct to record the job", lambda: (st := queue.states([array]).get(array)) and st[0] not in queue.ALIVE and st
    )
    assert final[0] == "FAILED"  # one cell: a plain job, no array
    again = run(["-m", *LAUNCH, *LONG, "sweep_name=t"], tmp_path)
    assert "1 jobs, 1 ran, 0 skipped (done before), 0 failed" in again.stdout, again.out
    (rec,) = records(tmp_path / "multirun/t").values()
    assert rec["resumed"] == {"batches": kept, "of": 15} and not (cell / "failed.json").exists()
    loc = local_record(tmp_path)
    assert {k: rec[k] for k in RECORD} == {k: loc[k] for k in RECORD}


@slurm
def test_an_out_of_memory_kill_is_recorded_by_slurm_and_reruns_on_relaunch(tmp_path):
    args = ["-m", *LAUNCH, *TINY, "K=1,2", "sweep_name=oom"]
    small = ["+hydra.launcher.additional_parameters.mem=64M"]  # below one Python interpreter with torch
    p = run([*args, *small], tmp_path, check=False)
    assert p.returncode == 1, p.out
    assert "2 killed" in p.stdout, p.out
    array = array_of(p.stdout)
    assert set(accounted(array, 2).values()) <= {
        "OUT_OF_MEMORY",
        "FAILED",
    }  # FAILED under polling enforcement (OverMemoryKill)
    df = report.collect(tmp_path / "multirun/oom")
    assert list(df["status"]) == ["killed", "killed"] and all("OUT_OF_MEMORY" in e for e in df["error"])
    again = run(args, tmp_path)
    assert "2 jobs, 2 ran" in again.stdout and len(records(tmp_path / "multirun/oom")) == 2


@slurm
def test_two_shards_in_an_array_merge_into_one_unsharded_run_bitwise(tmp_path):
    common = [*TINY, "batch_size=4", "save_samples=true"]
    run([*common, f"hydra.run.dir={tmp_path / 'single'}"], tmp_path)
    p = run(["-m", *LAUNCH, *common, "num_shards=2", "shard=0,1", "sweep_name=sh"], tmp_path)
    assert "shards merged" in p.stdout, p.out
    merged = next(
        d
        for d in (tmp_path / "multirun/sh").iterdir()
        if d.is_dir() and "shard" not in d.name and not d.name.startswith(".")
    )
    assert torch.equal(torch.load(tmp_path / "single/samples.pt"), torch.load(merged / "samples.pt"))
    a, b = (json.loads((d / "result.json").read_text()) for d in (tmp_path / "single", merged))
    assert a["config_hash"] == b["config_hash"] and a["speedup"] == b["speedup"]


@slurm
def test_the_digits_network_runs_in_an_array_task(tmp_path):
    p = run(
        ["-m", *LAUNCH, "model=digits", "K=2", "L=2", "steps=8", "n_samples=4", "threads=1", "sweep_name=dig"], tmp_path
    )
    (rec,) = records(tmp_path / "multirun/dig").values()
    assert (
        rec["status"] == "ok" and "digits" in rec["model"] and rec["slurm"]["job_id"] == array_of(p.stdout)
    )  # one cell: a plain job, no array


@slurm
def test_an_sbatch_refusal_names_the_setting_and_an_unreachable_controller_exits_3(tmp_path):
    p = run(["-m", *LAUNCH, *TINY, "K=1,2", "hydra.launcher.partition=nope", "sweep_name=x"], tmp_path, check=False)
    assert p.returncode == 2 and "hydra.launcher.partition='nope'" in p.stderr and "Traceback" not in p.out, p.out
    conf = tmp_path / "slurm.conf"
    conf.write_text(Path("/etc/slurm/slurm.conf").read_text() + "\nSlurmctldPort=1\n")  # nobody listens there
    p = run(["-m", *LAUNCH, *TINY, "K=1,2", "sweep_name=y"], tmp_path, check=False, env={"SLURM_CONF": str(conf)})
    assert p.returncode == 3 and "could not reach the SLURM controller" in p.stderr and "Traceback" not in p.out, p.out


@slurm
def test_a_request_no_node_can_satisfy_shows_the_pending_reason_stops_waiting_and_exits_2(tmp_path):
    """8 CPUs per task on the test cluster's node (its `nproc` CPUs, 2 on CI): sbatch accepts the array, SLURM
    keeps it pending with reason PartitionConfig; the launcher shows the reason, cancels the tasks and exits 2
    naming the setting; the relaunch with a request that fits submits them again."""
    cpus = int(
        subprocess.run(["sinfo", "-h", "-N", "-o", "%c"], capture_output=True, text=True, check=True).stdout.split()[0]
    )
    args = ["-m", *LAUNCH, *TINY, "K=1,2", "sweep_name=big"]
    p = run([*args, f"hydra.launcher.cpus_per_task={4 * cpus}"], tmp_path, check=False, timeout=120)
    assert p.returncode == 2 and "Traceback" not in p.out, p.out
    array = array_of(p.stdout)
    assert f"array job {array}: 2 pending (PartitionConfig)" in p.stdout, p.out
    assert f"SLURM cannot run job {array}" in p.stderr and f"hydra.launcher.cpus_per_task={4 * cpus}" in p.stderr, p.out
    assert f"{cpus} CPUs" in p.stderr and "cancelled" in p.stderr, p.out
    assert set(accounted(array, 2).values()) == {"CANCELLED"}
    again = run(args, tmp_path)
    assert "2 jobs, 2 ran, 0 skipped (done before), 0 failed" in again.stdout, again.out


@slurm
def test_dry_run_prints_the_sbatch_script_and_submits_nothing(tmp_path):
    p = run(["-m", *LAUNCH, *TINY, "K=1,2", "hydra.launcher.dry_run=true", "sweep_name=d"], tmp_path)
    assert (
        "#SBATCH --array=0-1%2" in p.stdout
        and "#SBATCH --signal=USR2@120" in p.stdout
        and "#SBATCH --gpus-per-node=0" in p.stdout
    )
    assert "nothing was submitted" in p.stdout and not list((tmp_path / "multirun/d").glob("*/slurm.json"))


# ------------------------------------------------------------------------------------------------
# without a scheduler


def compose_hydra(overrides):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose(config_name="config", overrides=overrides, return_hydra_config=True)


def test_slurm_presets_follow_the_device_and_threads():
    cpu = compose_hydra(["hydra/launcher=slurm", "threads=3"]).hydra.launcher
    assert (cpu.gpus_per_node, cpu.cpus_per_task) == (0, 3)
    assert compose_hydra(["hydra/launcher=slurm", "device=cuda"]).hydra.launcher.gpus_per_node == 1
    gpu = compose_hydra(["hydra/launcher=slurm_gpu"]).hydra.launcher
    assert (gpu.gpus_per_node, gpu.cpus_per_task, gpu.mem_gb) == (1, 8, 64)
    assert compose_hydra(["hydra/launcher=slurm_cpu", "device=cuda"]).hydra.launcher.gpus_per_node == 0
    assert compose_hydra(["hydra/launcher=slurm", "sweep_name=abc"]).hydra.launcher.name == "specsamp-abc"


@pytest.mark.parametrize("said, status, needle", [
    ("sbatch: error: Batch job submission failed: Invalid partition name specified", 2, "hydra.launcher.partition='gpu'"),
    (
        "sbatch: error: Batch job submission failed: Invalid account or account/partition combination specified",
        2,
        "hydra.launcher.account=",
    ),
    ("sbatch: error: Batch job submission failed: Requested node configuration is not available", 2, "hydra.launcher.mem_gb=4"),
    (
        "sbatch: error: Batch job submission failed: Invalid generic resource (gres) specification",
        2,
        "hydra.launcher.gpus_per_node=1",
    ),
    ("sbatch: error: Batch job submission failed: Unable to contact slurm controller (connect failure)", 3, "scontrol ping"),
    ("sbatch: error: something new", 2, "dry_run=true"),
])  # fmt: skip
def test_sbatch_refusals_are_sorted_into_user_input_and_infrastructure(said, status, needle):
    got, message = explain_refusal(
        RuntimeError(f"Could not submit job (exit 1)\n{said}\n"),
        {"partition": "gpu", "mem_gb": 4, "gpus_per_node": 1, "cpus_per_task": 1},
    )
    assert got == status and needle in message and "\n" not in message


def test_queue_states_parse_pending_ranges_and_accounting(tmp_path, monkeypatch):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "squeue").write_text("#!/bin/sh\necho '7_[2-3%2]|PENDING|Resources'\necho '7_1|RUNNING|None'\n")
    # 9: an array cancelled while all its tasks were pending, which accounting records under the bare id
    (bindir / "sacct").write_text(
        "#!/bin/sh\necho '7_0|OUT_OF_MEMORY|0:125'\necho '7_4|CANCELLED by 0|0:0'\necho '9|CANCELLED by 0|0:0'\n"
    )
    for f in bindir.iterdir():
        f.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    got = queue.states([f"7_{t}" for t in range(5)] + ["8_0", "9_0", "9_1"])
    assert got == {
        "7_0": ("OUT_OF_MEMORY", "exit code 0:125"),
        "7_1": ("RUNNING", "None"),
        "7_2": ("PENDING", "Resources"),
        "7_3": ("PENDING", "Resources"),
        "7_4": ("CANCELLED", ""),
        "9_0": ("CANCELLED", ""),
        "9_1": ("CANCELLED", ""),
    }


def test_job_identity_names_the_array_task_as_squeue_does():
    env = {
        "SLURM_JOB_ID": "41",
        "SLURM_ARRAY_JOB_ID": "37",
        "SLURM_ARRAY_TASK_ID": "4",
        "SLURMD_NODENAME": "n1",
        "SLURM_RESTART_COUNT": "1",
    }
    assert queue.job_identity(env) == {
        "job_id": "37_4",
        "array_job_id": "37",
        "array_task_id": "4",
        "raw_job_id": "41",
        "host": "n1",
        "restart_count": 1,
    }
    assert queue.job_identity({}) is None


def test_the_timeout_signal_stops_the_cell_and_its_record_says_timed_out(tmp_path, monkeypatch):
    """submitit's USR2 (``signal_delay_s`` before the limit) raises inside the cell, whose failed.json
    then has kind ``timed_out``; the handler is removed once the cell returns."""
    from specsamp.runner.task import write_failure

    # Hydra's plugin scan reloads the plugin modules: take the classes of the module as it is now
    mod = sys.modules["hydra_plugins.specsamp_sweeper.slurm"]
    SpecsampSlurmLauncher, CellTimedOut = mod.SpecsampSlurmLauncher, mod.CellTimedOut

    def cell(self, *args):  # the handler SLURM's signal would run, called as the interpreter calls it
        signal.getsignal(signal.SIGUSR2)(signal.SIGUSR2, None)
        raise AssertionError("the signal should have stopped the cell")

    monkeypatch.setattr(SpecsampSlurmLauncher.__bases__[0], "__call__", cell)  # hydra-submitit-launcher's job body
    launcher = SpecsampSlurmLauncher(submitit_folder=str(tmp_path), timeout_min=10, signal_delay_s=120)
    before = signal.getsignal(signal.SIGUSR2)
    with pytest.raises(CellTimedOut, match="signal_delay_s=120 s before timeout_min=10") as e:
        launcher(["K=1"], "hydra.sweep.dir", 0, "job_id_for_0", {})
    assert signal.getsignal(signal.SIGUSR2) is before
    assert write_failure(tmp_path, e.value, None, None)["kind"] == "timed_out"


def test_a_timed_out_cell_makes_the_sweep_exit_1_like_a_killed_one():
    from specsamp.runner import exits

    assert exits.sweep_exit_status({"kinds": ["config", "timed_out"]}) == exits.BUG
    assert exits.sweep_exit_status({"kinds": ["config"]}) == exits.USAGE


def test_on_the_signal_a_batch_wise_cell_is_checkpointed_and_requeued_by_submitit_and_any_other_records_timed_out(
    tmp_path, monkeypatch
):
    """With a batch-wise run sampling (its store active), the launcher's handler hands the signal to the
    handler submitit installed (which calls ``checkpoint`` and requeues: here it records the checkpoint
    and exits as submitit does); when submitit refuses (out of requeues) the cell records ``timed_out``
    naming its kept batches. Without an active store ``checkpoint`` returns None (no requeue)."""
    import submitit
    from submitit.core.utils import UncompletedJobError

    from specsamp.runner.resume import BatchStore

    mod = sys.modules["hydra_plugins.specsamp_sweeper.slurm"]
    launcher = mod.SpecsampSlurmLauncher(submitit_folder=str(tmp_path), timeout_min=10, signal_delay_s=120)
    args = (["K=1"], "hydra.sweep.dir", 0, "job_id_for_0", {})
    assert launcher.checkpoint(*args) is None
    seen = []

    def submitit_handler(signum, frame):  # SignalHandler.checkpoint_and_try_requeue, reduced to its two outcomes
        ckpt = launcher.checkpoint(*args)
        seen.append(ckpt)
        if len(seen) == 1:
            sys.exit(-1)  # requeued: submitit exits the task
        raise UncompletedJobError("Job not requeued because: timed-out too many times.")

    def cell(self, *a):
        with BatchStore(tmp_path, "h").running(5):
            signal.getsignal(signal.SIGUSR2)(signal.SIGUSR2, None)
        raise AssertionError("the signal should have stopped the cell")

    monkeypatch.setattr(mod.SpecsampSlurmLauncher.__bases__[0], "__call__", cell)
    before = signal.signal(signal.SIGUSR2, submitit_handler)
    try:
        with pytest.raises(SystemExit):
            launcher(*args)
        assert isinstance(seen[0], submitit.helpers.DelayedSubmission) and seen[0].args == args
        assert signal.getsignal(signal.SIGUSR2) == submitit_handler
        with pytest.raises(mod.CellTimedOut, match="was not requeued .*timed-out too many times.*0 of 5 batches"):
            launcher(*args)
    finally:
        signal.signal(signal.SIGUSR2, before)


def fake_slurm_commands(tmp_path, monkeypatch):
    bindir = tmp_path / "bin"  # the launcher and submitit insist on finding sbatch and srun; a dry run calls neither
    bindir.mkdir()
    for cmd in ("sbatch", "srun"):
        (bindir / cmd).write_text("#!/bin/sh\nexit 1\n")
        (bindir / cmd).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")


def test_mem_gb_unset_is_the_cells_memory_estimate_with_a_margin_in_the_sbatch_header(tmp_path, monkeypatch):
    from specsamp.runner.config import compose, load_config
    from specsamp.runner.memory import MEM_MARGIN, PROCESS_BYTES, mem_gb_for, run_memory_bytes

    fake_slurm_commands(tmp_path, monkeypatch)
    assert compose_hydra(["hydra/launcher=slurm"]).hydra.launcher.mem_gb is None
    assert compose_hydra(["hydra/launcher=slurm_cpu"]).hydra.launcher.mem_gb is None
    tiny = load_config(compose(TINY))[0]
    assert PROCESS_BYTES < run_memory_bytes(tiny) < PROCESS_BYTES + 2**20 and mem_gb_for(tiny) == 2
    big = ["model.dim=2000", "steps=16", "n_samples=100000", "batch_size=20000", "threads=1"]
    want = mem_gb_for(load_config(compose(big))[0])
    # execution=path holds 2K+16 float64 states per trajectory of a batch (20000 x 20 x 2000 x 8 B = 5.96 GiB) and
    # keeps the samples twice (100000 x 2 x 2000 x 8 B = 2.98 GiB): times the margin, at least 13.4 GiB
    assert want >= MEM_MARGIN * (20000 * 20 + 100000 * 2) * 2000 * 8 / 2**30
    dry = ["-m", "hydra/launcher=slurm_cpu", "hydra.launcher.dry_run=true"]
    p = run(
        [*dry, "steps=16", "threads=1", "model.dim=16,2000", "n_samples=8,100000", "batch_size=20000", "sweep_name=m"],
        tmp_path,
    )
    assert f"#SBATCH --mem={want}GB" in p.stdout and f"mem_gb={want} per task" in p.stdout, p.out  # the largest cell's
    p = run([*dry, *TINY, "K=1,2", "hydra.launcher.mem_gb=7", "sweep_name=n"], tmp_path)
    assert "#SBATCH --mem=7GB" in p.stdout and "per task" not in p.stdout, p.out


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine where torch sees no CUDA device (a login node)")
def test_a_gpu_sweep_submitted_from_a_node_without_a_gpu_is_checked_and_sized_there(tmp_path, monkeypatch):
    """The device is the compute nodes' to check: the sweep is not refused, and its memory is estimated."""
    fake_slurm_commands(tmp_path, monkeypatch)
    p = run(
        ["-m", "hydra/launcher=slurm", "hydra.launcher.dry_run=true", *TINY, "device=cuda", "K=1,2", "sweep_name=g"],
        tmp_path,
    )
    assert p.returncode == 0 and "torch sees no CUDA device" not in p.out, p.out
    assert "mem_gb=" in p.stdout and "per task" in p.stdout and "#SBATCH --gpus-per-node=1" in p.stdout, p.out


def test_the_memory_estimate_of_a_network_follows_its_checkpoint_and_batch_not_a_flat_allowance():
    """The digits network (0.1 M parameters, 0.67 GiB peak measured for a whole run) asks 2 GiB, so several
    tasks share a 12 GB node; the estimate grows with the rows of a call on the CPU and with the weights, and
    stays large for the big networks: CIFAR-10's 56 M parameters, SD3.5 medium's 8 G (3.4 G without T5)."""
    from specsamp.runner.config import compose, load_config
    from specsamp.runner.memory import (
        CUDA_HOST_BYTES,
        EDM_NETWORKS,
        PROCESS_BYTES,
        WEIGHT_LOAD_FACTOR,
        mem_gb_for,
        run_memory_bytes,
    )

    def est(*o):
        return run_memory_bytes(load_config(compose(list(o)), here=False)[0])

    def gb(*o):
        return mem_gb_for(load_config(compose(list(o)), here=False)[0])

    assert gb("model=digits") == 2 and gb("model=patches32") == 2  # the flat 3 GiB per network asked 7
    digits = EDM_NETWORKS["edm-digits-8x8-cond"]
    # path execution, K=2: a call evaluates 2 rows per trajectory; 1000 more trajectories add their rows' activations
    grown = est("model=digits", "n_samples=2000") - est("model=digits", "n_samples=1000")
    assert grown >= 1000 * 2 * digits.row_bytes
    assert (
        est("model=digits", "n_samples=2000", "max_batch=100")
        < est("model=digits", "n_samples=2000") - 1000 * digits.row_bytes
    )
    cifar = est("model=cifar10", "device=cuda")
    assert (
        cifar
        >= PROCESS_BYTES + CUDA_HOST_BYTES + WEIGHT_LOAD_FACTOR * EDM_NETWORKS["edm-cifar10-32x32-cond-vp"].weight_bytes
    )
    assert est("model=cifar10") > cifar - CUDA_HOST_BYTES  # on the CPU the rows of a call come on top
    assert gb("model=sd3", "device=cuda") >= 1.5 * WEIGHT_LOAD_FACTOR * 8.1e9 * 2 / 2**30  # bfloat16 weights, loaded
    assert 20 < gb("model=sd3", "device=cuda", "model.drop_t5=true") < gb("model=sd3", "device=cuda")


def test_a_timeout_at_or_below_the_signal_delay_is_refused_naming_both_keys():
    """timeout_min=2 with signal_delay_s=120 would send every cell its warning signal as it starts: refused
    (exit 2 in a sweep, before anything is written); timeout_min=3 (a minute of running before the signal) passes."""
    from specsamp.errors import ConfigError

    check = sys.modules["hydra_plugins.specsamp_sweeper.slurm"].check_time_limit
    for timeout, delay, hint in (
        (1, 120, "timeout_min=3 or more"),
        (2, 120, "timeout_min=3 or more"),
        (3, 150, "signal_delay_s to at most 120"),
        (1, 60, "signal_delay_s to at most 0"),
    ):
        with pytest.raises(
            ConfigError, match=f"hydra.launcher.timeout_min={timeout} .*hydra.launcher.signal_delay_s={delay}"
        ) as e:
            check({"timeout_min": timeout, "signal_delay_s": delay})
        assert hint in str(e.value)
    check({"timeout_min": 3, "signal_delay_s": 120})
    check({"timeout_min": 240, "signal_delay_s": 120})


@pytest.mark.slow
def test_a_sweep_whose_timeout_leaves_no_time_before_the_signal_exits_2_before_writing_anything(tmp_path, monkeypatch):
    fake_slurm_commands(tmp_path, monkeypatch)
    p = run(
        ["-m", *LAUNCH[:2], "hydra.launcher.timeout_min=2", *TINY, "K=1,2", "sweep_name=short"], tmp_path, check=False
    )
    assert p.returncode == 2 and "hydra.launcher.timeout_min=2 (120 s)" in p.stderr, p.out
    assert "hydra.launcher.signal_delay_s=120" in p.stderr and "Traceback" not in p.out
    assert not (tmp_path / "multirun").exists()  # refused before the sweep folder exists


def test_squeue_lines_give_states_pending_reasons_and_the_tasks_that_cannot_run():
    mod = sys.modules["hydra_plugins.specsamp_sweeper.slurm"]
    # recorded from `squeue -h -r -j 4 -o '%i|%T|%r'` on a 2-CPU node after sbatch -c 8 --array=0-1
    v = mod.queue_view("4_0|PENDING|PartitionConfig\n4_1|PENDING|PartitionConfig\n")
    assert v.line() == "2 pending (PartitionConfig)" and v.stuck == ["4_0", "4_1"] and v.left == 2
    v = mod.queue_view("7_0|RUNNING|None\n7_1|PENDING|Resources\n7_2|PENDING|Priority\n7_3|PENDING|Resources\n")
    assert v.line() == "3 pending (1 Priority, 2 Resources), 1 running" and not v.stuck
    assert mod.stuck_reason("ReqNodeNotAvail, UnavailableNodes:") and not mod.stuck_reason(
        "ReqNodeNotAvail, UnavailableNodes:n[1-2]"
    )
    assert not mod.stuck_reason("ReqNodeNotAvail, Reserved for maintenance") and not mod.stuck_reason("None")
    assert mod.stuck_reason("BadConstraints") and mod.stuck_reason("PartitionTimeLimit")


def fake_cluster(tmp_path, monkeypatch, job="43"):
    """sbatch, srun, squeue, sacct, scancel, sinfo that answer from files: sbatch submits job ``job``; squeue
    prints ``tmp_path/queue`` (empty: the job is over); scancel appends its arguments to ``tmp_path/scancel``
    and empties the queue; sacct prints ``tmp_path/acct``. Returns the queue file."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    q = tmp_path / "queue"
    q.write_text("")
    (tmp_path / "acct").write_text("")
    scripts = {
        "sbatch": f"echo 'Submitted batch job {job}'",
        "srun": "exit 1",
        "sacct": f"cat {tmp_path / 'acct'}",
        "squeue": f"cat {q}",
        "scancel": f'echo "$@" >> {tmp_path / "scancel"}; : > {q}',
        "sinfo": "echo 'n1|2|11980|(null)'",
    }
    for cmd, body in scripts.items():
        (bindir / cmd).write_text(f"#!/bin/sh\n{body}\n")
        (bindir / cmd).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    return q


@pytest.mark.slow
def test_tasks_pending_for_a_reason_that_never_resolves_are_cancelled_and_the_sweep_exits_2(tmp_path, monkeypatch):
    q = fake_cluster(tmp_path, monkeypatch)
    q.write_text("43_0|PENDING|PartitionConfig\n43_1|PENDING|PartitionConfig\n")
    p = run(["-m", *LAUNCH, "hydra.launcher.cpus_per_task=8", *TINY, "K=1,2", "sweep_name=big"], tmp_path, check=False)
    assert p.returncode == 2 and "Traceback" not in p.out, p.out
    assert "array job 43: 2 pending (PartitionConfig); 0 of 2 finished" in p.stdout, p.out
    assert "SLURM cannot run job 43: 2 tasks pend with reason PartitionConfig" in p.stderr, p.out
    assert "hydra.launcher.cpus_per_task=8" in p.stderr and "n1: 2 CPUs, 11980 MB" in p.stderr, p.out
    assert (tmp_path / "scancel").read_text().split() == ["43_0", "43_1"]


@pytest.mark.slow
def test_one_cell_is_a_plain_job_whose_log_path_and_scancel_exist(tmp_path, monkeypatch):
    fake_cluster(tmp_path, monkeypatch)
    (tmp_path / "acct").write_text("43|FAILED|1:0\n")  # the fake job never ran
    p = run(["-m", *LAUNCH, *TINY, "K=1", "sweep_name=one"], tmp_path, check=False)
    assert (
        "submitted SLURM job 43: 1 task" in p.stdout and "<task>" not in p.stdout and "scancel 43_" not in p.stdout
    ), p.out
    sweep = (tmp_path / "multirun/one").resolve()
    assert (
        f"logs:          {sweep}/.submitit/43/43_0_log.out (.err)" in p.stdout
        and "cancel:        scancel 43\n" in p.stdout
    ), p.out
    assert (sweep / ".submitit/43/43_submission.sh").is_file()  # where the printed sbatch script is


@pytest.mark.slow
def test_a_relaunch_while_every_cell_is_still_queued_exits_75_and_ctrl_c_says_to_wait(tmp_path, monkeypatch):
    """75: not every job wrote its record (0 would say they all did). Ctrl-C while the array runs: the
    summary counts running and pending cells as such, and the advice is to wait, not to rerun now."""
    from specsamp.runner import exits

    q = fake_cluster(tmp_path, monkeypatch)
    args = ["-m", *LAUNCH, *TINY, "K=1,2", "sweep_name=q"]
    q.write_text("43_0|RUNNING|None\n43_1|PENDING|Priority\n")
    proc = start(args, tmp_path)
    log = tmp_path / "launch.log"
    wait_until(
        "the progress line", lambda: "1 pending (Priority), 1 running; 0 of 2 finished" in log.read_text(), timeout=120
    )
    assert ctrl_c(proc, log) == 130, log.read_text()
    out = log.read_text()
    assert "SLURM array job 43 keeps running on the cluster" in out and "do not rerun yet" in out, out
    assert "1 running, 1 pending (queued)" in out and "not finished" not in out and "  resume:" not in out, out
    again = run(args, tmp_path, check=False)
    assert again.returncode == exits.NOT_FINISHED == 75, again.out
    assert "2 of 2 cells still pending or running: not submitted again" in again.stdout and "(Priority)" in again.stdout
    assert (
        "1 running, 1 pending (queued)" in again.stdout and "wait: 2 jobs are still queued or running" in again.stdout
    )
    assert exits.sweep_exit_status({"kinds": [], "unfinished": 2}) == 75
    assert exits.sweep_exit_status({"kinds": ["config"], "unfinished": 2}) == 2
    assert exits.sweep_exit_status({"kinds": [], "unfinished": 2, "dry_run": True}) == 0
