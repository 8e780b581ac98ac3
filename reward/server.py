"""Remote code verifier: ``python -m colossal_rl.reward.server --host 127.0.0.1 --port N --token-file F``.

A threaded stdlib HTTP server wrapping the same sandbox as local scoring, for when the
machines that generate should not run generated code. ``POST /v1/run_tests`` with
``Authorization: Bearer <token>`` and ``{"program": str, "test_cases": {...}}`` returns the
test report; ``GET /healthz`` needs no token and says nothing but ``{"ok": true}``.
Requests are size-limited, slow senders time out, and each request has a time budget.
"""

from __future__ import annotations

import argparse
import hmac
import ipaddress
import json
import logging
import signal
import stat
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from .code_runner import RUN_TESTS_PATH, TOKEN_HEADER, LocalCodeRunner, ProgramJob
from .code_tests import TestCaseError, parse_test_cases
from .sandbox import SandboxConfig

logger = logging.getLogger(__name__)


class VerifierServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(
        self,
        address: tuple[str, int],
        runner: LocalCodeRunner,
        token: str,
        *,
        max_request_bytes: int,
        request_timeout_s: float,
    ):
        if not token:
            raise ValueError("the verifier token is empty")
        self.runner = runner
        self.token = token.encode()
        self.max_request_bytes = max_request_bytes
        self.request_timeout_s = request_timeout_s
        super().__init__(address, _Handler)


class _HTTPError(Exception):
    def __init__(self, status: HTTPStatus, message: str):
        super().__init__(message)
        self.status = status


class _Handler(BaseHTTPRequestHandler):
    server: VerifierServer

    def setup(self) -> None:
        self.timeout = self.server.request_timeout_s  # socket timeout: a slow sender cannot hold a thread forever
        super().setup()

    def log_message(self, message_format: str, *args: Any) -> None:
        logger.info("%s %s", self.address_string(), message_format % args)

    def _send_json(self, status: HTTPStatus, payload: dict[str, Any]) -> None:
        body = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        if self.path == "/healthz":
            self._send_json(HTTPStatus.OK, {"ok": True})
        else:
            self._send_json(HTTPStatus.NOT_FOUND, {"error": "not found"})

    def do_POST(self) -> None:
        try:
            if self.path != RUN_TESTS_PATH:
                raise _HTTPError(HTTPStatus.NOT_FOUND, "not found")
            self._check_token()
            job = self._read_job()
            deadline = time.monotonic() + self.server.request_timeout_s
            report = self.server.runner.run_programs([job], deadline)[0]
            self._send_json(HTTPStatus.OK, report.to_json())
        except _HTTPError as error:
            self._send_json(error.status, {"error": str(error)})
        except TimeoutError:
            self._send_json(HTTPStatus.REQUEST_TIMEOUT, {"error": "request body not received in time"})
        except Exception as error:
            logger.exception("verifier request failed")
            self._send_json(HTTPStatus.INTERNAL_SERVER_ERROR, {"error": f"{type(error).__name__}: {error}"})

    def _check_token(self) -> None:
        header = self.headers.get(TOKEN_HEADER, "")
        scheme, _, presented = header.partition(" ")
        if scheme != "Bearer" or not hmac.compare_digest(presented.strip().encode(), self.server.token):
            raise _HTTPError(HTTPStatus.UNAUTHORIZED, "missing or wrong token")

    def _read_job(self) -> ProgramJob:
        length_header = self.headers.get("Content-Length")
        if length_header is None or not length_header.isdigit():
            raise _HTTPError(HTTPStatus.LENGTH_REQUIRED, "Content-Length required")
        length = int(length_header)
        if length > self.server.max_request_bytes:
            raise _HTTPError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"request over {self.server.max_request_bytes} bytes")
        try:
            payload = json.loads(self.rfile.read(length))
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise _HTTPError(HTTPStatus.BAD_REQUEST, f"body is not JSON: {error}") from None
        if not isinstance(payload, dict) or not isinstance(payload.get("program"), str):
            raise _HTTPError(HTTPStatus.BAD_REQUEST, "body needs a string 'program' and 'test_cases'")
        try:
            tests = parse_test_cases(payload.get("test_cases"), payload.get("fn_name"))
        except TestCaseError as error:
            raise _HTTPError(HTTPStatus.BAD_REQUEST, f"bad test cases: {error}") from None
        return ProgramJob(payload["program"], tests)


def read_token(path: str) -> str:
    token_path = Path(path)
    try:
        token = token_path.read_text().strip()
    except OSError as error:
        raise SystemExit(f"cannot read token file {path}: {error}") from None
    if not token:
        raise SystemExit(f"token file {path} is empty")
    if token_path.stat().st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        logger.warning("token file %s is readable by other users; chmod 600 it", path)
    return token


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m colossal_rl.reward.server", description=__doc__.split("\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True, help="0 picks a free port (logged at startup)")
    parser.add_argument("--token-file", required=True, help="file holding the shared secret clients must send")
    parser.add_argument("--max-request-bytes", type=int, default=16 << 20)
    parser.add_argument("--request-timeout-s", type=float, default=120.0, help="budget of one request")
    parser.add_argument("--timeout-s", type=float, default=5.0, help="wall-clock limit of one test case")
    parser.add_argument("--max-parallel", type=int, default=2, help="test cases running at once")
    parser.add_argument("--memory-mb", type=int, default=512)
    parser.add_argument("--max-processes", type=int, default=8)
    return parser.parse_args(argv)


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = _parse_args(argv)
    config = SandboxConfig(
        timeout_s=args.timeout_s,
        max_parallel=args.max_parallel,
        memory_mb=args.memory_mb,
        max_processes=args.max_processes,
    )
    runner = LocalCodeRunner(config)
    problem = runner.sandbox.self_test()
    if problem:
        raise SystemExit(f"refusing to serve: {problem}")
    server = VerifierServer(
        (args.host, args.port),
        runner,
        read_token(args.token_file),
        max_request_bytes=args.max_request_bytes,
        request_timeout_s=args.request_timeout_s,
    )
    signal.signal(signal.SIGTERM, _interrupt)
    host, port = server.server_address[:2]
    if not ipaddress.ip_address(host).is_loopback:
        logger.warning("listening on %s: requests and the token travel unencrypted; keep it on a trusted network", host)
    logger.info("verifier listening on http://%s:%d", host, port)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        logger.info("verifier shutting down")
    finally:
        server.server_close()
        runner.close()


if __name__ == "__main__":
    main()
