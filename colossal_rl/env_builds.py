"""Building an environment once, for the actors' Python environments (``producer_env.py``, ``trainer_nccl.py``):
where the caches live, the lock a build holds, and a build step run with its output logged.

Importing this module needs neither torch, Ray nor vLLM.
"""

from __future__ import annotations

import fcntl
import logging
import os
import subprocess
import threading
import time
from collections import deque
from pathlib import Path

logger = logging.getLogger(__name__)

CACHE_VARIABLE = "COLOSSAL_RL_CACHE"


class ProducerEnvError(RuntimeError):
    """The producer environment is missing, cannot be built, or does not work."""


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_VARIABLE) or Path.home() / ".cache" / "colossal-rl") / "producer-envs"


STEP_TIMEOUT_S = 1800.0
"""Bound on one build step (pip resolving and downloading vLLM's dependencies takes 2-4 minutes here)."""


def run_step(what: str, command: list[str], log_path: Path, timeout_s: float = STEP_TIMEOUT_S) -> None:
    """Run one step, streaming its output to the log file and (one line in twenty, plus the tail) to ``logger``."""
    logger.info("producer environment: %s", what)
    started = time.monotonic()
    tail: deque[str] = deque(maxlen=15)
    with log_path.open("a", encoding="utf-8") as log:
        log.write(f"$ {' '.join(command)}\n")
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                   env={**os.environ, "PIP_PROGRESS_BAR": "off", "PYTHONUNBUFFERED": "1"})  # fmt: skip
        assert process.stdout is not None
        watchdog = threading.Timer(timeout_s, process.kill)  # the line loop below ends when the process dies
        watchdog.start()
        try:
            for number, line in enumerate(process.stdout):
                log.write(line)
                tail.append(line.rstrip())
                if number % 20 == 0 and line.strip():
                    logger.info("producer environment: %s", line.rstrip()[:200])
            code = process.wait()
        finally:  # interrupted (Ctrl-C, a test's timeout): no pip left writing into the environment
            watchdog.cancel()
            if process.poll() is None:
                process.kill()
                process.wait()
    if code != 0 and time.monotonic() - started >= timeout_s:
        raise ProducerEnvError(f"building the vLLM producer environment: '{what}' took over {timeout_s:.0f}s and was "
                               f"stopped; full log: {log_path}")  # fmt: skip
    if code != 0:
        raise ProducerEnvError(
            f"building the vLLM producer environment failed at '{what}' (exit {code}); full log: {log_path}\n"
            + "\n".join(tail)
        )


def locked(directory: Path, timeout_s: float):
    """An exclusive lock on ``directory``'s build, waited for at most ``timeout_s``."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    handle = open(directory.with_suffix(".lock"), "w")  # noqa: SIM115 (closed by the caller)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return handle
        except BlockingIOError:
            if time.monotonic() > deadline:
                handle.close()
                raise ProducerEnvError(
                    f"another process has been building {directory} for over {timeout_s:.0f}s; remove "
                    f"{directory.with_suffix('.lock')} if no build is running"
                ) from None
            time.sleep(2.0)
