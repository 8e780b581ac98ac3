"""The result of scoring one response, and the statuses it can carry.

A record is what every scorer returns for every sample, whatever went wrong: scorers never
raise for a single bad sample. ``infra_error`` means the reward could not be computed (broken
verifier, malformed test cases, crashed plug-in); its reward is always 0 and producers mask it
out of the loss rather than treating it as a wrong answer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

OK = "ok"
"""The answer was verified (correct or not)."""
TIMEOUT = "timeout"
"""Verification or a test case exceeded its time limit; reward 0."""
INFRA_ERROR = "infra_error"
"""The reward could not be computed (verifier, sandbox, test data or plug-in failure); reward 0, not a verdict."""
FORMAT_ERROR = "format_error"
"""No answer (or program) could be extracted, or the required response shape was not met; reward 0."""
STRING_FALLBACK = "string_fallback"
"""math-verify could not parse the answer or the gold; compared as normalised strings."""
AMBIGUOUS_ANSWER = "ambiguous_answer"
"""Several different final answers were given; reward 0."""

STATUSES = frozenset({OK, TIMEOUT, INFRA_ERROR, FORMAT_ERROR, STRING_FALLBACK, AMBIGUOUS_ANSWER})


@dataclass(frozen=True)
class RewardRecord:
    reward: float
    """1.0 for a correct answer, else 0.0 (plug-ins may return other values)."""
    format_ok: bool
    """The response had the expected shape (tags, a boxed answer, a python block)."""
    answer_ok: bool
    """The extracted answer (or program) was judged correct, independently of the format."""
    status: str
    """One of :data:`STATUSES` (plug-ins may use their own)."""
    details: dict[str, Any] = field(default_factory=dict)
    """JSON-serialisable diagnostics: extracted answer, test-case verdicts, error messages."""

    def to_json(self) -> dict[str, Any]:
        return {
            "reward": self.reward,
            "format_ok": self.format_ok,
            "answer_ok": self.answer_ok,
            "status": self.status,
            "details": self.details,
        }


def infra_error(message: str, **details: Any) -> RewardRecord:
    """A record for a sample whose reward could not be computed."""
    return RewardRecord(0.0, False, False, INFRA_ERROR, {"error": message, **details})


def record_from_plugin_value(value: Any) -> RewardRecord:
    """Turn a plug-in's return value (a record or a finite number) into a record; raises TypeError otherwise."""
    if isinstance(value, RewardRecord):
        return value
    if isinstance(value, bool | int | float) and math.isfinite(float(value)):
        reward = float(value)
        return RewardRecord(reward, True, reward > 0, OK, {})
    raise TypeError(
        f"reward function returned {type(value).__name__} {value!r}; expected RewardRecord or a finite float"
    )
