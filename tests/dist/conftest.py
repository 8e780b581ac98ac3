"""What the tests of tests/dist share: a local Ray instance per test module that asks for one."""

import os

import pytest
from ray_leftovers import shut_down_a_leftover_ray


@pytest.fixture(scope="module")
def local_ray():
    """A fresh local Ray of 2 CPUs for this module (never a cluster another process runs), shut down after it."""
    ray = pytest.importorskip("ray")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    shut_down_a_leftover_ray()
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()
