"""Property-based tests of the advantage estimators (``algorithms/advantages.py``) and their batch stages finished
over an optimizer step (``training/step_advantages.py``).

Group estimators: centred within each group over its valid samples, zero on invalid samples and on groups whose
valid rewards are equal. Batch-level estimators: producers compute the per-group part on whatever groups they
hold, the trainers finish it over the step with statistics summed over their data-parallel shares, and the
result must be the estimator run over the whole step at once, however producers and ranks split the samples.
"""

from __future__ import annotations

from itertools import pairwise

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from colossal_rl.algorithms import ADVANTAGE_ESTIMATORS, BATCH_STAGES, group_part
from colossal_rl.batch import RolloutBatch, concat_batches
from colossal_rl.config import AlgorithmConfig
from colossal_rl.training.step_advantages import step_advantages

PROPERTY = settings(max_examples=60, deadline=None, derandomize=True, database=None)
GROUP_ESTIMATORS = ("grpo", "dr_grpo", "rloo")
BATCH_ESTIMATORS = tuple(BATCH_STAGES.names())
# Few values, so equal rewards in a group are common; three 0.45s or 0.9s do not average exactly in float32.
REWARDS = st.sampled_from([0.0, 0.45, 0.9, 1.0, -1.0, 2.5, 0.3])


@st.composite
def grouped_rewards(draw, *, max_groups: int = 5) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(rewards [N], valid mask [N] float, group size)."""
    group_size = draw(st.integers(1, 4))
    n = group_size * draw(st.integers(1, max_groups))
    equal_group = REWARDS.map(lambda reward: [reward] * group_size)
    any_group = st.lists(REWARDS, min_size=group_size, max_size=group_size)
    groups = draw(st.lists(st.one_of(equal_group, any_group), min_size=n // group_size, max_size=n // group_size))
    rewards = torch.tensor([reward for group in groups for reward in group])
    valid = torch.tensor(draw(st.lists(st.sampled_from([1.0, 1.0, 1.0, 0.0]), min_size=n, max_size=n)))
    return rewards, valid, group_size


@PROPERTY
@given(data=grouped_rewards(), name=st.sampled_from(GROUP_ESTIMATORS), eps=st.sampled_from([0.0, 1e-6, 0.1]))
def test_group_advantages_sum_to_zero_over_each_groups_valid_samples(data, name, eps):
    """Each group's valid advantages sum to 0; an invalid sample, and every sample of a group whose valid rewards
    are all equal, gets exactly 0 (never NaN), whatever ``eps``."""
    rewards, valid, group_size = data
    advantages = ADVANTAGE_ESTIMATORS.get(name)(rewards, group_size, eps, valid)
    assert bool(torch.isfinite(advantages).all())
    for group in range(rewards.numel() // group_size):
        members = slice(group * group_size, (group + 1) * group_size)
        own, keep = advantages[members], valid[members].bool()
        assert bool((own[~keep] == 0).all())
        assert abs(float(own[keep].sum())) <= 1e-5 * max(1.0, float(own.abs().sum()))
        if len(set(rewards[members][keep].tolist())) <= 1:
            assert bool((own == 0).all()), f"group {group}: equal rewards"


@PROPERTY
@given(data=grouped_rewards())
def test_rloo_is_each_reward_minus_the_mean_of_the_groups_other_valid_rewards(data):
    """RLOO against its definition, a loop over samples: r_i - mean_{j != i, valid} r_j (0 alone in its group)."""
    rewards, valid, group_size = data
    advantages = ADVANTAGE_ESTIMATORS.get("rloo")(rewards, group_size, 0.0, valid)
    for sample in range(rewards.numel()):
        start = sample - sample % group_size
        others = [float(rewards[j]) for j in range(start, start + group_size) if j != sample and valid[j]]
        expected = float(rewards[sample]) - sum(others) / len(others) if valid[sample] and others else 0.0
        assert abs(float(advantages[sample]) - expected) <= 1e-5


@PROPERTY
@given(data=grouped_rewards(), scale=st.sampled_from([0.5, 3.0, 10.0]), shift=st.sampled_from([-2.0, 0.0, 7.0]))
def test_grpo_does_not_change_under_an_affine_change_of_the_rewards(data, scale, shift):
    """With eps 0, rewards a r + b (a > 0) give the same GRPO advantages: the group's mean and std absorb it."""
    rewards, valid, group_size = data
    grpo = ADVANTAGE_ESTIMATORS.get("grpo")
    torch.testing.assert_close(
        grpo(rewards * scale + shift, group_size, 0.0, valid), grpo(rewards, group_size, 0.0, valid), atol=1e-4, rtol=0
    )


def rollout_batch(rewards, valid, response_lengths, policy_lengths, group_size, name, eps) -> RolloutBatch:
    """A producer's batch with the per-group part of ``name``'s advantages, as its post-processing attaches them."""
    n, width = rewards.numel(), int(max(response_lengths)) + 1
    response_mask = (torch.arange(width)[None, :] < response_lengths[:, None]).long()
    policy_mask = (torch.arange(width)[None, :] < policy_lengths[:, None]).long()
    advantages = group_part(name)(rewards, group_size, eps, valid, response_lengths=policy_lengths)
    return RolloutBatch(
        prompt_ids=torch.ones(n, 2, dtype=torch.long),
        prompt_mask=torch.ones(n, 2, dtype=torch.long),
        response_ids=response_mask * 5,
        response_mask=response_mask,
        behaviour_logprobs=torch.zeros(n, width),
        rewards=rewards,
        answer_correct=torch.zeros(n),
        loss_mask=valid,
        truncated=torch.zeros(n, dtype=torch.bool),
        advantages=advantages,
        policy_mask=policy_mask,
        group_size=group_size,
        policy_version=0,
    )


def cuts(draw, num_groups: int) -> list[int]:
    """Sorted group boundaries 0 < c < num_groups cutting the groups into consecutive parts."""
    inner = draw(st.sets(st.integers(1, max(num_groups - 1, 1)), max_size=3)) if num_groups > 1 else set()
    return [0, *sorted(inner), num_groups]


@PROPERTY
@given(data=st.data(), name=st.sampled_from(BATCH_ESTIMATORS), eps=st.sampled_from([0.0, 1e-6, 0.1]))
def test_a_batch_stage_split_over_producers_and_ranks_equals_the_estimator_over_the_whole_step(data, name, eps):
    """Producers attach the per-group part on their own groups; each data-parallel rank finishes its share with the
    step's statistics summed over every share (``step_advantages``). Concatenated, that is the registered estimator
    over the whole step, however the groups were split; multi-turn samples weigh their policy tokens only."""
    rewards, valid, group_size = data.draw(grouped_rewards(max_groups=6))
    n = rewards.numel()
    response_lengths = torch.tensor(data.draw(st.lists(st.integers(1, 6), min_size=n, max_size=n)))
    policy_lengths = torch.tensor([data.draw(st.integers(0, int(length))) for length in response_lengths])
    num_groups, algo = n // group_size, AlgorithmConfig(advantage_estimator=name, advantage_eps=eps)

    def part(first: int, last: int) -> slice:
        return slice(first * group_size, last * group_size)

    producer_cuts = cuts(data.draw, num_groups)
    producer_batches = [
        rollout_batch(rewards[part(a, b)], valid[part(a, b)], response_lengths[part(a, b)],
                      policy_lengths[part(a, b)], group_size, name, eps)
        for a, b in pairwise(producer_cuts)
    ]  # fmt: skip
    step = concat_batches(producer_batches, pad_token_id=0)
    rank_cuts = cuts(data.draw, num_groups)
    shares = [step.select_groups(list(range(a, b))) for a, b in pairwise(rank_cuts)]
    sent = [None] * len(shares)

    def send(rank):
        def sum_over_ranks(moments):
            sent[rank] = moments
            return moments

        return sum_over_ranks

    for rank, share in enumerate(shares):  # each rank's own moments, as the all-reduce receives them
        step_advantages(share, algo, send(rank))
    total = torch.stack(sent).sum(0)
    finished = torch.cat([step_advantages(share, algo, lambda _: total).advantages for share in shares])
    whole = ADVANTAGE_ESTIMATORS.get(name)(rewards, group_size, eps, valid, response_lengths=policy_lengths)
    torch.testing.assert_close(finished, whole, atol=1e-5, rtol=1e-5)


@PROPERTY
@given(data=grouped_rewards(max_groups=6), lengths=st.lists(st.integers(1, 6), min_size=24, max_size=24))
def test_the_batch_estimators_normalise_over_the_valid_samples_or_tokens(data, lengths):
    """reinforce_ppb: over the valid samples' tokens (a sample weighs its length) the advantages have mean 0 and
    Bessel-corrected variance var / (var + 1e-8); reinforce_ppb_sample (eps 0): over the valid samples, variance 1
    (a division by the batch std, not a product) unless all are 0; reinforce: mean 0 over the valid samples;
    invalid samples 0."""
    rewards, valid, group_size = data
    n = rewards.numel()
    response_lengths = torch.tensor(lengths[:n])
    keep = valid.bool()
    ppb = ADVANTAGE_ESTIMATORS.get("reinforce_ppb")(rewards, group_size, 0.0, valid, response_lengths=response_lengths)
    reinforce = ADVANTAGE_ESTIMATORS.get("reinforce")(rewards, group_size, 0.0, valid)
    sample = ADVANTAGE_ESTIMATORS.get("reinforce_ppb_sample")(rewards, group_size, 0.0, valid)
    assert bool((ppb[~keep] == 0).all()) and bool((reinforce[~keep] == 0).all()) and bool((sample[~keep] == 0).all())
    if keep.any():
        assert abs(float(reinforce[keep].mean())) <= 1e-5
    if int(keep.sum()) > 1 and bool((sample != 0).any()):
        assert abs(float(sample[keep].double().var()) - 1.0) <= 1e-4
    tokens = torch.repeat_interleave(ppb[keep].double(), response_lengths[keep])
    centred = torch.repeat_interleave(
        ADVANTAGE_ESTIMATORS.get("dr_grpo")(rewards, group_size, 0.0, valid)[keep].double(), response_lengths[keep]
    )
    if tokens.numel() > 1:
        variance = float(centred.var())  # Bessel-corrected over tokens
        assert abs(float(tokens.mean())) <= 1e-4
        assert abs(float(tokens.var()) - variance / (variance + 1e-8)) <= 1e-4
