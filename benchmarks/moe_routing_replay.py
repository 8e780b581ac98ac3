"""Routing replay on the embedded tiny Qwen3-MoE: eval lift, behaviour/trainer log-prob gap and routing mismatch,
with and without ``--routing-replay``, per seed.

Each run is ``python rl_example.py -m colossal_rl/assets/tiny_qwen3_moe --max-steps N -ei N/2 [--routing-replay]``
in its own process, one after the other (the default schedule: producers one version behind the trainers, so the
behaviour policy is pi_old's predecessor and the gap carries staleness as well as numerics). Read from each run's
metrics.jsonl:

- ``gap``: mean over steps of ``off_policy/logprob_abs_diff``, mean |log pi_old - log pi_behaviour| per token,
  pi_old recomputed by the trainer (with replay: under the producer's routes);
- ``mismatch``: mean over steps of ``train/routing_mismatch_fraction``, the (token, layer) choices where the
  trainer's own router disagreed with the producer's recorded one (measured under replay only: without it the
  producer records nothing, and each such choice is one the trainer's forward took differently);
- eval greedy accuracy at step 0 and at the end, and the lift in points.

    python benchmarks/moe_routing_replay.py [--seeds 0,1,2] [--steps 40]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from colossal_rl.config import EMBEDDED_MOE_DIR  # noqa: E402
from colossal_rl.metrics import read_metrics  # noqa: E402

MODES = {"no replay": (), "replay": ("--routing-replay",)}


def run_once(mode: str, seed: int, steps: int, save_dir: Path) -> dict[str, float]:
    argv = [
        sys.executable, str(REPO / "rl_example.py"), "--no-wandb", "-m", str(EMBEDDED_MOE_DIR), "--seed", str(seed),
        "--max-steps", str(steps), "-ei", str(max(1, steps // 2)), "-sd", str(save_dir), *MODES[mode],
    ]  # fmt: skip
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "WANDB_MODE": "disabled"}
    start = time.perf_counter()
    done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=3600)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{mode} seed {seed} failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    (run_dir,) = list(save_dir.iterdir())
    records = read_metrics(run_dir / "metrics.jsonl")
    evals = [r["eval/math_accuracy"] for r in records if r["kind"] == "eval"]
    gaps = [r["off_policy/logprob_abs_diff"] for r in records if "off_policy/logprob_abs_diff" in r]
    mismatches = [r["train/routing_mismatch_fraction"] for r in records if "train/routing_mismatch_fraction" in r]
    return {
        "before": evals[0],
        "after": evals[-1],
        "gap": statistics.mean(gaps),
        "mismatch": statistics.mean(mismatches) if mismatches else float("nan"),
        "wall": wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    results: dict[str, list[dict[str, float]]] = {}
    print("| mode | seed | eval before | eval after | lift (points) | log-prob gap | routing mismatch | wall |")
    print("|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as scratch:
        for seed in (int(s) for s in args.seeds.split(",")):
            for mode in MODES:
                r = run_once(mode, seed, args.steps, Path(scratch) / f"{mode.replace(' ', '_')}-{seed}")
                results.setdefault(mode, []).append(r)
                print(f"| {mode} | {seed} | {r['before']:.3f} | {r['after']:.3f} | {100 * (r['after'] - r['before']):+.1f} "
                      f"| {r['gap']:.4f} | {r['mismatch']:.4f} | {r['wall']:.0f} s |", flush=True)  # fmt: skip
    for mode, rows in results.items():
        lifts = [100 * (r["after"] - r["before"]) for r in rows]
        print(f"| {mode} | mean | | | {statistics.mean(lifts):+.1f} (min {min(lifts):+.1f}) "
              f"| {statistics.mean(r['gap'] for r in rows):.4f} | {statistics.mean(r['mismatch'] for r in rows):.4f} | |")  # fmt: skip


if __name__ == "__main__":
    main()
