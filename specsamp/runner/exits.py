"""The exit-status policy of ``run.py`` and the specsamp command lines: the one place that defines it.

=====  ==========================================================================================
  0    every run (or every job of a sweep) wrote its record
  1    a bug: an unexpected exception (its traceback is printed; in a sweep, in ``failed.json``)
  2    the input was wrong: a config key or value, an override that does not compose, a path given
       by the user; one paragraph names the key, its value and what is valid
  3    the machine failed, not the input: the disk is full, the output directory is read-only or
       cannot be created (a file in its path, a file system that takes no new directory), inductor's
       cache directory cannot serve ``compile=true`` (read-only, full, mounted noexec), a launcher's
       command (``sbatch``/``srun``) is missing, a logger failed after the record was written; one
       paragraph names the path, the command or the logger. Relaunching into the same directory once it
       is fixed resumes (and retries the logging): a sweep's ``sweep_name``, a run's ``hydra.run.dir``
  4    the samples are not finite: a run's samples hold NaN or inf (a coupling or draft returning
       non-finite values, a network overflowing in half precision); one paragraph says how many, from
       which step and the likely cause; ``failed.json`` (kind ``non_finite``) records it, and no
       ``result.json`` or samples are written for that run
  75   a sweep ended with jobs that have no record yet, none of them failed: they are still queued or
       running (a relaunch that finds a SLURM sweep's cells still in the queue submits nothing and
       exits 75), or were never started; relaunch once they have ended (sysexits' EX_TEMPFAIL)
 130   interrupted (Ctrl-C, SIGINT): one line, and for a sweep its summary; finished records stay
=====  ==========================================================================================

A sweep exits with the most serious status among its jobs: 130, then 3, then 1, then 4, then 2, then 75. A config error
that stops every job is the sweeper's to report, once, before launching (``hydra_plugins/specsamp_sweeper``).

:func:`main` wraps the Hydra entry point and applies this policy to what happened: an exception, or the
sweep's outcome that :class:`specsamp.runner.callback.SweepReport` leaves in ``callback.SWEEP_STATE``.
"""

from __future__ import annotations

import errno
import io
import os
import sys
from collections.abc import Callable, Sequence
from typing import IO, Any

from ..errors import ConfigError, error_chain

OK = 0
BUG = 1
USAGE = 2
INFRASTRUCTURE = 3
NOT_FINISHED = 75  # sysexits.h EX_TEMPFAIL: try again later
INTERRUPTED = 130
NON_FINITE = 4  # the samples hold NaN or inf (specsamp.errors.NonFiniteSamplesError)

# errno values that say the machine (storage, permissions on the output side) failed, not the input;
# ENOTDIR and EEXIST: an output directory that cannot be created because a file stands in its path
INFRA_ERRNOS = frozenset(
    getattr(errno, name)
    for name in (
        "ENOSPC",
        "EDQUOT",
        "EROFS",
        "EACCES",
        "EPERM",
        "EIO",
        "EFBIG",
        "ENFILE",
        "EMFILE",
        "ESTALE",
        "ENOTDIR",
        "EEXIST",
    )
    if hasattr(errno, name)
)


# ENOENT is the machine's only where a directory is being created (a parent that cannot hold one, such as
# /proc/foo): a missing file the user named as input (delta_profile=...) stays a config error
DIRECTORY_CREATORS = frozenset({"mkdir", "makedirs"})


def _creating_directory(error: OSError) -> bool:
    """True when ``error`` was raised while a directory was being created (its innermost Python frame is a
    ``mkdir``/``makedirs``: ``os.makedirs``, ``pathlib.Path.mkdir``)."""
    tb, last = error.__traceback__, None
    while tb is not None:
        last, tb = tb, tb.tb_next
    return last is not None and last.tb_frame.f_code.co_name in DIRECTORY_CREATORS


def _is_infra_oserror(error: BaseException) -> bool:
    if not isinstance(error, OSError):
        return False
    return error.errno in INFRA_ERRNOS or (error.errno == errno.ENOENT and _creating_directory(error))


from ..errors import InfrastructureError  # noqa: E402  (defined beside ConfigError, so the core can raise it)


def is_infrastructure(error: BaseException | None) -> bool:
    """True for :class:`InfrastructureError`, for an ``OSError`` whose errno is in :data:`INFRA_ERRNOS`, and
    for ENOENT raised while creating a directory (an output folder whose parent cannot hold one); also when
    it is the cause or context of ``error``."""
    return any(isinstance(e, InfrastructureError) or _is_infra_oserror(e) for e in error_chain(error))


def user_error(error: BaseException | None) -> ConfigError | None:
    """The :class:`~specsamp.errors.ConfigError` that ``error`` is or wraps (Hydra wraps what a plugin's
    constructor raises), or None."""
    return next((e for e in error_chain(error) if isinstance(e, ConfigError)), None)


def _root_oserror(error: BaseException | None) -> OSError | None:
    return next((e for e in error_chain(error) if _is_infra_oserror(e)), None)


_STANDARD_STREAMS = ("<stdin>", "<stdout>", "<stderr>")


def _writing(value: Any) -> bool:
    """True for a file object open for writing to a named file (not a standard stream, not a bare descriptor)."""
    if not isinstance(value, io.IOBase):
        return False
    name, mode = getattr(value, "name", None), getattr(value, "mode", "")
    return (
        isinstance(name, (str, bytes, os.PathLike))
        and str(name) not in _STANDARD_STREAMS
        and isinstance(mode, str)
        and any(c in mode for c in "wax+")
    )


def _file_being_written(os_err: OSError) -> IO | None:
    """The file object that the failed write ``os_err`` was writing, or None.

    A write through a file object (``open(path, "w")`` then ``write``/``close``: Hydra's ``.hydra/*.yaml``,
    OmegaConf's ``multirun.yaml``) fails with an ``OSError`` that names no file. The frames it passed
    through still hold the file object: the innermost frame holding one that is open for writing gives
    it, provided it holds just one (two would be a guess).
    """
    frames, tb = [], os_err.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    for frame in reversed(frames):
        open_files = {id(v): v for v in frame.f_locals.values() if _writing(v)}
        if open_files:
            return next(iter(open_files.values())) if len(open_files) == 1 else None
    return None


def _written_path(os_err: OSError) -> str | None:
    """The path ``os_err`` failed on: its ``filename``, else the name of the file it was writing."""
    if os_err.filename:
        return str(os_err.filename)
    f = _file_being_written(os_err)
    return None if f is None else os.fsdecode(f.name)


# a write that ran out of room: the file it was writing holds only the part that fitted
OUT_OF_ROOM = frozenset(getattr(errno, n) for n in ("ENOSPC", "EDQUOT", "EFBIG") if hasattr(errno, n))


def discard_torn_file(error: BaseException | None) -> str | None:
    """Remove the incomplete file that a failed non-atomic write left behind; return its path, or None.

    Only a file that the failing code opened for writing from empty (mode ``"w"``/``"x"``, found by
    :func:`_file_being_written`) and whose write ran out of room (disk full, quota, file-size limit:
    :data:`OUT_OF_ROOM`) is removed: what it held before was already truncated by the ``open``, and a reader
    (the sweep report, a relaunch) finds no file rather than a torn one. A file opened for appending is
    kept, and so is everything written atomically (:func:`specsamp.io.atomic_write` removes its own
    temporary file and names the destination itself).
    """
    os_err = _root_oserror(error)
    if os_err is None or os_err.filename or os_err.errno not in OUT_OF_ROOM:
        return None
    f = _file_being_written(os_err)
    if f is None or not any(c in f.mode for c in "wx"):
        return None
    path = os.fsdecode(f.name)
    try:
        f.close()
    except OSError:
        pass  # the close that failed already released the descriptor
    try:
        os.unlink(path)
    except OSError:
        return None
    return path


RUN_ELSEWHERE = "hydra.run.dir=DIR for a run, hydra.sweep.dir=DIR for a sweep"
RUN_AGAIN = "rerun the same command (finished records are kept and skipped)"


def _failed_directory(os_err: OSError) -> str | None:
    """For a directory that could not be created, the directory itself: a wrapper that names the file to be
    written (:func:`specsamp.io.atomic_write`) keeps the ``mkdir``'s own error as its cause."""
    cause, seen = os_err.__cause__, 0
    while cause is not None and seen < 8:
        if isinstance(cause, OSError) and cause.errno == os_err.errno and cause.filename:
            return str(cause.filename)
        cause, seen = cause.__cause__, seen + 1
    return None


def infrastructure_message(error: BaseException, *, elsewhere: str = RUN_ELSEWHERE, then: str = RUN_AGAIN) -> str:
    """One paragraph for an infrastructure failure: what failed, the path (or command), what to do.

    Args:
        error: the failure (:func:`is_infrastructure`).
        elsewhere: how to write elsewhere (``run.py``'s keys by default; ``out=PATH`` for a command that takes one).
        then: what to do once it is fixed.
    """
    if isinstance(error, InfrastructureError):
        return str(error)
    os_err = _root_oserror(error)
    if os_err is None:
        return str(error)
    path = _written_path(os_err) or "(unknown path)"
    what = os.strerror(os_err.errno) if os_err.errno else str(os_err)
    if os_err.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", -1), errno.EFBIG):
        hint = "free space on that file system (or raise the quota / file-size limit)"
    elif os_err.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        hint = f"make the directory writable, or write elsewhere: {elsewhere}"
    elif os_err.errno == errno.ENOENT:
        return (
            f"could not create the directory {_failed_directory(os_err) or path}: {what} [errno {os_err.errno}]; "
            "the file system there lets no directory be created (a virtual file system such as /proc, or a "
            f"folder removed meanwhile): write elsewhere: {elsewhere}, then {then}."
        )
    elif os_err.errno in (errno.ENOTDIR, errno.EEXIST):
        return (
            f"could not create the directory {_failed_directory(os_err) or path}: {what} [errno {os_err.errno}]; "
            f"a file, not a directory, stands in that path: remove it, or write elsewhere: {elsewhere}, then {then}."
        )
    else:
        hint = "check the file system holding it"
    return (
        f"could not write {path}: {what} [errno {os_err.errno}]. This is a problem of the machine, not of "
        f"the configuration: {hint}, then {then}."
    )


def sweep_exit_status(state: dict | None = None) -> int:
    """The exit status of a finished sweep (this module): the most serious of its jobs.

    130 when it was interrupted; 3 when a job met an infrastructure failure (``failed.json`` of kind
    ``infrastructure``, or a job that could not even write that); 1 when a job raised an unexpected
    exception, was killed, or was stopped by the scheduler's time limit (``failed.json`` of kind
    ``timed_out``); 4 when a job's samples held NaN or inf (kind ``non_finite``); 2 when the only
    failures are bad per-job values or configs that do not compose; 75 when no job failed but some
    have no record yet (``unfinished``: still queued or running, or never started); 0 otherwise:
    every job wrote its record.
    """
    from .callback import SWEEP_STATE

    state = SWEEP_STATE if state is None else state
    kinds = list(state.get("kinds") or [])
    if state.get("interrupted"):
        return INTERRUPTED
    if state.get("infrastructure") or "infrastructure" in kinds:
        return INFRASTRUCTURE
    if "exception" in kinds or "timed_out" in kinds or state.get("killed"):
        return BUG
    if "non_finite" in kinds:
        return NON_FINITE
    if kinds or state.get("failed"):
        return USAGE
    if state.get("unfinished") and not state.get("dry_run"):  # a dry run (SLURM launcher) submits nothing by design
        return NOT_FINISHED
    return OK


def missing_option(error: BaseException) -> str | None:
    """One paragraph for a config-group option that does not exist (``model=nosuch``), or None.

    Hydra's message lists the group's options on separate lines, the model group's structured schemas
    (``gmm_schema``, ...) among them, which are not models to choose; this names the override, the
    group's real options and where a YAML of one's own goes (docs/extending.md).
    """
    from hydra.errors import MissingConfigException

    if not isinstance(error, MissingConfigException) or not error.missing_cfg_file or error.options is None:
        return None
    group, _, name = str(error.missing_cfg_file).rpartition("/")
    if not group:
        return None
    options = [o for o in error.options if not o.endswith("_schema")]
    where = "" if group.startswith("hydra/") else f" (conf/{group}/)"  # hydra's groups also hold plugins' options
    return (
        f"{group}={name} is not an option of the config group {group}; valid: {', '.join(options) or 'none'}"
        f"{where}, or a YAML of your own in {group}/ of a folder given by "
        "hydra.searchpath=[file:///abs/path/to/myconf] (docs/extending.md)."
    )


def composition_message(error: BaseException) -> str:
    """The one paragraph printed for an override list that does not compose (a Hydra or OmegaConf error):
    a sweep given without ``-m``, a group option that does not exist, an unknown key or a wrong type, or
    Hydra's own message on one line. Shared by ``run.py`` and the command-line modules that take overrides."""
    from .explain import explain

    return sweep_without_multirun(error) or missing_option(error) or explain(error) or _one_paragraph(error)


def _one_paragraph(error: BaseException) -> str:
    """Hydra's and OmegaConf's multi-line messages as one paragraph (without the config search path)."""
    text = str(error).split("\nConfig search path:")[0]
    cause = error.__cause__
    if cause is not None and str(cause) and str(cause) not in text:
        text += "\n" + str(cause)
    return " ".join(line.strip() for line in text.splitlines() if line.strip()) or type(error).__name__


LIST_KEYS = ("widths", "metrics", "delta_profile")  # keys whose value may be a list, written key=[a,b]


def sweep_without_multirun(error: BaseException) -> str | None:
    """One paragraph for a sweep override (``K=2,3``, ``L=range(2,5)``) given to a single run, or None.

    Hydra's own hint offers ``key=[value1,value2]`` first, which is wrong for a key that takes one value
    (``K``, ``L``, ``eps``, ...): the comma means a sweep, and a sweep needs ``-m``. For a key that takes a
    list (:data:`LIST_KEYS`) both readings are named.
    """
    import re

    text = str(error)
    m = re.search(r"Ambiguous value for argument '([^']+)'", text) or re.search(
        r"Sweep parameters '([^']+)' requires --multirun", text
    )
    if m is None:
        return None
    line = m.group(1)
    key = line.partition("=")[0].lstrip("+~")
    if key in LIST_KEYS:
        return (
            f"{line} is ambiguous: {key} takes a list, written {key}=[{line.partition('=')[2]}]; to sweep over "
            f"values instead (one job each), add -m: python run.py -m {line}."
        )
    value = line.partition("=")[2]
    one = f", or give one value ({key}={value.split(',')[0]})" if "(" not in value else ", or give one value"
    return (
        f"{line} is a sweep over {key} (one job per value), and a single run takes one value of {key}: add -m to run "
        f"the sweep (python run.py -m {line}){one}."
    )


def per_job_model_overrides(argv: list[str]) -> list[str]:
    """A sweep over models checks each job's ``model.*`` overrides against its own model.

    Hydra composes a sweep's primary config with the overrides that are not swept, before any job, so
    ``-m model=digits,cifar10 model.fid_extractor=X`` would check ``model.fid_extractor`` against the
    default model (the GMM, which has no such key) and refuse the whole sweep. When ``model`` itself is
    swept, each plain ``model.KEY=VALUE`` is passed as the one-value sweep ``model.KEY=choice(VALUE)``:
    the same value for every job, applied when that job composes, so a job whose model has the key runs
    and one whose model lacks it is recorded as failed (kind ``config``) while the others run. Anything
    else (no ``-m``, no sweep over ``model``) is returned unchanged.
    """
    if not any(a in ("-m", "--multirun") for a in argv):
        return argv
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()

    def parse(a: str):
        try:
            return parser.parse_override(a)
        except Exception:  # a flag, or an override Hydra will report itself
            return None

    parsed = [parse(a) for a in argv]
    if not any(o is not None and o.key_or_group == "model" and o.is_sweep_override() for o in parsed):
        return argv
    out = []
    for a, o in zip(argv, parsed):
        if o is not None and not o.is_sweep_override() and o.key_or_group.startswith("model.") and o.is_add() is False:
            key, _, value = a.partition("=")
            swept = parse(f"{key}=choice({value})")
            if swept is not None and swept.is_sweep_override() and list(swept.value().list) == [o.value()]:
                a = f"{key}=choice({value})"
        out.append(a)
    return out


HYDRA_GROUPS = {"launcher": ("basic",), "sweeper": ("basic",)}  # Hydra's own options besides conf/hydra/<group>/


def group_options(group: str) -> list[str]:
    """The options of the config group ``hydra/<group>``: Hydra's own and the YAMLs of ``conf/hydra/<group>/``."""
    from .config import CONF_DIR

    return sorted({*HYDRA_GROUPS.get(group, ()), *(p.stem for p in (CONF_DIR / "hydra" / group).glob("*.yaml"))})


def group_given_as_key(argv: Sequence[str]) -> str | None:
    """One paragraph for ``hydra.launcher=local`` or ``hydra.sweeper=basic`` (a dot instead of the slash that
    picks a config group's option), or None.

    With the dot the override replaces the whole launcher (sweeper) config by a string, and Hydra later
    says only that the input config has no ``_target_``; a single run accepts it silently. The paragraph
    names the override, the spelling with the slash and the group's options.
    """
    for arg in argv:
        key, eq, value = arg.lstrip("+~").partition("=")
        group = key.removeprefix("hydra.")
        if not eq or key == group or group not in HYDRA_GROUPS:
            continue
        options = group_options(group)
        suggestion = f"hydra/{group}={value}" if value in options else f"hydra/{group}=NAME"
        return (
            f"{arg} is invalid: hydra.{group} is the {group}'s whole config, and a {group} is chosen from its "
            f"config group with a slash: {suggestion} (valid: {', '.join(options)}; specsamp's are in "
            f"conf/hydra/{group}/); one of its fields is set with hydra.{group}.FIELD=VALUE."
        )
    return None


# Hydra's flags that each choose what the command does: at most one may be given (Hydra's own rule)
MODE_FLAGS = {"--run": "-r", "--multirun": "-m", "--cfg": "-c", "--info": "-i", "--shell-completion": "-sc"}


def conflicting_modes(argv: Sequence[str]) -> str | None:
    """One paragraph for two of Hydra's mode flags given together (``-m K=1,2 --cfg job``), or None.

    Hydra allows only one of ``--run``, ``--multirun``, ``--cfg``, ``--info`` and ``--shell-completion`` and
    raises a bare ``ValueError`` otherwise; the paragraph names the flags and, for a sweep's config, how to
    print one job's.
    """
    given = []
    for arg in argv:
        name = arg.partition("=")[0]
        for long, short in MODE_FLAGS.items():
            if name in (long, short) and long not in given:
                given.append(long)
    if len(given) < 2:
        return None
    if "--multirun" in given and "--cfg" in given:
        return (
            "-m (--multirun) and --cfg cannot be given together: --cfg prints the config of one run, and a sweep "
            "composes one per job. To see a job's config, give each swept key one of its values and leave out "
            "-m (python run.py K=1 --cfg job); to see the sweep's own settings, print hydra.sweeper with "
            "python run.py --cfg hydra -p hydra.sweeper."
        )
    return (
        f"{' and '.join(given)} cannot be given together: Hydra runs one of --run, --multirun, --cfg, --info "
        "and --shell-completion per command; keep one."
    )


def _summary_if_swept() -> None:
    from .callback import SWEEP_STATE
    from .report import launched, print_sweep_summary

    sweep_dir = SWEEP_STATE.get("sweep_dir")
    if sweep_dir and launched(sweep_dir):
        try:
            print_sweep_summary(sweep_dir, file=sys.stderr)
        except Exception as e:  # the summary must not hide the real error
            print(f"warning: could not summarise {sweep_dir}: {e}", file=sys.stderr)


def _help_without_schemas() -> None:
    """``--help`` lists the config groups' options; the model group also holds the structured schemas that
    the model YAMLs extend (``edm_schema``, ``gmm_schema``, ...), which are not models to choose. Hydra has
    no setting to hide them, so its listing is filtered here, for ``--help`` only."""
    from hydra._internal.hydra import Hydra

    listing = Hydra.format_config_groups
    if getattr(listing, "_specsamp", False):
        return

    def without_schemas(self, predicate, compact: bool = True) -> str:
        lines = []
        for line in listing(self, predicate, compact).splitlines():
            group, sep, options = line.partition(": ")
            if sep:
                kept = [o for o in options.split(", ") if not o.endswith("_schema")]
                line = f"{group}: {', '.join(kept)}"
            elif line.strip().endswith("_schema"):
                continue
            lines.append(line)
        return "\n".join(lines) + ("\n" if lines else "")

    without_schemas._specsamp = True
    Hydra.format_config_groups = without_schemas


def main(hydra_main: Callable[[], Any], repo_dir: str) -> None:
    """Run ``hydra_main`` (``run.py``'s ``@hydra.main`` function) and exit with this module's status.

    A composition error (unknown key, wrong type, bad group option) becomes one paragraph naming the key
    and the closest valid one (:func:`specsamp.runner.explain.explain`), exit 2; an infrastructure failure
    exit 3, naming the file (a file that Hydra was writing in place and that did not fit is removed:
    :func:`discard_torn_file`); Ctrl-C exit 130 with the sweep's summary; anything else is a bug (traceback, exit 1).
    """
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from .callback import SWEEP_STATE

    os.environ.setdefault("WANDB_MODE", "offline")
    # submitit jobs unpickle the task in a fresh interpreter: let them import specsamp from this checkout
    os.environ["PYTHONPATH"] = os.pathsep.join([repo_dir, *filter(None, [os.environ.get("PYTHONPATH")])])
    full_error = os.environ.get("HYDRA_FULL_ERROR") == "1"
    # Hydra would print its own errors and exit 1 whatever they are; let them reach us to sort them out
    os.environ["HYDRA_FULL_ERROR"] = "1"
    if "--help" in sys.argv[1:] or "-h" in sys.argv[1:]:
        _help_without_schemas()
    from .explain import override_problem

    as_key = conflicting_modes(sys.argv[1:]) or group_given_as_key(sys.argv[1:]) or override_problem(sys.argv[1:])
    if as_key is not None:
        print(f"error: {as_key}", file=sys.stderr)
        sys.exit(USAGE)
    sys.argv[1:] = per_job_model_overrides(sys.argv[1:])
    try:
        hydra_main()
    except KeyboardInterrupt:
        where = SWEEP_STATE.get("sweep_dir")
        left = SWEEP_STATE.get("left_running")  # a SLURM job the launcher stopped waiting for
        if where and left:
            from .report import resume_hint

            rest = (
                f"SLURM job {left} is still queued or running and its cells write their records as they end "
                f"(squeue -j {left}; python -m specsamp.runner.report collect {where}); do not rerun yet. Once "
                f"it has left the queue, {resume_hint(where)}, to run what failed or was killed"
            )
        elif where:
            from .report import resume_hint

            rest = f"to run the unfinished jobs, {resume_hint(where)}"
        else:
            rest = "the unfinished run wrote no record"
        print(f"interrupted (Ctrl-C): finished records are kept; {rest}.", file=sys.stderr, flush=True)
        SWEEP_STATE["interrupted"] = True
        _summary_if_swept()
        sys.exit(INTERRUPTED)
    except SystemExit:
        raise
    except Exception as e:
        import traceback

        if is_infrastructure(e):
            discard_torn_file(e)  # Hydra's own files (.hydra/*.yaml, multirun.yaml) are written in place
            print(f"error: {infrastructure_message(e)}", file=sys.stderr)
            _summary_if_swept()
            sys.exit(INFRASTRUCTURE)
        user = user_error(e)
        if user is not None:  # the sweeper's refusal of a whole sweep, or of one of its own keys
            print(f"error: {user}", file=sys.stderr)
            _summary_if_swept()
            sys.exit(USAGE)
        if isinstance(e, (HydraException, OmegaConfBaseException)):
            # a config that does not compose (jobs of a sweep record their own composition errors;
            # this is the command line's or the whole sweep's)
            if full_error:
                traceback.print_exception(e, file=sys.stderr)
            print(f"error: {composition_message(e)}", file=sys.stderr)
            _summary_if_swept()
            sys.exit(USAGE)
        # a bug, or a launcher that gave up after jobs started (e.g. SLURM killed one): say where things stand
        traceback.print_exception(e, file=sys.stderr)
        _summary_if_swept()
        sys.exit(BUG)
    if SWEEP_STATE.get("sweep_dir"):
        failed = SWEEP_STATE.get("failed")
        if failed:
            print(
                f"error: {len(failed)} job(s) of the sweep failed (listed above; their failed.json has the details).",
                file=sys.stderr,
            )
        sys.exit(sweep_exit_status())
