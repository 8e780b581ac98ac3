"""Advantage estimators: hand-computed cases and the properties every estimator must keep."""

import pytest
import torch
from torch.testing import assert_close
from verl_reference import verl_reinforce_ppb

from colossal_rl.algorithms import (
    ADVANTAGE_ESTIMATORS,
    dr_grpo_advantages,
    grpo_advantages,
    reinforce_advantages,
    reinforce_ppb_advantages,
    reinforce_ppb_sample_advantages,
    rloo_advantages,
)

# Estimators whose every group sums to zero and whose equal-reward groups get exactly zero.
GROUP_ESTIMATORS = ["grpo", "dr_grpo", "rloo", "reinforce_ppb_sample"]


def test_grpo_hand_computed():
    # mean 0.25, centred [0.75, -0.25 x3], unbiased var = (0.5625 + 3 * 0.0625) / 3 = 0.25, std 0.5
    advantages = grpo_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), group_size=4, eps=0.0)
    assert_close(advantages, torch.tensor([1.5, -0.5, -0.5, -0.5]))
    with_eps = grpo_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), group_size=4, eps=0.5)
    assert_close(with_eps, torch.tensor([0.75, -0.25, -0.25, -0.25]))


def test_dr_grpo_hand_computed():
    advantages = dr_grpo_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 4.0]), group_size=2, eps=1e-6)
    assert_close(advantages, torch.tensor([0.5, -0.5, 0.0, 0.0, -1.0, 1.0]))


def test_rloo_hand_computed():
    # A_0 = 1 - mean(0, 0, 0) = 1;  A_j = 0 - mean(1, 0, 0) = -1/3
    advantages = rloo_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), group_size=4, eps=1e-6)
    assert_close(advantages, torch.tensor([1.0, -1 / 3, -1 / 3, -1 / 3]))


def test_reinforce_ppb_sample_hand_computed_divides_by_the_batch_std():
    # group-centred [0.5, -0.5, 1, -1]; unbiased batch std = sqrt(2.5 / 3)
    rewards = torch.tensor([1.0, 0.0, 3.0, 1.0])
    advantages = reinforce_ppb_sample_advantages(rewards, group_size=2, eps=0.0)
    assert_close(advantages, torch.tensor([0.5, -0.5, 1.0, -1.0]) / (2.5 / 3) ** 0.5)
    # whitening makes the result scale-free (ColossalChat's multiply-by-std would scale it by 100)
    assert_close(reinforce_ppb_sample_advantages(10 * rewards, group_size=2, eps=0.0), advantages)


def test_reinforce_ppb_hand_computed_whitens_over_tokens():
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0])
    lengths = torch.tensor([1, 3, 2, 2])
    # group-centred a = [0.5, -0.5, 0, 0]; tokens: one 0.5, three -0.5, four 0 -> 8 tokens
    # token mean = (0.5 - 1.5) / 8 = -0.125; deviations 0.625 (x1), -0.375 (x3), 0.125 (x4)
    # sum of squares = 0.390625 + 3 * 0.140625 + 4 * 0.015625 = 0.875; unbiased var = 0.875 / 7 = 0.125
    # rsqrt(0.125 + 1e-8) = sqrt(8) (to 1e-7 relative)
    advantages = reinforce_ppb_advantages(rewards, group_size=2, eps=0.0, response_lengths=lengths)
    assert_close(advantages, torch.tensor([0.625, -0.375, 0.125, 0.125]) * 8**0.5)
    # the equal-reward group gets 0.125 * sqrt(8) = 0.354 on both samples, not 0: verl re-centres over tokens
    assert advantages[2] == advantages[3] and advantages[2] > 0.35
    # without lengths every sample is one token: mean 0, unbiased var = 0.5 / 3, so a * sqrt(6)
    unweighted = reinforce_ppb_advantages(rewards, group_size=2, eps=0.0)
    assert_close(unweighted, torch.tensor([0.5, -0.5, 0.0, 0.0]) * 6**0.5)
    assert_close(reinforce_ppb_advantages(10 * rewards, 2, 0.0, response_lengths=lengths), advantages)


def _random_rollout(seed, groups=6, group_size=4, max_tokens=12):
    generator = torch.Generator().manual_seed(seed)
    n = groups * group_size
    if seed % 2:  # verifier-style 0/1 rewards: some groups have equal rewards
        rewards = torch.randint(0, 2, (n,), generator=generator).float()
    else:
        rewards = torch.randn(n, generator=generator)
    lengths = torch.randint(1, max_tokens + 1, (n,), generator=generator)
    mask = (torch.arange(max_tokens)[None, :] < lengths[:, None]).float()  # [N, T]
    return rewards, lengths, mask


@pytest.mark.parametrize("seed", range(6))
def test_reinforce_ppb_equals_verl_token_whitening(seed):
    rewards, lengths, mask = _random_rollout(seed)
    index = [i // 4 for i in range(len(rewards))]
    expected = verl_reinforce_ppb(rewards, mask, index)
    advantages = reinforce_ppb_advantages(rewards, 4, 1e-6, response_lengths=lengths)
    assert_close((advantages[:, None] * mask).double(), expected, atol=1e-6, rtol=0)
    # the per-sample variant is the old, different formula on unequal lengths
    assert not torch.allclose(reinforce_ppb_sample_advantages(rewards, 4, 1e-6), advantages, atol=1e-3)


@pytest.mark.parametrize("seed", range(4))
def test_reinforce_ppb_invalid_samples_are_as_if_removed_from_the_batch(seed):
    rewards, lengths, mask = _random_rollout(seed)
    valid = torch.ones(len(rewards), dtype=torch.bool)
    valid[[1, 6, 7, 13, 22]] = False  # every group keeps at least two valid samples
    index = [i // 4 for i in range(len(rewards))]
    kept = valid.nonzero().flatten().tolist()
    expected = verl_reinforce_ppb(rewards[kept], mask[kept], [index[i] for i in kept])
    advantages = reinforce_ppb_advantages(rewards, 4, 1e-6, valid_mask=valid, response_lengths=lengths)
    assert_close((advantages[kept, None] * mask[kept]).double(), expected, atol=1e-6, rtol=0)
    assert torch.all(advantages[~valid] == 0)
    # neither the rewards nor the lengths of invalid samples move anything
    noisy_rewards = torch.where(valid, rewards, 100.0)
    noisy_lengths = torch.where(valid, lengths, 1000)
    noisy = reinforce_ppb_advantages(noisy_rewards, 4, 1e-6, valid_mask=valid, response_lengths=noisy_lengths)
    assert torch.equal(noisy, advantages)


def test_reinforce_ppb_refuses_lengths_of_the_wrong_shape():
    with pytest.raises(ValueError, match=r"response_lengths must have shape \[4\]"):
        reinforce_ppb_advantages(torch.zeros(4), 2, 1e-6, response_lengths=torch.ones(3))


@pytest.mark.parametrize("name", ADVANTAGE_ESTIMATORS.names())
def test_every_estimator_accepts_response_lengths(name):
    rewards, lengths, _ = _random_rollout(0)
    estimator = ADVANTAGE_ESTIMATORS.get(name)
    weighted = estimator(rewards, 4, 1e-6, response_lengths=lengths)
    assert weighted.shape == rewards.shape and torch.isfinite(weighted).all()
    if name != "reinforce_ppb":  # only the token-whitened estimator weighs samples by their length
        assert torch.equal(weighted, estimator(rewards, 4, 1e-6))


def test_reinforce_hand_computed_uses_the_batch_mean():
    advantages = reinforce_advantages(torch.tensor([1.0, 0.0, 3.0, 1.0]), group_size=2, eps=1e-6)
    assert_close(advantages, torch.tensor([-0.25, -1.25, 1.75, -0.25]))


def test_valid_mask_excludes_samples_from_statistics_and_advantages():
    # valid rewards of the group: [1, 0, 0] -> mean 1/3, unbiased std sqrt(1/3)
    rewards = torch.tensor([1.0, 0.0, 5.0, 0.0])
    valid = torch.tensor([1.0, 1.0, 0.0, 1.0])
    advantages = grpo_advantages(rewards, group_size=4, eps=0.0, valid_mask=valid)
    assert_close(advantages, torch.tensor([2 / 3, -1 / 3, 0.0, -1 / 3]) / (1 / 3) ** 0.5)
    changed = grpo_advantages(torch.tensor([1.0, 0.0, -7.0, 0.0]), group_size=4, eps=0.0, valid_mask=valid)
    assert_close(changed, advantages)


def test_reinforce_valid_mask_hand_computed():
    # the batch mean is over the valid rewards [1, 0, 1]: 2/3 (over all four it would be 5/4)
    valid = torch.tensor([1.0, 1.0, 0.0, 1.0])
    advantages = reinforce_advantages(torch.tensor([1.0, 0.0, 3.0, 1.0]), group_size=2, eps=1e-6, valid_mask=valid)
    assert_close(advantages, torch.tensor([1 / 3, -2 / 3, 0.0, 1 / 3]))


def test_reinforce_ppb_sample_valid_mask_hand_computed():
    # group-centred valid a = [0.5, -0.5, 1, -1]; the batch std is over these 4 (unbiased: sqrt(2.5 / 3)),
    # not over all 6 samples (sqrt(2.5 / 5)), though the invalid group's centred values are 0 too
    rewards = torch.tensor([1.0, 0.0, 3.0, 1.0, 9.0, 4.0])
    valid = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 0.0])
    advantages = reinforce_ppb_sample_advantages(rewards, group_size=2, eps=0.0, valid_mask=valid)
    assert_close(advantages, torch.tensor([0.5, -0.5, 1.0, -1.0, 0.0, 0.0]) / (2.5 / 3) ** 0.5)


@pytest.mark.parametrize("name", ADVANTAGE_ESTIMATORS.names())
def test_an_invalid_group_is_as_if_removed(name):
    """Values, not only zeros: the valid groups' advantages equal those of the batch without the invalid group,
    for the batch-level estimators (reinforce, reinforce_ppb, reinforce_ppb_sample) too."""
    rewards, lengths, _ = _random_rollout(0)
    valid = torch.ones(len(rewards), dtype=torch.bool)
    valid[8:12] = False  # group 2 of 6
    kept = valid.nonzero().flatten()
    estimator = ADVANTAGE_ESTIMATORS.get(name)
    advantages = estimator(rewards, 4, 1e-6, valid_mask=valid, response_lengths=lengths)
    without = estimator(rewards[kept], 4, 1e-6, response_lengths=lengths[kept])
    assert_close(advantages[kept], without)
    assert torch.all(advantages[~valid] == 0)


@pytest.mark.parametrize("name", ADVANTAGE_ESTIMATORS.names())
def test_rewards_and_lengths_of_invalid_samples_change_nothing(name):
    rewards, lengths, _ = _random_rollout(1)
    valid = torch.ones(len(rewards), dtype=torch.bool)
    valid[[1, 6, 13, 22]] = False  # every group keeps three valid samples
    estimator = ADVANTAGE_ESTIMATORS.get(name)
    advantages = estimator(rewards, 4, 1e-6, valid_mask=valid, response_lengths=lengths)
    noisy_rewards, noisy_lengths = torch.where(valid, rewards, 100.0), torch.where(valid, lengths, 1000)
    assert torch.equal(estimator(noisy_rewards, 4, 1e-6, valid_mask=valid, response_lengths=noisy_lengths), advantages)


@pytest.mark.parametrize("name", ADVANTAGE_ESTIMATORS.names())
def test_invalid_samples_get_exactly_zero(name):
    rewards = torch.randn(12, generator=torch.Generator().manual_seed(0))
    valid = torch.tensor([1, 0, 1, 1, 0, 0, 1, 1, 1, 1, 1, 0], dtype=torch.bool)
    advantages = ADVANTAGE_ESTIMATORS.get(name)(rewards, 4, 1e-6, valid_mask=valid)
    assert torch.all(advantages[~valid] == 0)
    if name == "dpo_pairs":  # one chosen (+1) and one rejected (-1) valid sample per group; the rest are 0
        assert advantages.view(3, 4).sort(-1).values[:, [0, -1]].tolist() == [[-1.0, 1.0]] * 3
    else:
        assert torch.all(advantages[valid] != 0)


@pytest.mark.parametrize("name", GROUP_ESTIMATORS)
@pytest.mark.parametrize("eps", [0.0, 1e-6])
def test_zero_variance_group_gets_zero_advantage_not_nan(name, eps):
    rewards = torch.tensor([0.1, 0.1, 0.1, 0.1, 0.7, 0.7, 0.7, 0.7, 1.0, 0.0, 1.0, 1.0])
    advantages = ADVANTAGE_ESTIMATORS.get(name)(rewards, 4, eps)
    assert torch.isfinite(advantages).all()
    assert torch.all(advantages[:8] == 0)
    assert torch.all(advantages[8:] != 0)


def test_reinforce_ppb_zero_variance_groups_share_one_value_not_nan():
    rewards = torch.tensor([0.1, 0.1, 0.1, 0.1, 0.7, 0.7, 0.7, 0.7, 1.0, 0.0, 1.0, 1.0])
    lengths = torch.tensor([2, 5, 1, 1, 3, 3, 3, 3, 1, 2, 3, 4])
    advantages = reinforce_ppb_advantages(rewards, 4, 0.0, response_lengths=lengths)
    assert torch.isfinite(advantages).all()
    # both constant groups were centred to 0, then shifted by the same -mean_tok * rstd (verl's re-centring)
    assert torch.all(advantages[:8] == advantages[0]) and advantages[0] != 0


@pytest.mark.parametrize("name", [*GROUP_ESTIMATORS, "reinforce_ppb"])
def test_all_groups_constant_or_single_valid_sample_gives_zeros(name):
    estimator = ADVANTAGE_ESTIMATORS.get(name)
    assert torch.all(estimator(torch.ones(6), 3, 0.0) == 0)
    single = estimator(torch.tensor([1.0, 0.0, 0.0]), 3, 0.0, valid_mask=torch.tensor([1, 0, 0]))
    assert torch.all(single == 0)


@pytest.mark.parametrize("name", GROUP_ESTIMATORS)
def test_group_advantages_sum_to_zero(name):
    rewards = torch.rand(32, generator=torch.Generator().manual_seed(1))
    advantages = ADVANTAGE_ESTIMATORS.get(name)(rewards, 8, 1e-6)
    assert_close(advantages.view(4, 8).sum(-1), torch.zeros(4), atol=1e-5, rtol=0)


def _loop_reference(name, rewards, group_size, eps, valid):
    """Per-group python loop written straight from the formulas."""
    out = [0.0] * len(rewards)
    for start in range(0, len(rewards), group_size):
        idx = [i for i in range(start, start + group_size) if valid[i]]
        values = [rewards[i] for i in idx]
        k = len(values)
        if k == 0 or max(values) == min(values):
            continue
        mean = sum(values) / k
        std = (sum((v - mean) ** 2 for v in values) / max(k - 1, 1)) ** 0.5
        for i in idx:
            if name == "grpo":
                out[i] = (rewards[i] - mean) / (std + eps)
            elif name == "rloo":
                out[i] = rewards[i] - (sum(values) - rewards[i]) / (k - 1)
            else:
                out[i] = rewards[i] - mean
    return torch.tensor(out)


@pytest.mark.parametrize("name", ["grpo", "rloo", "dr_grpo"])
def test_vectorised_equals_python_loop(name):
    generator = torch.Generator().manual_seed(2)
    rewards = torch.randint(0, 3, (40,), generator=generator).float() / 2
    valid = torch.rand(40, generator=generator) > 0.25
    expected = _loop_reference(name, rewards.tolist(), 5, 1e-6, valid.tolist())
    assert_close(ADVANTAGE_ESTIMATORS.get(name)(rewards, 5, 1e-6, valid_mask=valid), expected)


def test_reinforce_ppb_sample_equals_python_loop():
    generator = torch.Generator().manual_seed(3)
    rewards = torch.rand(24, generator=generator)
    centred = _loop_reference("dr_grpo", rewards.tolist(), 4, 0.0, [True] * 24)
    std = (sum(a**2 for a in centred.tolist()) / 23) ** 0.5
    assert_close(reinforce_ppb_sample_advantages(rewards, 4, 1e-6), centred / (std + 1e-6))


def test_groups_must_tile_the_batch():
    with pytest.raises(ValueError, match="not a whole number of groups of 4"):
        grpo_advantages(torch.zeros(6), group_size=4, eps=1e-6)
