"""The producers' environment (real vLLM on CPU), built on first use and cached (``colossal_rl/producer_env.py``)."""

from __future__ import annotations

import pytest

from colossal_rl.producer_env import ensure_producer_env


@pytest.fixture(scope="session")
def producer_python() -> str:
    return str(ensure_producer_env("cpu"))
