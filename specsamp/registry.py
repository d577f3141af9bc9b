"""Name -> object tables for the pluggable parts: couplings (:data:`specsamp.coupling.COUPLINGS`), drafts
(:data:`specsamp.drafts.DRAFTS`) and tree rules (:data:`specsamp.runner.treerules.TREE_RULES`).

Every table also accepts ``"pkg.module:name"``, the spelling of an object defined outside specsamp: the
module is imported (which runs its ``register_*`` decorators) and the attribute is returned."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Generic, TypeVar

from .errors import ConfigError

T = TypeVar("T")


def import_object(spec: str, key: str = "value"):
    """``"pkg.module:name"`` -> the object it names (the module is imported from ``sys.path``).

    Args:
        spec: the module's dotted path, a colon, the attribute (``a.b`` for a nested one).
        key: the config key, for the message.

    Raises:
        ConfigError: (a ``ValueError``) the module cannot be imported or has no such attribute.
    """
    import importlib

    mod_name, _, attr = str(spec).partition(":")
    try:
        obj = importlib.import_module(mod_name)
    except ImportError as err:
        raise ConfigError(
            f"{key}={spec!r} is invalid: cannot import module {mod_name!r} ({err}); the module "
            "must be importable (installed, or on PYTHONPATH)."
        ) from None
    for part in attr.split("."):
        if not part or not hasattr(obj, part):
            raise ConfigError(f"{key}={spec!r} is invalid: module {mod_name!r} has no attribute {attr!r}.") from None
        obj = getattr(obj, part)
    return obj


class Registry(Generic[T]):
    """Objects of one kind, found by name.

    Args:
        kind: what the entries are (``"coupling"``, ``"draft"``, ``"tree"``); it is the config key that
            error messages name.
        cls: the entries' type, when there is one: :meth:`get` returns an instance of it as is, and
            refuses a ``pkg.module:name`` that names something else.
        modules: modules whose import registers more entries (the library's own, defined beside the registry's
            module): imported on the first read of the table, so that they may import the registry's module
            without a cycle.
    """

    def __init__(self, kind: str, cls: type | None = None, modules: tuple[str, ...] = ()):
        self.kind = kind
        self.cls = cls
        self._entries: dict[str, T] = {}
        self._pending = tuple(modules)

    def _load(self) -> None:
        """Import the :attr:`modules` not yet imported (once; a registration they make does not recurse here)."""
        if self._pending:
            import importlib

            pending, self._pending = self._pending, ()
            for module in pending:
                importlib.import_module(module)

    def register(self, name: str, obj: T, *, replace: bool = False) -> T:
        """Store ``obj`` under ``name`` and return it.

        Raises:
            ValueError: ``name`` is taken and ``replace`` is False.
        """
        if name in self._entries and not replace:
            raise ValueError(f"{self.kind} {name!r} is already registered")
        self._entries[name] = obj
        return obj

    def get(self, name) -> T:
        """The entry registered as ``name``; for ``"pkg.module:name"``, the object that names (imported:
        :func:`import_object`); an instance of the registry's ``cls`` as is.

        Raises:
            ConfigError: (a ``ValueError``) no such entry; the message lists the valid names and the
                ``pkg.module:name`` form.
        """
        if self.cls is not None and isinstance(name, self.cls):
            return name
        self._load()
        if isinstance(name, str) and ":" in name and name not in self._entries:
            obj = import_object(name, self.kind)
            if self.cls is not None and not isinstance(obj, self.cls):
                raise ConfigError(
                    f"{self.kind}={name!r} is invalid: it names a {type(obj).__name__}, not a "
                    f"{self.cls.__module__}.{self.cls.__name__}."
                )
            return obj
        try:
            return self._entries[name]
        except (KeyError, TypeError):
            raise ConfigError(f"{self.kind}={name!r} is not registered; valid: {self.valid_text()}") from None

    def valid_text(self) -> str:
        """What a value may be, for messages: the registered names (comma-separated), or a ``pkg.module:name``."""
        return (
            f"{', '.join(self.names()) or 'none'} (registered), or pkg.module:name of a {self.kind} defined elsewhere"
        )

    def valid(self, name) -> bool:
        """Whether :meth:`get` finds ``name`` (importing a ``pkg.module:name``)."""
        try:
            self.get(name)
        except ConfigError:
            return False
        return True

    __getitem__ = get

    def names(self) -> tuple[str, ...]:
        """Registered names, sorted."""
        self._load()
        return tuple(sorted(self._entries))

    def __contains__(self, name: object) -> bool:
        self._load()
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {list(self.names())})"
