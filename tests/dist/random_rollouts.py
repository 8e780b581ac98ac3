"""Random rollout batches shaped as producers make them, for the multi-process layout tests."""

from __future__ import annotations

import torch

from colossal_rl.batch import RolloutBatch


def random_rollouts(
    *,
    vocab_size: int,
    pad_token_id: int,
    group_size: int,
    prompt_lengths: list[int],
    response_lengths: list[int],
    generator: torch.Generator,
    policy_version: int = 0,
) -> RolloutBatch:
    """One random prompt per group (``prompt_lengths[g]`` tokens, left-padded) shared by its samples, random
    responses (``response_lengths[i]`` tokens, right-padded), 0/1 rewards, advantages and behaviour log-probs."""
    n = len(response_lengths)
    prompt_width, response_width = max(prompt_lengths), max(response_lengths)
    prompt_ids = torch.full((n, prompt_width), pad_token_id)
    prompt_mask = torch.zeros((n, prompt_width), dtype=torch.long)
    response_ids = torch.full((n, response_width), pad_token_id)
    response_mask = torch.zeros((n, response_width), dtype=torch.long)
    for group, p in enumerate(prompt_lengths):
        prompt = torch.randint(1, vocab_size, (p,), generator=generator)
        for i in range(group * group_size, (group + 1) * group_size):
            prompt_ids[i, prompt_width - p :] = prompt
            prompt_mask[i, prompt_width - p :] = 1
            r = response_lengths[i]
            response_ids[i, :r] = torch.randint(1, vocab_size, (r,), generator=generator)
            response_mask[i, :r] = 1
    rewards = torch.randint(0, 2, (n,), generator=generator).float()
    return RolloutBatch(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        response_ids=response_ids,
        response_mask=response_mask,
        behaviour_logprobs=-torch.rand((n, response_width), generator=generator) * response_mask,
        rewards=rewards,
        answer_correct=rewards,
        loss_mask=torch.ones(n),
        truncated=torch.zeros(n, dtype=torch.bool),
        advantages=torch.randn(n, generator=generator),
        group_size=group_size,
        policy_version=policy_version,
    )
