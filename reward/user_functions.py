"""User reward functions: ``path/to/file.py:function`` or ``module:function``.

The function is loaded and checked once, when the scorer is built, so a typo fails the launch
with a message naming the spec instead of failing every sample later. At scoring time an
exception inside the user's function becomes ``infra_error`` for that sample only.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from typing import Any

from .plugin_specs import load_spec
from .records import RewardRecord, infra_error, record_from_plugin_value

logger = logging.getLogger(__name__)

RewardFunction = Callable[[str, dict[str, Any]], "RewardRecord | float"]


class RewardConfigError(ValueError):
    """A reward setting (type, plug-in spec, option) is invalid; the message names it."""


def load_reward_fn(spec: str) -> RewardFunction:
    """The callable named by ``spec``, checked to accept ``(response, row)``; raises RewardConfigError."""
    location, attribute, function = load_spec(
        spec, label="reward_fn", kind="function", module_prefix="colossal_rl_user_reward", error=RewardConfigError
    )
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
