"""Rounds vs streaming with continuous batching, side by side, on issue 35's (b) long-tail task and (c) DAPO.

For each task and seed, starts ``rl_example.py --schedule rounds`` and ``--schedule stream --continuous-batching``
at the same time (one core each on a 2-core machine, so both see the same background load), with equal optimizer
steps (``--max-steps``), then prints per run: trained samples/s (steps x groups per step x -g, over the time from
the actors being ready, the ``data`` record, to the last step's record), the eval accuracy after, and the
stream/rounds ratio. Also prints (b)'s measured response-length histogram for ``schedule_simulator.py --lengths``.

(b): ``colossal_rl/assets/long_tail`` (``scripts/build_long_tail_task.py``): the default prompts plus one in nine
whose responses run to ``-mnt``. (c): the default task with ``-a DAPO`` (dynamic sampling).

    python benchmarks/stream_long_tail.py --tasks b c --seeds 0 --max-steps 30
    python benchmarks/stream_long_tail.py --tasks b --backend vllm --model /tmp/wide --against stream stream_partial

``--backend``/``--model`` apply to every run; several ``--against`` schedules start together with rounds.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from colossal_rl.metrics import read_metrics  # noqa: E402

logger = logging.getLogger("stream_long_tail")

LONG_TAIL = REPO / "colossal_rl" / "assets" / "long_tail"
TASKS = {
    "b": ["-d", str(LONG_TAIL / "train.jsonl"), "-ed", json.dumps({"long_tail": str(LONG_TAIL / "eval.jsonl")}),
          "-s", "", "-mnt", "96"],
    "c": ["-a", "DAPO"],
}  # fmt: skip
SCHEDULES = {
    "rounds": ["--schedule", "rounds"],
    "stream": ["--schedule", "stream", "--continuous-batching"],
    "stream_batched": ["--schedule", "stream"],  # without continuous batching: what the schedule alone gives
    "stream_partial": ["--schedule", "stream", "--continuous-batching", "--partial-rollouts"],  # syncs never drain
}
COMMON = ["--no-wandb", "--no-final-export", "--max-actor-restarts", "0", "-ei", "0", "--timeout", "600"]


def start(task: str, schedule: str, seed: int, max_steps: int, save_dir: Path, extra: list[str]) -> subprocess.Popen:
    command = [sys.executable, "rl_example.py", *TASKS[task], *SCHEDULES[schedule], *COMMON, *extra]
    command += ["--seed", str(seed), "--max-steps", str(max_steps), "-sd", str(save_dir)]
    log = (save_dir.parent / f"{save_dir.name}.log").open("w")
    return subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy())


def summary(save_dir: Path, num_generations: int) -> dict[str, float]:
    (run_dir,) = list(save_dir.iterdir())
    records = read_metrics(run_dir / "metrics.jsonl")
    train = [r for r in records if r["kind"] == "train"]
    ready = next((r["time"] for r in records if r["kind"] == "data"), records[0]["time"])
    groups = sum(len(r["train/data_indices"]) for r in train)
    evals = [r for r in records if r["kind"] == "eval"]
    accuracy = {k: v for k, v in evals[-1].items() if k.startswith("eval/") and "accuracy" in k} if evals else {}
    return {
        "steps": len(train),
        "seconds": train[-1]["time"] - ready,
        "samples_per_s": groups * num_generations / (train[-1]["time"] - ready),
        "eval_after": next(iter(accuracy.values()), float("nan")),
        "staleness": sum(r["train/staleness"] for r in train) / len(train),
        "lengths": response_lengths(records),
    }


def response_lengths(records: list[dict]) -> list[float]:
    return [r["rollout/response_length"] for r in records if r["kind"] == "rollout" and "rollout/response_length" in r]


def run_pair(
    task: str, seed: int, max_steps: int, root: Path, schedules: list[str], extra: list[str]
) -> dict[str, dict]:
    """The runs of ``schedules`` for one task and seed, started together (the same background load for all)."""
    dirs = {schedule: root / f"{task}-{schedule}-seed{seed}" for schedule in schedules}
    processes = {schedule: start(task, schedule, seed, max_steps, d, extra) for schedule, d in dirs.items()}
    for schedule, process in processes.items():
        if process.wait(timeout=3600) != 0:
            raise RuntimeError(f"{task} {schedule} seed {seed} failed: see {dirs[schedule]}.log")
    return {schedule: summary(d, num_generations=8) for schedule, d in dirs.items()}


def length_histogram(root: Path) -> str:
    """(b)'s per-sample response lengths in a stream run's rollouts (one prompt a chunk), as --lengths mix."""
    lengths = []
    for run_dir in root.glob("b-stream-seed*/*"):
        for record in read_metrics(run_dir / "metrics.jsonl"):
            if record["kind"] == "rollout":
                lengths.append(round(record["rollout/response_length"]))
    counts = Counter(min(96, 8 * max(1, round(length / 8))) for length in lengths)
    total = sum(counts.values())
    return ",".join(f"{count / total:.3f}@{length}" for length, count in sorted(counts.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", nargs="+", default=["b", "c"], choices=sorted(TASKS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--max-steps", type=int, default=30)
    parser.add_argument(
        "--against",
        nargs="+",
        choices=["stream", "stream_batched", "stream_partial"],
        default=["stream"],
        help="what runs beside rounds (several: all started together with it)",
    )
    parser.add_argument("--backend", choices=["transformers", "vllm"], default="transformers", help="-b of every run")
    parser.add_argument("--model", help="-m of every run (scripts/widen_model.py: a bigger model that does the task)")
    parser.add_argument("--keep", type=Path, default=None, help="keep the runs here (default: a temporary dir)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    root = args.keep or Path(tempfile.mkdtemp(prefix="stream_long_tail_"))
    root.mkdir(parents=True, exist_ok=True)
    extra = ["-b", args.backend] + (["-m", args.model] if args.model else [])
    logger.info(
        "| task | seed | against | rounds samples/s | its samples/s | ratio | eval after (rounds, it) | steps (rounds, "
        "it) | its lag |"
    )
    logger.info("|---|---:|---|---:|---:|---:|---|---|---:|")
    for task in args.tasks:
        for seed in args.seeds:
            result = run_pair(task, seed, args.max_steps, root, ["rounds", *args.against], extra)
            rounds = result["rounds"]
            for against in args.against:
                stream = result[against]
                logger.info(
                    "| %s | %d | %s | %.1f | %.1f | %.2fx | %.3f, %.3f | %d, %d | %.2f |", task, seed, against,
                    rounds["samples_per_s"], stream["samples_per_s"], stream["samples_per_s"] / rounds["samples_per_s"],
                    rounds["eval_after"], stream["eval_after"], rounds["steps"], stream["steps"], stream["staleness"],
                )  # fmt: skip
    if "b" in args.tasks:
        logger.info("(b) per-group mean response lengths, for schedule_simulator --lengths: %s", length_histogram(root))
    logger.info(
        "runs in %s (%s; beside rounds: %s)",
        root,
        " ".join(extra),
        "; ".join(" ".join(SCHEDULES[a]) for a in args.against),
    )


if __name__ == "__main__":
    main()
