"""The remote code verifier: token required, limits enforced, scoring through it matches local scoring."""

import http.client
import json
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request

import pytest

from colossal_rl.reward import build_reward_scorer

TOKEN = "s3cret-token-for-tests"
TESTS = {"inputs": ["2 3\n", "10 -4\n"], "outputs": ["5\n", "6\n"]}


def fenced(code: str) -> str:
    return f"```python\n{code}\n```"


@pytest.fixture(scope="module")
def server_url(tmp_path_factory):
    token_file = tmp_path_factory.mktemp("verifier") / "token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    command = [sys.executable, "-m", "colossal_rl.reward.server", "--host", "127.0.0.1", "--port", "0"]
    command += ["--token-file", str(token_file), "--timeout-s", "2", "--max-request-bytes", "100000"]
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    url = None
    deadline = time.monotonic() + 60
    while url is None and time.monotonic() < deadline:
        line = process.stderr.readline()
        if not line:
            break
        found = re.search(r"listening on (http://\S+)", line)
        url = found.group(1) if found else None
    if url is None:
        process.kill()
        pytest.fail(f"verifier did not start: {process.stderr.read()}")
    yield url
    process.terminate()
    process.wait(timeout=10)


def post(url: str, body: bytes, token: str | None) -> tuple[int, dict]:
    request = urllib.request.Request(url + "/v1/run_tests", data=body, method="POST")
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def oversized_status(url: str) -> int:
    """Announce a body over the server's limit without sending it: the server must refuse from the headers."""
    host, port = urllib.parse.urlsplit(url).hostname, urllib.parse.urlsplit(url).port
    connection = http.client.HTTPConnection(host, port, timeout=30)
    try:
        connection.putrequest("POST", "/v1/run_tests")
        connection.putheader("Authorization", f"Bearer {TOKEN}")
        connection.putheader("Content-Length", "200000")
        connection.endheaders()
        return connection.getresponse().status
    finally:
        connection.close()


@pytest.mark.slow
def test_token_and_limits(server_url):
    body = json.dumps({"program": "print(5)", "test_cases": TESTS}).encode()
    with urllib.request.urlopen(server_url + "/healthz", timeout=10) as response:
        assert json.loads(response.read()) == {"ok": True}
    assert post(server_url, body, None)[0] == 401
    assert post(server_url, body, "wrong")[0] == 401
    status, report = post(server_url, body, TOKEN)
    assert status == 200 and report["verdicts"] == ["passed", "wrong_answer"]
    assert oversized_status(server_url) == 413
    assert post(server_url, b"{not json", TOKEN)[0] == 400
    empty = json.dumps({"program": "print(1)", "test_cases": {"inputs": [], "outputs": []}}).encode()
    assert post(server_url, empty, TOKEN)[0] == 400


@pytest.mark.slow
def test_scoring_through_the_server(server_url):
    scorer = build_reward_scorer("code", code_verifier_url=server_url, verifier_token=TOKEN, verifier_timeout_s=30)
    try:
        responses = [
            fenced("a, b = map(int, input().split())\nprint(a + b)"),
            fenced("a, b = map(int, input().split())\nprint(a * b)"),
            fenced("while True:\n    pass"),
        ]
        records = scorer.score_batch(responses, [{"test_cases": TESTS}] * 3)
    finally:
        scorer.close()
    assert [r.reward for r in records] == [1.0, 0.0, 0.0]
    assert records[0].status == "ok" and records[2].status == "timeout"


@pytest.mark.slow
def test_wrong_token_and_dead_server_are_infra_errors(server_url):
    wrong = build_reward_scorer("code", code_verifier_url=server_url, verifier_token="nope")
    with socket.socket() as probe:  # a port with nothing listening
        probe.bind(("127.0.0.1", 0))
        dead_url = f"http://127.0.0.1:{probe.getsockname()[1]}"
    dead = build_reward_scorer("code", code_verifier_url=dead_url, verifier_token=TOKEN, verifier_timeout_s=5)
    try:
        response, row = fenced("print(5)"), {"test_cases": TESTS}
        for scorer, message in ((wrong, "HTTP 401"), (dead, "unreachable")):
            record = scorer.score_batch([response], [row])[0]
            assert record.status == "infra_error" and record.reward == 0.0
            assert message in record.details["error"]
    finally:
        wrong.close()
        dead.close()
