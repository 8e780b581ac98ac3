"""Deal a step's prompt groups to the data-parallel ranks so that each rank computes about as many tokens.

Every rank gets the same number of groups (the loss and the advantage statistics are per group and the step's
sample count is fixed); which groups go where is chosen by their token cost, so the slowest rank, which every
other rank waits for at the gradient all-reduce, is as fast as it can be. Dealing by count alone puts the
longest responses of a step on one rank by chance.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the buffer actor deals by these costs and never needs torch
    from colossal_rl.batch import RolloutBatch


def group_token_costs(batch: RolloutBatch, *, shared_prompt: bool) -> list[int]:
    """Tokens the trainer's forward computes for each group of ``batch``: prompt and response tokens of every
    sample, with the prompt counted once per group under the shared-prompt layout."""
    response = batch.response_mask.sum(-1).view(batch.num_groups, batch.group_size)
    prompt = batch.prompt_mask.sum(-1).view(batch.num_groups, batch.group_size)
    prompt_cost = prompt[:, 0] if shared_prompt else prompt.sum(-1)
    return (response.sum(-1) + prompt_cost).long().tolist()


def balanced_parts(costs: list[int], num_parts: int) -> list[list[int]]:
    """Split the indices of ``costs`` into ``num_parts`` parts of equal size with about equal total cost.

    Longest-processing-time first under a size cap: the costliest item goes to the least loaded part that has
    room. Each part lists its indices in ascending order. ``len(costs)`` must be a multiple of ``num_parts``.
    """
    if num_parts < 1 or len(costs) % num_parts:
        raise ValueError(f"{len(costs)} items cannot be split into {num_parts} parts of equal size")
    size = len(costs) // num_parts
    parts: list[list[int]] = [[] for _ in range(num_parts)]
    loads = [0] * num_parts
    for index in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        part = min((p for p in range(num_parts) if len(parts[p]) < size), key=lambda p: (loads[p], p))
        parts[part].append(index)
        loads[part] += costs[index]
    return [sorted(part) for part in parts]


def step_shares(costs: list[int], num_parts: int) -> list[list[int]]:
    """The indices of one optimizer step's groups each data-parallel rank trains, as many per rank: balanced by
    token cost (:func:`balanced_parts`) when there are several ranks and every cost is known (> 0), else rank
    ``d`` takes the ``d``-th contiguous slice."""
    if num_parts < 1 or len(costs) % num_parts:
        raise ValueError(f"{len(costs)} groups cannot be dealt to {num_parts} ranks equally")
    if num_parts > 1 and all(cost > 0 for cost in costs):
        return balanced_parts(costs, num_parts)
    size = len(costs) // num_parts
    return [list(range(rank * size, (rank + 1) * size)) for rank in range(num_parts)]
