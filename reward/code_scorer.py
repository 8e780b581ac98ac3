"""Code rewards: the last ```python block of a response, run against the row's test cases.

Reward 1 iff every test case passes. Missing or malformed test cases, and any sandbox or
verifier failure, give ``infra_error`` (reward 0, masked by producers) — never a pass.
"""

from __future__ import annotations

import logging
from typing import Any

from .code_runner import CodeRunner, ProgramJob
from .code_tests import TestCaseError, TestReport, parse_test_cases
from .extract import last_python_block
from .records import FORMAT_ERROR, OK, TIMEOUT, RewardRecord, infra_error

logger = logging.getLogger(__name__)


class CodeScorer:
    def __init__(self, runner: CodeRunner):
        self.runner = runner

    def score_batch(self, responses: list[str], rows: list[dict[str, Any]]) -> list[RewardRecord]:
        if len(responses) != len(rows):
            raise ValueError(f"{len(responses)} responses but {len(rows)} rows")
        records: list[RewardRecord | None] = []
        jobs: list[ProgramJob] = []
        for response, row in zip(responses, rows, strict=True):
            record, job = _prepare(response, row)
            records.append(record)
            if job is not None:
                jobs.append(job)
        try:
            reports = iter(self.runner.run_programs(jobs))
        except Exception as error:  # a runner bug must not take the producer down, nor pass anything
            logger.exception("code runner failed")
            reports = iter([TestReport([], f"code runner failed: {type(error).__name__}: {error}")] * len(jobs))
        return [record if record is not None else _record(next(reports)) for record in records]

    def score(self, response: str, row: dict[str, Any]) -> RewardRecord:
        return self.score_batch([response], [row])[0]

    def close(self) -> None:
        self.runner.close()


def _prepare(response: str, row: dict[str, Any]) -> tuple[RewardRecord | None, ProgramJob | None]:
    if "test_cases" not in row:
        return infra_error("row has no 'test_cases'", row_keys=sorted(row)[:20]), None
    try:
        tests = parse_test_cases(row["test_cases"], row.get("fn_name"))
    except TestCaseError as error:
        return infra_error(f"bad test cases: {error}"), None
    program = last_python_block(response) if isinstance(response, str) else None
    if program is None or not program.strip():
        return RewardRecord(0.0, False, False, FORMAT_ERROR, {"error": "no ```python block in the response"}), None
    return None, ProgramJob(program, tests)


def _record(report: TestReport) -> RewardRecord:
    if report.infra_error:
        return infra_error(report.infra_error, verdicts=report.verdicts)
    passed, total = report.passed, report.total
    details = {
        "passed": passed,
        "total": total,
        "pass_fraction": passed / total,
        "verdicts": report.verdicts,
        "case_seconds": report.case_seconds,
    }
    if report.stderr_tail:
        details["stderr_tail"] = report.stderr_tail
    correct = passed == total
    status = TIMEOUT if not correct and "timeout" in report.verdicts else OK
    return RewardRecord(1.0 if correct else 0.0, True, correct, status, details)
