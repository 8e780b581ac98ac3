"""Batch-level advantages over the whole optimizer step across real trainer ranks (two processes, gloo).

Two spawned consumer processes train one REINFORCE++-baseline step under DDP (two data-parallel ranks, each with
half the step's groups) and under TP=2 (one data-parallel rank: both tensor-parallel ranks hold the whole step).
Each rank records the advantages its objective is called with. Checked: under DDP the two shares' advantages
together are the estimator over the whole step (not over either share); under TP both ranks train on the same
advantages, the whole step's.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path

import pytest
import torch
from random_rollouts import random_rollouts
from spawned import run_spawned
from torch.testing import assert_close

from colossal_rl.algorithms import ADVANTAGE_ESTIMATORS
from colossal_rl.batch import RolloutBatch
from colossal_rl.comm.process_group import find_free_port
from colossal_rl.config import AlgorithmConfig, ParallelConfig, RLConfig, TrainConfig

pytestmark = [pytest.mark.dist, pytest.mark.slow]

HOST = "127.0.0.1"
WORLD_SIZE = 2
GROUP_SIZE = 4
NUM_GROUPS = 4
DEADLINE_S = 180.0
ALGORITHM = AlgorithmConfig(advantage_estimator="reinforce_ppb")
LAYOUTS = {"ddp": ParallelConfig(num_trainers=2), "tp2": ParallelConfig(num_trainers=2, tp_size=2)}


def make_step(vocab_size: int, pad_token_id: int) -> RolloutBatch:
    """The step's groups as the producers post-processed them (per-group part attached), two infra errors."""
    from colossal_rl.rollout.postprocess import postprocess_rollout

    generator = torch.Generator().manual_seed(7)
    responses = torch.randint(1, 8, (NUM_GROUPS * GROUP_SIZE,), generator=generator).tolist()
    batch = random_rollouts(
        vocab_size=vocab_size,
        pad_token_id=pad_token_id,
        group_size=GROUP_SIZE,
        prompt_lengths=[3, 5, 4, 6],
        response_lengths=responses,
        generator=generator,
    )
    loss_mask = torch.ones(batch.num_samples)
    loss_mask[[1, 10]] = 0
    rewards = torch.randn(batch.num_samples, generator=generator)
    batch = dataclasses.replace(batch, rewards=rewards, loss_mask=loss_mask, advantages=None)
    return postprocess_rollout(batch, ALGORITHM, max_new_tokens=16)[0]


def _consumer(rank: int, port: int, out_dir: Path) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING)
    from colossal_rl.training.booster_plugins import launch_colossalai
    from colossal_rl.training.trainer import Trainer

    launch_colossalai(rank, WORLD_SIZE, HOST, port, on_cpu=True)
    results = {}
    for name, parallel in LAYOUTS.items():
        config = RLConfig(
            algorithm=ALGORITHM, train=TrainConfig(microbatch_size=4, minibatch_size=1), parallel=parallel
        )
        trainer = Trainer(rank, WORLD_SIZE, config, HOST, port)
        trainer.build()
        seen: list[torch.Tensor] = []
        loss = trainer.objective.loss

        def recorded(loss=loss, seen=seen, **kwargs):
            seen.append(kwargs["advantages"].detach().cpu().clone())
            return loss(**kwargs)

        trainer.objective = dataclasses.replace(trainer.objective, loss=recorded)
        step = make_step(trainer.vocab_size, trainer.pad_token_id)
        groups = list(range(trainer.dp_rank, NUM_GROUPS, trainer.dp_size))
        trainer.train_step(step.select_groups(groups))
        results[name] = {"groups": groups, "advantages": torch.cat(seen), "step": step}
    torch.save(results, out_dir / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    out_dir = tmp_path_factory.mktemp("step_advantages")
    port = find_free_port()
    run_spawned(out_dir, {f"rank{r}": (_consumer, (r, port, out_dir)) for r in range(WORLD_SIZE)}, DEADLINE_S)
    return {rank: torch.load(out_dir / f"rank{rank}.pt", weights_only=False) for rank in range(WORLD_SIZE)}


def _estimate(batch: RolloutBatch) -> torch.Tensor:
    return ADVANTAGE_ESTIMATORS.get("reinforce_ppb")(
        batch.rewards, GROUP_SIZE, 1e-6, batch.loss_mask, response_lengths=batch.response_mask.sum(-1)
    )


def test_data_parallel_shares_train_on_the_whole_steps_advantages(results):
    step = results[0]["ddp"]["step"]
    full = _estimate(step).view(NUM_GROUPS, GROUP_SIZE)
    for rank in range(WORLD_SIZE):
        groups, trained = results[rank]["ddp"]["groups"], results[rank]["ddp"]["advantages"]
        assert groups == [rank, rank + 2]
        assert_close(trained, full[groups].flatten())
        alone = _estimate(step.select_groups(groups))  # what the share alone would give
        assert not torch.allclose(trained, alone, atol=1e-3)


def test_tensor_parallel_ranks_train_on_the_same_advantages(results):
    step = results[0]["tp2"]["step"]
    assert results[0]["tp2"]["groups"] == results[1]["tp2"]["groups"] == list(range(NUM_GROUPS))
    assert torch.equal(results[0]["tp2"]["advantages"], results[1]["tp2"]["advantages"])
    assert_close(results[0]["tp2"]["advantages"], _estimate(step))
