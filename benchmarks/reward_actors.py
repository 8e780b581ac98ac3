"""Reward-model throughput: one reward actor batching every producer's requests vs each producer scoring its own.

``-rt model`` runs the reward model on its own actor(s) (``driver/actors.RewardModelActor``), fed by every producer
through ``comm/remote_reward.RemoteRewardScorer``; the alternative is a copy of the model in every producer. Both
are measured side by side in one run, on the same samples: ``--producers`` Ray tasks each score ``--batches``
batches of ``--batch`` samples (a round's share: prompts x group size), at the same time,

  shared       every task sends its batches to one reward actor, which batches them together (up to
               ``--reward-batch-size`` samples a forward pass);
  per-producer every task loads the reward model itself and scores its own batches.

It prints samples/s of each and their ratio, the shared actor's batches (requests per batch), and each side's
model copies. Memory is the other half of the trade: one copy of the model instead of one per producer.

    python benchmarks/reward_actors.py                       # the tiny reward model, 4 producers
    python benchmarks/reward_actors.py --producers 2 --batch 64 --reward-model PATH
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

import ray

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from colossal_rl.config import ASSETS_DIR, EMBEDDED_EVAL_DATA, RewardConfig, RLConfig, ScheduleConfig  # noqa: E402

logger = logging.getLogger("reward_actors")
TINY_REWARD_MODEL = ASSETS_DIR / "tiny_reward_model"


def samples(count: int) -> tuple[list[dict], list[str]]:
    """``count`` (row, response) pairs from the embedded eval set, half with the right boxed answer."""
    rows = [json.loads(line) for line in EMBEDDED_EVAL_DATA.read_text().splitlines() if line.strip()]
    picked = [rows[i % len(rows)] for i in range(count)]
    responses = [
        f"\\boxed{{{row['gt_answer']}}}" if i % 2 == 0 else f"\\boxed{{{row['gt_answer']}1}}"
        for i, row in enumerate(picked)
    ]
    return [{"messages": row["messages"], "gt_answer": row["gt_answer"]} for row in picked], responses


@ray.remote(num_cpus=0)
def producer_through_actor(actors, rank: int, batches: list, timeout_s: float) -> float:
    from colossal_rl.comm.remote_reward import RemoteRewardScorer

    scorer = RemoteRewardScorer(actors, rank, timeout_s=timeout_s, label="benchmark")
    started = time.perf_counter()
    for rows, responses in batches:
        records = scorer.score_batch(responses, rows)
        assert all(record.status == "ok" for record in records), records[0]
    return time.perf_counter() - started


@ray.remote(num_cpus=0)
def producer_scoring_itself(reward_model: str, batch_size: int, batches: list, threads: int) -> float:
    import torch

    from colossal_rl.reward import build_served_scorer

    torch.set_num_threads(threads)
    scorer = build_served_scorer("model", reward_model=reward_model, batch_size=batch_size)
    started = time.perf_counter()
    for rows, responses in batches:
        scorer.score_batch(responses, rows)
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reward-model", default=str(TINY_REWARD_MODEL))
    parser.add_argument("--producers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32, help="samples per producer request")
    parser.add_argument("--batches", type=int, default=8, help="requests per producer")
    parser.add_argument("--reward-batch-size", type=int, default=128, help="the actor's largest forward pass")
    parser.add_argument("--repeats", type=int, default=2, help="alternating repeats of both sides; the best is kept")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    from colossal_rl.driver.actors import RewardModelActor

    cores = os.cpu_count() or 1
    rows, responses = samples(args.batch * args.batches * args.producers)
    per = args.batch * args.batches
    work = [
        [
            (rows[p * per + b * args.batch : p * per + (b + 1) * args.batch],
             responses[p * per + b * args.batch : p * per + (b + 1) * args.batch])
            for b in range(args.batches)
        ]
        for p in range(args.producers)
    ]  # fmt: skip
    total = args.producers * per
    ray.init(num_cpus=cores, include_dashboard=False, log_to_driver=False)
    try:
        config = RLConfig(
            reward=RewardConfig(reward_type="model", reward_model=args.reward_model,
                                reward_batch_size=args.reward_batch_size),
            schedule=ScheduleConfig(num_producers=args.producers),
        )  # fmt: skip
        actor = RewardModelActor.options(num_cpus=0).remote(0, config, 1)  # one thread: faster here than 2
        ray.get(actor.ready.remote(), timeout=300)
        best = {"shared": float("inf"), "per-producer": float("inf")}
        for _ in range(args.repeats):
            took = ray.get([producer_through_actor.remote([actor], p, work[p], 600.0) for p in range(args.producers)])
            best["shared"] = min(best["shared"], max(took))  # every producer done
            threads = max(1, cores // args.producers)
            took = ray.get([producer_scoring_itself.remote(args.reward_model, args.batch, work[p], threads)
                            for p in range(args.producers)])  # fmt: skip
            best["per-producer"] = min(best["per-producer"], max(took))  # loading the model left out
        stats = ray.get(actor.stats.remote())
    finally:
        ray.shutdown()
    shared, own = total / best["shared"], total / best["per-producer"]
    print(f"reward model {args.reward_model}; {args.producers} producers x {args.batches} requests x {args.batch} "
          f"samples = {total} samples; {cores} cores")  # fmt: skip
    print(f"  shared actor   {shared:8.1f} samples/s  (1 model copy; {stats['requests_per_batch']:.2f} requests "
          f"and up to {stats['largest_batch']:.0f} samples a batch)")  # fmt: skip
    print(f"  per producer   {own:8.1f} samples/s  ({args.producers} model copies, loading not timed)")
    print(f"shared / per-producer: {shared / own:.2f}x samples/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
