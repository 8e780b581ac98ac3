"""Shared pytest setup: GPU tests skip themselves on machines without CUDA; Ray runs without auth locally; with vLLM
tests selected, the producers' environment starts building in the background as soon as collection ends."""

import os
import signal
import subprocess
import sys

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _no_ray_auto_init() -> None:
    """A Ray call before ``ray.init`` raises in the test that made it, instead of starting a Ray instance in the
    pytest worker unasked (Ray's auto-init): that instance outlives the test, and a later module's ``ray.init``
    then fails far from the cause. This process only: a run a test starts calls ``ray.init`` itself."""
    from ray._private import auto_init_hook

    auto_init_hook.enable_auto_connect = False


_no_ray_auto_init()


LONGEST_FIRST = ("tests/e2e/", "tests/vllm_engine/", "tests/engines/", "tests/dist/")
"""Directories whose files run longest, in the order their files are handed to the xdist workers: the long files
first and the many short unit files last, so the two workers end together instead of one waiting on the last long
file (the vLLM files start after the e2e ones, by when the background build of their environment is done)."""


def longest_first(item) -> int:
    for position, prefix in enumerate(LONGEST_FIRST):
        if item.nodeid.startswith(prefix):
            return position
    return len(LONGEST_FIRST)


def pytest_collection_modifyitems(config, items):
    import torch

    items.sort(key=longest_first)  # stable: each file's tests keep their order
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


_background_build: subprocess.Popen | None = None


@pytest.fixture(scope="session")
def producer_python() -> str:
    """The producers' environment's interpreter (real vLLM on CPU, today's torch: the fsdp2 trainers' too), built on
    first use and cached (``colossal_rl/producer_env.py``)."""
    from colossal_rl.producer_env import ensure_producer_env

    return str(ensure_producer_env("cpu"))


def producer_env_missing() -> bool:
    """Whether the vLLM producers' environment this checkout needs is not built yet (and no override names one)."""
    from colossal_rl.producer_env import PYTHON_OVERRIDE_VARIABLE, detect_kind, env_dir, is_complete, spec_for

    if os.environ.get(PYTHON_OVERRIDE_VARIABLE):
        return False
    spec = spec_for(detect_kind())
    return not is_complete(env_dir(spec), spec)


def pytest_collection_finish(session):
    """Minutes of pip that would otherwise stall the first vLLM test overlap every test collected before it: the
    tier's fixture (``ensure_producer_env``) then waits on this build's lock, or finds it done."""
    global _background_build
    if not any("vllm" in item.keywords for item in session.items) or not producer_env_missing():
        return
    log = open(os.devnull, "w")  # noqa: SIM115  (the build writes its own log next to the environment)
    _background_build = subprocess.Popen(
        [sys.executable, "-m", "colossal_rl.producer_env", "build"], stdout=log, stderr=subprocess.STDOUT,
        start_new_session=True,
    )  # fmt: skip


def pytest_sessionfinish(session, exitstatus):
    """A build still running when the session ends (its tests deselected or failed early) is stopped, pip included:
    the next build starts over (an environment is used only once marked complete)."""
    if _background_build is not None and _background_build.poll() is None:
        os.killpg(_background_build.pid, signal.SIGKILL)
        _background_build.wait(timeout=30)
