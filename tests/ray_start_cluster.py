"""A two-node Ray cluster made with ``ray start`` on this one machine, as a user makes one across machines: a head
(``ray start --head``) and a second node joining it (``ray start --address=...``), each with its own CPUs and a
custom resource naming it.

Each node is a ``ray start --block`` child of the test, marked (``run_processes``); :meth:`RayStartCluster.stop`
sends each SIGTERM (``ray start --block`` then stops its node's processes, as ``ray stop`` would) and kills whatever
still carries the marker after a grace period. Not ``ray stop``: it stops every Ray process on the machine, other
runs' included. Every port is chosen by the OS (two raylets on one host must not share the fixed defaults), and the
cluster's temp dir is its own, so ``/tmp/ray/ray_current_cluster`` (which a bare ``ray.init()`` on this machine
would join) is never written.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
from run_processes import marked_env, new_marker, processes_of_run

RAY = str(Path(sys.executable).with_name("ray"))
NODE_START_TIMEOUT_S = 180.0
STOP_GRACE_S = 30.0


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class RayStartCluster:
    def __init__(self) -> None:
        self.marker = new_marker()
        # Short: Ray's unix sockets live under it (108-byte path limit); removed by stop().
        self.temp_dir = tempfile.mkdtemp(prefix="rc-", dir="/tmp")
        self.address = f"127.0.0.1:{free_port()}"
        self.nodes: dict[str, subprocess.Popen] = {}
        self.logs: dict[str, Path] = {}

    def add_node(self, name: str, num_cpus: int, env: dict[str, str] | None = None) -> None:
        """Start node ``name`` (the first one is the head) with ``num_cpus`` CPUs and resource ``{name: 1}``;
        returns once ``ray start`` says the node runs. ``env``: extra variables of that node's processes (every
        process Ray starts there inherits them)."""
        head = not self.nodes
        where = ["--head", f"--port={self.address.rsplit(':', 1)[1]}", "--include-dashboard=false"] if head else [
            f"--address={self.address}"
        ]  # fmt: skip
        command = [
            RAY, "start", *where, f"--num-cpus={num_cpus}", f'--resources={{"{name}": 1}}', "--num-gpus=0",
            f"--temp-dir={self.temp_dir}", "--disable-usage-stats", "--dashboard-agent-listen-port=0",
            "--min-worker-port=0", "--max-worker-port=0", "--block",
        ]  # fmt: skip
        self.logs[name] = Path(self.temp_dir) / f"ray-start-{name}.log"
        with self.logs[name].open("w") as log:
            self.nodes[name] = subprocess.Popen(command, env=marked_env(self.marker) | (env or {}), stdout=log,
                                                stderr=subprocess.STDOUT)  # fmt: skip
        deadline = time.monotonic() + NODE_START_TIMEOUT_S
        while "Ray runtime started" not in self.logs[name].read_text():
            if self.nodes[name].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"ray start of node {name!r} failed: {self.logs[name].read_text()[-3000:]}")
            time.sleep(0.5)

    def node_of(self, pid: int) -> str | None:
        """The node whose ``ray start`` process ``pid`` descends from (Ray starts actors under their node's raylet)."""
        starts = {process.pid: name for name, process in self.nodes.items()}
        try:
            ancestors = psutil.Process(pid).parents()
        except psutil.NoSuchProcess:
            return None
        return next((starts[parent.pid] for parent in ancestors if parent.pid in starts), None)

    def stop(self) -> list[str]:
        """Stop every node and every process of the cluster; returns the command lines that had to be killed."""
        for process in reversed(self.nodes.values()):  # workers first, then the head
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for process in self.nodes.values():
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
        while processes_of_run(self.marker) and time.monotonic() < deadline:
            time.sleep(0.5)
        left = processes_of_run(self.marker)
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue
        shutil.rmtree(self.temp_dir, ignore_errors=True)
        return sorted(left.values())
