"""Math rewards (``boxed`` and ``think_answer_tags``): extract the final answer, compare it with the gold.

Equal normalised strings are correct at once; everything else goes to math-verify in the
worker pool (:mod:`colossal_rl.reward.math_pool`), with a plain string comparison only when
math-verify cannot parse one side. Several different final answers, or a hedged one ("3 or 4"),
score 0. The verdicts are pure functions (:func:`prepare_answer` before math-verify, :func:`finish_answer`
on its outcome), testable without the worker pool.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from .extract import (
    HEDGE_RE,
    ExtractedAnswer,
    extract_boxed_answer,
    extract_tagged_answer,
    find_boxed,
    normalize_answer,
    normalize_for_fallback,
)
from .math_pool import MathCheck, MathVerifierPool
from .records import (
    AMBIGUOUS_ANSWER,
    FORMAT_ERROR,
    OK,
    STRING_FALLBACK,
    TIMEOUT,
    RewardRecord,
    infra_error,
)

logger = logging.getLogger(__name__)

MathRewardType = Literal["boxed", "think_answer_tags"]

EXTRACTORS: dict[str, Callable[[str], ExtractedAnswer]] = {
    "boxed": extract_boxed_answer,
    "think_answer_tags": extract_tagged_answer,
}


@dataclass(frozen=True, kw_only=True)
class MathRewardConfig:
    timeout_s: float = 5.0
    """Per-answer limit on math-verify (parse + verify); past it the worker is killed and the answer scores 0."""
    num_workers: int = 2
    """Worker processes running math-verify."""
    require_format: bool = True
    """think_answer_tags: reward 1 needs the ``<think>..</think><answer>..</answer>`` shape, not just the answer."""
    startup_timeout_s: float = 120.0
    """How long a fresh worker may take to import math-verify."""

    def __post_init__(self) -> None:
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        if self.num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {self.num_workers}")


@dataclass(frozen=True)
class PreparedAnswer:
    """A sample after extraction: either already scored (``record``) or waiting for math-verify."""

    record: RewardRecord | None
    gold: str = ""
    answer: str = ""
    format_ok: bool = False


class MathScorer:
    def __init__(self, reward_type: MathRewardType, config: MathRewardConfig | None = None):
        if reward_type not in EXTRACTORS:
            raise ValueError(f"unknown math reward type {reward_type!r}; expected one of {sorted(EXTRACTORS)}")
        self.reward_type = reward_type
        self.config = config or MathRewardConfig()
        self._extract = EXTRACTORS[reward_type]
        self._needs_format = reward_type == "think_answer_tags" and self.config.require_format
        self._pool = MathVerifierPool(self.config.num_workers, self.config.timeout_s, self.config.startup_timeout_s)

    def score_batch(self, responses: list[str], rows: list[dict[str, Any]]) -> list[RewardRecord]:
        if len(responses) != len(rows):
            raise ValueError(f"{len(responses)} responses but {len(rows)} rows")
        prepared = [
            prepare_answer(response, row, self._extract, self._needs_format)
            for response, row in zip(responses, rows, strict=True)
        ]
        pending = [p for p in prepared if p.record is None]
        checks = iter(self._pool.check_many([(p.gold, p.answer) for p in pending]))
        return [
            p.record if p.record is not None else finish_answer(p, next(checks), self._needs_format) for p in prepared
        ]

    def score(self, response: str, row: dict[str, Any]) -> RewardRecord:
        return self.score_batch([response], [row])[0]

    def close(self) -> None:
        self._pool.close()


# ------------------------------------------------------------------ verdicts: pure functions, no workers
def prepare_answer(
    response: str, row: dict[str, Any], extract: Callable[[str], ExtractedAnswer], needs_format: bool
) -> PreparedAnswer:
    """Extract the answer and decide what needs no math-verify: no gold, no answer, several answers, a hedge,
    or a normalised string equal to the gold's (correct). Everything else is left for math-verify."""
    gold = _gold_answer(row)
    if gold is None:
        return PreparedAnswer(infra_error("row has no usable 'gt_answer'", row_keys=sorted(row)[:20]))
    if not isinstance(response, str):
        return PreparedAnswer(infra_error(f"response is {type(response).__name__}, not str"))
    extracted = extract(response)
    format_ok = extracted.format_ok
    details = {"answer": (extracted.answer or "")[:500], "gold": gold[:500]}
    if extracted.answer is None:
        return PreparedAnswer(RewardRecord(0.0, format_ok, False, FORMAT_ERROR, details))
    if len(extracted.candidates) > 1:
        details["candidates"] = [c[:200] for c in extracted.candidates[:10]]
        return PreparedAnswer(RewardRecord(0.0, format_ok, False, AMBIGUOUS_ANSWER, details))
    if HEDGE_RE.search(extracted.answer) and not HEDGE_RE.search(gold):
        details["reason"] = "hedged answer"
        return PreparedAnswer(RewardRecord(0.0, format_ok, False, AMBIGUOUS_ANSWER, details))
    if normalize_answer(extracted.answer) == normalize_answer(gold):
        return PreparedAnswer(answer_record(True, format_ok, OK, details, needs_format))
    return PreparedAnswer(None, gold, extracted.answer, format_ok)


def finish_answer(prepared: PreparedAnswer, check: MathCheck, needs_format: bool) -> RewardRecord:
    """The record of a sample math-verify looked at; ``unparsed`` falls back to comparing normalised strings."""
    details = {"answer": prepared.answer[:500], "gold": prepared.gold[:500]}
    if check.outcome in ("correct", "wrong"):
        return answer_record(check.outcome == "correct", prepared.format_ok, OK, details, needs_format)
    if check.outcome == "unparsed":
        equal = normalize_for_fallback(prepared.answer) == normalize_for_fallback(prepared.gold)
        return answer_record(equal, prepared.format_ok, STRING_FALLBACK, details, needs_format)
    if check.outcome == "timeout":
        return RewardRecord(0.0, prepared.format_ok, False, TIMEOUT, {**details, "error": check.detail})
    return infra_error(f"math verifier failed: {check.detail}", **details)


def answer_record(correct: bool, format_ok: bool, status: str, details: dict, needs_format: bool) -> RewardRecord:
    """Reward 1 iff the answer is correct and, when ``needs_format``, the response has the required shape."""
    reward = 1.0 if correct and (format_ok or not needs_format) else 0.0
    if correct and needs_format and not format_ok:
        status = FORMAT_ERROR
    return RewardRecord(reward, format_ok, correct, status, details)


def _gold_answer(row: dict[str, Any]) -> str | None:
    """The row's gold answer as a string; a boxed gold (a full solution) is reduced to its last box."""
    gold = row.get("gt_answer")
    if gold is None or isinstance(gold, dict | list):
        return None
    text = str(gold).strip()
    if not text:
        return None
    boxed = find_boxed(text)
    return boxed[-1] if boxed else text
