"""FSDP2's GPU paths, written and checked on the CPU (issue 55, item 7): the devices and dtypes a GPU run gets, and the
one-GPU check's ``fsdp2_step`` in its dry run. Both run in the producers' environment (torch 2.13: its FSDP2 runs on
the CPU, torch 2.5.1's needs CUDA streams), so this file is in that tier.

Seen to fail, each with the engine deliberately broken (one mistake at a time, then restored):
- ``fsdp2_device_cases.py`` (run by ``test_trainer_under_fsdp2.py`` in that environment's one pytest process): mixed
  precision off under bf16 (blocks compute in fp32), the policy loaded in bf16 (bf16
  shards, no fp32 masters), full weights not cast to the training precision, ``device()`` always ``cuda:0``, gloo on
  GPUs, the device mesh always on the CPU, no decoder block found, ``auto`` precision resolved as on the CPU, the
  optimizer built over the parameters before sharding.
- ``fsdp2_step``'s dry run: mixed precision off under bf16, full weights not cast.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from uninstalled_checkout import SCRIPT, python_without_the_project, uninstalled_checkout

pytestmark = [pytest.mark.slow, pytest.mark.dist, pytest.mark.vllm]

REPO = Path(__file__).resolve().parents[2]
DEADLINE_S = 600


def test_the_one_gpu_checks_fsdp2_step_passes_its_dry_run_as_on_the_gpu_machine(tmp_path, producer_python):
    """As the lent machine runs it (an uninstalled copy of the checkout on ``PYTHONPATH``, an interpreter without
    the project), with today's torch and transformers: bf16 FSDP2 on the CPU over gloo against the fp32 step."""
    checkout = uninstalled_checkout(tmp_path / "checkout")
    python = python_without_the_project(tmp_path / "venv", producer_python)
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"} | {"PYTHONPATH": str(checkout)}
    done = subprocess.run(
        [python, str(checkout / "tests" / "gpu" / SCRIPT.name), "--dry-run", "--check", "fsdp2_step",
         "--timeout-s", "400"],
        cwd=checkout, env=env, capture_output=True, text=True, timeout=450,
    )  # fmt: skip
    record, summary = (json.loads(line) for line in done.stdout.splitlines())
    assert record["check"] == "fsdp2_step" and record["ok"] is True, (record, done.stderr[-2000:])
    assert "skipped" not in record and not record["detail"].get("forbidden_imports")
    step, reference = record["detail"]["step"], record["detail"]["reference"]["step"]
    assert record["detail"]["problems"] == []
    assert step["block_output_dtypes"] == ["torch.bfloat16"] and reference["block_output_dtypes"] == ["torch.float32"]
    assert step["full_state"]["dtypes"] == ["torch.bfloat16"] and step["sharded_blocks"] == 4
    assert step["parameters_after"] == {"types": ["DTensor"], "dtypes": ["torch.float32"], "devices": ["cpu"]}
    assert step["loss"] != reference["loss"]  # bf16 computed: the step's loss depends on its log-probs
    assert done.returncode == 0 and summary["ok"] is True
