"""Calls to user code bounded in time: a small pool of killable worker processes, safe to use from any thread.

Python cannot stop a thread, so a function that may hang (a ``--reward-fn`` plug-in, later a judge client) runs in
a worker process (``python -m colossal_rl.reward.bounded_worker``, a fresh interpreter, never a fork of a threaded
caller), which loads it once. A call past its limit gets its worker killed (the whole process group) and replaced;
the call's outcome says so, and the other calls go on. Workers die with their parent: they are started from one
long-lived thread of the pool and ask the kernel for SIGKILL when it ends (``PR_SET_PDEATHSIG``), and they watch
their parent's pid as well; :meth:`BoundedCallPool.close` (or the pool's garbage collection) kills them.

The same pattern as the math-verify pool (``math_pool.py``): per-call limits, no signals in the calling process.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from .worker_lifetime import Spawner, shut_down_workers

logger = logging.getLogger(__name__)

WORKER_MODULE = "colossal_rl.reward.bounded_worker"
SYS_PATH_VARIABLE = "COLOSSAL_RL_BOUNDED_WORKER_SYS_PATH"
"""The caller's ``sys.path`` (JSON), so a worker finds the modules its caller would (``module:function`` specs)."""


@dataclass(frozen=True)
class CallOutcome:
    status: str
    """``ok`` (``value`` holds the result), ``raised`` (the function raised, or returned what cannot be pickled),
    ``timeout`` (past the limit: its worker was killed) or ``failed`` (the worker could not start or died)."""
    value: Any = None
    message: str = ""
    """Unless ``ok``: what happened, in one line (``raised``: the exception's type and message)."""


class _Worker:
    """One worker process: loads ``factory(spec)`` once, then answers calls one at a time."""

    def __init__(self, factory: str, spec: str):
        to_child_read, to_child_write = os.pipe()
        from_child_read, from_child_write = os.pipe()
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-m", WORKER_MODULE, factory, spec, str(os.getpid())],
                stdin=to_child_read,
                stdout=from_child_write,
                start_new_session=True,  # its own process group, killed as a whole
                env={**os.environ, SYS_PATH_VARIABLE: json.dumps(sys.path)},
            )
        except OSError:
            for fd in (to_child_read, to_child_write, from_child_read, from_child_write):
                os.close(fd)
            raise
        os.close(to_child_read)
        os.close(from_child_write)
        self.requests = Connection(to_child_write, readable=False)
        self.replies = Connection(from_child_read, writable=False)
        self.ready = False
        self._kill_lock = threading.Lock()
        self._killed = False

    def wait_ready(self, deadline: float) -> str | None:
        """None once the worker has loaded the function, else why it cannot serve calls."""
        if self.ready:
            return None
        reply = self._receive(deadline)
        if reply is None:
            return "the worker did not load the function before its startup timeout"
        if reply[0] != "ready":
            return str(reply[1])
        self.ready = True
        return None

    def call(self, arguments: tuple, timeout_s: float) -> tuple[str, Any] | None:
        """``(status, value or message)``, or None past ``timeout_s`` (the worker is then unusable)."""
        try:
            self.requests.send(arguments)
        except OSError as error:  # the worker is gone
            return "failed", f"the worker is gone ({error})"
        return self._receive(time.monotonic() + timeout_s)

    def _receive(self, deadline: float) -> tuple[str, Any] | None:
        try:
            if not self.replies.poll(max(0.0, deadline - time.monotonic())):
                return None
            return self.replies.recv()
        except (EOFError, OSError):  # it exited, or the pool was closed meanwhile
            return "failed", f"the worker exited (code {self.process.poll()})"
        except Exception as error:  # a value this process cannot unpickle (a class only the worker imports)
            return "failed", f"its reply could not be read: {type(error).__name__}: {error}"

    def kill(self) -> None:
        """Kill its process group, reap it and close its pipes; once, whichever thread asks first (a caller whose
        call the kill cut short discards the worker while the pool's close is still killing it: closing the pipes
        twice at once could close another file that took the same descriptor)."""
        with self._kill_lock:
            if self._killed:
                return
            self._killed = True
            if self.process.poll() is None:
                try:
                    os.killpg(self.process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            self.process.wait()
            self.requests.close()
            self.replies.close()


class BoundedCallPool:
    """``num_workers`` worker processes each holding ``factory(spec)``; :meth:`call_many` runs calls on all of them,
    each bounded by ``timeout_s`` from when its worker gets it.

    ``factory`` is ``"module:function"``: called once in each worker with ``spec``, it returns the function to call
    (e.g. :func:`colossal_rl.reward.user_functions.plugin_record_function`). Arguments and results are pickled.
    """

    def __init__(
        self, factory: str, spec: str, *, timeout_s: float, num_workers: int = 2, startup_timeout_s: float = 120.0
    ):
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        self.factory, self.spec = factory, spec
        self.timeout_s = timeout_s
        self.startup_timeout_s = startup_timeout_s
        self._spawner = Spawner("bounded-call-spawner")
        self._idle: queue.Queue[list[_Worker | None]] = queue.Queue()  # slots: a worker, or None to start one
        self._live: set[_Worker] = set()  # every started process, for shutdown
        self._lock = threading.Lock()
        self._closed = False
        for _ in range(num_workers):
            self._idle.put([self._start()])  # started now, so their imports overlap the caller's start-up
        self._executor = ThreadPoolExecutor(max_workers=num_workers, thread_name_prefix="bounded-call")
        self._finalizer = weakref.finalize(self, shut_down_workers, self._live, self._executor, self._spawner)

    def _start(self) -> _Worker | None:
        if self._closed:
            return None
        try:
            worker = self._spawner.start(lambda: _Worker(self.factory, self.spec))
        except OSError as error:  # retried at the slot's next use
            logger.error("cannot start a worker for %s: %s", self.spec, error)
            return None
        with self._lock:
            self._live.add(worker)
        return worker

    def _discard(self, worker: _Worker) -> None:
        worker.kill()
        with self._lock:
            self._live.discard(worker)

    def call(self, *arguments: Any, deadline: float | None = None) -> CallOutcome:
        """One call on the next free worker (blocks until one is free). ``deadline`` (``time.monotonic()``): the
        call gets at most what is left of it, and is not made at all (a ``timeout``) once it has passed."""
        slot = self._idle.get()
        try:
            if self._closed:
                raise RuntimeError("BoundedCallPool is closed")
            limit_s = self.timeout_s if deadline is None else min(self.timeout_s, deadline - time.monotonic())
            if limit_s <= 0:
                return CallOutcome("timeout", message="its batch's time budget was spent before it was called")
            if slot[0] is None:
                slot[0] = self._start()
            if slot[0] is None:
                return CallOutcome("failed", message="its worker process could not be started")
            return self._ask(slot, arguments, limit_s)
        finally:
            self._idle.put(slot)

    def _ask(self, slot: list[_Worker | None], arguments: tuple, limit_s: float) -> CallOutcome:
        worker = slot[0]
        problem = worker.wait_ready(time.monotonic() + self.startup_timeout_s)
        reply = None if problem else worker.call(arguments, limit_s)
        if problem is None and reply is not None and reply[0] in ("ok", "raised"):
            return CallOutcome("ok", reply[1]) if reply[0] == "ok" else CallOutcome("raised", message=reply[1])
        self._discard(worker)
        slot[0] = self._start()  # replaced at once, so its start-up overlaps the next calls
        if problem is not None:
            return CallOutcome("failed", message=problem)
        if reply is None:
            cut = " (what was left of its batch's time budget)" if limit_s < self.timeout_s else ""
            return CallOutcome("timeout", message=f"no answer within {limit_s:g}s{cut}")
        return CallOutcome("failed", message=str(reply[1]))

    def call_many(self, argument_lists: list[tuple], budget_s: float | None = None) -> list[CallOutcome]:
        """Every call, in parallel on all workers; outcomes in input order. ``budget_s``: the whole batch ends within
        about that long (plus a worker's reply), however many calls hang: calls not made by then are ``timeout``."""
        deadline = None if budget_s is None else time.monotonic() + budget_s
        return list(self._executor.map(lambda arguments: self.call(*arguments, deadline=deadline), argument_lists))

    def worker_pids(self) -> list[int]:
        with self._lock:
            return sorted(worker.process.pid for worker in self._live)

    def close(self) -> None:
        self._closed = True
        self._finalizer()
