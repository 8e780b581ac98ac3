"""Package ``__init__`` re-exports imported on first use (PEP 562): importing one light module of a package
(``algorithms.registry``, ``comm.buffer``) does not import its heavy siblings (torch)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_exports(package_globals: dict[str, Any], exports: dict[str, str]) -> tuple[Callable, Callable]:
    """(``__getattr__``, ``__dir__``) for a package whose name -> defining module map is ``exports``."""

    def __getattr__(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package_globals['__name__']!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(exports[name]), name)
        package_globals[name] = value  # later lookups skip this function
        return value

    def __dir__() -> list[str]:
        return sorted(set(package_globals) | set(exports))

    return __getattr__, __dir__
