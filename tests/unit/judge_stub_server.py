"""A stub OpenAI-compatible judge on loopback for tests: ``/v1/chat/completions`` answering as a test says.

``JudgeStub(behaviour)`` serves on 127.0.0.1 (a free port) in a thread. ``behaviour(request_number, prompt)``
returns a :class:`StubReply`; the helpers below build the usual ones. The stub records every request (its
headers and JSON body) and the most requests it held at once.
"""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass(frozen=True)
class StubReply:
    content: str | None = ""
    """The verdict, sent as ``choices[0].message.content``; ignored when ``raw_body`` is set."""
    status: int = 200
    sleep_s: float = 0.0
    """Wait this long before answering."""
    raw_body: bytes | None = None
    """Send these bytes as the body instead of a chat completion."""


Behaviour = Callable[[int, str], StubReply]


@dataclass
class RecordedRequest:
    path: str
    headers: dict[str, str]
    body: dict[str, Any] = field(default_factory=dict)


def fixed(*verdicts: str) -> Behaviour:
    """Answer the n-th request with ``verdicts[n % len(verdicts)]``."""
    return lambda number, prompt: StubReply(verdicts[number % len(verdicts)])


def echo_number(low_score: str = "0", high_score: str = "1") -> Behaviour:
    """Score by the prompt: ``Score: high_score`` when the response in it says ``CORRECT``, else ``low_score``."""
    return lambda number, prompt: StubReply(f"Reasoning...\nScore: {high_score if 'CORRECT' in prompt else low_score}")


def echo_marker() -> Behaviour:
    """Answer with the number after ``#`` in the prompt (``#7`` -> ``\\boxed{7}``): each reply names its prompt."""

    def answer(number: int, prompt: str) -> StubReply:
        marker = re.search(r"#(\d+)", prompt)
        return StubReply("\\boxed{" + (marker.group(1) if marker else "?") + "}")

    return answer


def garbage() -> Behaviour:
    return lambda number, prompt: StubReply("I cannot decide, sorry.")


def sleeping(sleep_s: float, verdict: str = "1") -> Behaviour:
    return lambda number, prompt: StubReply(verdict, sleep_s=sleep_s)


def fail_then(failures: int, then: Behaviour, status: int = 500) -> Behaviour:
    """The first ``failures`` requests get HTTP ``status``; later ones are answered by ``then``."""
    return lambda number, prompt: StubReply(None, status=status) if number < failures else then(number, prompt)


def status(code: int) -> Behaviour:
    return lambda number, prompt: StubReply(None, status=code)


def closed_port() -> int:
    """A loopback port with nothing listening (connections to it are refused)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class JudgeStub:
    def __init__(self, behaviour: Behaviour):
        self.behaviour = behaviour
        self.requests: list[RecordedRequest] = []
        self.max_in_flight = 0
        self._in_flight = 0
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler_class(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.02,), name="judge-stub", daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> JudgeStub:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._server.shutdown()  # stops the accept loop; handlers still sleeping are daemon threads
        self._server.server_close()

    def _begin(self, request: RecordedRequest) -> int:
        with self._lock:
            self.requests.append(request)
            self._in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self._in_flight)
            return len(self.requests) - 1

    def _end(self) -> None:
        with self._lock:
            self._in_flight -= 1


def _handler_class(stub: JudgeStub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            number = stub._begin(RecordedRequest(self.path, dict(self.headers.items()), body))
            ended = False
            try:
                prompt = body["messages"][-1]["content"]
                reply = stub.behaviour(number, prompt)
                time.sleep(reply.sleep_s)
                # No longer in flight once answered: the client may send its next request the moment it reads the
                # reply, before this thread would get back here (counting after the write saw one too many).
                stub._end()
                ended = True
                self._send(reply)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client gave up (a timeout test)
            finally:
                if not ended:
                    stub._end()

        def _send(self, reply: StubReply) -> None:
            if reply.raw_body is not None:
                payload = reply.raw_body
            elif reply.status != 200:
                payload = json.dumps({"error": {"message": f"stub error {reply.status}"}}).encode()
            else:
                message = {"role": "assistant", "content": reply.content}
                payload = json.dumps({"choices": [{"index": 0, "message": message}]}).encode()
            self.send_response(reply.status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    return Handler
