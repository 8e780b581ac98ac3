"""Remote code verifier: ``python -m colossal_rl.reward.server --host 127.0.0.1 --port N --token-file F``.

A threaded stdlib HTTP server wrapping the same sandbox as local scoring, for when the
machines that generate should not run generated code. ``POST /v1/run_tests`` with
``Authorization: Bearer <token>`` and ``{"program": str, "test_cases": {...}}`` returns the
test report; ``GET /healthz`` needs no token and says nothing but ``{"ok": true}``.

Under load it refuses rather than fails: the listen backlog holds the connections it admits,
more than ``--max-concurrent-requests`` at once are answered 503 (clients retry with backoff),
oversized bodies 413 and too deeply nested JSON 400. A body answered without being read is read
and dropped first, so the client sees the answer instead of a reset connection. Each test case's
time limit counts from when it starts; a request past its whole deadline reports ``infra_error``.
"""

from __future__ import annotations

import argparse
import hmac
import ipaddress
import json
import logging
import signal
import stat
import threading
import time
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from .code_runner import RUN_TESTS_PATH, TOKEN_HEADER, CodeRunner, LocalCodeRunner, ProgramJob
from .code_tests import TestCaseError, parse_test_cases
from .sandbox import SandboxConfig

logger = logging.getLogger(__name__)

RETRY_AFTER_S = 1
"""What a 503 asks the client to wait before retrying (clients add their own backoff)."""
_MAX_DISCARD_BYTES = 256 << 20
"""Most of an unread body read and dropped before closing; past it the client may see a reset."""
_DISCARD_TIMEOUT_S = 10.0
_SOMAXCONN = Path("/proc/sys/net/core/somaxconn")


@dataclass(frozen=True, kw_only=True)
class ServerLimits:
    """What one verifier accepts, and how many clients it serves at once."""

    max_request_bytes: int = 16 << 20
    """Largest request body; a larger one is answered 413."""
    request_timeout_s: float = 120.0
    """Deadline of one admitted request (and the socket timeout). Cases cut short or not run by it make the
    report an ``infra_error``, never a ``timeout`` verdict: each case's own limit counts from its start."""
    max_concurrent_requests: int = 256
    """Requests admitted at once (being scored, or waiting for a sandbox slot); more are answered 503."""
    backlog: int | None = None
    """listen() backlog: connections the kernel holds until accepted; None: twice max_concurrent_requests."""
    max_json_depth: int = 400
    """Deepest nesting of arrays and objects accepted in a body; deeper is answered 400."""

    def __post_init__(self) -> None:
        for name in ("max_request_bytes", "request_timeout_s", "max_concurrent_requests", "max_json_depth"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ServerLimits.{name} must be > 0, got {getattr(self, name)}")
        if self.backlog is not None and self.backlog <= 0:
            raise ValueError(f"ServerLimits.backlog must be > 0, got {self.backlog}")

    @property
    def listen_backlog(self) -> int:
        return self.backlog if self.backlog is not None else max(128, 2 * self.max_concurrent_requests)


class VerifierServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], runner: CodeRunner, token: str, limits: ServerLimits):
        if not token:
            raise ValueError("the verifier token is empty")
        self.runner = runner
        self.token = token.encode()
        self.limits = limits
        self.admission = threading.BoundedSemaphore(limits.max_concurrent_requests)
        self.request_queue_size = limits.listen_backlog  # socketserver's default of 5 resets bursts of clients
        super().__init__(address, _Handler)
        cap = kernel_backlog_cap()
        if cap is not None and cap < self.request_queue_size:
            logger.warning("listen backlog %d is capped by net.core.somaxconn=%d", self.request_queue_size, cap)


def kernel_backlog_cap() -> int | None:
    """The kernel's cap on any listen backlog (``net.core.somaxconn``), if readable."""
    try:
        return int(_SOMAXCONN.read_text())
    except (OSError, ValueError):
        return None


class _HTTPError(Exception):
    def __init__(self, status: HTTPStatus, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.headers = headers or {}


def nesting_exceeds(value: Any, max_depth: int) -> bool:
    """True if ``value`` nests lists/dicts more than ``max_depth`` deep (iterative: no recursion to exhaust)."""
    stack = [(value, 1)] if isinstance(value, list | dict) else []
    while stack:
        item, depth = stack.pop()
        if depth > max_depth:
            return True
        children = item.values() if isinstance(item, dict) else item
        stack.extend((child, depth + 1) for child in children if isinstance(child, list | dict))
    return False


def parse_body(body: bytes, max_depth: int) -> Any:
    """The body's JSON value; raises a 400 _HTTPError if it is not JSON or nests deeper than ``max_depth``."""
    too_deep = _HTTPError(HTTPStatus.BAD_REQUEST, f"body nests arrays/objects deeper than {max_depth} levels")
    try:
        payload = json.loads(body)
    except RecursionError:
        raise too_deep from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise _HTTPError(HTTPStatus.BAD_REQUEST, f"body is not JSON: {error}") from None
    if nesting_exceeds(payload, max_depth):
        raise too_deep
    return payload


def job_from_payload(payload: Any) -> ProgramJob:
    if not isinstance(payload, dict) or not isinstance(payload.get("program"), str):
        raise _HTTPError(HTTPStatus.BAD_REQUEST, "body needs a string 'program' and 'test_cases'")
    try:
        tests = parse_test_cases(payload.get("test_cases"), payload.get("fn_name"))
    except TestCaseError as error:
        raise _HTTPError(HTTPStatus.BAD_REQUEST, f"bad test cases: {error}") from None
    return ProgramJob(payload["program"], tests)


class _Handler(BaseHTTPRequestHandler):
    server: VerifierServer

    def setup(self) -> None:
        self.timeout = self.server.limits.request_timeout_s  # socket timeout: a slow sender cannot hold a thread
        self._unread_body_bytes = 0
        super().setup()

    def log_message(self, message_format: str, *args: Any) -> None:
        logger.info("%s %s", self.address_string(), message_format % args)

    def _send_json(self, status: HTTPStatus, payload: dict[str, Any], headers: dict[str, str] | None = None) -> None:
        body = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        if self._unread_body_bytes:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        if self.path == "/healthz":
            self._send_json(HTTPStatus.OK, {"ok": True})
        else:
            self._send_json(HTTPStatus.NOT_FOUND, {"error": "not found"})

    def do_POST(self) -> None:
        length = self.headers.get("Content-Length", "")
        self._unread_body_bytes = int(length) if length.isdigit() else 0
        try:
            self._send_json(HTTPStatus.OK, self._run_tests())
        except _HTTPError as error:
            self._send_json(error.status, {"error": str(error)}, error.headers)
        except TimeoutError:
            self._send_json(HTTPStatus.REQUEST_TIMEOUT, {"error": "request body not received in time"})
        except Exception as error:
            logger.exception("verifier request failed")
            self._send_json(HTTPStatus.INTERNAL_SERVER_ERROR, {"error": f"{type(error).__name__}: {error}"})
        self._discard_unread_body()

    def _run_tests(self) -> dict[str, Any]:
        if self.path != RUN_TESTS_PATH:
            raise _HTTPError(HTTPStatus.NOT_FOUND, "not found")
        self._check_token()
        length = self._body_length()
        if not self.server.admission.acquire(blocking=False):
            limit = self.server.limits.max_concurrent_requests
            message = f"verifier busy: {limit} requests already admitted; retry later"
            raise _HTTPError(HTTPStatus.SERVICE_UNAVAILABLE, message, {"Retry-After": str(RETRY_AFTER_S)})
        try:
            body = self.rfile.read(length)
            self._unread_body_bytes = 0
            job = job_from_payload(parse_body(body, self.server.limits.max_json_depth))
            deadline = time.monotonic() + self.server.limits.request_timeout_s
            return self.server.runner.run_programs([job], deadline)[0].to_json()
        finally:
            self.server.admission.release()

    def _check_token(self) -> None:
        header = self.headers.get(TOKEN_HEADER, "")
        scheme, _, presented = header.partition(" ")
        if scheme != "Bearer" or not hmac.compare_digest(presented.strip().encode(), self.server.token):
            raise _HTTPError(HTTPStatus.UNAUTHORIZED, "missing or wrong token")

    def _body_length(self) -> int:
        length_header = self.headers.get("Content-Length")
        if length_header is None or not length_header.isdigit():
            raise _HTTPError(HTTPStatus.LENGTH_REQUIRED, "Content-Length required")
        length, limit = int(length_header), self.server.limits.max_request_bytes
        if length > limit:
            raise _HTTPError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"request of {length} bytes is over {limit} bytes")
        return length

    def _discard_unread_body(self) -> None:
        """Read and drop a body answered without being read: closing a socket with unread input resets the
        connection, and a client still sending would see a broken pipe instead of the answer."""
        remaining = min(self._unread_body_bytes, _MAX_DISCARD_BYTES)
        self._unread_body_bytes = 0
        give_up = time.monotonic() + _DISCARD_TIMEOUT_S
        try:
            self.connection.settimeout(_DISCARD_TIMEOUT_S)
            while remaining > 0 and time.monotonic() < give_up:
                chunk = self.rfile.read1(min(remaining, 1 << 16))
                if not chunk:
                    break
                remaining -= len(chunk)
        except OSError:  # the client gave up first: nothing left to protect
            pass


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
    parser.add_argument("--max-request-bytes", type=int, default=16 << 20, help="larger bodies are answered 413")
    parser.add_argument(
        "--request-timeout-s", type=float, default=120.0, help="deadline of one request; past it: infra_error"
    )
    parser.add_argument(
        "--max-concurrent-requests", type=int, default=256, help="requests admitted at once; more get 503"
    )
    parser.add_argument("--backlog", type=int, help="listen backlog (default: twice --max-concurrent-requests)")
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
    limits = ServerLimits(
        max_request_bytes=args.max_request_bytes,
        request_timeout_s=args.request_timeout_s,
        max_concurrent_requests=args.max_concurrent_requests,
        backlog=args.backlog,
    )
    runner = LocalCodeRunner(config)
    problem = runner.sandbox.self_test()
    if problem:
        raise SystemExit(f"refusing to serve: {problem}")
    server = VerifierServer((args.host, args.port), runner, read_token(args.token_file), limits)
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
