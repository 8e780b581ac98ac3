"""Dealing a step's groups to data-parallel ranks by token cost: the partition, the producers' costs, and the
buffer using them (equal group counts, balanced tokens, old snapshots still restoring)."""

import itertools
import random

import pytest
import torch

from colossal_rl.batch import RolloutBatch
from colossal_rl.comm.buffer import BufferSnapshot, RoundBuffer
from colossal_rl.comm.token_balance import balanced_parts, group_token_costs, step_shares


def loads(costs, parts):
    return [sum(costs[i] for i in part) for part in parts]


def best_max_load(costs, num_parts):
    """Brute force: the smallest possible maximum load over equal-size partitions (small inputs only)."""
    size = len(costs) // num_parts
    best = float("inf")

    def search(remaining, current_max):
        nonlocal best
        if not remaining:
            best = min(best, current_max)
            return
        first, rest = remaining[0], remaining[1:]
        for others in itertools.combinations(rest, size - 1):
            part = (first, *others)
            left = [i for i in rest if i not in others]
            search(left, max(current_max, sum(costs[i] for i in part)))

    search(list(range(len(costs))), 0)
    return best


def test_parts_have_equal_sizes_cover_every_index_once_and_list_them_in_order():
    costs = [5, 90, 3, 3, 40, 41, 7, 60, 2, 11, 12, 30]
    parts = balanced_parts(costs, 3)
    assert [len(p) for p in parts] == [4, 4, 4]
    assert sorted(i for p in parts for i in p) == list(range(len(costs)))
    assert all(p == sorted(p) for p in parts)


def test_long_groups_are_spread_instead_of_dealt_side_by_side():
    costs = [100, 100, 1, 1]  # dealt by position, rank 0 would compute 200 tokens and rank 1 two
    assert loads(costs, balanced_parts(costs, 2)) == [101, 101]


@pytest.mark.parametrize("seed", range(20))
def test_max_load_is_within_a_third_of_the_optimum(seed):
    rng = random.Random(seed)
    num_parts = rng.choice([2, 3])
    costs = [rng.randint(20, 400) for _ in range(num_parts * rng.choice([2, 3]))]
    got = max(loads(costs, balanced_parts(costs, num_parts)))
    assert got <= best_max_load(costs, num_parts) * 4 / 3


def test_uneven_count_is_refused():
    with pytest.raises(ValueError, match="5 items cannot be split into 2 parts"):
        balanced_parts([1, 2, 3, 4, 5], 2)


def make_batch(prompt_lengths, response_lengths, group_size):
    n = len(response_lengths)
    prompt_mask = torch.zeros((n, 6), dtype=torch.long)
    response_mask = torch.zeros((n, 5), dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompt_lengths, response_lengths, strict=True)):
        prompt_mask[i, 6 - p :] = 1
        response_mask[i, :r] = 1
    return RolloutBatch(
        prompt_ids=torch.ones((n, 6), dtype=torch.long),
        prompt_mask=prompt_mask,
        response_ids=torch.ones((n, 5), dtype=torch.long),
        response_mask=response_mask,
        behaviour_logprobs=torch.zeros((n, 5)),
        rewards=torch.zeros(n),
        answer_correct=torch.zeros(n),
        loss_mask=torch.ones(n),
        truncated=torch.zeros(n, dtype=torch.bool),
        advantages=torch.zeros(n),
        group_size=group_size,
        policy_version=0,
    )


def test_group_costs_count_the_prompt_once_per_group_when_it_is_shared():
    batch = make_batch([4, 4, 2, 2], [5, 1, 3, 3], group_size=2)
    assert group_token_costs(batch, shared_prompt=False) == [4 + 5 + 4 + 1, 2 + 3 + 2 + 3]
    assert group_token_costs(batch, shared_prompt=True) == [4 + 5 + 1, 2 + 3 + 3]


def names(assignment):
    return [f"{group.payload}:{group.group_index}" for group in assignment.groups]


def test_buffer_deals_each_step_balanced_with_equal_group_counts():
    buffer = RoundBuffer(num_producers=1, dp_size=2, groups_per_step=2, n_behind=1)
    # Step 0: A:0..3 with costs 100, 90, 10, 5 (by position rank 0 would get 190, rank 1 15); step 1: A:4..7.
    buffer.put(0, 0, "A", 8, policy_version=0, group_tokens=(100, 90, 10, 5, 7, 7, 7, 7))
    rank0, rank1 = (buffer.take(0, rank, trainer_policy_version=0) for rank in range(2))
    assert rank0.num_steps == rank1.num_steps == 2
    step0 = [rank0.groups[:2], rank1.groups[:2]]
    assert sorted(g.group_index for share in step0 for g in share) == [0, 1, 2, 3]
    assert [sum(g.tokens for g in share) for share in step0] == [105, 100]
    assert sorted(names(rank0)[2:] + names(rank1)[2:]) == ["A:4", "A:5", "A:6", "A:7"]  # step 1 from step 1's groups


def test_buffer_without_costs_deals_by_position():
    buffer = RoundBuffer(num_producers=1, dp_size=2, groups_per_step=2, n_behind=1)
    buffer.put(0, 0, "A", 4, policy_version=0)
    assert [names(buffer.take(0, rank, trainer_policy_version=0)) for rank in range(2)] == [
        ["A:0", "A:1"],
        ["A:2", "A:3"],
    ]


def test_costs_must_match_the_group_count():
    buffer = RoundBuffer(num_producers=1, dp_size=2, groups_per_step=2, n_behind=1)
    with pytest.raises(ValueError, match="producer 0: 3 token costs for 4 groups"):
        buffer.put(0, 0, "A", 4, policy_version=0, group_tokens=(1, 2, 3))


def test_costs_survive_a_snapshot_and_old_snapshots_restore_without_them():
    buffer = RoundBuffer(num_producers=1, dp_size=2, groups_per_step=2, n_behind=1)
    buffer.put(0, 0, "A", 6, policy_version=0, group_tokens=(1, 2, 3, 4, 50, 60))  # 2 groups carried over
    buffer.put(1, 0, "B", 2, policy_version=0, group_tokens=(70, 80))  # delivered, not dealt
    for rank in range(2):
        buffer.take(0, rank, trainer_policy_version=0)
    snapshot = buffer.snapshot()
    restored = RoundBuffer(num_producers=1, dp_size=2, groups_per_step=2, n_behind=1)
    restored.restore(snapshot)
    shares = [restored.take(1, rank, trainer_policy_version=0) for rank in range(2)]
    assert sorted(g.tokens for share in shares for g in share.groups) == [50, 60, 70, 80]
    assert sorted(sum(g.tokens for g in share.groups) for share in shares) == [130, 130]

    old = BufferSnapshot(
        payloads=["A", "B"],
        rounds={1: {0: (1, 2, 0)}},
        pool=[(0, 4, 0, 0), (0, 5, 0, 0)],
        last_dealt_round=0,
        dropped_stale_groups=0,
    )
    legacy = RoundBuffer(num_producers=1, dp_size=2, groups_per_step=2, n_behind=1)
    legacy.restore(old)
    assert [names(legacy.take(1, rank, trainer_policy_version=0)) for rank in range(2)] == [
        ["A:4", "A:5"],
        ["B:0", "B:1"],
    ]


def test_step_shares_balance_known_costs_and_slice_otherwise():
    """The dealing both schedules use: the round buffer's steps and the streaming driver's step orders."""
    assert step_shares([100, 1, 1, 100], 2) == balanced_parts([100, 1, 1, 100], 2)
    shares = step_shares([100, 100, 1, 1], 2)
    assert sorted(sum([100, 100, 1, 1][i] for i in part) for part in shares) == [101, 101]
    assert step_shares([0, 5, 7, 9], 2) == [[0, 1], [2, 3]]  # a cost unknown: contiguous slices
    assert step_shares([3, 4, 5], 1) == [[0, 1, 2]]
    with pytest.raises(ValueError, match="3 groups cannot be dealt to 2 ranks equally"):
        step_shares([1, 2, 3], 2)
