"""The driver never imports torch: its start-up is the serial part of every run's start (issue 23).

Checked in a fresh interpreter doing what the driver does: parse the default flags, check the inputs, make the
scheduler and its plan (the rounds counted, the first chunks ordered), import the launch, loop and actor modules, and
unpickle what producers really send it (a chunk's metrics and per-row facts, an eval result, start-up spans and
logged rollout samples, made here by a real producer on the embedded model).
"""

from __future__ import annotations

import pickle
import subprocess
import sys
from pathlib import Path

from colossal_rl.config import RLConfig, ScheduleConfig
from colossal_rl.config_resolve import resolve
from colossal_rl.driver.actors import rollout_samples
from colossal_rl.reward import build_reward_scorer
from colossal_rl.rollout.producer import Producer
from colossal_rl.schedule.prompts import EpisodeSchedule

REPO = Path(__file__).resolve().parents[2]

DRIVER = """
import pickle, sys
import rl_example
config = rl_example.config_from_args(rl_example.build_parser().parse_args([]))
from colossal_rl.input_checks import check_inputs
check_inputs(config)
from colossal_rl.data_sources import load_prompt_rows
from colossal_rl.driver.launch import run_training
from colossal_rl.driver.run import Driver
from colossal_rl.driver.schedule_loop import ScheduleLoop
from colossal_rl.driver.schedules import make_scheduler
from colossal_rl.schedule.rounds import RoundScheduler
import colossal_rl.driver.actors, colossal_rl.startup
scheduler, plan = make_scheduler(config, len(load_prompt_rows(config.data.train_path)))
assert plan.rounds > 0 and isinstance(scheduler, RoundScheduler)
received = pickle.loads(sys.stdin.buffer.read())
assert received["eval"][0].task == "math" and received["metrics"]["rollout/accuracy"] >= 0
assert sorted(group.row for group in received["groups"]) == received["rows"]
heavy = sorted(name for name in ("torch", "transformers", "colossalai", "numpy") if name in sys.modules)
print("heavy modules:", heavy)
sys.exit(1 if heavy else 0)
"""


def test_the_driver_path_and_what_producers_send_it_need_no_torch():
    config = resolve(RLConfig(schedule=ScheduleConfig(inference_batch_size=2)))  # as run_training gives it
    scorer = build_reward_scorer(reward_type=config.reward.reward_type)
    try:
        producer = Producer(0, config, scorer)
        rows = EpisodeSchedule(len(producer.train_data), 1, 2, config.data.seed).rows_for(0, 0)  # round 0's share
        chunk = producer.produce_chunk(0, rows, seed_index=0)
        batch = chunk.batch
        received = {
            "metrics": chunk.metrics,
            "groups": chunk.groups,  # every row's facts, for the scheduler
            "rows": sorted(rows),
            "eval": producer.evaluate(num_producers=64),  # a few eval prompts
            "startup": producer.startup.drain(),
            "samples": rollout_samples(batch),
            "data_indices": sorted(batch.data_indices),
        }
    finally:
        scorer.close()
    assert received["startup"], "the producer recorded no start-up phases"
    result = subprocess.run(
        [sys.executable, "-c", DRIVER], input=pickle.dumps(received), cwd=REPO, capture_output=True, timeout=120
    )
    assert result.returncode == 0, result.stdout.decode() + result.stderr.decode()[-2000:]
