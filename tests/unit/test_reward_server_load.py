"""The verifier server under load and abuse: it refuses with an answer the client reads (400, 413, 503), its
client retries what may succeed later and turns the rest into ``infra_error``, and queueing never turns into a
``timeout`` verdict.

The fast tests serve an in-process :class:`VerifierServer` over a fake runner; the slow ones run the real server
(and sandbox) in a subprocess. Latencies under load are measured in ``benchmarks/verifier_server_load.py``.
"""

import http.client
import json
import socket
import struct
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from colossal_rl.reward.code_runner import (
    LocalCodeRunner,
    ProgramJob,
    RemoteCodeRunner,
    RetryPolicy,
    backoff_s,
    retry_after_s,
)
from colossal_rl.reward.code_scorer import CodeScorer
from colossal_rl.reward.code_tests import TestCases, TestReport
from colossal_rl.reward.sandbox import SandboxConfig
from colossal_rl.reward.server import ServerLimits, VerifierServer, nesting_exceeds

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # benchmark scripts, not a package
from verifier_server_load import TOKEN, post_once, run_load, summarize, verifier_server  # noqa: E402

TESTS = {"inputs": ["2 3\n", "10 -4\n"], "outputs": ["5\n", "6\n"]}
RIGHT = "a, b = map(int, input().split())\nprint(a + b)\n"
FAST_RETRY = RetryPolicy(max_attempts=3, first_backoff_s=0.01, max_backoff_s=0.05)


class FakeRunner:
    """Passes every case; while ``release`` is clear, holds each request (to fill the server's queue)."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.release.set()
        self.entered = threading.Event()

    def run_programs(self, jobs: list[ProgramJob], deadline: float | None = None) -> list[TestReport]:
        self.entered.set()
        assert self.release.wait(30)
        return [TestReport(["passed"] * len(job.tests.inputs)) for job in jobs]

    def close(self) -> None:
        pass


@contextmanager
def serving(runner: FakeRunner, **limits):
    server = VerifierServer(("127.0.0.1", 0), runner, TOKEN, ServerLimits(**limits))
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def raw_post(url: str, body: bytes) -> tuple[int, http.client.HTTPMessage, dict]:
    """One POST with the whole body sent before the answer is read (as urllib does); no retries."""
    parts = urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    try:
        connection.request("POST", "/v1/run_tests", body, {"Authorization": f"Bearer {TOKEN}"})
        response = connection.getresponse()
        return response.status, response.headers, json.loads(response.read())
    finally:
        connection.close()


def body_of(payload: dict) -> bytes:
    return json.dumps(payload).encode()


def score_remotely(url: str, program: str, retry: RetryPolicy):
    scorer = CodeScorer(RemoteCodeRunner(url, TOKEN, timeout_s=30, retry=retry))
    try:
        return scorer.score(f"```python\n{program}```", {"test_cases": TESTS})
    finally:
        scorer.close()


def nested(depth: int):
    value = 0
    for _ in range(depth):
        value = [value]
    return value


def test_limits_and_backlog_defaults():
    limits = ServerLimits()
    assert limits.max_json_depth == 400
    assert limits.listen_backlog >= 2 * limits.max_concurrent_requests > 5  # socketserver's default is 5
    assert ServerLimits(backlog=64).listen_backlog == 64
    with pytest.raises(ValueError, match="max_concurrent_requests"):
        ServerLimits(max_concurrent_requests=0)
    with serving(FakeRunner(), max_concurrent_requests=300) as url:
        assert raw_post(url, body_of({"program": RIGHT, "test_cases": TESTS}))[0] == 200


def test_nesting_depth():
    assert not nesting_exceeds(nested(400), 401) and not nesting_exceeds("text", 0)
    assert nesting_exceeds(nested(402), 401) and nesting_exceeds({"a": [{"b": []}]}, 3)
    assert not nesting_exceeds({"a": [{"b": []}]}, 4)


def test_deep_json_is_a_400_not_a_500():
    with serving(FakeRunner()) as url:
        hostile = b'{"program": "print(1)", "test_cases": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
        status, _, payload = raw_post(url, hostile)
        assert status == 400 and "deeper than 400 levels" in payload["error"]
        # body object (1) > test_cases (2) > inputs (3) > the call's argument list nested 397 or 398 deep
        for argument_depth, expected in ((397, 200), (398, 400)):
            tests = {"inputs": [nested(argument_depth)], "outputs": [1], "fn_name": "f"}
            status, _, payload = raw_post(url, body_of({"program": "def f(x): return 1", "test_cases": tests}))
            assert status == expected, payload


def test_oversized_body_is_a_413_the_client_reads():
    big_program = "#" + "x" * (20 << 20) + "\n" + RIGHT  # 20 MB: more than the socket buffers hold
    with serving(FakeRunner(), max_request_bytes=100_000) as url:
        status, _, payload = raw_post(url, body_of({"program": big_program, "test_cases": TESTS}))
        assert status == 413 and "over 100000 bytes" in payload["error"]
        record = score_remotely(url, big_program, FAST_RETRY)
    assert record.status == "infra_error" and record.reward == 0.0
    assert "HTTP 413" in record.details["error"] and "too large" in record.details["error"]


def test_full_queue_is_a_503_and_the_client_backs_off_then_gives_up():
    runner = FakeRunner()
    runner.release.clear()
    body = body_of({"program": RIGHT, "test_cases": TESTS})
    with serving(runner, max_concurrent_requests=1) as url:
        holder = threading.Thread(target=raw_post, args=(url, body))
        holder.start()
        try:
            assert runner.entered.wait(10)
            status, headers, payload = raw_post(url, body)
            assert status == 503 and headers["Retry-After"] == "1" and "busy" in payload["error"]
            record = score_remotely(url, RIGHT, FAST_RETRY)
            assert record.status == "infra_error" and record.reward == 0.0
            assert "HTTP 503" in record.details["error"] and "after 3 attempts" in record.details["error"]
            # a client that keeps retrying gets through once the queue has room
            threading.Timer(0.3, runner.release.set).start()
            record = score_remotely(url, RIGHT, RetryPolicy(max_attempts=50, first_backoff_s=0.05, max_backoff_s=0.1))
            assert record.status == "ok" and record.reward == 1.0, record
        finally:
            runner.release.set()
            holder.join()


def test_reset_connections_are_retried_then_infra_error():
    """An overloaded server resetting connections: each attempt is a fresh connection, the last gives up."""
    listener = socket.create_server(("127.0.0.1", 0))
    accepted = []

    def reset_everything() -> None:
        while True:
            try:
                connection, _ = listener.accept()
            except OSError:
                return
            accepted.append(connection.recv(1 << 16))  # the request is in: the reset comes while awaiting the answer
            connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            connection.close()

    threading.Thread(target=reset_everything, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        job = ProgramJob(RIGHT, TestCases(TESTS["inputs"], TESTS["outputs"]))
        client = RemoteCodeRunner(url, TOKEN, retry=FAST_RETRY)
        report = client.run_programs([job])[0]
        client.close()
    finally:
        listener.close()
    assert "connection reset" in report.infra_error and "after 3 attempts" in report.infra_error
    assert len(accepted) == 3 and report.verdicts == ["infra_error"] * 2


def test_backoff():
    policy = RetryPolicy(first_backoff_s=0.5, max_backoff_s=10.0)
    assert backoff_s(policy, 1, None, 0.5) == 0.5 and backoff_s(policy, 3, None, 0.5) == 2.0
    assert backoff_s(policy, 3, None, 0.0) == 1.0 and backoff_s(policy, 10, None, 0.5) == 10.0
    assert backoff_s(policy, 1, 3.0, 0.5) == 3.0 and backoff_s(policy, 1, 60.0, 0.5) == 10.0
    assert retry_after_s({"Retry-After": "2"}) == 2.0 and retry_after_s({}) is None
    assert retry_after_s({"Retry-After": "Wed, 21 Oct 2015 07:28:00 GMT"}) is None
    with pytest.raises(ValueError, match="max_attempts"):
        RetryPolicy(max_attempts=0)


def test_request_deadline_is_an_infra_error_not_a_timeout():
    """A case's own limit counts from its start; the caller's deadline cutting it short is not the program's fault."""
    runner = LocalCodeRunner(SandboxConfig(timeout_s=5.0, max_parallel=1, uid_base=62200, uid_count=2))
    if runner.sandbox.unavailable:
        pytest.skip(runner.sandbox.unavailable)
    slow = ProgramJob("import time\ntime.sleep(3)\n" + RIGHT, TestCases(["2 3\n"], ["5\n"]))
    try:
        cut = runner.run_programs([slow], deadline=time.monotonic() + 0.5)[0]
        late = runner.run_programs([slow], deadline=time.monotonic() - 1.0)[0]
    finally:
        runner.close()
    assert cut.verdicts == ["infra_error"] and "deadline exceeded" in cut.infra_error
    assert late.verdicts == ["skipped"] and "deadline exceeded" in late.infra_error


@pytest.mark.slow
def test_short_request_behind_a_big_one_scores_correct():
    """Sent just after a 2000-case request, a correct 0.8 s program is neither queued behind all of it nor
    charged for it; the big request, past its whole-request deadline, reports infra_error, not timeout."""
    big = {"inputs": ["2 3\n"] * 2000, "outputs": ["5\n"] * 2000}
    short_program = "import time\ntime.sleep(0.8)\n" + RIGHT
    with verifier_server("--timeout-s", "3", "--request-timeout-s", "8") as url:
        big_outcome = []
        sender = threading.Thread(target=lambda: big_outcome.append(post_once(url, "big", RIGHT, big, True, 120)))
        sender.start()
        time.sleep(0.3)  # the big request is in and its cases are queued
        short = post_once(url, "short", short_program, TESTS, True, 120)
        sender.join()
    assert short.status == 200 and short.scored_right, short
    (big_result,) = big_outcome
    assert big_result.status == 200 and "timeout" not in big_result.report["verdicts"]
    assert big_result.scored_right or "deadline exceeded" in big_result.report["infra_error"]


@pytest.mark.slow
def test_200_clients_no_resets_every_program_scored_right():
    """200 clients released together, each sending two requests one after the other (a second request behind a
    full queue): no connection reset, every answer 200, every program scored right. Throughput and latency under
    more requests are measured by ``benchmarks/verifier_server_load.py``, not here."""
    with verifier_server("--timeout-s", "5") as url:
        summary = summarize(run_load(url, clients=200, requests=2), wall_s=0.0)
    assert summary.resets == 0 and summary.statuses == {"200": 400}, summary
    assert summary.right_scored_right == summary.right_total == 300, summary
    assert summary.wrong_scored_wrong == summary.wrong_total == 100, summary
