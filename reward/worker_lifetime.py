"""Worker processes that never outlive their parent: the parent starts them from one long-lived thread
(:class:`Spawner`), and each worker asks the kernel to SIGKILL it when that thread's process ends
(:func:`die_with_parent`, ``PR_SET_PDEATHSIG``), besides watching its parent's pid.

The kernel's signal reaches a worker even when it is stuck in C code holding the GIL (sympy's big-integer powers of
a hostile answer, a plug-in's tight loop), where a watching thread never runs. ``PR_SET_PDEATHSIG`` fires when the
*thread* that started the process ends, not only its process, so no short-lived caller thread may start one.
Used by the math-verify pool (``math_pool.py``) and the bounded plug-in calls (``bounded_calls.py``).
"""

from __future__ import annotations

import ctypes
import logging
import os
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

logger = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> None:
    """In a worker: SIGKILL this process when its parent ends (Linux), and exit when it notices the parent is gone."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        except (OSError, AttributeError):
            pass  # the watch below still ends it
    if os.getppid() != parent_pid:  # the parent died before the request took effect
        os._exit(1)

    def watch() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent_pid:
                os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


class Spawner:
    """In the parent: runs every ``start(make)`` on one thread that lives as long as the pool (see the module)."""

    def __init__(self, name: str) -> None:
        self._requests: queue.Queue[tuple[Future, Callable[[], Any]] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def start(self, make: Callable[[], Any]) -> Any:
        """``make()``'s result (it starts a process), made on the spawner's thread; its exception is raised here."""
        future: Future = Future()
        self._requests.put((future, make))
        return future.result()

    def _serve(self) -> None:
        while (request := self._requests.get()) is not None:
            future, make = request
            try:
                future.set_result(make())
            except Exception as error:  # OSError from Popen: the caller reports it
                future.set_exception(error)

    def stop(self) -> None:
        self._requests.put(None)


def shut_down_workers(workers: set, executor: ThreadPoolExecutor, spawner: Spawner) -> None:
    """A pool's end (its ``weakref.finalize``): no new calls, no new workers, every live worker killed."""
    executor.shutdown(wait=False, cancel_futures=True)
    spawner.stop()
    for worker in list(workers):
        try:
            worker.kill()
        except Exception:  # one worker's failure to die must not keep the others alive
            logger.exception("could not kill a worker process")
    workers.clear()
