"""The GPU check's harness: the sections' registry, the command line, the time budget, SIGTERM, the output.

A section is a function ``fn(ctx: Context) -> dict`` registered with :func:`section` under a name of
:data:`SECTIONS` (the order the sections run in). Its dict is recorded under ``result`` in
``<name>.json``; its ``summary`` lines go to stdout and ``summary.txt``, ``passed`` (default True) says
whether its checks held. What a section finishes before the run may be cut short goes in
``ctx.partial``, which a SIGTERM's record keeps; what later sections need goes in ``ctx.shared``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.common import environment
from specsamp.io import atomic_write

# the sections, in the order they run (and their order of value: an early one is worth more)
SECTIONS = ("call_cost", "wallclock", "projection", "auto", "cuda_vs_cpu", "laws", "compile", "round_cost")
SECTION_FNS: dict[str, Callable[[Context], dict]] = {}  # name -> section function, filled by :func:`section`


def section(name: str):
    """Register the decorated function as the section ``name`` (one of :data:`SECTIONS`)."""
    if name not in SECTIONS:
        raise ValueError(f"unknown GPU check section {name!r}: add it to SECTIONS in its place first")

    def register(fn):
        SECTION_FNS[name] = fn
        return fn

    return register


class Context:
    """What the sections share: device, sizes, the soft deadline and results later sections use."""

    def __init__(self, a: argparse.Namespace):
        self.device = torch.device(a.device)
        self.tiny = a.tiny
        self.seed = a.seed
        self.repeats = a.repeats or (2 if a.tiny else 5)
        self.steps = 8 if a.tiny else 100
        self.batches = a.batches or ([1, 2] if a.tiny else [1, 4, 16, 64])
        self.max_rows = 8 if a.tiny else 4096
        self.t0 = time.perf_counter()
        self.deadline = self.t0 + a.budget_s
        self.shared: dict = {}
        self.budget_s = a.budget_s
        self.section_t0 = self.t0
        self.partial: dict = {}  # what the running section has finished (kept if the run is terminated)
        self.quiet = False

    def left(self) -> float:
        """Seconds left in the soft budget."""
        return self.deadline - time.perf_counter()

    def over_share(self, share: float) -> bool:
        """True once the current section has used ``share`` of the whole budget (or the budget is spent):
        it then starts no new measurement, so the sections after it keep their time."""
        return self.left() < 0 or time.perf_counter() - self.section_t0 > share * self.budget_s

    def log(self, line: str) -> None:
        """A progress line on stdout at once (the device's log keeps what a timeout would cut)."""
        if not self.quiet:
            print(line, flush=True)


def parse_args(argv, description: str) -> argparse.Namespace:
    """The command line; a bad value exits 2 with one line naming the key, its value and what is valid."""
    p = argparse.ArgumentParser(prog="python3 -m benchmarks.gpu_check", description=description)
    p.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    p.add_argument("--tiny", action="store_true", help="tiny sizes: a rehearsal of every section")
    p.add_argument("--out", default=None, help="output folder (default $OUT, else ./gpu_check)")
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {','.join(SECTIONS)}")
    p.add_argument("--repeats", type=int, default=None, help="timed repeats per measurement (default 5; tiny 2)")
    p.add_argument("--batches", default=None, help="images sampled together, e.g. 1,4,16,64 (the default)")
    p.add_argument(
        "--budget-s",
        type=float,
        default=270.0,
        help="soft time budget in seconds: sections not begun by then are skipped (default 270)",
    )
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    a.device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if a.device not in ("cuda", "cpu") and not a.device.startswith("cuda:"):
        p.error(f"--device={a.device!r} is invalid: valid values are cuda, cuda:N and cpu.")
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        p.error(f"--device={a.device!r} is invalid here: torch sees no CUDA device; use --device cpu.")
    sections = [s.strip() for s in a.sections.split(",") if s.strip()]
    bad = [s for s in sections if s not in SECTIONS]
    if bad or not sections:
        p.error(f"--sections={a.sections!r} is invalid: valid sections are {', '.join(SECTIONS)} (comma-separated).")
    a.sections = sections
    if a.repeats is not None and a.repeats < 1:
        p.error(f"--repeats={a.repeats!r} is invalid: need an integer >= 1.")
    if a.batches is not None:
        try:
            a.batches = [int(b) for b in a.batches.split(",") if b.strip()]
            assert a.batches and min(a.batches) >= 1
        except (ValueError, AssertionError):
            p.error(f"--batches={a.batches!r} is invalid: need comma-separated integers >= 1, e.g. 1,4,16,64.")
    if not a.budget_s > 0:
        p.error(f"--budget-s={a.budget_s!r} is invalid: need a number of seconds > 0.")
    return a


class Terminated(BaseException):
    """SIGTERM arrived (``timeout`` ending the run); not an ``Exception``, so no section swallows it."""


def _on_sigterm(signum, frame):
    raise Terminated()


def _json_default(o):
    if isinstance(o, torch.Tensor):
        return o.tolist()
    if isinstance(o, tuple):
        return list(o)
    return str(o)


def _write_json(path: Path, record: dict) -> None:
    atomic_write(path, lambda f: json.dump(record, f, indent=1, default=_json_default), mode="w")


def _write_text(path: Path, text: str) -> None:
    atomic_write(path, lambda f: f.write(text), mode="w")


def _run_section(name: str, ctx: Context, a: argparse.Namespace, env: dict, terminated: str | None):
    """Run (or skip) one section: ``(record, summary lines, terminated)``, the last as it stands after it."""
    record = {"section": name, "env": env, "tiny": a.tiny, "seed": a.seed}
    ctx.partial = {}
    if terminated or ctx.left() < 0:
        why = terminated or f"soft budget of {a.budget_s:g} s spent before it began"
        record.update(status="skipped", reason=why)
        return record, [f"{name}: skipped ({why})"], terminated
    try:
        result = SECTION_FNS[name](ctx)
        lines = result.pop("summary", [])
        record.update(status="ok", passed=bool(result.get("passed", True)), result=result)
    except Exception as e:  # noqa: BLE001  (recorded; the next section still runs)
        record.update(status="error", error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
        lines = [f"{name}: ERROR {type(e).__name__}: {str(e)[:300]}"]
    except Terminated:
        terminated = "terminated (SIGTERM) before it began"
        record.update(status="error", error="terminated (SIGTERM) while it ran", partial=ctx.partial)
        lines = [f"{name}: terminated while it ran; its finished measurements are under 'partial'"]
    if ctx.device.type == "cuda":
        torch.cuda.empty_cache()
    return record, lines, terminated


def main(argv, description: str) -> int:
    """Run the chosen sections in order: 0 when every section ran, 1 otherwise, 2 for a bad argument.

    Output folder: ``--out``, else ``$OUT``, else ``./gpu_check``. Each section's record is written as it
    ends, and ``summary.txt`` rewritten, atomically (:func:`specsamp.io.atomic_write`). Once ``--budget-s``
    is spent, sections not begun are skipped; a SIGTERM ends the running section with its ``partial``
    results and skips the rest.
    """
    a = parse_args(argv, description)
    out = Path(a.out or os.environ.get("OUT") or "gpu_check")
    out.mkdir(parents=True, exist_ok=True)
    ctx = Context(a)
    env = environment(ctx.device)
    head = (
        f"# specsamp GPU check on {env.get('gpu', 'CPU')} ({env['device']}), torch {env['torch']}, "
        f"{'tiny rehearsal' if a.tiny else 'full sizes'}, {env['date']}"
    )
    summary = [head]
    print(head, flush=True)
    statuses = {}
    terminated = None
    previous = signal.signal(signal.SIGTERM, _on_sigterm)  # `timeout` ends the run: record what it cut
    try:
        for name in a.sections:
            t = ctx.section_t0 = time.perf_counter()
            record, lines, terminated = _run_section(name, ctx, a, env, terminated)
            record["seconds"] = time.perf_counter() - t
            record["elapsed_s"] = time.perf_counter() - ctx.t0
            statuses[name] = record["status"] + ("" if record.get("passed", True) else " (check failed)")
            _write_json(out / f"{name}.json", record)
            tail = f"## {name}: {statuses[name]} in {record['seconds']:.1f} s; elapsed {record['elapsed_s']:.1f} s"
            summary += lines + [tail]
            print("\n".join(lines + [tail]), flush=True)
            _write_text(out / "summary.txt", "\n".join(summary) + "\n")
    finally:
        signal.signal(signal.SIGTERM, previous)
    ran = all(s.startswith("ok") for s in statuses.values())
    final = f"# {'every section ran' if ran else 'some sections did not run'}: " + ", ".join(
        f"{k} {v}" for k, v in statuses.items()
    )
    summary.append(final)
    print(final, flush=True)
    _write_text(out / "summary.txt", "\n".join(summary) + "\n")
    return 0 if ran else 1
