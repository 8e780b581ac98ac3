"""Generative-judge rewards: a judge model reads a rendered prompt and its verdict is parsed into a score.

Three parts, each replaceable: a :class:`JudgeTemplate` (the judge's prompt, with the sample's prompt,
response and reference answer filled in), a verdict rule from :data:`VERDICT_RULES` (verdict text ->
score in [0, 1]) and a :class:`JudgeBackend` (prompts -> verdicts: ``judge_local.LocalModelJudge``, or
``judge_client.OpenAICompatibleJudge`` for a judge served elsewhere).

A verdict that does not parse, and a judge that fails, make that sample an ``infra_error`` (counted, and
logged once per batch), never a silent 0. This module runs no model and opens no connection itself.
"""

from __future__ import annotations

import logging
import math
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from .extract import find_boxed
from .records import OK, RewardRecord, infra_error
from .user_functions import RewardConfigError

logger = logging.getLogger(__name__)

TEMPLATE_FIELDS = ("prompt", "response", "reference")
"""The fields a judge template may use; ``{response}`` is required."""
_PLACEHOLDER_RE = re.compile(r"\{\{([A-Za-z_]\w*)\}\}|\{([A-Za-z_]\w*)\}")
_NUMBER_RE = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)")
_SCORE_LINE_RE = re.compile(r"score\s*[:=]\s*\**\s*([-+]?(?:\d+(?:\.\d*)?|\.\d+))", re.IGNORECASE)
VERDICT_EXCERPT_CHARS = 80
"""How much of an unparseable verdict its infra_error quotes."""


class VerdictError(ValueError):
    """A verdict the rule could not turn into a score; the message says why in a few words."""


# ------------------------------------------------------------------ the template
@dataclass(frozen=True)
class JudgeTemplate:
    """The judge's prompt: ``{prompt}``, ``{response}`` and ``{reference}`` are replaced by the sample's.

    Only those three ``{name}`` placeholders are fields; ``{{name}}`` is a literal ``{name}``, and every
    other brace (``\\boxed{}``, ``{"score": 1}``) is kept as written. Values are inserted in one pass over
    the template, so braces in a prompt or response are never read as fields.
    """

    text: str
    source: str = "<template>"
    """Where the text came from (a file path), named in errors."""

    def __post_init__(self) -> None:
        used = {match.group(2) for match in _PLACEHOLDER_RE.finditer(self.text) if match.group(2)}
        unknown = sorted(used - set(TEMPLATE_FIELDS))
        if unknown:
            raise RewardConfigError(
                f"judge template {self.source}: unknown field(s) {unknown}; valid fields: {list(TEMPLATE_FIELDS)} "
                "(write {{name}} for a literal {name})"
            )
        if "response" not in used:
            raise RewardConfigError(f"judge template {self.source}: has no {{response}} field")

    @classmethod
    def from_file(cls, path: str | Path) -> JudgeTemplate:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as error:
            raise RewardConfigError(f"judge template {path}: {error}") from None
        return cls(text, str(path))

    @property
    def fields(self) -> frozenset[str]:
        return frozenset(match.group(2) for match in _PLACEHOLDER_RE.finditer(self.text) if match.group(2))

    def render(self, *, prompt: str, response: str, reference: str) -> str:
        values = {"prompt": prompt, "response": response, "reference": reference}

        def substitute(match: re.Match[str]) -> str:
            escaped, field = match.groups()
            return "{" + escaped + "}" if escaped else values[field]

        return _PLACEHOLDER_RE.sub(substitute, self.text)


def row_prompt(row: dict[str, Any]) -> str:
    """The sample's prompt for ``{prompt}``: ``messages`` as a string, or the content of its last user message."""
    messages = row.get("messages")
    if isinstance(messages, str):
        return messages
    message_list = [messages] if isinstance(messages, dict) else messages
    if isinstance(message_list, list):
        for message in reversed(message_list):
            if isinstance(message, dict) and message.get("role") == "user" and isinstance(message.get("content"), str):
                return message["content"]
    raise VerdictError("row has no user message in 'messages'")


# ------------------------------------------------------------------ verdict rules
class VerdictRule(Protocol):
    def score(self, verdict: str) -> float:
        """The verdict's score in [0, 1]; raises :class:`VerdictError` when it does not parse."""
        ...


VERDICT_RULES: dict[str, Callable[[str], VerdictRule]] = {}
"""Rule name -> builder taking the text after ``name:`` in a rule spec (``""`` when there is none)."""


def register_verdict_rule(name: str) -> Callable[[Callable[[str], VerdictRule]], Callable[[str], VerdictRule]]:
    def register(builder: Callable[[str], VerdictRule]) -> Callable[[str], VerdictRule]:
        if name in VERDICT_RULES:
            raise ValueError(f"verdict rule {name!r} is already registered")
        VERDICT_RULES[name] = builder
        return builder

    return register


def parse_verdict_rule(spec: str) -> VerdictRule:
    """``number``, ``number:LO,HI``, ``choice:A=1,B=0``: the rule named before the first ``:``, built from the rest."""
    name, _, argument = spec.partition(":")
    builder = VERDICT_RULES.get(name.strip())
    if builder is None:
        raise RewardConfigError(f"unknown judge rule {name!r} in {spec!r}; expected one of {sorted(VERDICT_RULES)}")
    try:
        return builder(argument.strip())
    except ValueError as error:
        raise RewardConfigError(f"judge rule {spec!r}: {error}") from None


@dataclass(frozen=True)
class NumberRule:
    """A number in [low, high], mapped linearly onto [0, 1]; a number outside the range does not parse.

    Which number: the last ``\\boxed{...}`` if the verdict has one (its whole content must be a number), else
    the last ``Score: N`` (or ``score = N``, any case), else the last number anywhere in the verdict.
    """

    low: float = 0.0
    high: float = 1.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.low) and math.isfinite(self.high) and self.low < self.high):
            raise ValueError(f"need finite LO < HI, got {self.low}, {self.high}")

    def score(self, verdict: str) -> float:
        value = _verdict_number(verdict)
        if not self.low <= value <= self.high:
            raise VerdictError(f"score {value:g} outside [{self.low:g}, {self.high:g}]")
        return (value - self.low) / (self.high - self.low)


def _verdict_number(verdict: str) -> float:
    boxed = find_boxed(verdict)
    if boxed:
        text = boxed[-1].strip()
        if not _NUMBER_RE.fullmatch(text):
            raise VerdictError(f"boxed verdict {text[:20]!r} is not a number")
        return float(text)
    score_lines = _SCORE_LINE_RE.findall(verdict)
    if score_lines:
        return float(score_lines[-1])
    numbers = _NUMBER_RE.findall(verdict)
    if not numbers:
        raise VerdictError("no number in the verdict")
    return float(numbers[-1])


@register_verdict_rule("number")
def _number_rule(argument: str) -> VerdictRule:
    if not argument:
        return NumberRule()
    parts = argument.split(",")
    if len(parts) != 2:
        raise ValueError(f"expected number:LO,HI (e.g. number:0,10), got number:{argument}")
    return NumberRule(float(parts[0]), float(parts[1]))


@dataclass(frozen=True)
class ChoiceRule:
    """One of a few tokens, each with its score in [0, 1] (``A=1,B=0``, ``yes=1,no=0``), matched in any case.

    Which token: the last ``\\boxed{...}`` if the verdict has one (its whole content must be a choice), else the
    last choice appearing as a whole word. Single letters also match as words in prose ("a"), so a template
    should ask for the choice in ``\\boxed{}`` or as the verdict's last word.
    """

    scores: tuple[tuple[str, float], ...]

    def __post_init__(self) -> None:
        if not self.scores:
            raise ValueError("a choice rule needs at least one choice")
        for token, value in self.scores:
            if not token or not 0.0 <= value <= 1.0:
                raise ValueError(f"choice {token!r}={value}: need a non-empty token and a score in [0, 1]")
        if len({token.lower() for token, _ in self.scores}) != len(self.scores):
            raise ValueError(f"duplicate choices (case-insensitive) in {[token for token, _ in self.scores]}")

    def score(self, verdict: str) -> float:
        by_token = {token.lower(): value for token, value in self.scores}
        boxed = find_boxed(verdict)
        if boxed:
            text = boxed[-1].strip().lower()
            if text not in by_token:
                raise VerdictError(f"boxed verdict {text[:20]!r} is none of {sorted(by_token)}")
            return by_token[text]
        tokens = sorted(by_token, key=len, reverse=True)  # the longest first: "[[A]]" before "A"
        pattern = r"(?<!\w)(?:" + "|".join(re.escape(token) for token in tokens) + r")(?!\w)"
        found = re.findall(pattern, verdict, flags=re.IGNORECASE)
        if not found:
            raise VerdictError(f"none of {sorted(by_token)} in the verdict")
        return by_token[found[-1].lower()]


@register_verdict_rule("choice")
def _choice_rule(argument: str) -> VerdictRule:
    scores = []
    for item in argument.split(","):
        token, separator, value = item.partition("=")
        if not separator:
            raise ValueError(f"expected choice:TOKEN=SCORE,... (e.g. choice:A=1,B=0), got choice:{argument}")
        scores.append((token.strip(), float(value)))
    return ChoiceRule(tuple(scores))


# ------------------------------------------------------------------ the scorer
class JudgeBackend(Protocol):
    def complete(self, prompts: list[str]) -> list[str | Exception]:
        """One verdict per prompt, or the exception that sample failed with for good (never raised)."""
        ...

    def close(self) -> None: ...


class JudgeScorer:
    """Scores each response by asking the judge: reward = the verdict's score in [0, 1].

    ``answer_ok`` is ``score >= 0.5``; ``format_ok`` is True (a judge sets no format requirement). A row that
    cannot be rendered, a judge failure and an unparseable verdict are ``infra_error``s; ``failed`` and
    ``unparsed`` count the last two over the scorer's life, and each batch with any logs one warning.
    """

    def __init__(self, template: JudgeTemplate, rule: VerdictRule, backend: JudgeBackend):
        self.template = template
        self.rule = rule
        self.backend = backend
        self.failed = 0
        """Samples whose judge call failed (endpoint down, timeout, error answer)."""
        self.unparsed = 0
        """Samples whose verdict the rule could not parse."""
        self._lock = threading.Lock()

    def score_batch(self, responses: list[str], rows: list[dict[str, Any]]) -> list[RewardRecord]:
        if len(responses) != len(rows):
            raise ValueError(f"{len(responses)} responses but {len(rows)} rows")
        records: list[RewardRecord | None] = []
        prompts: list[str] = []
        for response, row in zip(responses, rows, strict=True):
            try:
                prompts.append(self._render(response, row))
                records.append(None)
            except VerdictError as error:
                records.append(infra_error(f"judge prompt not rendered: {error}"))
        verdicts = iter(self._complete(prompts))
        failed, unparsed = [], []
        for index, record in enumerate(records):
            if record is None:
                record = self._record(next(verdicts), failed, unparsed)
                records[index] = record
        self._report(len(responses), failed, unparsed)
        return records  # type: ignore[return-value]  # every None was replaced

    def score(self, response: str, row: dict[str, Any]) -> RewardRecord:
        return self.score_batch([response], [row])[0]

    def close(self) -> None:
        self.backend.close()

    def _render(self, response: str, row: dict[str, Any]) -> str:
        prompt = row_prompt(row) if "prompt" in self.template.fields else ""
        reference = ""
        if "reference" in self.template.fields:
            gold = row.get("gt_answer")
            if gold is None or gold == "":
                raise VerdictError("row has no 'gt_answer' for the template's {reference}")
            reference = str(gold)
        return self.template.render(prompt=prompt, response=str(response), reference=reference)

    def _complete(self, prompts: list[str]) -> list[str | Exception]:
        if not prompts:
            return []
        try:
            verdicts = self.backend.complete(prompts)
            if len(verdicts) != len(prompts):
                raise RuntimeError(f"judge returned {len(verdicts)} verdicts for {len(prompts)} prompts")
            return verdicts
        except Exception as error:  # a backend bug must not take the producer down, nor score anything
            logger.exception("judge backend failed")
            return [error] * len(prompts)

    def _record(self, verdict: str | Exception, failed: list[str], unparsed: list[str]) -> RewardRecord:
        if isinstance(verdict, BaseException):
            reason = one_line(str(verdict) or type(verdict).__name__)
            failed.append(reason)
            return infra_error(f"judge failed: {reason}")
        try:
            value = self.rule.score(verdict)
        except VerdictError as error:
            excerpt = one_line(verdict[:VERDICT_EXCERPT_CHARS])
            unparsed.append(f"{error}: {excerpt!r}")
            return infra_error(f"judge verdict did not parse ({error}): {excerpt!r}", verdict=verdict[:500])
        return RewardRecord(value, True, value >= 0.5, OK, {"judge_score": value, "verdict": verdict[:500]})

    def _report(self, total: int, failed: list[str], unparsed: list[str]) -> None:
        if not failed and not unparsed:
            return
        with self._lock:
            self.failed += len(failed)
            self.unparsed += len(unparsed)
        first = failed[0] if failed else unparsed[0]
        logger.warning(
            "judge: %d of %d samples are infra_errors (%d judge failures, %d unparseable verdicts); first: %s",
            len(failed) + len(unparsed),
            total,
            len(failed),
            len(unparsed),
            first,
        )


def one_line(text: str, limit: int = 300) -> str:
    """``text`` on one line (whitespace runs collapsed), at most ``limit`` characters."""
    collapsed = " ".join(text.split())
    return collapsed if len(collapsed) <= limit else collapsed[: limit - 3] + "..."
