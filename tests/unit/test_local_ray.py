"""Stopping a local Ray instance leaves none of its processes running (``colossal_rl/local_ray.py``), on real
processes standing in for Ray's: a process tree whose root is titled like a Ray process, with a child that
would never exit by itself (as the agents did, for a while, in CI), beside a child that is not Ray's."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil

from colossal_rl.local_ray import ray_process_tree, stop_processes

SLEEPER = "import time; time.sleep(120)"
STARTS_A_CHILD = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {SLEEPER!r}]); time.sleep(120)"
ROOT = f"""
import os, subprocess, sys
subprocess.Popen([sys.executable, "-c", {STARTS_A_CHILD!r}, "/site-packages/ray/core/raylet"])
subprocess.Popen([sys.executable, "-c", {SLEEPER!r}, "--user-script"])
while True:
    os.wait()  # reaps its children as they die, as an init would
"""
"""A driver stand-in: one child whose command line names ``.../ray/...`` (like the raylet) and which starts a
grandchild of its own (like a worker), and one child that is not Ray's. None would exit within 2 minutes."""


def test_the_tree_is_rays_processes_and_everything_under_them_and_stopping_it_kills_what_stays():
    root = subprocess.Popen([sys.executable, "-c", ROOT])
    try:
        deadline = time.monotonic() + 30
        while len(psutil.Process(root.pid).children(recursive=True)) < 3:
            assert time.monotonic() < deadline, "the stand-in's processes did not start"
            time.sleep(0.05)
        children = psutil.Process(root.pid).children()
        (ray_like,) = [c for c in children if "/ray/" in " ".join(c.cmdline())]
        (not_ray,) = [c for c in children if c is not ray_like]
        (grandchild,) = ray_like.children()

        tree = ray_process_tree(psutil.Process(root.pid))
        assert {p.pid for p in tree} == {ray_like.pid, grandchild.pid}, "Ray's processes and theirs, nothing else"

        started = time.monotonic()
        killed = stop_processes(tree, grace_s=0.5)
        assert {p.pid for p in killed} == {ray_like.pid, grandchild.pid}, "neither exits by itself: both killed"
        assert time.monotonic() - started < 10
        for process in (ray_like, grandchild):
            assert not process.is_running() or process.status() == psutil.STATUS_ZOMBIE
        assert not_ray.is_running() and not_ray.status() != psutil.STATUS_ZOMBIE, "other children are left alone"
    finally:
        for process in psutil.Process(root.pid).children(recursive=True):
            process.kill()
        root.kill()
        root.wait(timeout=10)


def test_processes_that_exit_within_the_grace_period_are_not_killed():
    quick = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.3)", "/ray/quick"])
    killed = stop_processes([psutil.Process(quick.pid)], grace_s=30)
    assert killed == [] and quick.wait(timeout=5) == 0
