"""A vLLM engine core that dies under a producer ends the producer (Ray restarts it), whichever sees it first: the
watchdog's periodic look, or a call into the engine that failed on the dead core's closed socket.

Real processes stand in for the engine core (a child whose command line names ``EngineCore``, as vLLM's does)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from colossal_rl.rollout.vllm_backend import EngineWatchdog, VllmBackend


@pytest.fixture
def engine_core():
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", "EngineCore_DP0"])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # its command line is readable once it has exec'd
        watchdog = EngineWatchdog(on_death=lambda pids: None)
        if watchdog.children:
            break
        time.sleep(0.05)
    yield process
    process.kill()
    process.wait()


def test_the_watchdog_sees_the_engine_core_of_this_process_and_its_death(engine_core):
    deaths = []
    watchdog = EngineWatchdog(on_death=deaths.append, interval_s=0.1)
    assert [child.pid for child in watchdog.children] == [engine_core.pid]
    watchdog.start()
    assert watchdog.gone() == [] and watchdog.gone_within(0.3) == []
    engine_core.send_signal(signal.SIGKILL)  # not reaped: a zombie, which counts as gone
    assert watchdog.gone_within(5.0) == [engine_core.pid]
    deadline = time.monotonic() + 5
    while not deaths and time.monotonic() < deadline:
        time.sleep(0.05)
    assert deaths == [[engine_core.pid]]


def backend_with(watchdog: EngineWatchdog, died: list) -> VllmBackend:
    """A backend as far as its failure handling goes: its watchdog, and ``_engine_died`` recording instead of exiting."""
    backend = object.__new__(VllmBackend)
    backend._watchdog = watchdog
    backend._closing = False
    backend._engine_died = died.append
    return backend


def test_a_call_failing_on_a_dead_engine_core_ends_the_producer_before_the_watchdog_looks(engine_core):
    died = []
    backend = backend_with(EngineWatchdog(on_death=lambda pids: None, interval_s=3600), died)
    engine_core.send_signal(signal.SIGKILL)
    backend._failure("generate", RuntimeError("ZMQError: Socket operation on non-socket"))
    assert died == [[engine_core.pid]]


def test_a_call_failing_with_the_engine_core_alive_is_an_error_named_in_one_line(engine_core):
    died = []
    backend = backend_with(EngineWatchdog(on_death=lambda pids: None, interval_s=3600), died)
    error = backend._failure("generate", ValueError("a worker raised: bad request"))
    assert died == []
    assert str(error) == "the vLLM engine failed during generate (ValueError: a worker raised: bad request)"
