"""Two consumers in a ZeRO-1, a tensor-parallel or a pipeline-parallel layout train the embedded model end to end through
``rl_example.py`` and learn (greedy eval accuracy rises).

Both runs see the same 12 optimizer steps of 8 prompts x 4 samples (ZeRO-1: 2 data-parallel ranks x
4 prompts; TP=2 and PP=2: one data-parallel rank of 8 prompts), fp32, and evaluate only before and after.
Measured on the 2-core CI machine (each run ~65-75 s): 0.215 -> 0.43 in the ZeRO-1 and TP layouts (PP=2 by hand: 0.215 -> 0.43, 72 s), with the same
accuracies at every intermediate eval too (steps 4 and 8 gave 0.34 and 0.24: the curve is noisy, so
fewer steps are not reliably above the start). Runs are deterministic (seeded sampling per round and
producer), so the margin asked for below is a real one, not luck.
"""

from __future__ import annotations

import math
import subprocess
import sys
import time
from pathlib import Path

import pytest

from colossal_rl.metrics import read_metrics

REPO = Path(__file__).resolve().parents[2]
STEPS = 12
MIN_GAIN = 0.1  # eval accuracy points; observed +0.215
RUN_TIMEOUT_S = 400

pytestmark = [pytest.mark.dist, pytest.mark.slow]

# Flags per layout; -tbs is per data-parallel rank, so both layouts train 8 prompts a step.
LAYOUTS = {
    "zero1": ["-t", "2", "-zero", "1", "-tbs", "4", "-tMbs", "4"],
    "tp2": ["-t", "2", "-tp", "2", "-tbs", "8", "-tMbs", "8"],
    "pp2": ["-t", "2", "-pp", "2", "-tbs", "8", "-tMbs", "8"],  # 4 pipeline micro-batches of 16 // 2 a step
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_parallel_consumers_learn_end_to_end(tmp_path, layout):
    command = [
        sys.executable,
        str(REPO / "rl_example.py"),
        *LAYOUTS[layout],
        *("-i", "2", "-g", "4", "-ibs", "8", "-imbs", "8", "-tmbs", "16"),
        *("--max-steps", str(STEPS), "-ei", "0", "-sd", str(tmp_path), "--no-wandb", "--timeout", "120"),
    ]
    started = time.monotonic()
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    wall_s = time.monotonic() - started
    assert done.returncode == 0, done.stderr[-3000:]

    (run_dir,) = [path for path in tmp_path.iterdir() if path.is_dir()]
    records = read_metrics(run_dir / "metrics.jsonl")
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))
    assert all(math.isfinite(r["train/loss"]) and math.isfinite(r["train/grad_norm"]) for r in train)
    versions = [r["rollout/policy_version"] for r in records if r["kind"] == "rollout"]
    assert versions[-1] > 0, "the producers never received trained weights"
    evals = [r for r in records if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [0, STEPS]
    before, after = (r["eval/math_accuracy"] for r in evals)
    print(f"{layout}: {wall_s:.0f}s, eval accuracy {before} -> {after}")  # noqa: T201
    assert after >= before + MIN_GAIN, f"{layout}: eval accuracy {before} -> {after}"
