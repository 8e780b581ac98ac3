"""GRPO on the embedded tiny VLM: greedy eval accuracy on the shapes-counting task before and after, per seed.

Runs the vision guide's command, docs/guides/vision.md (
``python rl_example.py -m colossal_rl/assets/tiny_qwen2_5_vl -d .../shapes/train.jsonl
-ed '{"shapes": ".../shapes/eval.jsonl"}' -rt boxed -mnt 12 --max-steps N -ei N/3``) once per seed and layout, one
after the other, each in its own process, and prints eval accuracy at every evaluation, the lift (last minus
step 0, in points) and the wall time; the last lines give each layout's mean and smallest lift.

Layouts: ``1p1t`` is 1 producer + 1 trainer (DDP); ``zero1`` is 1 producer + 2 trainers under ZeRO-1 (8 prompts each per step: the same 16 a step).

    python benchmarks/vision_learning.py [--seeds 0,1,2] [--steps 30] [--layouts 1p1t,zero1]
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

from colossal_rl.config import EMBEDDED_SHAPES_EVAL_DATA, EMBEDDED_SHAPES_TRAIN_DATA, EMBEDDED_VLM_DIR  # noqa: E402
from colossal_rl.metrics import read_metrics  # noqa: E402

LAYOUTS = {"1p1t": (), "zero1": ("-t", "2", "-zero", "1", "-tbs", "8", "-tMbs", "8")}


def run_once(layout: str, seed: int, steps: int, save_dir: Path) -> tuple[list[tuple[int, float]], float]:
    """((step, eval accuracy) at every evaluation, wall seconds) of one run."""
    argv = [
        sys.executable, str(REPO / "rl_example.py"), "--no-wandb", "-m", str(EMBEDDED_VLM_DIR),
        "-d", str(EMBEDDED_SHAPES_TRAIN_DATA), "-ed", json.dumps({"shapes": str(EMBEDDED_SHAPES_EVAL_DATA)}),
        "-rt", "boxed", "-mnt", "12", "--seed", str(seed), "--max-steps", str(steps),
        "-ei", str(max(1, steps // 3)), "-sd", str(save_dir), *LAYOUTS[layout],
    ]  # fmt: skip
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "WANDB_MODE": "disabled"}
    start = time.perf_counter()
    done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=3600)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{layout} seed {seed} failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    (run_dir,) = list(save_dir.iterdir())
    evals = [
        (record["step"], record["eval/shapes_accuracy"])
        for record in read_metrics(run_dir / "metrics.jsonl")
        if record["kind"] == "eval"
    ]
    return evals, wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--layouts", default="1p1t,zero1")
    args = parser.parse_args()
    lifts: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as scratch:
        for layout in args.layouts.split(","):
            for seed in (int(s) for s in args.seeds.split(",")):
                evals, wall = run_once(layout, seed, args.steps, Path(scratch) / f"{layout}-{seed}")
                lift = 100 * (evals[-1][1] - evals[0][1])
                lifts.setdefault(layout, []).append(lift)
                curve = " -> ".join(f"{accuracy:.3f}@{step}" for step, accuracy in evals)
                print(f"{layout:6s} seed {seed}: {curve}  lift {lift:+.1f} points  ({wall:.0f} s)", flush=True)
    for layout, values in lifts.items():
        print(f"{layout:6s} lift over {len(values)} seeds: mean {statistics.mean(values):+.1f}, min {min(values):+.1f}")


if __name__ == "__main__":
    main()
