"""Several optimizer steps and passes per round against one step per round, on the same prompts.

Issue 17's check: with pi_old the round's starting policy, DAPO with 4 optimizer steps per round and two
passes over the round (``-tbs 4 --ppo-epochs 2``, 8 updates a round) should learn at least as well as the
default one update per round (``-tbs 16``) on the same rounds of the same prompts, and its clip fraction
should be nonzero (the trust region acts). Each run is a fresh process (``rl_example.py``'s own config
path); the table gives greedy eval accuracy before -> after per seed, and the mean clip fractions.

    python benchmarks/ppo_epochs.py                  # 3 seeds x 2 configurations, 60 rounds each (~15 min)
    python benchmarks/ppo_epochs.py --rounds 20 --seeds 0
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CONFIGURATIONS = {
    "1 step/round": ["-a", "DAPO", "-ibs", "16", "-tbs", "16", "-tMbs", "16"],
    "4 steps x 2 epochs": ["-a", "DAPO", "-ibs", "16", "-tbs", "4", "-tMbs", "4", "--ppo-epochs", "2"],
    # A 4x smaller batch per update with the learning rate scaled down alike.
    "4 steps x 2 epochs lr/4": [
        *("-a", "DAPO", "-ibs", "16", "-tbs", "4", "-tMbs", "4", "--ppo-epochs", "2", "-lr", "5e-5"),
    ],
}
STEPS_PER_ROUND = {"1 step/round": 1, "4 steps x 2 epochs": 8, "4 steps x 2 epochs lr/4": 8}


def run_child(flags: list[str]) -> dict:
    """One training run in this process; prints a JSON summary line."""
    import logging

    from colossal_rl.command_line import build_parser, config_from_args
    from colossal_rl.driver.launch import run_training
    from colossal_rl.metrics import read_metrics

    logging.basicConfig(level=logging.WARNING)
    config = config_from_args(build_parser().parse_args(flags))
    summary = run_training(config, use_wandb=False)
    train = [r for r in read_metrics(Path(summary.run_dir) / "metrics.jsonl") if r["kind"] == "train"]
    return {
        "eval_before": summary.eval_accuracy_before["math"],
        "eval_after": summary.eval_accuracy_after["math"],
        "steps": summary.steps,
        "clip_fraction": statistics.mean(r["train/clip_fraction"] for r in train),
        "clip_fraction_high": statistics.mean(r["train/clip_fraction_high"] for r in train),
        "ratio_max": max(r["train/ratio_max"] for r in train),
    }


def run(name: str, seed: int, rounds: int, save_dir: str) -> dict:
    flags = [
        *CONFIGURATIONS[name],
        *("--seed", str(seed), "--max-steps", str(rounds * STEPS_PER_ROUND[name])),
        *("-ei", "0", "-sd", save_dir, "-p", "ppo_epochs", "--no-wandb"),
    ]
    env = os.environ | {"RAY_AUTH_MODE": "disabled", "WANDB_MODE": "disabled"}
    command = [sys.executable, __file__, "--child", json.dumps(flags)]
    finished = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO, check=False)
    if finished.returncode != 0:
        raise RuntimeError(f"{name} seed {seed} failed:\n{finished.stderr[-3000:]}")
    return json.loads(finished.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=60, help="production rounds per run (16 prompts each)")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--configs", default=",".join(CONFIGURATIONS), help="comma-separated configuration names")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(run_child(json.loads(args.child))))
        return
    seeds = [int(s) for s in args.seeds.split(",")]
    names = args.configs.split(",")
    unknown = set(names) - set(CONFIGURATIONS)
    if unknown:
        parser.error(f"--configs: unknown {sorted(unknown)}; known: {list(CONFIGURATIONS)}")
    results: dict[str, list[dict]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory() as save_dir:
        for seed in seeds:
            for name in names:  # alternate, so machine load hits every configuration alike
                results[name].append(run(name, seed, args.rounds, save_dir))
                print(f"{name:>20} seed {seed}: {results[name][-1]}", flush=True)
    print(f"\n{args.rounds} rounds of 16 prompts x 8 samples, DAPO, seeds {seeds}")
    print(
        "| configuration | optimizer steps | eval before -> after per seed | mean after | mean clip fraction (high) |"
    )
    print("|---|---:|---|---:|---:|")
    for name, runs in results.items():
        per_seed = ", ".join(f"{r['eval_before']:.3f} -> {r['eval_after']:.3f}" for r in runs)
        after = statistics.mean(r["eval_after"] for r in runs)
        clip = statistics.mean(r["clip_fraction"] for r in runs)
        high = statistics.mean(r["clip_fraction_high"] for r in runs)
        print(f"| {name} | {runs[0]['steps']} | {per_seed} | {after:.3f} | {clip:.4f} ({high:.4f}) |")
    base = statistics.mean(r["eval_after"] for r in results[names[0]])
    for name in names[1:]:
        other = statistics.mean(r["eval_after"] for r in results[name])
        print(f"ratio of mean final accuracy ({name} / {names[0]}): {other / base:.3f}")


if __name__ == "__main__":
    main()
