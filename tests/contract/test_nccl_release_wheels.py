"""Both environments run one NCCL release, held to the resolved wheels' metadata (issue 44 item 1; no GPU needed).

- The GPU producers' resolved set (``producer_env_constraints_gpu.txt``, pip's report from the public index) pins the
  CUDA 13 torch 2.13.0 and ``nvidia-nccl-cu13`` at ``NCCL_RELEASE``; the trainers' installed torch 2.5.1 pins another
  release (so the preload is needed, and a change on either side fails here first).
- Resolved against the index as this machine's pip is configured (a local ``torch-2.13.0+cpu`` wheel in find-links on
  CI's machines), the GPU build gets the CUDA torch whose metadata pins ``NCCL_RELEASE`` (item 3's exclusion works).
- The trainers' preload, installed for real: torch 2.5.1's process then calls NCCL ``NCCL_RELEASE`` — asked of the
  loaded library with ``ncclGetVersion``, which needs no GPU.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from importlib.metadata import requires, version
from pathlib import Path

import pytest

from colossal_rl import trainer_nccl
from colossal_rl.comm.nccl_release import NCCL_RELEASE, PRODUCER_NCCL_PACKAGE, TRAINER_BASE_NCCL, TRAINER_NCCL_PACKAGE
from colossal_rl.producer_env import VLLM_PACKAGES, constraints_file

REPO_ROOT = Path(__file__).resolve().parents[2]


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def pins(text: str) -> dict[str, str]:
    return dict(re.findall(r"^([A-Za-z0-9_.\-]+)==(\S+)$", text, flags=re.MULTILINE))


def test_the_producers_resolved_set_runs_the_release_and_the_trainers_torch_another():
    gpu = constraints_file("gpu").read_text()
    resolved = pins(gpu)
    assert resolved["torch"] == "2.13.0" and "torch!=2.13.0+cpu" in gpu.splitlines()
    assert resolved[PRODUCER_NCCL_PACKAGE] == NCCL_RELEASE
    assert resolved["vllm"] == "0.32.0" and resolved["cupy-cuda13x"] == "14.2.0"
    assert f"{PRODUCER_NCCL_PACKAGE}=={NCCL_RELEASE}" in VLLM_PACKAGES["gpu"]  # a drift fails to resolve, loudly
    assert "cuda12" not in " ".join(resolved)  # no CUDA 12 runtime there: cupy-cuda12x would not load
    torch_nccl = [r for r in requires("torch") or [] if r.startswith(TRAINER_NCCL_PACKAGE)]
    assert (
        torch_nccl
        and re.sub(r"[\s()]", "", torch_nccl[0].split(";")[0]) == f"{TRAINER_NCCL_PACKAGE}=={TRAINER_BASE_NCCL}"
    )
    assert version(TRAINER_NCCL_PACKAGE) == TRAINER_BASE_NCCL != NCCL_RELEASE
    assert trainer_nccl.requirement() == f"{TRAINER_NCCL_PACKAGE}=={NCCL_RELEASE}"


def _index_or_skip(result: subprocess.CompletedProcess) -> None:
    if result.returncode != 0 and not in_ci() and "ResolutionImpossible" not in result.stderr:
        pytest.skip(f"no package index here: {result.stderr[-500:]}")
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.contract
def test_the_gpu_build_resolves_the_cuda_torch_that_pins_the_release(tmp_path):
    report = tmp_path / "report.json"
    command = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--no-deps", "--quiet",
               "--report", str(report), "-c", str(constraints_file("gpu")), "torch==2.13.0"]  # fmt: skip
    _index_or_skip(subprocess.run(command, capture_output=True, text=True, timeout=600))
    (torch,) = json.loads(report.read_text())["install"]
    assert torch["metadata"]["version"] == "2.13.0"  # not 2.13.0+cpu, even with that wheel in find-links
    assert f"{PRODUCER_NCCL_PACKAGE}=={NCCL_RELEASE}" in " ".join(torch["metadata"]["requires_dist"])


PROBE = "from colossal_rl.comm.nccl_release import loaded_nccl_version as v, loaded_nccl_library as l; print(v(), l())"


@pytest.mark.contract
@pytest.mark.slow
def test_under_the_preload_the_trainers_torch_calls_the_producers_release(monkeypatch):
    monkeypatch.delenv(trainer_nccl.OVERRIDE_VARIABLE, raising=False)  # the real install, cached across runs
    try:
        library = trainer_nccl.ensure_trainer_nccl()
    except Exception as error:  # noqa: BLE001 (pip's failure, reported)
        if in_ci():
            raise
        pytest.skip(f"could not install {trainer_nccl.requirement()}: {error}")
    env = {**os.environ, **trainer_nccl.trainer_runtime_env(on_gpu=True)["runtime_env"]["env_vars"]}
    preloaded = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert preloaded.stdout.split() == [NCCL_RELEASE, str(library)], preloaded.stderr[-2000:]
    env.pop("LD_PRELOAD")
    plain = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert plain.stdout.split()[0] == TRAINER_BASE_NCCL, plain.stderr[-2000:]
