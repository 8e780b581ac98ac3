"""One continuous-batching engine shared by a producer's concurrent calls (``--continuous-batching``).

A thread of its own steps a ``Batcher`` (``batcher.py``: the transformers or the vLLM one); any number of callers
(the threads of a Ray actor with ``max_concurrency``) submit prompts and wait for their own groups, so a call
returns as soon as its prompts are done, while the engine goes on decoding the others'. Weights change only at a
safe point: :meth:`load_weights` stops admitting prompts, waits until no row is running (every group finishes with
the version it started with), loads, and labels what is admitted next with the new version. With partial rollouts
(``--partial-rollouts``) it does not wait: it pauses decoding between two steps, stops the running rows
(``Batcher.before_new_weights``: vLLM's leave its engine), loads, continues them from their tokens so far under the
new weights (``Batcher.take_new_weights``: re-prefilled) and lets decoding go on, so a response may span two
versions (each token records its own). :meth:`exclusive` runs something else on the model (an evaluation) with
decoding paused. Every wait is bounded.

Plain threading, no Ray: testable in-process.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from colossal_rl.rollout.batcher import Batcher, DecodedGroup

logger = logging.getLogger(__name__)

IDLE_POLL_S = 1.0
"""How often the decode thread re-checks for work while it has none (it is woken on every submission anyway)."""


class EngineStopped(RuntimeError):
    """The decode thread failed or was closed; the message says why."""


class EngineService:
    """Drives ``batcher`` from a daemon thread; its methods may be called from any thread."""

    def __init__(self, batcher: Batcher, *, partial_rollouts: bool = False):
        self.batcher = batcher
        self.partial_rollouts = partial_rollouts
        """Load weights with rows running (they continue with the new version) instead of waiting for them."""
        self._lock = threading.Condition()  # guards the batcher: held for each decode step, a load, an evaluation
        self._results: dict[int, DecodedGroup] = {}
        self._loading = False
        self._failure: BaseException | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="continuous-batching", daemon=True)
        self._thread.start()

    @property
    def policy_version(self) -> int:
        return self.batcher.policy_version

    # ------------------------------------------------------------------ callers
    def generate(self, prompts: list[list[int]], *, min_version: int, timeout_s: float) -> list[DecodedGroup]:
        """Each prompt's group, in the order given, once the engine holds at least ``min_version``."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            self._wait_for(lambda: self.batcher.policy_version >= min_version, deadline, f"weights v{min_version}")
            request_ids = [self.batcher.submit(prompt) for prompt in prompts]
            self._lock.notify_all()
            self._wait_for(lambda: all(r in self._results for r in request_ids), deadline, "its groups")
            return [self._results.pop(request_id) for request_id in request_ids]

    def load_weights(self, load: Callable[[], None], version: int, *, timeout_s: float) -> None:
        """Run ``load`` once no row is running (no prompt is admitted meanwhile); label later groups ``version``.
        With partial rollouts: at once, between two decode steps, the running rows going on with ``version``."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            self._loading = True
            try:
                if not self.partial_rollouts:
                    self._wait_for(lambda: self.batcher.idle, deadline, "the running rows to finish before a load")
                try:  # stopping the rows is part of the load: a failure there leaves them stopped too
                    self.batcher.before_new_weights()
                    load()
                    self.batcher.take_new_weights(version)
                except BaseException as error:  # rows stopped for a load that failed cannot go on: say so to callers
                    self._failure = error
                    raise
            finally:
                self._loading = False
                self._lock.notify_all()

    def wait_for_version(self, version: int, *, timeout_s: float) -> None:
        with self._lock:
            self._wait_for(lambda: self.batcher.policy_version >= version, time.monotonic() + timeout_s, f"v{version}")

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        """Decoding paused (running rows keep their place) while the caller uses the model."""
        with self._lock:
            yield

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        self._thread.join(timeout=10)

    def _wait_for(self, condition: Callable[[], bool], deadline: float, what: str) -> None:
        while not condition():
            if self._failure is not None or self._closed:
                raise EngineStopped(f"continuous batching stopped while waiting for {what}: {self._failure!r}")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"continuous batching: no {what} within the timeout")
            self._lock.wait(timeout=min(remaining, IDLE_POLL_S))

    # ------------------------------------------------------------------ the decode thread
    def _has_work(self) -> bool:
        batcher = self.batcher
        return batcher.running_rows > 0 or (batcher.waiting_prompts > 0 and not self._loading)

    def _run(self) -> None:
        while True:
            with self._lock:
                if not self._lock.wait_for(lambda: self._closed or self._has_work(), timeout=IDLE_POLL_S):
                    continue
                if self._closed:
                    return
                try:
                    for group in self.batcher.step(admit=not self._loading):
                        self._results[group.request_id] = group
                except BaseException as error:  # reported to every waiting caller
                    logger.exception("continuous batching failed")
                    self._failure = error
                    return
                finally:
                    self._lock.notify_all()
            time.sleep(0)  # let a waiting caller take the lock between two steps
