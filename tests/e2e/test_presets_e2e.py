"""Every --algo preset trains a few steps end to end on the embedded model (one Ray session for all)."""

from __future__ import annotations

import math

import pytest

from colossal_rl.config import GenerationConfig, RLConfig, RunConfig, ScheduleConfig, TrainConfig
from colossal_rl.metrics import MetricsLogger, read_metrics
from colossal_rl.presets import PRESETS, algorithm_preset

pytestmark = [pytest.mark.dist, pytest.mark.slow]


def test_every_preset_runs_end_to_end(tmp_path):
    import ray

    from colossal_rl.launch import Driver, init_ray, make_run_dir

    generation = GenerationConfig(num_generations=4, microbatch_size=8, max_new_tokens=16)
    names = sorted(PRESETS.names())
    assert set(names) == {"GRPO", "DAPO", "RLOO", "REINFORCE_PPB", "DR_GRPO", "GSPO"}
    try:
        for name in names:
            config = RLConfig(
                generation=generation,
                algorithm=algorithm_preset(name, kl_coeff=0.01, max_new_tokens=16, n_behind=1),
                train=TrainConfig(batch_size=8, minibatch_size=8, microbatch_size=32),
                schedule=ScheduleConfig(num_producers=1, inference_batch_size=8, n_behind=1, max_steps=2),
                run=RunConfig(project=name, save_dir=str(tmp_path), eval_interval=0, timeout_s=120),
            ).validate()
            init_ray(config)
            run_dir = make_run_dir(config)
            metrics = MetricsLogger(run_dir, name, {}, use_wandb=False)
            driver = Driver(config, run_dir, metrics)
            try:
                driver.start()
                driver.run(rounds=2)
            finally:
                driver.shutdown()
                metrics.close()
            train = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "train"]
            # DAPO may filter every group of a round (all right or all wrong): then fewer steps run.
            assert len(train) >= (0 if name == "DAPO" else 2), name
            assert all(math.isfinite(r["train/loss"]) for r in train), name
            if config.algorithm.kl_coeff > 0 and train:
                assert all(math.isfinite(r["train/kl"]) for r in train), name
    finally:
        ray.shutdown()
