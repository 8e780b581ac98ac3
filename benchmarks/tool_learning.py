"""GRPO with the calculator environment on the embedded tool-calling model: eval accuracy and tool-call rate, per seed.

Runs the tool guide's command, docs/guides/tools.md (
``python rl_example.py --env calculator -m colossal_rl/assets/tiny_qwen2_tools -d
.../arithmetic/train.jsonl -ed '{"arithmetic": ".../arithmetic/eval.jsonl"}' ...``) once per seed, one after the
other, each in its own process, and prints greedy eval accuracy and eval tool-call rate at every evaluation, the
training rollouts' tool-call rate at the first and last step, the lift (last eval minus step 0, in points) and the
wall time; the last line gives the mean and smallest lift.

    python benchmarks/tool_learning.py [--seeds 0,1,2] [--steps 16] [--save-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from colossal_rl.config import (  # noqa: E402
    EMBEDDED_ARITHMETIC_EVAL_DATA,
    EMBEDDED_ARITHMETIC_TRAIN_DATA,
    EMBEDDED_TOOL_MODEL_DIR,
)
from colossal_rl.metrics import read_metrics  # noqa: E402

FLAGS = ("-mnt", "40", "--max-turns", "3", "--max-total-tokens", "128", "-ei", "8")
"""The guide's command besides model, data, seed and steps."""


def command(seed: int, steps: int, save_dir: Path) -> list[str]:
    return [
        sys.executable, str(REPO / "rl_example.py"), "--no-wandb", "--env", "calculator",
        "-m", str(EMBEDDED_TOOL_MODEL_DIR), "-d", str(EMBEDDED_ARITHMETIC_TRAIN_DATA),
        "-ed", json.dumps({"arithmetic": str(EMBEDDED_ARITHMETIC_EVAL_DATA)}), *FLAGS,
        "--seed", str(seed), "--max-steps", str(steps), "-sd", str(save_dir),
    ]  # fmt: skip


def summarise(records: list[dict]) -> dict:
    """Evals (step, accuracy, tool-call rate) and the rollouts' tool-call rate per step (mean over producers)."""
    evals = [
        (r["step"], r["eval/arithmetic_accuracy"], r.get("eval/arithmetic_tool_call_rate", float("nan")))
        for r in records
        if r["kind"] == "eval"
    ]
    by_step: dict[int, list[float]] = {}
    for record in records:
        if record["kind"] == "rollout" and "rollout/tool_call_rate" in record:
            by_step.setdefault(record["step"], []).append(record["rollout/tool_call_rate"])
    rollout = [(step, statistics.mean(values)) for step, values in sorted(by_step.items())]
    return {"evals": evals, "rollout_tool_call_rate": rollout}


def run_once(seed: int, steps: int, save_dir: Path) -> tuple[dict, float]:
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "WANDB_MODE": "disabled"}
    start = time.perf_counter()
    argv = command(seed, steps, save_dir)
    done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=7200)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"seed {seed} failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    (run_dir,) = list(save_dir.iterdir())
    return summarise(read_metrics(run_dir / "metrics.jsonl")), wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--save-dir", type=Path, default=None, help="keep the run directories here (plots)")
    args = parser.parse_args()
    lifts = []
    with tempfile.TemporaryDirectory() as scratch:
        for seed in (int(s) for s in args.seeds.split(",")):
            summary, wall = run_once(seed, args.steps, (args.save_dir or Path(scratch)) / f"seed-{seed}")
            evals, rollout = summary["evals"], summary["rollout_tool_call_rate"]
            lift = 100 * (evals[-1][1] - evals[0][1])
            lifts.append(lift)
            curve = " -> ".join(f"{accuracy:.3f} (tools {rate:.2f})@{step}" for step, accuracy, rate in evals)
            calls = (
                f"rollout tool-call rate {rollout[0][1]:.2f}@{rollout[0][0]} -> {rollout[-1][1]:.2f}@{rollout[-1][0]}"
            )
            print(f"seed {seed}: {curve}  lift {lift:+.1f} points; {calls} ({wall:.0f} s)", flush=True)
    print(f"lift over {len(lifts)} seeds: mean {statistics.mean(lifts):+.1f}, min {min(lifts):+.1f}")


if __name__ == "__main__":
    main()
