"""User reward functions: ``path/to/file.py:function`` or ``module:function``.

The function is loaded and checked once, when the scorer is built, so a typo fails the launch
with a message naming the spec instead of failing every sample later. At scoring time an
exception inside the user's function becomes ``infra_error`` for that sample only.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .records import RewardRecord, infra_error, record_from_plugin_value

logger = logging.getLogger(__name__)

RewardFunction = Callable[[str, dict[str, Any]], "RewardRecord | float"]


class RewardConfigError(ValueError):
    """A reward setting (type, plug-in spec, option) is invalid; the message names it."""


def _load_file_module(spec: str, path_text: str):
    path = Path(path_text).expanduser()
    if not path.is_file():
        raise RewardConfigError(f"reward_fn {spec!r}: file {path} does not exist")
    digest = hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:12]
    module_name = f"colossal_rl_user_reward_{path.stem}_{digest}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    if module_spec is None or module_spec.loader is None:
        raise RewardConfigError(f"reward_fn {spec!r}: {path} is not an importable Python file")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module
    try:
        module_spec.loader.exec_module(module)
    except Exception as error:
        del sys.modules[module_name]
        raise RewardConfigError(
            f"reward_fn {spec!r}: importing {path} failed: {type(error).__name__}: {error}"
        ) from error
    return module


def _load_module(spec: str, module_name: str):
    try:
        return importlib.import_module(module_name)
    except Exception as error:
        raise RewardConfigError(f"reward_fn {spec!r}: cannot import module {module_name!r}: {error}") from error


def load_reward_fn(spec: str) -> RewardFunction:
    """The callable named by ``spec``, checked to accept ``(response, row)``; raises RewardConfigError."""
    location, _, attribute = spec.rpartition(":")
    if not location or not attribute:
        raise RewardConfigError(f"reward_fn {spec!r}: expected 'path/to/file.py:function' or 'module:function'")
    is_file = location.endswith(".py") or "/" in location
    module = _load_file_module(spec, location) if is_file else _load_module(spec, location)
    function = getattr(module, attribute, None)
    if function is None:
        raise RewardConfigError(f"reward_fn {spec!r}: {location} has no attribute {attribute!r}")
    if not callable(function):
        raise RewardConfigError(f"reward_fn {spec!r}: {attribute!r} is a {type(function).__name__}, not callable")
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):  # some builtins have no signature: accept them
        return function
    try:
        signature.bind("response", {})
    except TypeError as error:
        raise RewardConfigError(
            f"reward_fn {spec!r}: {attribute}{signature} must accept two positional arguments (response, row): {error}"
        ) from None
    return function


class PluginScorer:
    """Scores with a user's function, in the calling thread."""

    def __init__(self, function: RewardFunction, spec: str):
        self.function = function
        self.spec = spec

    def score_batch(self, responses: list[str], rows: list[dict[str, Any]]) -> list[RewardRecord]:
        if len(responses) != len(rows):
            raise ValueError(f"{len(responses)} responses but {len(rows)} rows")
        return [self.score(response, row) for response, row in zip(responses, rows, strict=True)]

    def score(self, response: str, row: dict[str, Any]) -> RewardRecord:
        try:
            return record_from_plugin_value(self.function(response, row))
        except Exception as error:
            logger.warning("reward_fn %s failed on a sample: %s: %s", self.spec, type(error).__name__, error)
            return infra_error(f"reward_fn {self.spec} raised {type(error).__name__}: {error}"[:1000])

    def close(self) -> None:
        pass
