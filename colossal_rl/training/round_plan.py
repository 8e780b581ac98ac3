"""Which samples each optimizer step of a round trains on, over ``train.ppo_epochs`` passes.

The first pass keeps the buffer's order (the steps as dealt). Each later pass re-shuffles the round's
groups (a group stays whole) and cuts them into the same number of steps; the permutation comes from a
generator seeded by (run seed, round, epoch) and nothing else, so a resumed run makes the same steps.
Pure functions over ``RolloutBatch``; no model, no communication.
"""

from __future__ import annotations

import torch

from colossal_rl.batch import RolloutBatch, concat_batches


def epoch_permutation(num_groups: int, *, seed: int, round_index: int, epoch: int) -> list[int]:
    """The order of the round's groups in pass ``epoch`` (0-based): identity for epoch 0."""
    if epoch == 0:
        return list(range(num_groups))
    generator = torch.Generator().manual_seed(((seed * 1_000_003 + round_index) * 1_009 + epoch) % 2**63)
    return torch.randperm(num_groups, generator=generator).tolist()


def epoch_steps(
    steps: list[RolloutBatch], *, epoch: int, seed: int, round_index: int, pad_token_id: int
) -> list[RolloutBatch]:
    """The round's ``steps`` regrouped for pass ``epoch``: same number of steps, same groups per step."""
    if epoch == 0 or len(steps) == 0:
        return steps
    groups_per_step = steps[0].num_groups
    if any(step.num_groups != groups_per_step for step in steps):
        raise ValueError(f"steps of unequal size {[step.num_groups for step in steps]} cannot be re-shuffled")
    round_batch = concat_batches(steps, pad_token_id)
    order = epoch_permutation(round_batch.num_groups, seed=seed, round_index=round_index, epoch=epoch)
    return [
        round_batch.select_groups(order[start : start + groups_per_step])
        for start in range(0, len(order), groups_per_step)
    ]
