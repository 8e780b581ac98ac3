"""Run test bodies in spawned processes, all joined with one deadline; a failure's traceback reaches the test.

Shared by the tests in this directory (importable as ``spawned``: pytest puts this directory on
``sys.path`` for them, and spawned children inherit the parent's ``sys.path``).
"""

from __future__ import annotations

import multiprocessing as mp
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import pytest


def run_and_report(out_dir: Path, name: str, body: Callable, *args) -> None:
    """The target of every spawned process: ``body(*args)``, its traceback written to ``name.error``."""
    try:
        body(*args)
    except BaseException:
        (out_dir / f"{name}.error").write_text(traceback.format_exc())
        raise


def error_text(out_dir: Path, name: str) -> str:
    path = out_dir / f"{name}.error"
    return path.read_text() if path.exists() else "(no traceback: killed or crashed before reporting)"


def run_spawned(out_dir: Path, bodies: dict[str, tuple[Callable, tuple]], deadline_s: float) -> float:
    """Start ``name -> (body, args)`` each in a spawned process; fail the test on the first failure or at
    the deadline (every process still alive is killed). Returns the wall time."""
    context = mp.get_context("spawn")
    processes = {
        name: context.Process(target=run_and_report, args=(out_dir, name, body, *args))
        for name, (body, args) in bodies.items()
    }
    started = time.monotonic()
    for process in processes.values():
        process.start()
    try:
        while any(p.is_alive() for p in processes.values()):
            failed = [name for name, p in processes.items() if p.exitcode not in (None, 0)]
            if failed:
                errors = {name: error_text(out_dir, name) for name in failed}
                pytest.fail(f"processes {failed} failed:\n" + "\n".join(f"{n}: {e}" for n, e in errors.items()))
            if time.monotonic() - started > deadline_s:
                alive = [name for name, p in processes.items() if p.is_alive()]
                pytest.fail(f"processes {alive} still running after {deadline_s:.0f}s (hung collective?)")
            time.sleep(0.2)
        failed = [name for name, p in processes.items() if p.exitcode != 0]
        if failed:
            pytest.fail(f"processes {failed} failed:\n" + "\n".join(error_text(out_dir, n) for n in failed))
    finally:
        for process in processes.values():
            if process.is_alive():
                process.kill()
            process.join(timeout=10)
    return time.monotonic() - started
