"""``EngineService`` (``rollout/engine_service.py``) when a weight load fails: the load's caller gets the error, and
every caller waiting on the engine — for the new version (a chunk's ``generate``, an eval's ``wait_for_version``),
or for its groups (prompts held back while the load waits, rows stopped by a partial-rollout load) — fails at once
with ``EngineStopped`` naming the error, not at its own timeout. Wherever the load fails: stopping the running rows
(``before_new_weights``), loading, or taking the new weights (``take_new_weights``).

The service is real; its batcher is a fake whose rows run until released (no model). The service's idle poll is
made longer than any timeout here, so a caller is only ever woken by being told.
"""

from __future__ import annotations

import threading
import time
from collections import deque

import pytest
import torch

from colossal_rl.rollout import engine_service
from colossal_rl.rollout.batcher import DecodedGroup
from colossal_rl.rollout.engine_service import EngineService, EngineStopped

CALL_TIMEOUT_S = 20.0
"""Each waiting caller's own timeout: failing anywhere near it means it was not told."""
AT_ONCE_S = 5.0


class LoadFailed(RuntimeError):
    pass


class HeldRowsBatcher:
    """A fake batcher: every admitted prompt runs until :meth:`release` (one row per prompt)."""

    def __init__(self, fail_in: str | None = None):
        self.policy_version = 0
        self.fail_in = fail_in
        """``"before_new_weights"`` or ``"take_new_weights"``: that step of a load raises."""
        self._waiting: deque[int] = deque()
        self._running: set[int] = set()
        self._released: set[int] = set()
        self._next_id = 0

    @property
    def running_rows(self) -> int:
        return len(self._running)

    @property
    def waiting_prompts(self) -> int:
        return len(self._waiting)

    @property
    def idle(self) -> bool:
        return not self._running

    def submit(self, prompt: list[int], tag: object = None) -> int:
        self._next_id += 1
        self._waiting.append(self._next_id)
        return self._next_id

    def release(self) -> None:
        self._released |= self._running

    def step(self, admit: bool = True) -> list[DecodedGroup]:
        while admit and self._waiting:
            self._running.add(self._waiting.popleft())
        finished = sorted(self._running & self._released)
        self._running -= set(finished)
        if not finished:
            time.sleep(0.005)  # a decode step's time: the thread does not spin a core
        return [
            DecodedGroup(request_id, torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 1), (1,), self.policy_version)
            for request_id in finished
        ]

    def before_new_weights(self) -> None:
        if self.fail_in == "before_new_weights":
            raise LoadFailed("stopping the running rows failed")

    def take_new_weights(self, version: int) -> None:
        if self.fail_in == "take_new_weights":
            raise LoadFailed("re-prefilling the running rows failed")
        self.policy_version = version


class Caller(threading.Thread):
    """Runs ``call`` in a thread; what it returned or raised, and after how long."""

    def __init__(self, call):
        super().__init__(daemon=True)
        self.call, self.result, self.error, self.elapsed = call, None, None, None
        self.start()

    def run(self) -> None:
        started = time.monotonic()
        try:
            self.result = self.call()
        except BaseException as error:  # noqa: BLE001 - the test inspects it
            self.error = error
        self.elapsed = time.monotonic() - started

    def outcome(self) -> BaseException | None:
        self.join(CALL_TIMEOUT_S + 5)
        assert not self.is_alive()
        return self.error


@pytest.fixture(autouse=True)
def long_idle_poll(monkeypatch):
    monkeypatch.setattr(engine_service, "IDLE_POLL_S", 600.0)


def failing_load():
    raise LoadFailed("the sync's tensors did not load")


def wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + AT_ONCE_S
    while not condition():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.005)


def assert_stopped_at_once(caller: Caller, reason: str) -> None:
    error = caller.outcome()
    assert isinstance(error, EngineStopped), f"{type(error).__name__}: {error}"
    assert reason in str(error)
    assert caller.elapsed < AT_ONCE_S, f"told after {caller.elapsed:.1f}s"


@pytest.mark.parametrize("partial_rollouts", [False, True])
def test_a_failed_load_fails_the_callers_waiting_for_its_version_at_once(partial_rollouts):
    engine = EngineService(HeldRowsBatcher(), partial_rollouts=partial_rollouts)
    try:
        chunk = Caller(lambda: engine.generate([[1]], min_version=1, timeout_s=CALL_TIMEOUT_S))
        evaluation = Caller(lambda: engine.wait_for_version(1, timeout_s=CALL_TIMEOUT_S))
        time.sleep(0.05)  # both wait for v1
        with pytest.raises(LoadFailed, match="did not load"):
            engine.load_weights(failing_load, 1, timeout_s=CALL_TIMEOUT_S)
        assert_stopped_at_once(chunk, "did not load")
        assert_stopped_at_once(evaluation, "did not load")
    finally:
        engine.close()


def test_a_load_failing_after_the_running_rows_finish_fails_the_prompts_it_held_back_at_once():
    """Without partial rollouts a load waits for the running rows, holding new prompts back meanwhile; when it then
    fails, the prompts it held back are never admitted: their caller is told at once."""
    batcher = HeldRowsBatcher()
    engine = EngineService(batcher)
    try:
        running = Caller(lambda: engine.generate([[1]], min_version=0, timeout_s=CALL_TIMEOUT_S))
        wait_until(lambda: batcher.running_rows == 1, "the first prompt runs")
        load = Caller(lambda: engine.load_weights(failing_load, 1, timeout_s=CALL_TIMEOUT_S))
        wait_until(lambda: engine._loading, "the load waits for the running row")
        held_back = Caller(lambda: engine.generate([[2]], min_version=0, timeout_s=CALL_TIMEOUT_S))
        wait_until(lambda: batcher.waiting_prompts == 1, "the second prompt waits")
        with engine.exclusive():
            batcher.release()
        assert isinstance(load.outcome(), LoadFailed)
        assert running.outcome() is None and len(running.result) == 1  # finished with the weights it started with
        assert_stopped_at_once(held_back, "did not load")
    finally:
        engine.close()


@pytest.mark.parametrize("fail_in", ["before_new_weights", "load", "take_new_weights"])
def test_a_partial_rollout_load_failing_anywhere_fails_the_callers_of_the_rows_it_stopped_at_once(fail_in):
    batcher = HeldRowsBatcher(fail_in=fail_in)
    engine = EngineService(batcher, partial_rollouts=True)
    try:
        caller = Caller(lambda: engine.generate([[1], [2]], min_version=0, timeout_s=CALL_TIMEOUT_S))
        wait_until(lambda: batcher.running_rows == 2, "both prompts run")
        load = failing_load if fail_in == "load" else lambda: None
        with pytest.raises(LoadFailed):
            engine.load_weights(load, 1, timeout_s=CALL_TIMEOUT_S)
        assert_stopped_at_once(caller, "LoadFailed")
        with pytest.raises(EngineStopped):  # and the engine takes no more work
            engine.generate([[3]], min_version=0, timeout_s=CALL_TIMEOUT_S)
    finally:
        engine.close()


def test_a_decode_step_failing_fails_every_waiting_caller_at_once():
    batcher = HeldRowsBatcher()
    engine = EngineService(batcher)
    try:
        caller = Caller(lambda: engine.generate([[1]], min_version=0, timeout_s=CALL_TIMEOUT_S))
        waiting = Caller(lambda: engine.wait_for_version(1, timeout_s=CALL_TIMEOUT_S))
        wait_until(lambda: batcher.running_rows == 1, "the prompt runs")

        def broken_step(admit: bool = True):
            raise LoadFailed("decode step failed")

        with engine.exclusive():
            batcher.step = broken_step
        assert_stopped_at_once(caller, "decode step failed")
        assert_stopped_at_once(waiting, "decode step failed")
    finally:
        engine.close()
