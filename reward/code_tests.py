"""Test cases of a code problem: validating them, and judging one run's output against one case.

Pure functions shared by the local runner, the verifier server and its client. Expected outputs
stay here, in the parent: they never enter a sandbox.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from .call_harness import RESULT_MARKER
from .sandbox import RunResult

PASSED = "passed"
VERDICTS = (PASSED, "wrong_answer", "runtime_error", "timeout", "output_limit", "skipped", "infra_error")


class TestCaseError(ValueError):
    """The row's test cases are missing or malformed: an infrastructure problem, not a wrong program."""

    __test__ = False  # not a pytest test class


@dataclass(frozen=True)
class TestCases:
    __test__ = False  # not a pytest test class

    inputs: list[Any]
    """stdin text per case, or (call-based) the list of arguments."""
    outputs: list[Any]
    """Expected stdout text per case, or (call-based) the expected return value."""
    fn_name: str | None = None
    """Set for call-based problems: the function (or ``Solution`` method) to call."""

    def to_json(self) -> dict[str, Any]:
        return {"inputs": self.inputs, "outputs": self.outputs, "fn_name": self.fn_name}


def parse_test_cases(raw: Any, fn_name: str | None = None) -> TestCases:
    """Validate ``{"inputs": [...], "outputs": [...]}`` (a dict or its JSON text); raises TestCaseError."""
    if isinstance(raw, str | bytes):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as error:
            raise TestCaseError(f"test_cases is not valid JSON ({error.msg} at column {error.colno})") from None
    if not isinstance(raw, dict):
        raise TestCaseError(f"test_cases must be an object with 'inputs' and 'outputs', got {type(raw).__name__}")
    inputs, outputs = raw.get("inputs"), raw.get("outputs")
    if not isinstance(inputs, list) or not isinstance(outputs, list):
        raise TestCaseError("test_cases needs list-valued 'inputs' and 'outputs'")
    if not inputs:
        raise TestCaseError("test_cases has no test case: refusing to score a program against nothing")
    if len(inputs) != len(outputs):
        raise TestCaseError(f"test_cases has {len(inputs)} inputs but {len(outputs)} outputs")
    fn_name = fn_name or raw.get("fn_name")
    if fn_name is not None and (not isinstance(fn_name, str) or not fn_name.isidentifier()):
        raise TestCaseError(f"fn_name must be a Python identifier, got {fn_name!r}")
    if fn_name is None:
        inputs = [_as_text(value, "input") for value in inputs]
        outputs = [_as_text(value, "output") for value in outputs]
    return TestCases(inputs, outputs, fn_name)


def _as_text(value: Any, what: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(line, str) for line in value):
        return "\n".join(value)
    raise TestCaseError(f"stdin/stdout test {what} must be a string (or a list of lines), got {type(value).__name__}")


def stdin_bytes(cases: TestCases, index: int) -> bytes:
    value = cases.inputs[index]
    if cases.fn_name is not None:
        return json.dumps(value if isinstance(value, list) else [value]).encode()
    return value.encode() if value.endswith("\n") or not value else (value + "\n").encode()


def normalized_lines(text: str) -> list[str]:
    """Lines with runs of whitespace collapsed and blank lines at either end dropped."""
    return [" ".join(line.split()) for line in text.strip().splitlines()]


def _call_result(stdout: bytes) -> tuple[bool, Any]:
    text = stdout.decode("utf-8", errors="replace")
    marker = text.rfind(RESULT_MARKER + "\n")
    if marker < 0:
        return False, None
    try:
        return True, json.loads(text[marker + len(RESULT_MARKER) + 1 :])
    except json.JSONDecodeError:
        return False, None


def _values_equal(actual: Any, expected: Any) -> bool:
    # Datasets in the APPS format wrap a call's expected value in a one-element list.
    return actual == expected or [actual] == expected or (isinstance(expected, str) and actual == _maybe_json(expected))


def _maybe_json(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def judge(result: RunResult, cases: TestCases, index: int) -> str:
    """The verdict of one run of a program on case ``index`` (one of :data:`VERDICTS`)."""
    if result.infra_error:
        return "infra_error"
    if result.timed_out:
        return "timeout"
    if result.output_limited:
        return "output_limit"
    if result.exit_code != 0:
        return "runtime_error"
    expected = cases.outputs[index]
    if cases.fn_name is None:
        actual = result.stdout.decode("utf-8", errors="replace")
        return PASSED if normalized_lines(actual) == normalized_lines(expected) else "wrong_answer"
    found, value = _call_result(result.stdout)
    return PASSED if found and _values_equal(value, expected) else "wrong_answer"


@dataclass(frozen=True)
class TestReport:
    """The outcome of one program on all its test cases."""

    __test__ = False  # not a pytest test class

    verdicts: list[str]
    infra_error: str | None = None
    stderr_tail: str = ""
    """The end of the first failing case's stderr (for debugging rollouts)."""
    case_seconds: list[float] = field(default_factory=list)

    @property
    def passed(self) -> int:
        return sum(v == PASSED for v in self.verdicts)

    @property
    def total(self) -> int:
        return len(self.verdicts)

    def to_json(self) -> dict[str, Any]:
        return {
            "verdicts": self.verdicts,
            "infra_error": self.infra_error,
            "stderr_tail": self.stderr_tail,
            "case_seconds": self.case_seconds,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TestReport:
        verdicts = data["verdicts"]
        if not isinstance(verdicts, list) or not all(v in VERDICTS for v in verdicts):
            raise ValueError(f"malformed verdicts {verdicts!r}")
        return cls(
            list(verdicts), data.get("infra_error"), str(data.get("stderr_tail", "")), data.get("case_seconds", [])
        )
