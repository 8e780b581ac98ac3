"""Trainer step time per sequence layout, side by side in one process, on real rollouts of the embedded task.

Two rollout shapes, each one optimizer step of 16 prompts x 8 samples made by the real producer
(``Producer.produce_chunk`` on round 0's rows: the embedded model, data, reward and post-processing):

- ``default``: the default run's rollouts (``python rl_example.py``'s config: prompts much longer than the
  16-token responses);
- ``long_responses``: a short system prompt (``-s "Add."``: prompts of ~14 tokens instead of ~80) and
  ``-mnt 64``: the model, pre-trained with the long default prompt, answers at length, so responses are
  longer than prompts and vary in length (the shape where sharing the prompt saves least).

For each, a world-size-1 ``Trainer`` per layout (padded, packed, shared_prompt; with and without a token
budget) runs ``train_step`` on the same batch, alternating layouts rep by rep; the median step time is
reported as a ratio to the padded layout, with the computed / real token ratio the trainer logs. AdamW
steps are real, so each rep starts from slightly different weights: timing only, not a loss comparison
(exactness is ``tests/unit/test_trainer_layouts.py``'s job).

    python benchmarks/sequence_layouts.py [--reps 7] [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

LAYOUTS = {
    "padded": {"sequence_layout": "padded"},
    "packed": {"sequence_layout": "packed"},
    "shared_prompt": {"sequence_layout": "shared_prompt"},
    "padded+budget": {"sequence_layout": "padded", "max_tokens_per_microbatch": 2048},
    "shared_prompt+budget": {"sequence_layout": "shared_prompt", "max_tokens_per_microbatch": 2048},
}
SHAPES = {
    "default": ({}, {}),
    "long_responses": ({"system_prompt": "Add."}, {"max_new_tokens": 64}),
}


def rollout_batch(data_changes: dict, generation_changes: dict):
    from colossal_rl.config import RLConfig, replace
    from colossal_rl.config_resolve import resolve
    from colossal_rl.reward import build_reward_scorer
    from colossal_rl.rollout.producer import Producer
    from colossal_rl.schedule.prompts import EpisodeSchedule

    config = RLConfig()
    config = resolve(
        replace(
            config,
            data=replace(config.data, **data_changes),
            generation=replace(config.generation, **generation_changes),
        )
    ).validate()
    scorer = build_reward_scorer(reward_type=config.reward.reward_type, code_verifier_url=None, reward_fn=None)
    producer = Producer(0, config, scorer)
    schedule = config.schedule  # round 0's share of producer 0, as the round schedule orders it
    rows = EpisodeSchedule(
        len(producer.train_data), schedule.num_producers, schedule.inference_batch_size, config.data.seed
    ).rows_for(0, 0)
    return config, producer.produce_chunk(0, rows, seed_index=0).batch


def make_trainer(config, train_changes: dict):
    from colossal_rl.config import replace
    from colossal_rl.training.trainer import Trainer

    config = replace(config, train=replace(config.train, **train_changes)).validate()
    trainer = Trainer(0, 1, config, "127.0.0.1", 0, device="cpu")
    trainer.build()
    return trainer


def measure(shape: str, reps: int) -> None:
    config, batch = rollout_batch(*SHAPES[shape])
    prompt_lengths, response_lengths = batch.prompt_mask.sum(1).float(), batch.response_mask.sum(1).float()
    print(
        f"\n{shape}: {batch.num_samples} samples, prompt tokens {prompt_lengths.mean():.1f} mean "
        f"({prompt_lengths.min():.0f}-{prompt_lengths.max():.0f}), response tokens {response_lengths.mean():.1f} "
        f"mean ({response_lengths.min():.0f}-{response_lengths.max():.0f}); -tmbs {config.train.microbatch_size}"
    )
    trainers = {name: make_trainer(config, changes) for name, changes in LAYOUTS.items()}
    times: dict[str, list[float]] = {name: [] for name in LAYOUTS}
    tokens: dict[str, dict[str, float]] = {}
    for name, trainer in trainers.items():  # warm-up
        tokens[name] = trainer.train_step(batch)
    for _ in range(reps):
        for name, trainer in trainers.items():
            started = time.perf_counter()
            trainer.train_step(batch)
            times[name].append(time.perf_counter() - started)
    base = statistics.median(times["padded"])
    print(f"{'layout':<22}{'step s':>9}{'vs padded':>11}{'computed':>10}{'real':>8}{'computed/real':>15}")
    for name in LAYOUTS:
        median = statistics.median(times[name])
        metrics = tokens[name]
        print(
            f"{name:<22}{median:>9.3f}{median / base:>11.2f}{metrics['train/computed_tokens']:>10.0f}"
            f"{metrics['train/real_tokens']:>8.0f}{metrics['train/computed_per_real_token']:>15.2f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--shapes", default=",".join(SHAPES))
    args = parser.parse_args()

    import torch

    from colossal_rl.training.booster_plugins import launch_colossalai

    torch.set_num_threads(args.threads)
    launch_colossalai(0, 1, "127.0.0.1", 29533, on_cpu=True)
    print(f"threads {args.threads}, load average {os.getloadavg()[0]:.2f} at start")
    for shape in args.shapes.split(","):
        measure(shape, args.reps)
    print(f"load average {os.getloadavg()[0]:.2f} at end")


if __name__ == "__main__":
    main()
