"""Producer-side post-processing of a scored rollout batch: shaping, filtering, advantages.

Reads ``AlgorithmConfig`` and applies the registered functions of ``colossal_rl.algorithms`` in the
order the algorithms define; no branching on the algorithm's name, no communication. A producer batch is
whatever the schedule hands out (a round's share, a stream chunk, one group), so only statistics within a
group are computed here; batch-level ones are the trainer's, over the optimizer step's batch.
"""

from __future__ import annotations

from dataclasses import replace

from colossal_rl.algorithms import (
    batch_stage,
    dynamic_sampling_group_mask,
    filter_truncated_response,
    group_part,
    masked_mean,
    soft_over_length_penalty,
)
from colossal_rl.batch import RolloutBatch
from colossal_rl.config import AlgorithmConfig


def postprocess_rollout(
    batch: RolloutBatch, algo: AlgorithmConfig, max_new_tokens: int
) -> tuple[RolloutBatch | None, dict[str, float]]:
    """Shape rewards, mask and filter samples, and attach advantages; None when no group survives.

    In order: (1) DAPO's soft over-length penalty is added to the rewards the advantages see
    (``batch.rewards`` keeps the verifier's reward; lengths count policy tokens, against ``max_new_tokens``: the
    per-response budget, an episode's ``max_total_tokens`` for multi-turn rollouts); (2) truncated responses leave ``loss_mask``;
    (3) dynamic sampling drops groups whose accuracy over loss-masked-in samples lies outside
    ``algo.filter_range`` (before advantages, so batch-level estimators see only kept groups);
    (4) ``algo.advantage_estimator`` computes advantages over the samples in ``loss_mask``: the whole estimator
    when its statistics stay within a group (grpo, dr_grpo, rloo, dpo_pairs), else only its per-group part
    (``algorithms.advantages.group_part``), which the trainer finishes over the optimizer step's batch
    (``training/step_advantages.py``); (5) with ``algo.mask_zero_advantage`` samples whose advantage is
    exactly 0 leave ``loss_mask`` (online DPO's unpaired samples; refused for a batch-level estimator, whose
    advantages are not final here).

    Metrics (floats): ``rollout/reward_mean`` and ``rollout/accuracy`` over samples without infra errors
    (the incoming ``loss_mask``), ``rollout/groups``, ``rollout/groups_filtered``,
    ``rollout/loss_masked_fraction`` and, when shaping is on, ``rollout/over_length_penalty_mean``.
    """
    scored = batch.loss_mask.bool()
    metrics = {
        "rollout/reward_mean": float(masked_mean(batch.rewards.float(), scored)),
        "rollout/accuracy": float(masked_mean(batch.answer_correct.float(), scored)),
        "rollout/groups": float(batch.num_groups),
    }
    shaped_rewards = batch.rewards.float()
    if algo.soft_over_length_punishment:
        lengths = batch.policy_token_mask().sum(-1)  # multi-turn: the policy's tokens, not the environment's
        penalty = soft_over_length_penalty(lengths, max_new_tokens, algo.cache_length)
        shaped_rewards = shaped_rewards + penalty
        metrics["rollout/over_length_penalty_mean"] = float(penalty.mean())
    loss_mask = batch.loss_mask.float()
    if algo.filter_truncated_response:
        loss_mask = loss_mask * filter_truncated_response(batch.truncated)
    metrics["rollout/loss_masked_fraction"] = float(1 - loss_mask.mean())

    batch = replace(batch, loss_mask=loss_mask)
    kept_groups = list(range(batch.num_groups))
    if algo.filter_range is not None:
        low, high = algo.filter_range
        keep = dynamic_sampling_group_mask(batch.answer_correct, batch.group_size, low, high, valid_mask=loss_mask)
        kept_groups = keep.nonzero().flatten().tolist()
    metrics["rollout/groups_filtered"] = float(batch.num_groups - len(kept_groups))
    if not kept_groups:
        return None, metrics
    if len(kept_groups) < batch.num_groups:
        shaped_rewards = shaped_rewards.view(-1, batch.group_size)[kept_groups].view(-1)
        batch = batch.select_groups(kept_groups)

    if algo.mask_zero_advantage and batch_stage(algo.advantage_estimator) is not None:
        raise ValueError(
            f"algorithm.mask_zero_advantage needs advantages final on the producer; {algo.advantage_estimator}'s "
            "are finished by the trainer over the optimizer step's batch"
        )
    estimate = group_part(algo.advantage_estimator)
    advantages = estimate(
        shaped_rewards,
        batch.group_size,
        algo.advantage_eps,
        valid_mask=batch.loss_mask,
        response_lengths=batch.policy_token_mask().sum(-1),  # multi-turn: the policy's own tokens
    )
    if algo.mask_zero_advantage:  # e.g. online DPO: only the paired samples are trained
        batch = replace(batch, loss_mask=batch.loss_mask * (advantages != 0).to(batch.loss_mask.dtype))
        metrics["rollout/zero_advantage_masked_fraction"] = float((advantages == 0).float().mean())
    return batch.with_advantages(advantages), metrics
