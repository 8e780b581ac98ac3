"""What a user's plug-in spec names: ``path/to/file.py:name`` or ``module:name`` (``--reward-fn``, ``--env``).

One loader for every plug-in flag, so each reports a bad spec, a missing file or a module that fails to import
the same way: one line naming the flag and the spec. It checks nothing about the object found (the flag's own
loader does). Imports neither torch nor Ray.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any


def load_spec(spec: str, *, label: str, kind: str, module_prefix: str, error: type[Exception]) -> tuple[str, str, Any]:
    """``(location, attribute, the object or None)`` that ``spec`` names; a bad spec, a missing file or a failed
    import raises ``error`` with ``label`` (the flag) and ``spec`` in one line. ``kind`` ("function", "Class")
    is what the spec's name part should be; a file is imported once per process, under ``module_prefix``."""
    location, _, attribute = spec.rpartition(":")
    if not location or not attribute:
        raise error(f"{label} {spec!r}: expected 'path/to/file.py:{kind}' or 'module:{kind}'")
    is_file = location.endswith(".py") or "/" in location
    module = (
        _load_file(spec, location, label, module_prefix, error) if is_file else _import(spec, location, label, error)
    )
    return location, attribute, getattr(module, attribute, None)


def _load_file(spec: str, path_text: str, label: str, module_prefix: str, error: type[Exception]) -> ModuleType:
    path = Path(path_text).expanduser()
    if not path.is_file():
        raise error(f"{label} {spec!r}: file {path} does not exist")
    digest = hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:12]
    name = f"{module_prefix}_{path.stem}_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:
        raise error(f"{label} {spec!r}: {path} is not an importable Python file")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except Exception as failure:  # whatever the user's module raises, named in one line
        del sys.modules[name]
        raise error(f"{label} {spec!r}: importing {path} failed: {type(failure).__name__}: {failure}") from None
    return module


def _import(spec: str, module_name: str, label: str, error: type[Exception]) -> ModuleType:
    try:
        return importlib.import_module(module_name)
    except Exception as failure:
        raise error(f"{label} {spec!r}: cannot import module {module_name!r}: {failure}") from None
