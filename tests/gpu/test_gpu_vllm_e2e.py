"""The GPU path end to end: one vLLM producer (in the producers' own environment, ``vllm`` 0.32) and one trainer on
the embedded model, weights synced over NCCL straight into the engine's worker (``--vllm-weight-receive`` auto:
the worker is a member of the sync group, torch 2.13's NCCL there, torch 2.5.1's in the trainer).

Needs 2 CUDA GPUs and the gpu extra (``pip install -e ".[gpu]"``); ``tests/conftest.py`` skips every
``gpu``-marked test on machines without CUDA. Written for GPU machines; not run on a GPU.

Precision: weights are compared at the engine's dtype (the sync's cast rounds as ``Tensor.to`` does), and
"training changed the weights" compares the producer's own weights before and after: ``torch.equal`` promotes
mixed dtypes, so a lower engine precision against float32 would differ even if nothing had trained.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from colossal_rl.config import (
    GenerationConfig,
    ParallelConfig,
    RLConfig,
    RunConfig,
    ScheduleConfig,
    TrainConfig,
    VllmEngineConfig,
)
from colossal_rl.config_resolve import resolve
from colossal_rl.metrics import MetricsLogger

pytestmark = [pytest.mark.gpu, pytest.mark.dist, pytest.mark.slow]


def gpu_config(tmp_path: Path) -> RLConfig:
    return RLConfig(
        generation=GenerationConfig(
            backend="vllm",
            num_generations=4,
            microbatch_size=8,
            vllm=VllmEngineConfig(gpu_memory_utilization=0.3),  # the embedded model needs next to nothing
        ),
        train=TrainConfig(batch_size=4, minibatch_size=4, microbatch_size=16, learning_rate=2e-4),
        parallel=ParallelConfig(num_trainers=1),
        schedule=ScheduleConfig(num_producers=1, inference_batch_size=8, n_behind=0, max_steps=2),
        run=RunConfig(save_dir=str(tmp_path), eval_interval=0, timeout_s=900),
    ).validate()


def test_vllm_producer_holds_the_trainer_weights_after_an_nccl_sync(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs: one producer, one trainer")
    import ray

    from colossal_rl.driver.launch import init_ray, make_run_dir
    from colossal_rl.driver.run import Driver
    from colossal_rl.driver.schedule_loop import ScheduleLoop
    from colossal_rl.driver.schedules import planned_steps, round_settings
    from colossal_rl.producer_env import ensure_producer_env
    from colossal_rl.schedule.prompts import episode_rows
    from colossal_rl.schedule.rounds import RoundScheduler

    ensure_producer_env("gpu")
    config = gpu_config(tmp_path)
    assert config.steps_per_round == 2 and config.engine_workers_receive_weights
    init_ray(config)
    driver = None
    try:
        run_dir = make_run_dir(config)
        driver = Driver(resolve(config), run_dir, MetricsLogger(run_dir, "gpu-test", {}, use_wandb=False))
        driver.start()
        producer = driver.producers[0]
        initial = ray.get(producer.named_weights.remote())

        resolved = driver.config
        rows = episode_rows(driver.train_rows, resolved.data.seed)
        scheduler = RoundScheduler(round_settings(resolved, 1), rows)
        ScheduleLoop(driver, scheduler, planned_steps(resolved, 1)).run()  # vLLM generates, 2 steps, v1 over NCCL

        assert driver.step == 2
        trainer_weights = {n: t.cpu() for n, t in ray.get(driver.trainers[0].full_state_dict.remote()).items()}
        producer_weights = ray.get(producer.named_weights.remote())
        assert producer_weights.keys() == trainer_weights.keys()
        for name, tensor in trainer_weights.items():
            assert torch.equal(producer_weights[name], tensor.to(producer_weights[name].dtype)), name
        assert any(not torch.equal(initial[n], producer_weights[n]) for n in initial), "the sync changed nothing"
    finally:
        if driver is not None:
            driver.shutdown()
        ray.shutdown()
