"""A mixture-of-experts policy end to end through ``rl_example.py``: the embedded tiny Qwen3-MoE trained under
ZeRO-1 on two trainers with routing replay (docs/guides/mixture-of-experts.md's second command, cut to 10 steps).

The producer records every token's experts in its sampling forward, the batches carry them to both trainers, and
the trainers' forwards replay them: at the first step (staleness 0, the producer's weights) the trainer's recomputed
log-probs equal the behaviour ones; afterwards the producers run one version behind, the trainers' own routers
disagree on some choices (``train/routing_mismatch_fraction`` > 0), and the run still lifts eval accuracy by at
least 25 points.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from colossal_rl.config import EMBEDDED_MOE_DIR
from colossal_rl.metrics import read_metrics

REPO = Path(__file__).resolve().parents[2]
MIN_LIFT = 0.25

pytestmark = [pytest.mark.dist, pytest.mark.slow]


def test_the_tiny_moe_learns_under_zero1_with_routing_replay(tmp_path):
    argv = [
        sys.executable, str(REPO / "rl_example.py"), "--no-wandb", "-m", str(EMBEDDED_MOE_DIR), "--routing-replay",
        "-t", "2", "-zero", "1", "-tbs", "8", "-tMbs", "8", "--max-steps", "10", "-ei", "10", "--timeout", "120",
        "-sd", str(tmp_path),
    ]  # fmt: skip
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "WANDB_MODE": "disabled"}
    done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    (run_dir,) = list(tmp_path.iterdir())
    records = read_metrics(run_dir / "metrics.jsonl")
    evals = [r["eval/math_accuracy"] for r in records if r["kind"] == "eval"]
    assert evals[-1] - evals[0] >= MIN_LIFT, evals
    steps = [r for r in records if "train/routing_mismatch_fraction" in r]
    assert len(steps) == 10  # every step replayed routes
    first = min(steps, key=lambda r: r["step"])
    assert first["off_policy/logprob_abs_diff"] < 1e-5  # staleness 0: the producer's log-probs, recomputed
    assert first["train/routing_mismatch_fraction"] == 0.0
    assert max(r["train/routing_mismatch_fraction"] for r in steps) > 0.0  # one version behind: some disagree
