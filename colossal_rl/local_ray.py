"""Stopping the local Ray instance a run started, with nothing of it left running afterwards.

``ray.shutdown()`` stops the GCS and the raylet; the rest of the instance exits on its own once it notices:
the dashboard and runtime-env agents poll for their raylet's death, and on a busy 2-core machine they were
seen alive 15 s later (CI: a run "finished" with two of its processes still running). So the driver takes the
instance's process tree before the shutdown, waits a grace period for it to exit, and kills what is left.
Only for an instance this process started (``ray.init(address="local")``): a cluster joined with
``--master_address`` is never touched.
"""

from __future__ import annotations

import logging

import psutil
import ray

logger = logging.getLogger(__name__)


def _command(process: psutil.Process) -> str:
    try:
        return " ".join(process.cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return ""


def _is_ray_process(process: psutil.Process) -> bool:
    """Ray's own processes: workers titled ``ray::...``, and the GCS, raylet and agents started from its package."""
    command = _command(process)
    return command.startswith("ray::") or "/ray/" in command


def ray_process_tree(root: psutil.Process | None = None) -> list[psutil.Process]:
    """The Ray processes among ``root``'s children (default: this process's), each with everything under it
    (workers, and what workers started: reward sandboxes and math workers)."""
    root = root or psutil.Process()
    tree: dict[int, psutil.Process] = {}
    for child in root.children():
        if _is_ray_process(child):
            tree[child.pid] = child
            try:
                tree |= {p.pid: p for p in child.children(recursive=True)}
            except psutil.NoSuchProcess:
                continue
    return list(tree.values())


def stop_processes(processes: list[psutil.Process], grace_s: float) -> list[psutil.Process]:
    """Wait up to ``grace_s`` for ``processes`` to exit, then kill the ones still running; returns those."""
    _, alive = psutil.wait_procs(processes, timeout=grace_s)
    for process in alive:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            continue
    psutil.wait_procs(alive, timeout=5)
    return alive


def shutdown_local_ray(grace_s: float = 10.0) -> None:
    """``ray.shutdown()`` of the instance this process started, then every process of it gone (killed after
    ``grace_s``)."""
    tree = ray_process_tree()
    commands = {process.pid: _command(process)[:80] for process in tree}
    ray.shutdown()
    killed = stop_processes(tree, grace_s)
    if killed:
        names = [commands[process.pid] for process in killed]
        logger.info("killed %d Ray processes still running %.0fs after shutdown: %s", len(killed), grace_s, names)
