"""Our vLLM backend against the real vLLM 0.7.3 package, on CPU: every name, keyword and output field it uses.

``vllm_package`` finds or installs the pinned package beside the project's environment (never into it);
``vllm_probe.py`` runs the checks in a subprocess that has it on ``PYTHONPATH`` and reports problems per check,
plus the problems each check reports for a planted mistake (its control). The engine itself needs a GPU:
what runs here is everything up to it (signatures, dataclass fields, config validation, vLLM's own output
classes fed to our re-batching, the worker RPC dispatch), read as source where an import needs libcuda.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from vllm_package import VLLM_VERSION, subprocess_env, vllm_pythonpath

pytestmark = pytest.mark.contract

PROBE = Path(__file__).with_name("vllm_probe.py")
CHECKS = (
    "llm_keywords", "sampling_params", "prompts", "outputs", "finish_reasons", "backend_uses", "weights_uses",
    "environment", "collective_rpc", "model_loaders",
)  # fmt: skip
CONTROLS = (*CHECKS, "backend_chain", "model_loaders_table")


@pytest.fixture(scope="module")
def vllm_env() -> dict[str, str]:
    return subprocess_env(vllm_pythonpath())


@pytest.fixture(scope="module")
def probe_result(vllm_env, tmp_path_factory) -> dict[str, dict[str, list[str]]]:
    result_path = tmp_path_factory.mktemp("vllm_probe") / "result.json"
    run = subprocess.run([sys.executable, str(PROBE), str(result_path)], env=vllm_env, capture_output=True, text=True,
                         timeout=900)  # fmt: skip
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(result_path.read_text())


def test_the_probe_ran_every_check_and_control(probe_result):
    assert sorted(probe_result["checks"]) == sorted(CHECKS)
    assert sorted(probe_result["controls"]) == sorted(CONTROLS)


@pytest.mark.parametrize("check", CHECKS)
def test_our_use_of_vllm_holds_against_the_real_package(probe_result, check):
    assert probe_result["checks"][check] == []


@pytest.mark.parametrize("control", CONTROLS)
def test_each_check_reports_a_planted_mistake(probe_result, control):
    assert probe_result["controls"][control], f"the {control} check did not notice its planted mistake"


def test_backend_sees_the_installed_package(vllm_env):
    # The counterpart of the unit tests that run without vLLM: with it importable, -b vllm is allowed.
    code = (
        "from colossal_rl.rollout.backend import require_backend, vllm_installed\n"
        "from colossal_rl.rollout.vllm_weights import installed_vllm_version\n"
        "require_backend('vllm')\n"
        "print(vllm_installed(), installed_vllm_version())\n"
    )
    run = subprocess.run([sys.executable, "-c", code], env=vllm_env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["True", VLLM_VERSION]
