"""Running programs against their test cases: locally in the sandbox, or through a verifier server.

Both runners take a list of (program, test cases) jobs and return one :class:`TestReport` per job;
an infrastructure failure becomes that report's ``infra_error``, never a passing verdict.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

from .code_tests import PASSED, TestCases, TestReport, judge, stdin_bytes
from .sandbox import ProgramFiles, Sandbox, SandboxConfig

logger = logging.getLogger(__name__)

TOKEN_HEADER = "Authorization"
RUN_TESTS_PATH = "/v1/run_tests"


@dataclass(frozen=True)
class ProgramJob:
    program: str
    tests: TestCases


class CodeRunner(Protocol):
    def run_programs(self, jobs: list[ProgramJob], deadline: float | None = None) -> list[TestReport]: ...

    def close(self) -> None: ...


class _JobState:
    """Verdicts of one program's cases as they come in, from several threads."""

    def __init__(self, job: ProgramJob, files: ProgramFiles):
        self.job = job
        self.files = files
        self.verdicts = ["skipped"] * len(job.tests.inputs)
        self.seconds = [0.0] * len(job.tests.inputs)
        self.failed = threading.Event()
        self.infra_error: str | None = None
        self.stderr_tail = ""


class LocalCodeRunner:
    """Runs every test case in its own sandbox, ``max_parallel`` at a time across all jobs."""

    def __init__(self, config: SandboxConfig | None = None):
        self.config = config or SandboxConfig()
        self.sandbox = Sandbox(self.config)
        self._executor = ThreadPoolExecutor(max_workers=self.config.max_parallel, thread_name_prefix="sandbox")

    def run_programs(self, jobs: list[ProgramJob], deadline: float | None = None) -> list[TestReport]:
        if self.sandbox.unavailable:
            return [TestReport(["infra_error"] * len(j.tests.inputs), self.sandbox.unavailable) for j in jobs]
        states: list[_JobState] = []
        try:
            for job in jobs:
                states.append(_JobState(job, ProgramFiles(job.program)))
            futures = [
                self._executor.submit(self._run_case, state, index, deadline)
                for state in states
                for index in range(len(state.job.tests.inputs))
            ]
            for future in futures:
                future.result()
        finally:
            for state in states:
                state.files.__exit__(None, None, None)
        return [_report(state, deadline) for state in states]

    def _run_case(self, state: _JobState, index: int, deadline: float | None) -> None:
        if state.infra_error or (self.config.early_stop and state.failed.is_set()):
            return
        timeout_s = self.config.timeout_s
        if deadline is not None:
            timeout_s = min(timeout_s, deadline - time.monotonic())
            if timeout_s <= 0:
                return
        tests = state.job.tests
        result = self.sandbox.run(state.files, stdin_bytes(tests, index), tests.fn_name, timeout_s)
        verdict = judge(result, tests, index)
        state.verdicts[index] = verdict
        state.seconds[index] = round(result.elapsed_s, 4)
        if result.infra_error:
            state.infra_error = result.infra_error
        if verdict != PASSED and not state.failed.is_set():
            state.failed.set()
            state.stderr_tail = result.stderr[-400:].decode("utf-8", errors="replace")

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)


def _report(state: _JobState, deadline: float | None) -> TestReport:
    infra_error = state.infra_error
    if infra_error is None and not state.failed.is_set() and "skipped" in state.verdicts:
        infra_error = "deadline exceeded before every test case ran" if deadline is not None else "test cases skipped"
    return TestReport(state.verdicts, infra_error, state.stderr_tail, state.seconds)


class RemoteCodeRunner:
    """Sends each job to a verifier server (``python -m colossal_rl.reward.server``)."""

    def __init__(self, url: str, token: str, timeout_s: float = 180.0, concurrency: int = 8):
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"code_verifier_url must start with http:// or https://, got {url!r}")
        self.endpoint = url.rstrip("/") + RUN_TESTS_PATH
        self._token = token
        self.timeout_s = timeout_s
        self._executor = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="verifier-client")

    def run_programs(self, jobs: list[ProgramJob], deadline: float | None = None) -> list[TestReport]:
        return list(self._executor.map(self._run_one, jobs))

    def _run_one(self, job: ProgramJob) -> TestReport:
        body = json.dumps({"program": job.program, "test_cases": job.tests.to_json()}).encode()
        request = urllib.request.Request(self.endpoint, data=body, method="POST")
        request.add_header("Content-Type", "application/json")
        request.add_header(TOKEN_HEADER, f"Bearer {self._token}")
        failed = ["infra_error"] * len(job.tests.inputs)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                report = TestReport.from_json(json.loads(response.read()))
            if report.total != len(failed):
                raise ValueError(f"{report.total} verdicts for {len(failed)} test cases")
            return report
        except urllib.error.HTTPError as error:
            detail = error.read()[:300].decode("utf-8", errors="replace")
            return TestReport(failed, f"verifier answered HTTP {error.code}: {detail}")
        except (urllib.error.URLError, OSError, TimeoutError) as error:
            return TestReport(failed, f"verifier unreachable at {self.endpoint}: {error}")
        except (ValueError, KeyError, TypeError) as error:
            return TestReport(failed, f"verifier sent a malformed reply: {error}")

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
