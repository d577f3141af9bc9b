"""What the test folders share: the repository root, ``run.py`` and the CLIs as child processes forked from
the test process (:func:`python`: a tiny GMM's overrides, an offline digits run), two-sample statistical checks for
the sampler and model tests (one-sample ones:
:mod:`specsamp.testing`), and stand-ins for a logger and a model."""

from __future__ import annotations

import contextlib
import io
import json
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np
import torch
from scipy import stats

from specsamp.models import GaussianMixture
from specsamp.schedule import Schedule
from specsamp.trees import DraftTree

ROOT = Path(__file__).resolve().parents[1]  # the repository root: run.py, conf/, docs/, results/
TINY = ["model.dim=16", "steps=8", "n_samples=8"]  # a GMM small enough for a subprocess run in seconds


def python(argv, *, cwd, env=None, timeout=300, capture_output=True, text=True) -> subprocess.CompletedProcess:
    """``python SCRIPT ARGS`` or ``python -m MODULE ARGS`` as a child process, with text output captured.

    ``argv`` is a command line that starts with ``sys.executable``. The child is forked from this test process,
    which has imported torch, Hydra and specsamp already, and runs the script or module as ``__main__`` with
    its own arguments, environment (``env``, default this process's), working directory, file descriptors 1
    and 2 and exit status: the command line's behaviour for a few tenths of a second instead of the three
    seconds a fresh interpreter takes to import torch. Coverage follows the child (``patch = ["fork"]``). The
    child sees modules this process imported already, so a test whose command depends on what happens at
    import time (an environment variable read when a module loads, the interpreter's start-up) uses
    ``subprocess`` instead; so does one that limits the child's resources (a ``preexec_fn`` would run after
    the fork, where this process's address space and open files are already there). Returns a
    :class:`subprocess.CompletedProcess`; a child still running after
    ``timeout`` seconds is killed and :class:`subprocess.TimeoutExpired` raised.
    """
    if not (capture_output and text):
        raise ValueError("python(): output is always captured as text")
    return Forked(argv, cwd=cwd, env=env).wait(timeout)


class Forked:
    """A :func:`python` child started without waiting for it (several at once, or one to signal):
    ``pid``, ``returncode``, :meth:`poll`, :meth:`send_signal`, :meth:`kill`, :meth:`communicate` (as
    :class:`subprocess.Popen`'s) and :meth:`wait`, which returns the :class:`subprocess.CompletedProcess`."""

    def __init__(self, argv, *, cwd, env=None):
        argv = [str(a) for a in argv]
        if (
            argv[0] != sys.executable
            or len(argv) < 2
            or (argv[1] == "-m" and len(argv) < 3)
            or (argv[1] != "-m" and argv[1].startswith("-"))
        ):
            raise ValueError(f"python(): expected [sys.executable, script | -m module, ...], got {argv[:3]}")
        env = dict(os.environ if env is None else env)
        self.argv, self.returncode, self._result = argv, None, None
        self._out, self._err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
        sys.stdout.flush()
        sys.stderr.flush()
        self.pid = os.fork()
        if self.pid == 0:  # the child: never returns
            _forked_main(argv, cwd, env, self._out, self._err)

    def poll(self):
        """The exit status, or None while the child runs."""
        if self.returncode is None:
            done, status = os.waitpid(self.pid, os.WNOHANG)
            if done:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def send_signal(self, sig) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, timeout=300) -> tuple[str, str]:
        """``(stdout, stderr)`` once the child has ended, as :meth:`subprocess.Popen.communicate`."""
        p = self.wait(timeout)
        return p.stdout, p.stderr

    def wait(self, timeout=300) -> subprocess.CompletedProcess:
        """Wait for the child (killed, and :class:`subprocess.TimeoutExpired` raised, after ``timeout`` s)."""
        if self._result is None:
            t0 = time.monotonic()
            while self.poll() is None:
                if time.monotonic() - t0 > timeout:
                    os.kill(self.pid, signal.SIGKILL)
                    os.waitpid(self.pid, 0)
                    self._out.close()
                    self._err.close()
                    raise subprocess.TimeoutExpired(self.argv, timeout)
                time.sleep(0.005)
            outs = []
            for f in (self._out, self._err):
                f.seek(0)
                outs.append(f.read().decode(errors="replace"))
                f.close()
            self._result = subprocess.CompletedProcess(self.argv, self.returncode, *outs)
        return self._result


def _forked_main(argv, cwd, env, out, err) -> None:
    """The forked child of :func:`python`: run the script or module as ``__main__``, then ``os._exit``."""
    code = 1
    try:
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        sys.stdout = open(1, "w", encoding="utf-8", closefd=False, buffering=1)
        sys.stderr = open(2, "w", encoding="utf-8", closefd=False, buffering=1)
        sys.stdin = open(os.devnull)
        for sig in (signal.SIGINT, signal.SIGTERM):  # the test runner's handlers are not the command's
            signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        head = [
            str(Path(cwd, argv[1]).resolve().parent) if argv[1] != "-m" else str(Path(cwd).resolve()),
            *filter(None, env.get("PYTHONPATH", "").split(os.pathsep)),
        ]  # as the interpreter builds sys.path
        sys.path[:] = [*head, *(p for p in sys.path[1:] if p not in head)]
        try:
            if argv[1] == "-m":
                sys.argv = [argv[2], *argv[3:]]
                runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
            else:
                sys.argv = argv[1:]
                runpy.run_path(str(Path(cwd, argv[1])), run_name="__main__")
            code = 0
        except SystemExit as e:
            if e.code is None or isinstance(e.code, int):
                code = e.code or 0
            else:  # sys.exit("message"): printed to stderr, status 1
                print(e.code, file=sys.stderr)
                code = 1
        except KeyboardInterrupt:
            traceback.print_exc()
            code = 130
        except BaseException:  # noqa: BLE001 - an uncaught error: the interpreter's traceback and status 1
            traceback.print_exc()
            code = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
            import coverage

            cov = coverage.Coverage.current()
            if cov is not None:  # the child's own data file (coverage restarted it at the fork)
                cov.stop()
                cov.save()
        finally:
            os._exit(code)


def run(args, tmp_path, check=True):
    """``python run.py ARGS hydra.run.dir=tmp_path`` in ``tmp_path`` (wandb offline, Hydra's short errors).

    Returns the completed process (text output); with ``check``, asserts exit status 0 (stderr as the message).
    """
    env = dict(os.environ, WANDB_MODE="offline", HYDRA_FULL_ERROR="0")
    cmd = [sys.executable, str(ROOT / "run.py"), *args, f"hydra.run.dir={tmp_path}"]
    p = python(cmd, cwd=tmp_path, env=env)
    if check:
        assert p.returncode == 0, p.stderr
    return p


def run_inprocess(args, out_dir, monkeypatch):
    """``python run.py ARGS`` in this process (runpy, as ``__main__``): ``(exit status, stdout, stderr)``.

    Same code path as the command line at a tenth of a subprocess's cost; two cases below also run
    as real subprocesses."""
    monkeypatch.setattr("sys.argv", [str(ROOT / "run.py"), *args, f"hydra.run.dir={out_dir}"])
    monkeypatch.setenv("PYTHONPATH", "")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("HYDRA_FULL_ERROR", "0")
    out, err = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_path(str(ROOT / "run.py"), run_name="__main__")
        except SystemExit as e:
            code = e.code
    return code, out.getvalue(), err.getvalue()


def write_shard_job(tmp_path, cfg, k: int, n_shards: int) -> Path:
    """A finished shard job directory under ``tmp_path``, written as the runner's task writes one: shard ``k`` of
    ``n_shards`` of the plain config ``cfg`` sampled, its tensors saved and its ``result.json`` written."""
    from specsamp.runner import run_config, shards

    c = {**cfg, "shard": k, "num_shards": n_shards}
    idx = shards.shard_indices(c["n_samples"], k, n_shards, c["batch_size"])
    rec, res = run_config(c, indices=idx)
    rec.update(shard=k, num_shards=n_shards, n_samples=len(idx), overrides=[f"num_shards={n_shards}", f"shard={k}"])
    d = tmp_path / f"num_shards={n_shards},seed=0,shard={k}"
    d.mkdir(parents=True)
    shards.save_shard(d, res, idx, rec)
    (d / "result.json").write_text(json.dumps(rec, default=str))
    return d


def two_sample_pvalues(a: torch.Tensor, b: torch.Tensor, directions: int = 3, seed: int = 0) -> list[float]:
    """Two-sample KS p-values on projections of ``a`` and ``b`` (``[n, d]``) onto fixed random directions."""
    g = torch.Generator().manual_seed(seed)
    a = a.double().reshape(a.shape[0], -1)
    b = b.double().reshape(b.shape[0], -1)
    out = []
    for _ in range(directions):
        w = torch.randn(a.shape[1], generator=g, dtype=torch.float64)
        out.append(stats.ks_2samp((a @ w).numpy(), (b @ w).numpy()).pvalue)
    return out


def chi2_same_counts(a: np.ndarray, b: np.ndarray, bins: int) -> float:
    """p-value of a chi-square test that two label samples come from the same categorical law."""
    ca = np.bincount(a, minlength=bins)
    cb = np.bincount(b, minlength=bins)
    keep = (ca + cb) > 0
    return stats.chi2_contingency(np.stack([ca[keep], cb[keep]])).pvalue if keep.sum() > 1 else 1.0


def run_digits_with_fid(tmp_path: Path, *, steps: int, n_samples: int):
    """``run.py model=digits sampler=dgrs K=2 L=3 metrics=[fid]`` offline, one thread, in ``tmp_path``.

    Asserts exit status 0 (stderr as the message); returns ``(stdout, result.json as a dict)``.
    """
    env = dict(os.environ, SPECSAMP_OFFLINE="1", SPECSAMP_CACHE=str(tmp_path / "cache"), WANDB_MODE="offline")
    cmd = [
        sys.executable,
        str(ROOT / "run.py"),
        "model=digits",
        "sampler=dgrs",
        "K=2",
        "L=3",
        f"steps={steps}",
        f"n_samples={n_samples}",
        "metrics=[fid]",
        "threads=1",
        f"hydra.run.dir={tmp_path}",
    ]
    out = python(cmd, cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stderr
    return out.stdout, json.loads((tmp_path / "result.json").read_text())


class FlakyLogger:
    """A logger (``logger._target_=helpers.FlakyLogger``) that fails while ``$FLAKY_LOGGER_DOWN`` is set, as
    a logging service without network does, and otherwise appends the logged speedup to ``logged.txt``."""

    def __init__(self, name="flaky", project=None, entity=None, mode=None, group=None):
        self.name = name

    def log(self, config, record, out_dir):
        import os
        from pathlib import Path

        if os.environ.get("FLAKY_LOGGER_DOWN"):
            raise ConnectionError("the logging service cannot be reached")
        with open(Path(out_dir) / "logged.txt", "a") as f:
            f.write(f"{record['speedup']['mean']}\n")


class CountingModel:
    """Wraps a model and logs, per invocation, which trajectories (``tid`` condition) had rows in it."""

    def __init__(self, model):
        self.model, self.event_shape, self.dtype = model, model.event_shape, model.dtype
        self.log = []

    def __call__(self, x, sigma, tid):
        self.log.append(tid.clone())
        return self.model(x, sigma)

    def per_trajectory(self, m):
        calls = torch.zeros(m, dtype=torch.long)
        rows = torch.zeros(m, dtype=torch.long)
        for t in self.log:
            calls += torch.bincount(t.unique(), minlength=m)
            rows += torch.bincount(t, minlength=m)
        return calls, rows


# ----------------------------------------------------------------------------------------------
# the sampler's law tests' setup (tests/core/test_sampler.py states it; tests/core/test_compiled.py reuses it)

P_MIN = 1e-3
N_SPEC = 2000
N_REF = 4000
REF_SEED = 10_000

MODEL = GaussianMixture(dim=4, components=3, layout_seed=1)
SCHED = Schedule.make(8, 1.0)


class RowwiseMixture(GaussianMixture):
    """The mixture evaluated one row at a time, so that its output for a row does not depend on the batch the
    row is in. The batched mixture's matrix products round a row's last bits by the batch size (and the CPU's
    vector width), and the tree and path executions evaluate a node in batches of different sizes; with this
    target their samples are compared bitwise, which tests the sampler's own claim (both executions draft,
    verify and commit with the same operations), not the BLAS."""

    def __call__(self, x: torch.Tensor, sigma: torch.Tensor, **cond) -> torch.Tensor:
        if x.shape[0] <= 1:
            return super().__call__(x, sigma, **cond)
        s = sigma.reshape(-1)
        return torch.cat([super(RowwiseMixture, self).__call__(x[i : i + 1], s[i : i + 1]) for i in range(x.shape[0])])


ROWWISE = RowwiseMixture(dim=4, components=3, layout_seed=1)
IRREGULAR = [-1, 0, 0, 0, 1, 1, 2, 4, 4]  # widths 3 / (2, 1, 0) / (2, 0, 0) / leaves
# step-dependent trees (tree=optimal_per_step's kind): a different shape per root state index 1..6
BY_ROOT = {
    1: DraftTree.uniform(2, 3),
    2: DraftTree.from_widths([3, 1, 2]),
    3: DraftTree.chain(2),
    4: DraftTree(IRREGULAR),
    5: DraftTree.uniform(1, 1),
    6: DraftTree.uniform(3, 2),
}


def tree_of(spec):
    """A law case's tree from its spec ``(kind, arg)``: uniform, chain, widths, by_root or a parent array."""
    from specsamp.treesearch import TreesByRoot

    kind, arg = spec
    if kind == "uniform":
        return DraftTree.uniform(*arg)
    if kind == "chain":
        return DraftTree.chain(arg)
    if kind == "widths":
        return DraftTree.from_widths(arg)
    if kind == "by_root":
        return TreesByRoot(arg)
    return DraftTree(arg)


def law_reference():
    """The law tests' reference: ``(samples [N_REF, 4], mixture components [N_REF])`` of the standard sampler."""
    from specsamp.sampler import sample_standard

    r = sample_standard(MODEL, SCHED, N_REF, seed=REF_SEED)
    return r.samples, MODEL.component(r.samples).numpy()


def law_pvalues(samples, reference):
    """KS p-values on 3 fixed projections and the chi-square p-value of the mixture components, against ``reference``."""
    ref, ref_lab = reference
    p = two_sample_pvalues(samples, ref, directions=3, seed=0)
    p.append(chi2_same_counts(MODEL.component(samples).numpy(), ref_lab, MODEL.means.shape[0]))
    return p


class NaNBelow:
    """The test GMM, except that its velocity is NaN for trajectory states with x[0] > 0 below sigma 0.6."""

    event_shape, dtype, device = MODEL.event_shape, MODEL.dtype, "cpu"

    def __call__(self, x, sigma, **cond):
        v = MODEL(x, sigma)
        bad = (sigma < 0.6) & (x[:, 0] > 0)
        v[bad] = float("nan")
        return v


def nan_residual_coupling(**_):
    """A coupling (``sampler.coupling={_target_: helpers.nan_residual_coupling}``) that rejects every child and
    returns NaN for the residual, checking nothing: a rule whose residual draw went wrong."""
    import torch

    from specsamp.coupling import Coupling, Verdict

    def verify(children, mean_p, mean_q, sigma, generator=None):
        n, k = children.shape[:2]
        return Verdict(
            torch.full_like(mean_q, float("nan")),
            torch.zeros(n, dtype=torch.bool, device=children.device),
            torch.full((n,), k, dtype=torch.long, device=children.device),
        )

    return Coupling("nan_residual", verify)


def min_ks_p(a, b) -> float:
    """The smallest two-sample KS p-value of samples ``a [n, ...]`` and ``b [m, ...]`` over 5 fixed random projections
    (seed 7) and the norm: the image law tests' statistic."""
    import torch
    from scipy import stats

    a, b = a.reshape(a.shape[0], -1).double(), b.reshape(b.shape[0], -1).double()
    dirs = torch.randn(5, a.shape[1], generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    p = [stats.ks_2samp((a @ d).numpy(), (b @ d).numpy()).pvalue for d in dirs]
    p.append(stats.ks_2samp(a.norm(dim=1).numpy(), b.norm(dim=1).numpy()).pvalue)
    return min(p)


def karras(n: int, sigma_min: float = 0.03, sigma_max: float = 80.0, rho: float = 7.0):
    """Karras et al.'s noise levels (k-diffusion's ``get_sigmas_karras``), float64, then 0: ``[n + 1]``."""
    import torch

    ramp = torch.linspace(0, 1, n, dtype=torch.float64)
    lo, hi = sigma_min ** (1 / rho), sigma_max ** (1 / rho)
    s = (hi + ramp * (lo - hi)) ** rho
    return torch.cat([s, s.new_zeros(1)])


def _wide_mixture():
    from specsamp.models.gmm import GaussianMixture

    return GaussianMixture(dim=8, components=3, layout_seed=1, std_range=(0.5, 0.8))


WIDE = _wide_mixture()
"""A mixture of wide components (standard deviations 0.5 to 0.8 around means in ``[-2, 2]^8``), on which a sampler's
law depends on every step's coefficients (with tight components every sampler ends on the data law)."""


def wide_denoiser(x, sigma, **extra):
    """:data:`WIDE`'s exact posterior mean as a k-diffusion denoiser (variance-exploding ``x = x0 + sigma xi``)."""
    import torch

    s = sigma.to(torch.float64)
    return WIDE.denoise(x.to(torch.float64) / (1.0 + s[:, None]), s / (1.0 + s)).to(x.dtype)
