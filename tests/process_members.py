"""Group members of a collective test run as separate processes, as they are in a run (``tests`` is on pytest's
``pythonpath``)."""

from __future__ import annotations

import multiprocessing
import pickle
import time

_FORK = multiprocessing.get_context("fork")  # the members are closures: fork runs them without pickling


def run_members(targets, timeout_s: float) -> list:
    """``target()`` of every member, each in its own forked process, as group members are in a run; returns
    each one's result, or the exception it raised (re-created from its text if it does not pickle).

    Processes, not threads: gloo groups built concurrently by threads of one process occasionally abort that
    whole process (SIGABRT from C++, no Python traceback; seen 1 in ~25 runs of this file) - a situation a
    run never creates, and one that took the whole test session down with it."""

    def body(target, conn) -> None:
        try:
            outcome = target()
        except BaseException as error:  # noqa: BLE001 - reported to the test below
            outcome = error
        try:  # plain pickle: tensors by value (multiprocessing's own would share memory this process frees)
            payload = pickle.dumps(outcome)
        except Exception:  # an exception or result that does not pickle: its text
            payload = pickle.dumps(RuntimeError(repr(outcome)))
        conn.send_bytes(payload)
        conn.close()

    pipes, processes = [], []
    for target in targets:
        receive_end, send_end = _FORK.Pipe(duplex=False)
        process = _FORK.Process(target=body, args=(target, send_end), daemon=True)
        process.start()
        send_end.close()
        pipes.append(receive_end)
        processes.append(process)
    results = []
    deadline = time.monotonic() + timeout_s + 10
    for index, (pipe, process) in enumerate(zip(pipes, processes, strict=True)):
        if not pipe.poll(max(0.0, deadline - time.monotonic())):
            for other in processes:
                other.kill()
            raise AssertionError(f"member {index} hung or died (exit code {process.exitcode})")
        results.append(pickle.loads(pipe.recv_bytes()))
    for process in processes:
        process.join(10)
    return results
