"""Running programs against their test cases: locally in the sandbox, or through a verifier server.

Both runners take a list of (program, test cases) jobs and return one :class:`TestReport` per job;
an infrastructure failure becomes that report's ``infra_error``, never a passing verdict.
"""

from __future__ import annotations

import http.client
import json
import logging
import random
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from email.message import Message
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

    def wants_more(self, early_stop: bool) -> bool:
        return self.infra_error is None and not (early_stop and self.failed.is_set())


class LocalCodeRunner:
    """Runs every test case in its own sandbox, ``max_parallel`` at a time across all jobs and callers.

    Each case's time limit counts from when it starts, not from when its request arrived; a caller's
    ``deadline`` bounds the whole call, and a case cut short by it makes the report an ``infra_error``
    (the program's verdict is unknown), never a ``timeout``.
    """

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
            self._run_cases(states, deadline)
        finally:
            for state in states:
                state.files.__exit__(None, None, None)
        return [_report(state, deadline) for state in states]

    def _run_cases(self, states: list[_JobState], deadline: float | None) -> None:
        """Run every wanted case with at most ``max_parallel`` of this call's cases queued or running.

        The workers are shared by every caller (every request of the verifier server): submitting all
        cases at once would queue a later caller's cases behind all of ours. With a window per call,
        a newcomer waits behind at most ``max_parallel`` cases of each other caller.
        """
        window: set[Future] = set()
        try:
            for state, index in _cases(states):
                while len(window) >= self.config.max_parallel:
                    done, window = wait(window, return_when=FIRST_COMPLETED)
                    for future in done:
                        future.result()
                if deadline is not None and time.monotonic() >= deadline:
                    break
                if state.wants_more(self.config.early_stop):
                    window.add(self._executor.submit(self._run_case, state, index, deadline))
        finally:
            done, _ = wait(window)  # no case outlives the call (its files are removed next)
        for future in done:
            future.result()

    def _run_case(self, state: _JobState, index: int, deadline: float | None) -> None:
        if not state.wants_more(self.config.early_stop):
            return
        timeout_s, cut_by_deadline = self.config.timeout_s, False
        if deadline is not None:
            remaining_s = deadline - time.monotonic()
            if remaining_s <= 0:
                return
            timeout_s, cut_by_deadline = min(timeout_s, remaining_s), remaining_s < timeout_s
        tests = state.job.tests
        result = self.sandbox.run(state.files, stdin_bytes(tests, index), tests.fn_name, timeout_s)
        stopped = result.timed_out or result.infra_error is not None  # (killed before the program even started)
        if cut_by_deadline and stopped and time.monotonic() >= deadline:  # the caller's deadline, not the case's limit
            state.verdicts[index] = "infra_error"
            state.infra_error = f"request deadline exceeded while test case {index} ran"
            return
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


def _cases(states: list[_JobState]) -> Iterator[tuple[_JobState, int]]:
    for state in states:
        for index in range(len(state.job.tests.inputs)):
            yield state, index


def _report(state: _JobState, deadline: float | None) -> TestReport:
    infra_error = state.infra_error
    if infra_error is None and not state.failed.is_set() and "skipped" in state.verdicts:
        infra_error = "deadline exceeded before every test case ran" if deadline is not None else "test cases skipped"
    return TestReport(state.verdicts, infra_error, state.stderr_tail, state.seconds)


# ------------------------------------------------------------------ the verifier client
@dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    """How the verifier client retries a request the server was too busy for (HTTP 503, a reset connection)."""

    max_attempts: int = 8
    """Attempts in all, the first included; after the last the job is an ``infra_error``."""
    first_backoff_s: float = 0.5
    """Wait after the first busy answer; doubled after each further one (with jitter), up to max_backoff_s."""
    max_backoff_s: float = 10.0
    """Longest wait between two attempts, whatever the server's Retry-After says."""

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"RetryPolicy.max_attempts must be >= 1, got {self.max_attempts}")
        if not 0 <= self.first_backoff_s <= self.max_backoff_s:
            raise ValueError(
                f"need 0 <= RetryPolicy.first_backoff_s <= max_backoff_s, got {self.first_backoff_s}, {self.max_backoff_s}"
            )


def backoff_s(policy: RetryPolicy, attempt: int, retry_after_s: float | None, jitter: float) -> float:
    """Wait after busy attempt ``attempt`` (1-based): ``first * 2**(attempt-1) * (0.5 + jitter)``, at least the
    server's Retry-After, at most ``max_backoff_s``; ``jitter`` in [0, 1) spreads clients that were refused together."""
    exponential = policy.first_backoff_s * 2 ** (attempt - 1) * (0.5 + jitter)
    return min(policy.max_backoff_s, max(exponential, retry_after_s or 0.0))


def retry_after_s(headers: Message | None) -> float | None:
    """The delay-seconds form of a Retry-After header (None if absent or an HTTP date)."""
    value = headers.get("Retry-After") if headers is not None else None
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None


class _Busy(Exception):
    """The verifier could not take the request now; the same request may succeed later."""

    def __init__(self, message: str, retry_after: float | None = None):
        super().__init__(message)
        self.retry_after = retry_after


class RemoteCodeRunner:
    """Sends each job to a verifier server (``python -m colossal_rl.reward.server``).

    A busy server (503, or a connection reset before the answer) is retried with exponential backoff;
    every other failure, and a server still busy after the last attempt, is the job's ``infra_error``.
    """

    def __init__(
        self,
        url: str,
        token: str,
        timeout_s: float = 180.0,
        concurrency: int = 8,
        retry: RetryPolicy | None = None,
    ):
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"code_verifier_url must start with http:// or https://, got {url!r}")
        self.endpoint = url.rstrip("/") + RUN_TESTS_PATH
        self._token = token
        self.timeout_s = timeout_s
        self.retry = retry or RetryPolicy()
        self._executor = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="verifier-client")

    def run_programs(self, jobs: list[ProgramJob], deadline: float | None = None) -> list[TestReport]:
        return list(self._executor.map(self._run_one, jobs))

    def _run_one(self, job: ProgramJob) -> TestReport:
        body = json.dumps({"program": job.program, "test_cases": job.tests.to_json()}).encode()
        failed = ["infra_error"] * len(job.tests.inputs)
        started = time.monotonic()
        for attempt in range(1, self.retry.max_attempts + 1):
            try:
                return self._post(body, failed)
            except _Busy as busy:
                if attempt == self.retry.max_attempts:
                    waited = time.monotonic() - started
                    return TestReport(failed, f"{busy}; gave up after {attempt} attempts over {waited:.1f}s")
                time.sleep(backoff_s(self.retry, attempt, busy.retry_after, random.random()))
        raise AssertionError("unreachable: the last attempt returns")

    def _post(self, body: bytes, failed: list[str]) -> TestReport:
        """One attempt: the server's report, or a report carrying the infra_error; raises _Busy to retry."""
        request = urllib.request.Request(self.endpoint, data=body, method="POST")
        request.add_header("Content-Type", "application/json")
        request.add_header(TOKEN_HEADER, f"Bearer {self._token}")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                report = TestReport.from_json(json.loads(response.read()))
            if report.total != len(failed):
                raise ValueError(f"{report.total} verdicts for {len(failed)} test cases")
            return report
        except urllib.error.HTTPError as error:
            return TestReport(failed, _refusal(error, len(body)))
        except (urllib.error.URLError, OSError, http.client.HTTPException) as error:
            reason = error.reason if isinstance(error, urllib.error.URLError) else error
            if isinstance(reason, ConnectionResetError):  # includes RemoteDisconnected: an overloaded server
                raise _Busy(f"verifier connection reset at {self.endpoint}: {reason}") from None
            if isinstance(reason, BrokenPipeError):
                return TestReport(failed, f"verifier closed the connection while the {len(body)}-byte request was sent")
            return TestReport(failed, f"verifier unreachable at {self.endpoint}: {error}")
        except (ValueError, KeyError, TypeError) as error:
            return TestReport(failed, f"verifier sent a malformed reply: {error}")

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def _refusal(error: urllib.error.HTTPError, body_bytes: int) -> str:
    """The infra_error message of an HTTP error answer; raises _Busy for 503 (retry later)."""
    try:
        detail = error.read()[:300].decode("utf-8", errors="replace")
    except (OSError, http.client.HTTPException):
        detail = ""
    if error.code == 503:
        raise _Busy(f"verifier busy (HTTP 503: {detail})", retry_after_s(error.headers))
    if error.code == 413:
        return (
            f"verifier refused the {body_bytes}-byte request as too large (HTTP 413: {detail}); "
            "shorten the program or test cases, or raise the server's --max-request-bytes"
        )
    return f"verifier answered HTTP {error.code}: {detail}"
