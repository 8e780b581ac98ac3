"""The trainer's own unit tests, run again in the producers' environment, where ``--trainer-backend auto`` in a bare
process is FSDP2: one trainer, two engines, one set of tests.

Each file below builds real trainers through ``tests/unit/trainer_harness.py`` and checks behaviour, not the engine:
exact resume (weights, optimizer, LR schedule and the random stream, bit for bit), pi_old and ``--ppo-epochs``, the
sequence layouts against padded, LoRA (adapter-only sync, merged export), the memory features, batch-level
advantages and online DPO — and FSDP2's own device and dtype cases (``fsdp2_device_cases.py``, see
``test_fsdp2_gpu_paths.py``). Here they run under torch 2.13 and transformers 5.19 with FSDP2, through that environment's
pytest, in one subprocess.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

REPO = Path(__file__).resolve().parents[2]
TRAINER_TESTS = (
    "tests/unit/test_trainer_resume.py",
    "tests/unit/test_trainer_old_logprobs.py",
    "tests/unit/test_trainer_layouts.py",
    "tests/unit/test_lora.py",
    "tests/unit/test_memory_features.py",
    "tests/unit/test_step_advantages.py",
    "tests/unit/test_online_dpo.py",
    "tests/unit/test_checkpoint_format.py",
    "tests/engines/fsdp2_device_cases.py",  # FSDP2's GPU devices and dtypes, checked on the CPU (one interpreter here)
)
DEADLINE_S = 900


def test_the_trainer_tests_pass_under_fsdp2(producer_python):
    check = [producer_python, "-c", "import colossal_rl.training.engines as e, colossal_rl.config as c; "
             "print(e.engine_name(c.RLConfig()))"]  # fmt: skip
    assert subprocess.run(check, cwd=REPO, capture_output=True, text=True, check=True).stdout.strip() == "fsdp2"
    command = [producer_python, "-m", "pytest", "-o", "addopts=", "-p", "no:cacheprovider", "-q", "--strict-markers"]
    done = subprocess.run(command + list(TRAINER_TESTS), cwd=REPO, capture_output=True, text=True, timeout=DEADLINE_S)
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    assert done.returncode == 0, done.stdout[-8000:] + done.stderr[-2000:]
    passed = re.search(r"(\d+) passed", summary)
    assert passed and int(passed.group(1)) >= 20 and "skipped" not in summary, summary
