"""LoRA end to end through ``rl_example.py`` on the embedded model.

ZeRO-1 on two trainers, the weights going to the producer through the ``files`` weight-sync mode: two steps with a
checkpoint per step, the export holding merged weights and the adapter alone; then a run resumed from the first
checkpoint trains step 2 again and must train it exactly as the uninterrupted run did. The weight sync moves only
adapters, at most 5 % of the full model's bytes. (DDP LoRA, on one trainer, runs in ``tests/vllm_engine``.)
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from colossal_rl.metrics import read_metrics

REPO = Path(__file__).resolve().parents[2]
LORA = ("--lora-rank", "4", "--lora-alpha", "8")
COMPARED = ("train/loss", "train/grad_norm", "train/reward", "train/entropy")

pytestmark = [pytest.mark.dist, pytest.mark.slow]


def run(save_dir: Path, max_steps: int, *extra: str) -> subprocess.CompletedProcess:
    argv = [
        sys.executable, str(REPO / "rl_example.py"), "--no-wandb", *LORA, "--max-steps", str(max_steps),
        "-ei", "0", "--timeout", "120", "-sd", str(save_dir), *extra,
    ]  # fmt: skip
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "WANDB_MODE": "disabled"}
    return subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def synced_fraction(stderr: str) -> float:
    found = re.findall(r"LoRA: the weight sync carries \d+ adapter tensors, \d+ bytes = ([0-9.]+)% of the full", stderr)
    assert found, "the trainer did not report the adapter-only sync"
    return float(found[-1]) / 100


def train_records(save_dir: Path) -> list[dict]:
    (run_dir,) = list(save_dir.iterdir())
    return [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "train"]


def test_lora_zero1_through_files_sync_resumes_exactly_and_exports_merged_weights(tmp_path: Path):
    from peft import PeftConfig
    from transformers import AutoModelForCausalLM

    zero1 = ("-t", "2", "-zero", "1", "-tbs", "8", "-tMbs", "8", "-si", "1", "--weight-sync-mode", "files")
    first = run(tmp_path / "first", 2, *zero1)
    assert first.returncode == 0, first.stderr[-3000:]
    assert synced_fraction(first.stderr) <= 0.05
    (run_dir,) = list((tmp_path / "first").iterdir())
    assert [r["step"] for r in train_records(tmp_path / "first")] == [1, 2]
    AutoModelForCausalLM.from_pretrained(run_dir / "final")  # plain weights: no adapter keys left
    assert PeftConfig.from_pretrained(str(run_dir / "final" / "adapter")).r == 4

    resumed = run(tmp_path / "resumed", 2, *zero1, "-cp", str(run_dir / "checkpoints" / "step_000001"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "at step 1" in resumed.stderr
    uninterrupted, again = train_records(tmp_path / "first")[1], train_records(tmp_path / "resumed")[0]
    assert again["step"] == uninterrupted["step"] == 2
    assert {k: again[k] for k in COMPARED} == {k: uninterrupted[k] for k in COMPARED}
