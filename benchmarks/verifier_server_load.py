"""The code verifier server under a burst of clients: connection resets, correctness and latency.

Starts ``python -m colossal_rl.reward.server`` on loopback and lets ``--clients`` threads, released
together, each send ``--requests`` requests one after another over fresh connections (raw
``http.client``, no retries, so every reset is counted). Requests cycle through a mix of sizes: one
case, three cases, one case padded to 256 KB, and a wrong program. With ``--control-backlog 5``
(socketserver's default listen backlog) the same load runs against a second server first, side by side.

    python benchmarks/verifier_server_load.py [--clients 200] [--requests 5] [--control-backlog 5]
"""

from __future__ import annotations

import argparse
import http.client
import json
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

TOKEN = "verifier-load-benchmark-token"
RIGHT = "a, b = map(int, input().split())\nprint(a + b)\n"
WRONG = "a, b = map(int, input().split())\nprint(a - b)\n"
ONE_CASE = {"inputs": ["2 3\n"], "outputs": ["5\n"]}
THREE_CASES = {"inputs": ["2 3\n", "10 -4\n", "0 0\n"], "outputs": ["5\n", "6\n", "0\n"]}
PADDING = "#" + "x" * (256 << 10) + "\n"
MIX = (  # (kind, program, test cases, expected to pass)
    ("one case", RIGHT, ONE_CASE, True),
    ("three cases", RIGHT, THREE_CASES, True),
    ("256 KB body", PADDING + RIGHT, ONE_CASE, True),
    ("wrong program", WRONG, ONE_CASE, False),
)
RESETS = (ConnectionResetError, BrokenPipeError, http.client.RemoteDisconnected)


@contextmanager
def verifier_server(*flags: str, timeout_s: float = 60.0) -> Iterator[str]:
    """A verifier subprocess on a free loopback port (its log in a temp file); yields its URL."""
    with tempfile.TemporaryDirectory() as directory:
        token_file, log_file = Path(directory) / "token", Path(directory) / "server.log"
        token_file.write_text(TOKEN)
        token_file.chmod(0o600)
        command = [sys.executable, "-m", "colossal_rl.reward.server", "--host", "127.0.0.1", "--port", "0"]
        with log_file.open("w") as log:
            process = subprocess.Popen([*command, "--token-file", str(token_file), *flags], stderr=log)
        try:
            yield _wait_for_url(process, log_file, time.monotonic() + timeout_s)
        finally:
            process.terminate()
            process.wait(timeout=30)


def _wait_for_url(process: subprocess.Popen, log_file: Path, deadline: float) -> str:
    while time.monotonic() < deadline and process.poll() is None:
        found = re.search(r"listening on (http://\S+)", log_file.read_text())
        if found:
            return found.group(1)
        time.sleep(0.05)
    raise RuntimeError(f"verifier did not start: {log_file.read_text()[-2000:]}")


@dataclass
class Outcome:
    kind: str
    should_pass: bool
    seconds: float
    status: int | None = None
    """HTTP status, None if the connection failed."""
    error: str | None = None
    """Exception type name when the connection failed."""
    report: dict = field(default_factory=dict)

    @property
    def reset(self) -> bool:
        return self.error in {error.__name__ for error in RESETS}

    @property
    def scored_right(self) -> bool:
        """Scored as it should: all cases passed for a right program, a non-passing verdict for a wrong one."""
        if self.status != 200 or self.report.get("infra_error"):
            return False
        passed = all(verdict == "passed" for verdict in self.report["verdicts"])
        return passed == self.should_pass


def post_once(url: str, kind: str, program: str, tests: dict, should_pass: bool, timeout_s: float) -> Outcome:
    parts = urlsplit(url)
    body = json.dumps({"program": program, "test_cases": tests}).encode()
    headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    started = time.perf_counter()
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout_s)
    try:
        connection.request("POST", "/v1/run_tests", body, headers)
        response = connection.getresponse()
        payload = json.loads(response.read())
        return Outcome(kind, should_pass, time.perf_counter() - started, response.status, report=payload)
    except (OSError, http.client.HTTPException, ValueError) as error:
        return Outcome(kind, should_pass, time.perf_counter() - started, error=type(error).__name__)
    finally:
        connection.close()


def run_load(url: str, clients: int, requests: int, timeout_s: float = 600.0) -> list[Outcome]:
    """``clients`` threads, released together, each sending ``requests`` requests one after another."""
    outcomes: list[Outcome] = []
    lock, start = threading.Lock(), threading.Barrier(clients)

    def client(index: int) -> None:
        start.wait()
        for number in range(requests):
            kind, program, tests, should_pass = MIX[(index + number) % len(MIX)]
            outcome = post_once(url, kind, program, tests, should_pass, timeout_s)
            with lock:
                outcomes.append(outcome)

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return outcomes


@dataclass(frozen=True)
class Summary:
    requests: int
    resets: int
    statuses: dict[str, int]
    right_scored_right: int
    right_total: int
    wrong_scored_wrong: int
    wrong_total: int
    p50_s: float
    p99_s: float
    wall_s: float


def summarize(outcomes: list[Outcome], wall_s: float) -> Summary:
    latencies = sorted(o.seconds for o in outcomes)
    quantiles = statistics.quantiles(latencies, n=100, method="inclusive")
    right = [o for o in outcomes if o.should_pass]
    wrong = [o for o in outcomes if not o.should_pass]
    return Summary(
        requests=len(outcomes),
        resets=sum(o.reset for o in outcomes),
        statuses=dict(Counter(str(o.status) if o.status else o.error for o in outcomes)),
        right_scored_right=sum(o.scored_right for o in right),
        right_total=len(right),
        wrong_scored_wrong=sum(o.scored_right for o in wrong),
        wrong_total=len(wrong),
        p50_s=quantiles[49],
        p99_s=quantiles[98],
        wall_s=wall_s,
    )


def describe(name: str, summary: Summary) -> str:
    return (
        f"{name:18} {summary.requests} requests in {summary.wall_s:.1f} s: resets {summary.resets}, "
        f"statuses {summary.statuses}, right programs scored right {summary.right_scored_right}/{summary.right_total}, "
        f"wrong scored wrong {summary.wrong_scored_wrong}/{summary.wrong_total}, "
        f"latency p50 {summary.p50_s:.2f} s p99 {summary.p99_s:.2f} s"
    )


def measure(clients: int, requests: int, *flags: str) -> Summary:
    with verifier_server("--timeout-s", "5", *flags) as url:
        started = time.perf_counter()
        outcomes = run_load(url, clients, requests)
        return summarize(outcomes, time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, default=200)
    parser.add_argument("--requests", type=int, default=5, help="requests per client, one after another")
    parser.add_argument("--control-backlog", type=int, help="also run against a server with this listen backlog")
    args = parser.parse_args()
    runs = []
    if args.control_backlog is not None:
        runs.append((f"backlog {args.control_backlog}", ("--backlog", str(args.control_backlog))))
    runs.append(("default", ()))
    summaries = {}
    for name, flags in runs:
        summaries[name] = measure(args.clients, args.requests, *flags)
        print(describe(name, summaries[name]), flush=True)
    default = summaries["default"]
    print(
        f"resets {default.resets}/{default.requests}; right programs scored right "
        f"{default.right_scored_right}/{default.right_total}; p99/p50 latency {default.p99_s / default.p50_s:.1f}"
    )


if __name__ == "__main__":
    main()
