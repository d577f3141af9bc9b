"""One paragraph for what the typed config refuses while Hydra composes: an unknown key (with the closest valid
one), a value of the wrong type (with what is valid), and an override that Hydra's grammar reads as something else
than what was typed. ``run.py`` prints it and exits with status 2 (:mod:`specsamp.runner.exits`).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Any

from omegaconf import MISSING

from .kernelconfig import KERNEL_SCHEMAS
from .overrides import SWEEPER_KEYS, _keys, _type_text, closest_key, misread_override, unreadable_override
from .schema import LoggerConfig, RunConfig, SamplerConfig, _model_schema


def _bool_keys() -> set[str]:
    """The keys that take true or false: :class:`RunConfig`'s and every model config's (``model.KEY``)."""
    from typing import get_type_hints

    from ..models import MODEL_SCHEMAS

    keys = {k for k, t in get_type_hints(RunConfig).items() if t is bool}
    for schema in MODEL_SCHEMAS.values():
        keys |= {f"model.{k}" for k, t in get_type_hints(schema).items() if t is bool}
    for schema in KERNEL_SCHEMAS.values():
        keys |= {f"kernel.{k}" for k, t in get_type_hints(schema).items() if t is bool}
    return keys


def override_problem(argv: Sequence[str]) -> str | None:
    """One paragraph for a command-line override whose value Hydra's grammar reads as something else than
    what was typed, or for an output folder with a control character; None when every override is fine
    (:func:`specsamp.runner.overrides.misread_override`, with the keys of :class:`RunConfig` and of every
    model config that take true or false)."""
    return misread_override(argv, _bool_keys)


def valid_keys(path: str, schema: type | None = None) -> list[str]:
    """The keys a user may set at ``path``'s level: the keys of ``schema`` (the config class the key was
    set on) under ``path``'s parent; without it, top-level keys (with the groups ``shape``, ``experiment``),
    or those under ``model`` (of every model config), ``sampler`` or ``logger``."""
    head = path.split(".")[0]
    if path.startswith("hydra.sweeper."):
        return sorted(f"hydra.sweeper.{k}" for k in SWEEPER_KEYS)
    if dataclasses.is_dataclass(schema) and "." in path:
        return sorted(_keys(schema, path.rsplit(".", 1)[0] + "."))
    if "." not in path:
        return sorted({f.name for f in dataclasses.fields(RunConfig)} | {"shape", "experiment"})
    if head == "model":
        from ..models import MODEL_SCHEMAS

        return sorted({k for sch in MODEL_SCHEMAS.values() for k in _keys(sch, "model.")})
    if head == "kernel":
        return sorted({k for sch in KERNEL_SCHEMAS.values() for k in _keys(sch, "kernel.")})
    schema = {"sampler": SamplerConfig, "logger": LoggerConfig}.get(head)
    return sorted(f"{head}.{k}" for k in _keys(schema)) if schema else []


def unknown_key_message(key: str, shown: str | None = None, schema: type | None = None) -> str:
    """One paragraph for a key that the config does not have (``shown``: as the user typed it), naming the
    closest valid key; under ``model``, the keys of the chosen model's config class ``schema``."""
    valid = valid_keys(key, schema)
    guess = closest_key(key, valid)
    shown = shown or repr(key)
    where = (
        f"{schema.__name__} (the config of {key.rsplit('.', 1)[0]})"
        if "." in key and dataclasses.is_dataclass(schema)
        else "specsamp's sweeper (hydra/sweeper=specsamp)"
        if key.startswith("hydra.sweeper.")
        else "specsamp's config"
    )
    return (
        f"{shown} is not a key of {where}"
        + (f"; did you mean {guess}? (e.g. {guess}=...)" if guess else "")
        + (
            f". Valid keys here: {', '.join(valid)} (see "
            + (
                "conf/hydra/sweeper/specsamp.yaml and docs/running.md"
                if key.startswith("hydra.sweeper.")
                else "conf/config.yaml, conf/model/ and docs/extending.md"
            )
            + ")."
            if valid
            else "."
        )
    )


def _rule_text(key: str) -> str | None:
    """What is valid for ``key``: its field's rule, else its type (top-level keys of :class:`RunConfig`)."""
    fields = {f.name: f for f in dataclasses.fields(RunConfig)}
    f = fields.get(key)
    if f is None:
        return None
    if f.metadata:
        text = f.metadata["text"]
        return text() if callable(text) else text
    return {bool: "true or false", "bool": "true or false", str: "a string", "str": "a string"}.get(f.type)


def _schema_of_node(node) -> type | None:
    """The config dataclass a model node's ``_target_`` names (a user's model config composed without its
    schema: its keys are then still the ones a typo is matched against), or None."""
    try:
        target = node.get("_target_") if node is not None else None
        return _model_schema({"_target_": target}) if isinstance(target, str) else None
    except Exception:
        return None


def explain(error: BaseException, value: Any = MISSING) -> str | None:
    """One paragraph for an OmegaConf/Hydra composition error about a key (unknown key, wrong type), or None.

    The key comes from the error's ``full_key``; an unknown key names the closest valid key of the config
    class it was set on (``object_type``; for a model composed without its schema, the class its
    ``_target_`` names) instead of Hydra's advice to append it with ``+``; a value of the
    wrong type says what is valid.
    """
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

    unread = unreadable_override(error)
    if unread is not None:
        return unread
    seen = error
    while seen is not None and not (isinstance(seen, OmegaConfBaseException) and getattr(seen, "full_key", None)):
        seen = seen.__cause__ or seen.__context__
    if seen is None:
        return None
    key = str(seen.full_key)
    typed = re.search(r"(?:use \+|override )" + re.escape(key) + r"=(\S*)", str(error))  # the override as typed
    shown = f"{key}={typed.group(1)}" if typed else key if value is MISSING else f"{key}={value!r}"
    if isinstance(seen, (ConfigKeyError, ConfigAttributeError)):
        schema = getattr(seen, "object_type", None)
        if not dataclasses.is_dataclass(schema) and key.startswith("model."):
            schema = _schema_of_node(getattr(seen, "parent_node", None))
        return unknown_key_message(key, shown=shown, schema=schema)
    valid = _rule_text(key) or _type_text(getattr(seen, "object_type", None), key.rpartition(".")[2])
    return f"{shown} is invalid: {str(seen).splitlines()[0].rstrip('.')}" + (f"; must be {valid}." if valid else ".")
