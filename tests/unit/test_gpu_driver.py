"""GPU producers refuse, in one line and before anything is built or started, a driver too old for their CUDA 13 torch
and a producer environment that got a CPU torch (issue 44 items 2 and 3)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from colossal_rl import nvidia_driver, producer_env
from colossal_rl.comm.nccl_release import NCCL_RELEASE
from colossal_rl.nvidia_driver import driver_problem, parse_proc_version, read_driver_version
from colossal_rl.producer_env import ProducerEnvError, torch_build_problem

PROPRIETARY = (
    "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 22:23:56 UTC 2024\nGCC version: gcc"
)
OPEN = "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.65.06  Release Build  (dvs-builder@U16-I3-B13-4-3)"


def test_the_kernel_modules_version_file_is_read_for_both_module_flavours():
    assert parse_proc_version(PROPRIETARY) == "550.54.15"
    assert parse_proc_version(OPEN) == "580.65.06"
    assert parse_proc_version("no driver here") is None


def test_nvidia_smi_answers_when_the_proc_file_is_missing(tmp_path):
    def smi(command, **kwargs):
        assert command[0] == "nvidia-smi"
        return subprocess.CompletedProcess(command, 0, stdout="575.57.08\n575.57.08\n", stderr="")

    assert read_driver_version(tmp_path / "missing", run=smi) == "575.57.08"
    proc = tmp_path / "version"
    proc.write_text(OPEN)
    assert read_driver_version(proc, run=lambda *a, **k: pytest.fail("the proc file answered")) == "580.65.06"

    def no_smi(command, **kwargs):
        raise FileNotFoundError("nvidia-smi")

    assert read_driver_version(tmp_path / "missing", run=no_smi) is None


@pytest.mark.parametrize("version", ["550.54.15", "575.57.08", "579.99"])
def test_a_driver_older_than_r580_is_refused_in_one_line_naming_it(version):
    problem = driver_problem(version)
    assert problem is not None and "\n" not in problem
    assert version in problem and "580.0 or later" in problem and "CUDA 13" in problem


@pytest.mark.parametrize("version", ["580.65.06", "580.0", "590.12"])
def test_r580_and_later_pass(version):
    assert driver_problem(version) is None


def test_an_unreadable_driver_is_refused_too():
    assert "cannot read the NVIDIA driver's version" in driver_problem(None)


def test_building_gpu_producers_on_an_old_driver_stops_before_any_build_step(tmp_path, monkeypatch):
    monkeypatch.setenv("COLOSSAL_RL_CACHE", str(tmp_path))
    monkeypatch.delenv("COLOSSAL_RL_PRODUCER_PYTHON", raising=False)
    monkeypatch.setattr(nvidia_driver, "read_driver_version", lambda: "550.54.15")
    monkeypatch.setattr(producer_env, "run_step", lambda *a: pytest.fail("built on a driver that cannot run it"))
    with pytest.raises(ProducerEnvError, match="NVIDIA driver 550.54.15 is too old"):
        producer_env.main(["build", "--kind", "gpu"])
    monkeypatch.setenv("COLOSSAL_RL_PRODUCER_PYTHON", str(Path(__file__)))  # a ready environment: still checked
    with pytest.raises(ProducerEnvError, match="too old"):
        producer_env.main(["build", "--kind", "gpu"])


def test_cpu_producers_never_read_the_driver(tmp_path, monkeypatch):
    monkeypatch.setenv("COLOSSAL_RL_PRODUCER_PYTHON", str(Path(__file__)))
    monkeypatch.setattr(nvidia_driver, "read_driver_version", lambda: pytest.fail("read on a CPU machine"))
    assert producer_env.ensure_producer_env("cpu") == Path(__file__)


def test_a_gpu_environment_with_a_cpu_torch_is_refused_in_one_line():
    problem = torch_build_problem("gpu", "2.13.0+cpu", None, None)
    assert problem is not None and "\n" not in problem
    assert "CPU build of torch (2.13.0+cpu)" in problem and "find-links" in problem
    assert torch_build_problem("cpu", "2.13.0+cpu", None, None) is None  # the CPU kind wants exactly that


def test_a_gpu_environment_whose_torch_runs_another_nccl_is_refused():
    assert torch_build_problem("gpu", "2.13.0", "13.0", NCCL_RELEASE) is None
    problem = torch_build_problem("gpu", "2.14.0", "13.0", "2.30.4")
    assert "NCCL 2.30.4" in problem and f"preload NCCL {NCCL_RELEASE}" in problem
