"""A real ``Trainer`` in this test process: world size 1 over gloo, the embedded tiny model, hand-made rollouts.

Shared by the trainer tests (device discipline, pi_old, memory features). The process group is started
once per process and kept (ColossalAI's launch is once per process). The engine is ``--trainer-backend auto``'s in
this process: ColossalAI in the trainers' environment, FSDP2 in the producers' (where
``tests/engines/test_trainer_under_fsdp2.py`` runs these same tests).
"""

from __future__ import annotations

import socket

import torch
import torch.distributed as dist

from colossal_rl.batch import RolloutBatch
from colossal_rl.config import AlgorithmConfig, GenerationConfig, RLConfig, TrainConfig, replace
from colossal_rl.training.trainer import Trainer

GROUP_SIZE = 4


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def ensure_process_group() -> None:
    """The engine's CPU process group (ColossalAI's: gloo and its CPU patches) with world size 1, once per process."""
    if dist.is_initialized():
        return
    from colossal_rl.training.engines import make_engine
    from colossal_rl.training.rendezvous import open_rendezvous_store

    store = open_rendezvous_store(_free_port(), 1, timeout_s=120)
    make_engine(RLConfig()).start_process_group(0, 1, store, on_cpu=True, timeout_s=120)


def make_config(
    *, algorithm: AlgorithmConfig | None = None, train: dict | None = None, seed: int = 0, **generation
) -> RLConfig:
    config = RLConfig()
    train_changes = {"batch_size": 4, "minibatch_size": 2, "microbatch_size": 4, "learning_rate": 1e-2} | (train or {})
    return replace(
        config,
        algorithm=algorithm or config.algorithm,
        train=replace(config.train, **train_changes),
        generation=replace(config.generation, **({"temperature": 1.0} | generation)),
        run=replace(config.run, seed=seed),
    ).validate()


def make_trainer(config: RLConfig, device: torch.device | str | None = None) -> Trainer:
    ensure_process_group()
    trainer = Trainer(0, 1, config, "127.0.0.1", 0, device=device)
    trainer.build()
    return trainer


def make_batch(
    *,
    num_groups: int = 4,
    prompt_len: int = 6,
    response_len: int = 5,
    seed: int = 0,
    vocab: int = 40,
    shared_prompts: bool = True,
) -> RolloutBatch:
    """Random prompts (left-padded) and responses (right-padded) of unequal lengths, advantages and
    behaviour log-probs; every tensor on the host, as rollouts arrive from Ray. ``shared_prompts``: the
    samples of a group share their first sample's prompt, as real rollouts do (False: random per sample)."""
    generator = torch.Generator().manual_seed(seed)
    n = num_groups * GROUP_SIZE
    prompt_ids = torch.randint(3, vocab, (n, prompt_len), generator=generator)
    prompt_mask = torch.ones(n, prompt_len, dtype=torch.long)
    prompt_mask[::3, :2] = 0
    response_ids = torch.randint(3, vocab, (n, response_len), generator=generator)
    response_mask = torch.ones(n, response_len, dtype=torch.long)
    response_mask[1::2, response_len - 2 :] = 0
    if shared_prompts:
        first = torch.arange(n) // GROUP_SIZE * GROUP_SIZE
        prompt_ids, prompt_mask = prompt_ids[first], prompt_mask[first]
    rewards = (torch.rand(n, generator=generator) > 0.5).float()
    return RolloutBatch(
        prompt_ids=prompt_ids * prompt_mask,
        prompt_mask=prompt_mask,
        response_ids=response_ids * response_mask,
        response_mask=response_mask,
        behaviour_logprobs=(-torch.rand((n, response_len), generator=generator) - 2.0) * response_mask,
        rewards=rewards,
        answer_correct=rewards,
        loss_mask=torch.ones(n),
        truncated=torch.zeros(n, dtype=torch.bool),
        advantages=torch.randn(n, generator=generator),
        group_size=GROUP_SIZE,
        policy_version=0,
    )


__all__ = ["GenerationConfig", "TrainConfig", "ensure_process_group", "make_batch", "make_config", "make_trainer"]
