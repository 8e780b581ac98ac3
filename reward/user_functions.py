"""User reward functions: ``path/to/file.py:function`` or ``module:function``.

The function is loaded and checked once, when the scorer is built, so a typo fails the launch
with a message naming the spec instead of failing every sample later. At scoring time the function runs in
worker processes, each call bounded in time (``--reward-timeout``); an exception inside it, or a call past the
limit, becomes ``infra_error`` for that sample only.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from typing import Any

from .plugin_specs import load_spec
from .records import INFRA_ERROR, RewardRecord, infra_error, record_from_plugin_value

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


def plugin_record_function(spec: str) -> Callable[[str, dict[str, Any]], RewardRecord]:
    """The function a bounded-call worker runs (``bounded_calls.py``): the plug-in's value as a record."""
    function = load_reward_fn(spec)
    return lambda response, row: record_from_plugin_value(function(response, row))


class PluginScorer:
    """Scores with a user's function: with ``timeout_s``, in a pool of worker processes that each load ``spec``,
    every call bounded by ``timeout_s`` (``bounded_calls.py``); without, in the calling thread (a trusted function
    given in-process, ``function``). A call that raises or passes the limit is an ``infra_error`` for that sample
    only; failures are logged once per batch, the first one's text in the line."""

    def __init__(
        self,
        function: RewardFunction,
        spec: str,
        timeout_s: float | None = None,
        num_workers: int = 2,
        batch_budget_s: float | None = None,
    ):
        """``batch_budget_s``: a batch's calls all end within about that long, however many hang (samples not
        scored by then are ``infra_error``): a producer answers its driver before ``--timeout`` ends the run."""
        self.function = function
        self.spec = spec
        self.timeout_s = timeout_s
        self.batch_budget_s = batch_budget_s
        self._pool = None
        if timeout_s is not None:
            from .bounded_calls import BoundedCallPool

            self._pool = BoundedCallPool(PLUGIN_FACTORY, spec, timeout_s=timeout_s, num_workers=num_workers)

    def score_batch(self, responses: list[str], rows: list[dict[str, Any]]) -> list[RewardRecord]:
        if len(responses) != len(rows):
            raise ValueError(f"{len(responses)} responses but {len(rows)} rows")
        if self._pool is None:
            records = [self._score_here(response, row) for response, row in zip(responses, rows, strict=True)]
        else:
            outcomes = self._pool.call_many(list(zip(responses, rows, strict=True)), budget_s=self.batch_budget_s)
            records = [self._record_of(outcome) for outcome in outcomes]
        _log_failures(self.spec, records)
        return records

    def score(self, response: str, row: dict[str, Any]) -> RewardRecord:
        return self.score_batch([response], [row])[0]

    def _score_here(self, response: str, row: dict[str, Any]) -> RewardRecord:
        try:
            return record_from_plugin_value(self.function(response, row))
        except Exception as error:
            return infra_error(f"reward_fn {self.spec} raised {type(error).__name__}: {error}"[:1000])

    def _record_of(self, outcome) -> RewardRecord:
        if outcome.status == "ok":
            return outcome.value
        if outcome.status == "timeout" and "budget" in outcome.message:  # the batch's, half of --timeout
            return infra_error(f"reward_fn {self.spec}: {outcome.message}", timed_out=True)
        if outcome.status == "timeout":
            return infra_error(
                f"reward_fn {self.spec} gave no reward within --reward-timeout {self.timeout_s:g}s", timed_out=True
            )
        if outcome.status == "raised":
            return infra_error(f"reward_fn {self.spec} raised {outcome.message}"[:1000])
        return infra_error(f"reward_fn {self.spec} could not be called: {outcome.message}"[:1000])

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()


PLUGIN_FACTORY = f"{__name__}:plugin_record_function"
"""What a bounded-call worker calls with the spec, to get the function it runs."""


def _log_failures(spec: str, records: list[RewardRecord]) -> None:
    """One line per batch for the samples the plug-in could not score (not one per sample)."""
    failed = [record for record in records if record.status == INFRA_ERROR]
    if failed:
        timed_out = sum(bool(record.details.get("timed_out")) for record in failed)
        logger.warning(
            "reward_fn %s: %d of %d samples are infra_error (%d past the time limit); first: %s",
            spec,
            len(failed),
            len(records),
            timed_out,
            failed[0].details.get("error", ""),
        )
