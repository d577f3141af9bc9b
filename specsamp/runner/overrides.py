"""What a user typed, read as typed: raw command-line overrides, sweep names and path-like keys.

Checks that need no schema, so :mod:`~specsamp.runner.config` (the typed config) builds on them:

- :func:`misread_override`: an override whose value Hydra's grammar reads otherwise than typed (a number for
  a key that takes true or false, a sweep name the grammar turns into another value), or an output folder
  with a control character, before anything composes (``run.py`` calls it through
  :func:`specsamp.runner.explain.override_problem`, which knows the keys that take true or false);
- :func:`unreadable_override`: one paragraph for an override the grammar cannot read at all;
- :data:`SWEEP_NAME_TEXT`, :func:`sweep_name_ok`: what ``sweep_name`` may be (a folder below ``multirun/``);
- :func:`path_problem`, :data:`PATH_FIELDS`, :data:`HYDRA_PATH_KEYS`: paths a user gives (a model's
  ``cache_dir``/``path``, Hydra's output folders), refused when empty or holding a control character, and
  :func:`launch_dir`, where a relative one is read from;
- :func:`closest_key` and the key and type texts that the paragraphs about a mistyped key use, the
  sweeper's keys (:data:`SWEEPER_KEYS`) among them.

Those that :mod:`specsamp.runner.config` defined before stay importable from there (it imports them).
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

# sweep_name: the folder multirun/<sweep_name>/ (one or more '/'-separated parts of these characters)
_NAME_PART = re.compile(r"[A-Za-z0-9._+=,@-]+")
SWEEP_NAME_TEXT = (
    "a folder name under multirun/: one or more parts separated by '/', each made of ASCII letters, "
    "digits and . _ - + = , @ (no part empty, '.' or '..'; no leading '/'), e.g. sweep_name=grid or "
    "sweep_name=2024-05-01/grid; give any other folder with hydra.sweep.dir=DIR"
)


def sweep_name_ok(v) -> bool:
    """``v`` names a folder below ``multirun/`` (:data:`SWEEP_NAME_TEXT`): never ``multirun/`` itself, never
    above it, never an absolute path, no control character or space."""
    if not isinstance(v, str) or not v:
        return False
    parts = v.split("/")
    return all(_NAME_PART.fullmatch(p) and p not in (".", "..") for p in parts)


def path_problem(v) -> str | None:
    """What is wrong with a path a user gave (``model.cache_dir``, ``hydra.run.dir``), or None: an empty
    one, or one holding a control character (a newline makes a folder whose name has a line break)."""
    if not isinstance(v, str):
        return None
    if not v:
        return "it is empty"
    bad = sorted({c for c in v if ord(c) < 32 or ord(c) == 127})
    if bad:
        return f"it holds the control character(s) {', '.join(repr(c) for c in bad)}"
    return None


def launch_dir() -> Path:
    """The directory the command was launched from: Hydra's original working directory inside a Hydra
    run (``hydra.job.chdir=true`` moves the process into the output directory), else the current one."""
    try:
        from hydra.core.hydra_config import HydraConfig

        return Path(HydraConfig.get().runtime.cwd)
    except Exception:  # not inside a Hydra run
        return Path.cwd()


PATH_FIELDS = ("cache_dir", "path")  # model keys that name a place on disk


def _model_paths(node, prefix: str = "model", depth: int = 0):
    """``(key, value)`` of every path key (:data:`PATH_FIELDS`) of a model config, nested configs included."""
    if depth > 2 or node is None:
        return
    items = (
        node.items()
        if isinstance(node, Mapping)
        else ((f.name, getattr(node, f.name)) for f in dataclasses.fields(node))
        if dataclasses.is_dataclass(node)
        else ()
    )
    for name, v in items:
        if name in PATH_FIELDS and isinstance(v, str):
            yield f"{prefix}.{name}", v
        elif isinstance(v, Mapping) or dataclasses.is_dataclass(v):
            yield from _model_paths(v, f"{prefix}.{name}", depth + 1)


HYDRA_PATH_KEYS = ("hydra.run.dir", "hydra.sweep.dir", "hydra.sweep.subdir")  # Hydra's keys that name an output folder

# the sweeper's keys (conf/hydra/sweeper/specsamp.yaml, docs/running.md) and what each one accepts: the
# sweeper (hydra_plugins/specsamp_sweeper) checks them, and the paragraph about a mistyped one lists them
SWEEPER_KEYS = {
    "max_batch_size": "an integer >= 1 (jobs launched together) or null (the whole grid at once)",
    "params": "a mapping {key: 'a,b,c'} of sweep parameters, or null",
    "validate": "true (refuse the whole sweep when one job is bad) or false (the bad jobs fail alone)",
}


def misread_override(argv: Sequence[str], bool_keys: Callable[[], Collection[str]]) -> str | None:
    """One paragraph for a command-line override whose value Hydra's grammar reads as something else than
    what was typed, where composing it would pass silently; None when every override is fine.

    - a key that takes true or false given a number (``compile=2``, which OmegaConf would read as true);
    - ``sweep_name`` given a value that is not a folder name under ``multirun/`` (:func:`sweep_name_ok`),
      or one that the grammar turns into another value (``1_1_1`` is the integer 111, ``true`` a bool,
      ``null`` no name), or characters the grammar cannot read unquoted (non-ASCII letters);
    - an output folder (:data:`HYDRA_PATH_KEYS`) that is empty or holds a control character (a newline).

    ``bool_keys()`` gives the keys that take true or false (called only when an override may set one);
    :func:`specsamp.runner.explain.override_problem` passes those of the config's schemas.
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser, bools = None, None
    for arg in argv:
        if arg.startswith("-"):
            continue
        key, eq, raw = arg.lstrip("+~").partition("=")
        if not eq:
            continue
        if bools is None and key.startswith(
            ("model.", "kernel.", "compile", "save_samples", "skip_existing", "evaluate_leaves")
        ):
            bools = bool_keys()
        is_path = key == "sweep_name" or key in HYDRA_PATH_KEYS or key.rpartition(".")[2] in PATH_FIELDS
        if is_path and path_problem(raw) and raw:  # a newline: Hydra's grammar cannot read it, nor a shell show it
            return f"{key}={raw!r} is invalid: {path_problem(raw)}; must be " + (
                f"{SWEEP_NAME_TEXT}." if key == "sweep_name" else "a folder path without control characters."
            )
        if not is_path and key not in (bools or ()):
            continue
        parser = parser or OverridesParser.create()
        try:
            o = parser.parse_override(arg)
        except Exception:  # noqa: BLE001 - Hydra's own paragraph says where (exits.composition_message)
            if key == "sweep_name":
                return f"{arg} is invalid: must be {SWEEP_NAME_TEXT}."
            continue
        if o.is_sweep_override():
            continue
        v = o.value()
        if key in (bools or ()):
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                return f"{arg} is invalid: {key} takes true or false, not a number."
        elif key == "sweep_name":
            if not isinstance(v, str) and str(v) != raw:
                read = "null (no name)" if v is None else f"the {type(v).__name__} {v!r}"
                return (
                    f"{arg} is invalid: Hydra's override grammar reads {raw} as {read}, not as the name {raw!r} "
                    f"(underscores between digits make a number; true, false and null are keywords); quote it to "
                    f"keep it as typed: \"sweep_name='{raw}'\"."
                )
            if not sweep_name_ok(str(v)):
                return f"sweep_name={str(v)!r} is invalid: must be {SWEEP_NAME_TEXT}."
        else:
            problem = path_problem(v) if isinstance(v, str) else None
            if problem:
                return f"{key}={v!r} is invalid: {problem}; must be a folder path without control characters."
    return None


def unreadable_override(error: BaseException) -> str | None:
    """One paragraph for an override that Hydra's grammar cannot read (its ``LexerNoViableAltException``: a
    non-ASCII letter, a space or a bracket in an unquoted value), naming the key and how to give the value;
    None for any other error."""
    text = str(error)
    m = re.search(r"LexerNoViableAltException: (.*)", text)
    if m is None:
        return None
    arg = m.group(1).strip()
    key, _, value = arg.lstrip("+~").partition("=")
    if key == "sweep_name":
        return f"{arg} is invalid: must be {SWEEP_NAME_TEXT}."
    return (
        f"{arg} could not be read: Hydra's override grammar takes unquoted values made of ASCII letters, digits and "
        "a few symbols (_ - + . / : @ ...), and {key} was given other characters; quote the value to pass it as "
        f"text: \"{key}='{value}'\" (see docs/running.md for the keys and their values)."
    ).replace("{key}", key)


# ----------------------------------------------------------------------------------------------
# the keys a paragraph about a mistyped key names


def _keys(schema, prefix: str = "") -> list[str]:
    from typing import get_type_hints

    hints = get_type_hints(schema)
    out = []
    for f in dataclasses.fields(schema):
        if f.name.startswith("_"):
            continue
        out.append(prefix + f.name)
        if dataclasses.is_dataclass(hints.get(f.name)):
            out += _keys(hints[f.name], f"{prefix}{f.name}.")
    return out


def closest_key(name: str, valid: Sequence[str]) -> str | None:
    """The valid key nearest to a mistyped ``name`` (:func:`difflib.get_close_matches`), or None."""
    name = str(name).lstrip("+~")
    exact = [k for k in valid if k.lower() == name.lower()]
    if exact:
        return exact[0]
    tail = {k.rsplit(".", 1)[-1]: k for k in valid}
    hit = difflib.get_close_matches(name.rsplit(".", 1)[-1], list(tail), n=1, cutoff=0.5)
    return tail[hit[0]] if hit else None


def _type_text(schema: Any, name: str) -> str | None:
    """What the field ``name`` of the config dataclass ``schema`` takes, from its type (``an integer``,
    ``a number``, ``true or false``, ``a string``, each ``or null`` when optional), or None."""
    import typing

    if not dataclasses.is_dataclass(schema):
        return None
    try:
        hint = typing.get_type_hints(schema).get(name)
    except Exception:
        return None
    args = typing.get_args(hint)
    optional = type(None) in args
    if optional and len(args) == 2:
        hint = next(a for a in args if a is not type(None))
    text = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(hint)
    return None if text is None else text + (" or null" if optional else "")
