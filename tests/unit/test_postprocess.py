"""postprocess_rollout: reward shaping, masking, dynamic sampling and advantages on a RolloutBatch."""

from dataclasses import replace

import pytest
import torch
from torch.testing import assert_close

from colossal_rl.algorithms import dr_grpo_advantages, grpo_advantages, reinforce_ppb_advantages
from colossal_rl.batch import RolloutBatch
from colossal_rl.config import AlgorithmConfig
from colossal_rl.rollout.postprocess import postprocess_rollout
from colossal_rl.training.step_advantages import step_advantages

GROUP = 4
MAX_NEW_TOKENS = 8


def _batch(rewards, correct, lengths, truncated=None, loss_mask=None):
    n = len(rewards)
    lengths = torch.tensor(lengths)
    return RolloutBatch(
        prompt_ids=torch.ones(n, 3, dtype=torch.long),
        prompt_mask=torch.ones(n, 3, dtype=torch.long),
        response_ids=torch.ones(n, MAX_NEW_TOKENS, dtype=torch.long),
        response_mask=(torch.arange(MAX_NEW_TOKENS)[None, :] < lengths[:, None]).long(),
        behaviour_logprobs=torch.zeros(n, MAX_NEW_TOKENS),
        rewards=torch.tensor(rewards, dtype=torch.float32),
        answer_correct=torch.tensor(correct, dtype=torch.float32),
        loss_mask=torch.ones(n) if loss_mask is None else torch.tensor(loss_mask, dtype=torch.float32),
        truncated=torch.zeros(n, dtype=torch.bool) if truncated is None else torch.tensor(truncated),
        group_size=GROUP,
        policy_version=0,
        prompts=[f"prompt {i}" for i in range(n // GROUP)],
        responses=[f"response {i}" for i in range(n)],
        data_indices=list(range(n // GROUP)),
    )


def test_plain_grpo_attaches_group_advantages():
    batch = _batch([1, 0, 0, 0, 1, 1, 0, 0], [1, 0, 0, 0, 1, 1, 0, 0], [3] * 8)
    processed, metrics = postprocess_rollout(batch, AlgorithmConfig(), MAX_NEW_TOKENS)
    assert_close(processed.advantages, grpo_advantages(batch.rewards, GROUP, 1e-6))
    assert metrics["rollout/accuracy"] == 3 / 8 and metrics["rollout/reward_mean"] == 3 / 8
    assert metrics["rollout/groups"] == 2 and metrics["rollout/groups_filtered"] == 0


def test_infra_errors_stay_out_of_advantages_and_metrics():
    batch = _batch([1, 0, 0, 0], [1, 0, 0, 0], [3] * 4, loss_mask=[1, 1, 1, 0])
    processed, metrics = postprocess_rollout(batch, AlgorithmConfig(), MAX_NEW_TOKENS)
    expected = grpo_advantages(batch.rewards, GROUP, 1e-6, valid_mask=batch.loss_mask)
    assert_close(processed.advantages, expected)
    assert processed.advantages[3] == 0
    assert metrics["rollout/accuracy"] == pytest.approx(1 / 3)


def test_soft_over_length_punishment_shapes_the_advantages_not_the_rewards():
    algo = AlgorithmConfig(soft_over_length_punishment=True, cache_length=4)
    batch = _batch([1, 1, 1, 1], [1, 1, 1, 1], [2, 4, 6, 8])  # penalties 0, 0, -0.5, -1
    processed, metrics = postprocess_rollout(batch, algo, MAX_NEW_TOKENS)
    assert_close(processed.rewards, batch.rewards)
    shaped = torch.tensor([1.0, 1.0, 0.5, 0.0])
    assert_close(processed.advantages, grpo_advantages(shaped, GROUP, algo.advantage_eps))
    assert metrics["rollout/over_length_penalty_mean"] == -1.5 / 4


def test_over_length_penalty_counts_the_policys_tokens_not_the_environments():
    algo = AlgorithmConfig(soft_over_length_punishment=True, cache_length=4)
    batch = _batch([1, 1, 1, 1], [1, 1, 1, 1], [8, 8, 8, 8])  # 8 response tokens each, tool results among them
    policy_mask = torch.ones(4, MAX_NEW_TOKENS, dtype=torch.long)
    policy_mask[:, 2:] = torch.tensor([[0] * 6, [0] * 4 + [1] * 2, [1, 1] + [0] * 4, [1] * 6])  # 2, 4, 4, 8 sampled
    _, metrics = postprocess_rollout(replace(batch, policy_mask=policy_mask), algo, MAX_NEW_TOKENS)
    assert metrics["rollout/over_length_penalty_mean"] == -1 / 4  # only the last is too long: penalties 0, 0, 0, -1
    _, all_tokens = postprocess_rollout(batch, algo, MAX_NEW_TOKENS)
    assert all_tokens["rollout/over_length_penalty_mean"] == -1.0  # counting every token would punish all four


def test_truncated_responses_leave_the_loss():
    algo = AlgorithmConfig(filter_truncated_response=True)
    batch = _batch([1, 0, 0, 1], [1, 0, 0, 1], [3, 3, 8, 8], truncated=[False, False, True, True])
    processed, metrics = postprocess_rollout(batch, algo, MAX_NEW_TOKENS)
    assert processed.loss_mask.tolist() == [1.0, 1.0, 0.0, 0.0]
    assert_close(processed.advantages, torch.tensor([0.7071, -0.7071, 0.0, 0.0]), atol=1e-4, rtol=0)
    assert metrics["rollout/loss_masked_fraction"] == 0.5


def test_dynamic_sampling_drops_groups_with_uniform_accuracy():
    algo = AlgorithmConfig(filter_range=(0.01, 0.99), advantage_estimator="reinforce_ppb")
    correct = [1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 1, 1, 0, 0]
    batch = _batch([float(c) for c in correct], correct, [3] * 16)
    processed, metrics = postprocess_rollout(batch, algo, MAX_NEW_TOKENS)
    assert processed.num_groups == 2
    assert processed.prompts == ["prompt 1", "prompt 3"] and processed.data_indices == [1, 3]
    assert processed.responses == [f"response {i}" for i in (4, 5, 6, 7, 12, 13, 14, 15)]
    # the producer attaches the per-group part (group-centred rewards); the trainer's batch stage sees only the
    # kept groups: whitened over their 8 x 3 tokens (token mean 0; unbiased variance = 3 * 1.75 / 23)
    centred = torch.tensor([0.75, -0.25, -0.25, -0.25, 0.5, 0.5, -0.5, -0.5])
    assert_close(processed.advantages, centred)
    finished = step_advantages(processed, algo, lambda moments: moments).advantages
    assert_close(finished, centred / (3 * 1.75 / 23 + 1e-8) ** 0.5)
    assert metrics["rollout/groups_filtered"] == 2


def test_no_surviving_group_gives_none():
    algo = AlgorithmConfig(filter_range=(0.01, 0.99))
    batch = _batch([1, 1, 1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0, 0, 0], [3] * 8)
    processed, metrics = postprocess_rollout(batch, algo, MAX_NEW_TOKENS)
    assert processed is None
    assert metrics["rollout/groups_filtered"] == 2 and metrics["rollout/accuracy"] == 0.5


def test_token_weighted_estimator_sees_the_response_lengths():
    # reinforce_ppb weighs each sample by its response length: 1 and 3 tokens in group 0, 2 and 2 in group 1
    algo = AlgorithmConfig(advantage_estimator="reinforce_ppb")
    rewards = [1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0]
    batch = _batch(rewards, rewards, [1, 3, 2, 2, 4, 8, 5, 6])
    processed, _ = postprocess_rollout(batch, algo, MAX_NEW_TOKENS)
    assert_close(processed.advantages, dr_grpo_advantages(batch.rewards, GROUP, algo.advantage_eps))
    finished = step_advantages(processed, algo, lambda moments: moments).advantages  # the trainer's batch stage
    lengths = torch.tensor([1, 3, 2, 2, 4, 8, 5, 6])
    expected = reinforce_ppb_advantages(batch.rewards, GROUP, algo.advantage_eps, response_lengths=lengths)
    assert_close(finished, expected)
    unweighted = reinforce_ppb_advantages(batch.rewards, GROUP, algo.advantage_eps)
    assert not torch.allclose(finished, unweighted, atol=1e-3)


def test_batch_level_estimators_leave_the_batch_statistics_to_the_trainer():
    # reinforce's per-group part is the valid reward itself: the batch mean is the optimizer step's, not this batch's
    batch = _batch([1.0, 0.0, 3.0, 1.0], [1, 0, 1, 1], [3] * 4, loss_mask=[1, 1, 0, 1])
    processed, _ = postprocess_rollout(batch, AlgorithmConfig(advantage_estimator="reinforce"), MAX_NEW_TOKENS)
    assert processed.advantages.tolist() == [1.0, 0.0, 0.0, 1.0]


def test_zero_advantage_masking_is_refused_for_a_batch_level_estimator():
    algo = AlgorithmConfig(advantage_estimator="reinforce_ppb", mask_zero_advantage=True)
    batch = _batch([1, 0, 0, 0], [1, 0, 0, 0], [3] * 4)
    with pytest.raises(ValueError, match="mask_zero_advantage needs advantages final on the producer"):
        postprocess_rollout(batch, algo, MAX_NEW_TOKENS)
