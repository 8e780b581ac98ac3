"""A small pool of killable math-verify worker processes, safe to use from any thread.

Each worker is a fresh interpreter (``python -m colossal_rl.reward.math_worker``, never a fork
of the caller, which may be a threaded Ray actor) talking JSON lines over pipes. A request that
exceeds its timeout gets its worker killed (the whole process group) and replaced; nothing here
uses signals in the calling process, so it works outside the main thread.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import select
import signal
import subprocess
import sys
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from .worker_lifetime import Spawner, shut_down_workers

logger = logging.getLogger(__name__)

WORKER_MODULE = "colossal_rl.reward.math_worker"


class WorkerFailed(RuntimeError):
    """The worker process died, failed to start, or broke the protocol."""


@dataclass(frozen=True)
class MathCheck:
    outcome: str
    """``correct``, ``wrong``, ``unparsed`` (fall back to strings), ``timeout`` or ``error``."""
    detail: str = ""


class _Worker:
    """One worker process and its partially read reply stream."""

    def __init__(self, startup_timeout_s: float):
        self.process = subprocess.Popen(
            [sys.executable, "-m", WORKER_MODULE, str(os.getpid())],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            start_new_session=True,  # its own process group, killed as a whole
        )
        self._buffer = b""
        self._ready = False
        self._startup_deadline = time.monotonic() + startup_timeout_s

    def request(self, gold: str, answer: str, timeout_s: float) -> dict | None:
        """The worker's reply, or None if it took longer than ``timeout_s`` (the worker is then unusable)."""
        if not self._ready:
            if self._read_line(self._startup_deadline) is None:
                raise WorkerFailed("math worker did not become ready before its startup timeout")
            self._ready = True
        try:
            self.process.stdin.write(json.dumps({"gold": gold, "answer": answer}).encode() + b"\n")
            self.process.stdin.flush()
        except (BrokenPipeError, OSError) as error:
            raise WorkerFailed(f"math worker is gone ({error})") from None
        return self._read_line(time.monotonic() + timeout_s)

    def _read_line(self, deadline: float) -> dict | None:
        fd = self.process.stdout.fileno()
        poller = select.poll()  # not select.select: Ray processes may hold fds above 1024
        poller.register(fd, select.POLLIN)
        while b"\n" not in self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not poller.poll(remaining * 1000):
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                raise WorkerFailed(f"math worker exited (code {self.process.poll()})")
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        try:
            return json.loads(line)
        except json.JSONDecodeError:
            raise WorkerFailed(f"math worker sent garbage: {line[:200]!r}") from None

    def kill(self) -> None:
        _kill_process_group(self.process)


def _kill_process_group(process: subprocess.Popen) -> None:
    if process.poll() is None:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    process.wait()
    for stream in (process.stdin, process.stdout):
        try:
            stream.close()
        except OSError:  # unflushed input for a dead process
            pass


class _Slot:
    """A place for one worker process, which is replaced whenever it times out or fails."""

    def __init__(self) -> None:
        self.worker: _Worker | None = None


class MathVerifierPool:
    """``num_workers`` worker processes; :meth:`check` blocks until one is free, from any thread."""

    def __init__(self, num_workers: int = 2, timeout_s: float = 5.0, startup_timeout_s: float = 120.0):
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        self.num_workers = num_workers
        self.timeout_s = timeout_s
        self.startup_timeout_s = startup_timeout_s
        self._idle: queue.Queue[_Slot] = queue.Queue()
        self._workers: set[_Worker] = set()  # every live process, for shutdown
        self._lock = threading.Lock()
        self._closed = False
        self._spawner = Spawner("math-verify-spawner")  # workers die with this process (worker_lifetime.py)
        for _ in range(num_workers):
            slot = _Slot()
            self._restart(slot)
            self._idle.put(slot)
        self._executor = ThreadPoolExecutor(max_workers=num_workers, thread_name_prefix="math-verify")
        self._finalizer = weakref.finalize(self, shut_down_workers, self._workers, self._executor, self._spawner)

    def _restart(self, slot: _Slot) -> None:
        """Kill the slot's worker (if any) and start a fresh one now, so its imports overlap other work."""
        if slot.worker is not None:
            slot.worker.kill()
            with self._lock:
                self._workers.discard(slot.worker)
            slot.worker = None
        if self._closed:
            return
        try:
            worker = self._spawner.start(lambda: _Worker(self.startup_timeout_s))
        except OSError as error:  # retried at the slot's next use
            logger.error("cannot start a math worker: %s", error)
            return
        with self._lock:
            self._workers.add(worker)
        slot.worker = worker

    def check(self, gold: str, answer: str) -> MathCheck:
        slot = self._idle.get()
        try:
            if self._closed:
                raise RuntimeError("MathVerifierPool is closed")
            if slot.worker is None:
                self._restart(slot)
            if slot.worker is None:
                return MathCheck("error", "cannot start a math worker")
            return self._ask(slot, gold, answer)
        finally:
            self._idle.put(slot)

    def _ask(self, slot: _Slot, gold: str, answer: str) -> MathCheck:
        try:
            reply = slot.worker.request(gold, answer, self.timeout_s)
        except WorkerFailed as error:
            logger.error("math worker failed: %s; restarting it", error)
            self._restart(slot)
            return MathCheck("error", str(error))
        if reply is None:
            logger.warning("math verification exceeded %.1fs; restarting its worker", self.timeout_s)
            self._restart(slot)
            return MathCheck("timeout", f"verification exceeded {self.timeout_s}s")
        if "error" in reply:
            return MathCheck("error", reply["error"])
        if not reply.get("parsed"):
            return MathCheck("unparsed", json.dumps(reply))
        return MathCheck("correct" if reply["correct"] else "wrong")

    def check_many(self, pairs: list[tuple[str, str]]) -> list[MathCheck]:
        """Check (gold, answer) pairs on all workers in parallel; results in input order."""
        return list(self._executor.map(lambda pair: self.check(*pair), pairs))

    def close(self) -> None:
        self._closed = True
        self._finalizer()
