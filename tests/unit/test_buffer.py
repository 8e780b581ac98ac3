"""RoundBuffer: rounds are dealt whole, split evenly and step-major over ranks, leftovers carried, stale groups dropped."""

import pytest

from colossal_rl.comm.buffer import RoundBuffer


def make_buffer(*, num_producers=2, dp_size=2, groups_per_step=2, n_behind=1) -> RoundBuffer:
    return RoundBuffer(num_producers=num_producers, dp_size=dp_size, groups_per_step=groups_per_step, n_behind=n_behind)


def names(assignment) -> list[str]:
    """Groups of an assignment as 'payload:index' strings."""
    return [f"{group.payload}:{group.group_index}" for group in assignment.groups]


def take_all(buffer: RoundBuffer, round_index: int, trainer_policy_version: int) -> list:
    return [buffer.take(round_index, rank, trainer_policy_version) for rank in range(buffer.dp_size)]


def test_round_is_dealt_only_when_every_producer_delivered():
    buffer = make_buffer()
    buffer.put(0, 0, "A", 4, policy_version=0)
    assert not buffer.is_complete(0)
    with pytest.raises(RuntimeError, match="round 0 is not complete"):
        buffer.take(0, 0, trainer_policy_version=0)
    buffer.put(0, 1, "B", 4, policy_version=0)
    assert buffer.is_complete(0)
    assert buffer.take(0, 0, trainer_policy_version=0).num_steps == 2


def test_ranks_get_disjoint_equal_step_major_shares_covering_the_round():
    buffer = make_buffer(num_producers=2, dp_size=2, groups_per_step=2)
    buffer.put(0, 1, "B", 4, policy_version=0)  # delivery order does not matter: the pool is in producer order
    buffer.put(0, 0, "A", 4, policy_version=0)
    rank0, rank1 = take_all(buffer, 0, trainer_policy_version=0)

    # Step s of rank d trains pool[s*4 + d*2 : s*4 + d*2 + 2], pool = A:0..3, B:0..3.
    assert names(rank0) == ["A:0", "A:1", "B:0", "B:1"]
    assert names(rank1) == ["A:2", "A:3", "B:2", "B:3"]
    assert rank0.num_steps == rank1.num_steps == 2
    assert set(names(rank0)).isdisjoint(names(rank1))
    assert sorted(names(rank0) + names(rank1)) == sorted(f"{p}:{g}" for p in "AB" for g in range(4))
    assert all(group.round_index == 0 and group.policy_version == 0 for group in rank0.groups + rank1.groups)
    assert (rank0.dropped_stale_groups, rank0.carried_over_groups) == (0, 0)
    assert buffer.pooled_groups() == 0


def test_shares_stay_equal_with_many_ranks_and_producers():
    buffer = make_buffer(num_producers=3, dp_size=4, groups_per_step=1)
    for producer, payload in enumerate("XYZ"):
        buffer.put(0, producer, payload, 4, policy_version=0)
    shares = take_all(buffer, 0, trainer_policy_version=0)
    assert [share.num_steps for share in shares] == [3] * 4
    assert [len(share.groups) for share in shares] == [3] * 4
    dealt = [name for share in shares for name in names(share)]
    assert len(set(dealt)) == 12
    # Step-major: step s is pool[4s : 4s + 4], one group per rank.
    pool = [f"{p}:{g}" for p in "XYZ" for g in range(4)]
    for step in range(3):
        assert [names(share)[step] for share in shares] == pool[4 * step : 4 * step + 4]


def test_leftover_groups_carry_over_to_the_next_round():
    buffer = make_buffer(num_producers=2, dp_size=2, groups_per_step=2, n_behind=1)
    buffer.put(0, 0, "A", 4, policy_version=0)
    buffer.put(0, 1, "B", 3, policy_version=0)  # one group filtered out
    rank0, rank1 = take_all(buffer, 0, trainer_policy_version=0)
    assert rank0.num_steps == rank1.num_steps == 1
    assert names(rank0) + names(rank1) == ["A:0", "A:1", "A:2", "A:3"]
    assert buffer.pooled_groups() == 3

    buffer.put(1, 0, "C", 4, policy_version=1)
    buffer.put(1, 1, "D", 4, policy_version=1)
    rank0, rank1 = take_all(buffer, 1, trainer_policy_version=1)
    assert rank0.num_steps == rank1.num_steps == 2
    assert rank0.carried_over_groups == rank1.carried_over_groups == 3
    assert names(rank0) == ["B:0", "B:1", "C:1", "C:2"]
    assert names(rank1) == ["B:2", "C:0", "C:3", "D:0"]
    assert [group.round_index for group in rank0.groups] == [0, 0, 1, 1]
    assert buffer.pooled_groups() == 3  # D:1..3
    assert buffer.dropped_stale_groups == 0


def test_carried_over_group_too_stale_is_dropped_and_counted():
    buffer = make_buffer(num_producers=2, dp_size=1, groups_per_step=2, n_behind=0)
    buffer.put(0, 0, "A", 2, policy_version=0)
    buffer.put(0, 1, "B", 1, policy_version=0)
    (first,) = take_all(buffer, 0, trainer_policy_version=0)
    assert names(first) == ["A:0", "A:1"]
    assert buffer.pooled_groups() == 1

    buffer.put(1, 0, "C", 2, policy_version=1)
    buffer.put(1, 1, "D", 2, policy_version=1)
    (second,) = take_all(buffer, 1, trainer_policy_version=1)
    assert names(second) == ["C:0", "C:1", "D:0", "D:1"]  # B:0 (version 0) is one version behind: dropped
    assert second.dropped_stale_groups == 1
    assert second.carried_over_groups == 1
    assert buffer.dropped_stale_groups == 1
    assert buffer.pooled_groups() == 0


def test_staleness_boundary_is_n_behind_inclusive_and_the_count_accumulates():
    buffer = make_buffer(num_producers=2, dp_size=1, groups_per_step=1, n_behind=1)
    buffer.put(0, 0, "old", 2, policy_version=0)
    buffer.put(0, 1, "ok", 2, policy_version=1)
    (share,) = take_all(buffer, 0, trainer_policy_version=2)
    assert names(share) == ["ok:0", "ok:1"]
    assert share.dropped_stale_groups == 2

    buffer.put(1, 0, "old", 3, policy_version=0)
    buffer.put(1, 1, "older", 1, policy_version=0)
    (share,) = take_all(buffer, 1, trainer_policy_version=2)
    assert share.num_steps == 0 and share.groups == []
    assert share.dropped_stale_groups == 4
    assert buffer.dropped_stale_groups == 6


def test_every_rank_gets_zero_steps_when_the_round_is_too_small_for_one_step():
    buffer = make_buffer(num_producers=1, dp_size=2, groups_per_step=2)
    buffer.put(0, 0, "A", 3, policy_version=0)
    shares = take_all(buffer, 0, trainer_policy_version=0)
    assert [(share.num_steps, share.groups) for share in shares] == [(0, []), (0, [])]
    assert buffer.pooled_groups() == 3


def test_duplicate_delivery_raises():
    buffer = make_buffer()
    buffer.put(0, 0, "A", 4, policy_version=0)
    with pytest.raises(ValueError, match="producer 0 delivered round 0 twice"):
        buffer.put(0, 0, "A again", 4, policy_version=0)


def test_late_delivery_for_a_dealt_round_raises():
    buffer = make_buffer(num_producers=1, dp_size=2)
    buffer.put(0, 0, "A", 4, policy_version=0)
    buffer.take(0, 0, trainer_policy_version=0)  # dealing happens on the first take
    with pytest.raises(ValueError, match="round 0 was already dealt out; producer 1 delivered late"):
        buffer.put(0, 1, "late", 4, policy_version=0)


def test_taking_twice_raises():
    buffer = make_buffer(num_producers=1, dp_size=2)
    buffer.put(0, 0, "A", 4, policy_version=0)
    buffer.take(0, 0, trainer_policy_version=0)
    with pytest.raises(ValueError, match="rank 0 already took round 0"):
        buffer.take(0, 0, trainer_policy_version=0)
    buffer.take(0, 1, trainer_policy_version=0)
    with pytest.raises(ValueError):  # every rank has taken round 0: it is gone
        buffer.take(0, 1, trainer_policy_version=0)


def test_rounds_must_be_taken_in_order():
    buffer = make_buffer(num_producers=1, dp_size=1)
    buffer.put(1, 0, "next", 4, policy_version=0)  # producers may run ahead ...
    buffer.put(0, 0, "first", 4, policy_version=0)
    assert buffer.is_complete(1)
    with pytest.raises(ValueError, match="round 1 asked for before round 0"):  # ... trainers may not
        buffer.take(1, 0, trainer_policy_version=0)
    assert names(buffer.take(0, 0, trainer_policy_version=0))[0] == "first:0"
    assert names(buffer.take(1, 0, trainer_policy_version=0))[0] == "next:0"


def test_has_delivery_tells_a_restarted_producer_which_shares_already_arrived():
    buffer = RoundBuffer(num_producers=2, dp_size=1, groups_per_step=1, n_behind=0)
    assert not buffer.has_delivery(0, 0)
    buffer.put(0, 0, "a", 1, 0)
    assert buffer.has_delivery(0, 0) and not buffer.has_delivery(0, 1)
    buffer.put(0, 1, "b", 1, 0)
    buffer.take(0, 0, trainer_policy_version=0)
    assert buffer.has_delivery(0, 1), "a dealt round holds every share"
    assert not buffer.has_delivery(1, 0)
