"""Name -> object tables for the pluggable parts: couplings (:data:`specsamp.coupling.COUPLINGS`) and
drafts (:data:`specsamp.drafts.DRAFTS`)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Generic, TypeVar

from .errors import ConfigError

T = TypeVar("T")


class Registry(Generic[T]):
    """Objects of one kind, found by name.

    Args:
        kind: what the entries are (``"coupling"``, ``"draft"``); it is the config key that error
            messages name.
    """

    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, T] = {}

    def register(self, name: str, obj: T, *, replace: bool = False) -> T:
        """Store ``obj`` under ``name`` and return it.

        Raises:
            ValueError: ``name`` is taken and ``replace`` is False.
        """
        if name in self._entries and not replace:
            raise ValueError(f"{self.kind} {name!r} is already registered")
        self._entries[name] = obj
        return obj

    def get(self, name: str) -> T:
        """The entry registered as ``name``.

        Raises:
            ConfigError: (a ``ValueError``) no such entry; the message lists the valid names.
        """
        try:
            return self._entries[name]
        except (KeyError, TypeError):
            raise ConfigError(f"{self.kind}={name!r} is not registered; valid: {list(self.names())}") from None

    __getitem__ = get

    def names(self) -> tuple[str, ...]:
        """Registered names, sorted."""
        return tuple(sorted(self._entries))

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {list(self.names())})"
