"""Name -> function registries: the extension point for estimators, losses and presets.

A new algorithm variant registers a function under a new name; the trainer looks it up by the
name in ``AlgorithmConfig`` and never branches on names itself. This module imports nothing heavy.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

Entry = TypeVar("Entry", bound=Callable)


class Registry(Generic[Entry]):
    """A mapping from names to functions that refuses duplicate names.

    ``kind`` names what is registered (e.g. "advantage estimator") for error messages.
    """

    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, Entry] = {}

    def register(self, name: str) -> Callable[[Entry], Entry]:
        """Decorator registering a function under ``name``; raises ``ValueError`` if the name is taken."""

        def decorate(entry: Entry) -> Entry:
            if name in self._entries:
                raise ValueError(f"{self.kind} {name!r} is already registered (by {self._entries[name].__qualname__})")
            self._entries[name] = entry
            return entry

        return decorate

    def get(self, name: str) -> Entry:
        """The function registered as ``name``; raises ``ValueError`` listing the known names otherwise."""
        try:
            return self._entries[name]
        except KeyError:
            known = ", ".join(sorted(self._entries))
            raise ValueError(f"unknown {self.kind} {name!r}; known: {known}") from None

    __getitem__ = get

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {self.names()})"
