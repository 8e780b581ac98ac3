"""The processes of one ``rl_example.py`` run a test started, told apart from every other process on the machine.

The test sets :data:`RUN_MARKER` in the run's environment; every process the run starts (Ray's raylet and
workers, reward sandboxes) inherits it. Finding processes by marker, not by title, keeps a test from counting
or killing another run's processes: an earlier test's workers still exiting, or a parallel job's actors (a
benchmark's producer killed by a fault test was once absorbed by that benchmark's restart, and the test failed
for want of the restart it had caused). ``tests`` is on pytest's ``pythonpath``.
"""

from __future__ import annotations

import os
import time

import psutil

RUN_MARKER = "COLOSSAL_RL_TEST_RUN"


def new_marker() -> str:
    """A value no other run on this machine carries."""
    return f"{os.getpid()}-{time.monotonic_ns()}"


def marked_env(marker: str) -> dict[str, str]:
    """This process's environment with ``marker`` set and Ray's local auth off."""
    return {**os.environ, "RAY_AUTH_MODE": "disabled", RUN_MARKER: marker}


def processes_of_run(marker: str) -> dict[int, str]:
    """pid -> command line (200 characters) of every live process carrying ``marker``."""
    found = {}
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            if proc.environ().get(RUN_MARKER) == marker:
                found[proc.info["pid"]] = " ".join(proc.info["cmdline"] or [])[:200]
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def actor_pids(marker: str, actor: str) -> set[int]:
    """The run's worker processes of Ray actor class ``actor`` (Ray titles them ``ray::ProducerActor...``)."""
    return {pid for pid, cmdline in processes_of_run(marker).items() if f"ray::{actor}" in cmdline}
