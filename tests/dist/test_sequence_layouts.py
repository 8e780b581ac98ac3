"""Packed, shared-prompt and token-budget steps equal the padded step under DDP, ZeRO-2 and TP=2 (two processes).

Two spawned consumer processes (gloo, fp32, the embedded model, a KL term to the reference model) train
one step per (plugin layout, sequence layout) on the same rollouts, in one process group. The optimizer
is plain SGD with lr 1 and clipping off, so the full weights before minus after (gathered on rank 0:
ZeRO's shards, TP's column/row shards) are the step's gradient; AdamW would hide differences behind
``lr * sign(gradient)`` (the optimizer sits around the unit under test: the forward/backward).

The token-budget case gives the two data-parallel ranks different work: rank 1's groups have long prompts
and responses, so on its own it needs more micro-batches than rank 0; every backward all-reduces
gradients, so both must run the largest count (``MicroBatchForward.micro_ranges``) — a mismatch hangs
(the deadline fails the test) or, with DDP's bucket order, averages the wrong gradients.

Checked per plugin layout, every sequence layout against padded: gradient relative L2 difference <= 1e-5 and
element-wise within 1e-5 of the largest gradient element (fp32 summation order differs: a packed row is
one long sequence to the kernels), step loss and entropy to 1e-5.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch
from random_rollouts import random_rollouts
from spawned import run_spawned

from colossal_rl.batch import RolloutBatch
from colossal_rl.comm.process_group import find_free_port
from colossal_rl.config import AlgorithmConfig, ParallelConfig, RLConfig, TrainConfig

pytestmark = [pytest.mark.dist, pytest.mark.slow]

HOST = "127.0.0.1"
WORLD_SIZE = 2
GROUP_SIZE = 4
NUM_GROUPS = 4  # data-parallel rank r trains groups r and r + 2
DEADLINE_S = 240.0
BUDGET = 48
"""Tokens per micro-batch: one short group fits twice (rank 0: one micro-batch), a long group once (rank 1: two)."""

PLUGIN_LAYOUTS = {
    "ddp": ParallelConfig(num_trainers=2),
    "zero2": ParallelConfig(num_trainers=2, zero_stage=2),
    "tp2": ParallelConfig(num_trainers=2, tp_size=2),
}
SEQUENCE_LAYOUTS = {
    "padded": {"sequence_layout": "padded"},
    "packed": {"sequence_layout": "packed"},
    "shared_prompt": {"sequence_layout": "shared_prompt"},
    "shared_prompt_budget": {"sequence_layout": "shared_prompt", "max_tokens_per_microbatch": BUDGET},
    "packed_budget": {"sequence_layout": "packed", "max_tokens_per_microbatch": BUDGET},
}


def make_config(parallel: ParallelConfig, sequence: dict) -> RLConfig:
    return RLConfig(
        algorithm=AlgorithmConfig(kl_coeff=0.1),
        train=TrainConfig(learning_rate=1.0, microbatch_size=8, max_norm=1e9, **sequence),
        parallel=parallel,
    )


def make_batch(vocab_size: int, pad_token_id: int) -> RolloutBatch:
    """Groups 0 and 2 short (prompts 3-4 tokens, responses 1-3), groups 1 and 3 long (prompts 10-12, responses 4-9)."""
    generator = torch.Generator().manual_seed(99)

    def length(low: int, high: int) -> int:
        return int(torch.randint(low, high, (1,), generator=generator))

    prompts = [length(10, 13) if group % 2 else length(3, 5) for group in range(NUM_GROUPS)]
    responses = [length(4, 10) if i // GROUP_SIZE % 2 else length(1, 4) for i in range(GROUP_SIZE * NUM_GROUPS)]
    return random_rollouts(
        vocab_size=vocab_size,
        pad_token_id=pad_token_id,
        group_size=GROUP_SIZE,
        prompt_lengths=prompts,
        response_lengths=responses,
        generator=generator,
    )


def _flat(state: dict[str, torch.Tensor] | None) -> torch.Tensor | None:
    return None if state is None else torch.cat([state[name].detach().double().flatten() for name in sorted(state)])


def _consumer(rank: int, port: int, out_dir: Path) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING)
    torch.optim.AdamW = lambda params, lr, weight_decay: torch.optim.SGD(params, lr=lr)  # the update is the gradient
    from colossal_rl.training.booster_plugins import launch_colossalai
    from colossal_rl.training.trainer import Trainer

    launch_colossalai(rank, WORLD_SIZE, HOST, port, on_cpu=True)
    results = {}
    for plugin_name, parallel in PLUGIN_LAYOUTS.items():
        for sequence_name, sequence in SEQUENCE_LAYOUTS.items():
            trainer = Trainer(rank, WORLD_SIZE, make_config(parallel, sequence), HOST, port)
            trainer.build()
            batch = make_batch(trainer.vocab_size, trainer.pad_token_id)
            before = _flat(trainer.full_state_dict())
            groups = list(range(trainer.dp_rank, batch.num_groups, trainer.dp_size))
            share = batch.select_groups(groups)
            own_count = len(trainer.micro_forward.micro_ranges(share, same_count_on_every_rank=False))
            run_count = len(trainer.micro_forward.micro_ranges(share, same_count_on_every_rank=True))
            metrics = trainer.train_step(share)
            after = _flat(trainer.full_state_dict())
            results[(plugin_name, sequence_name)] = {
                "gradient": None if before is None else before - after,
                "loss": metrics["train/loss"],
                "entropy": metrics["train/entropy"],
                "micro_batches": (own_count, run_count),
            }
    torch.save(results, out_dir / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    out_dir = tmp_path_factory.mktemp("sequence_layouts")
    port = find_free_port()
    run_spawned(out_dir, {f"rank{r}": (_consumer, (r, port, out_dir)) for r in range(WORLD_SIZE)}, DEADLINE_S)
    return {rank: torch.load(out_dir / f"rank{rank}.pt") for rank in range(WORLD_SIZE)}


def test_budget_gives_the_ranks_unequal_work_and_both_run_the_larger_count(results):
    for plugin_name, parallel in PLUGIN_LAYOUTS.items():
        counts = [results[rank][(plugin_name, "shared_prompt_budget")]["micro_batches"] for rank in range(WORLD_SIZE)]
        if parallel.dp_size == 2:
            assert counts[0][0] < counts[1][0], f"{plugin_name}: the long groups' rank should need more: {counts}"
            assert counts[0][1] == counts[1][1] == counts[1][0], f"{plugin_name}: {counts}"
        else:  # TP: both ranks train the same samples
            assert counts[0] == counts[1]


@pytest.mark.parametrize("plugin_name", list(PLUGIN_LAYOUTS))
@pytest.mark.parametrize("sequence_name", [name for name in SEQUENCE_LAYOUTS if name != "padded"])
def test_step_equals_the_padded_step(results, plugin_name, sequence_name):
    padded, other = results[0][(plugin_name, "padded")], results[0][(plugin_name, sequence_name)]
    reference = padded["gradient"]
    assert float(reference.norm()) > 0
    assert float((other["gradient"] - reference).norm() / reference.norm()) <= 1e-5
    torch.testing.assert_close(other["gradient"], reference, atol=1e-5 * float(reference.abs().max()), rtol=1e-5)
    for rank in range(WORLD_SIZE):
        for key in ("loss", "entropy"):
            expected = results[rank][(plugin_name, "padded")][key]
            assert results[rank][(plugin_name, sequence_name)][key] == pytest.approx(expected, rel=1e-5, abs=1e-7)
