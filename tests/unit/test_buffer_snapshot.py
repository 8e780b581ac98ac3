"""RoundBuffer.snapshot/restore: a restored buffer deals exactly what the original would have dealt."""

import pytest

from colossal_rl.comm.buffer import RoundBuffer


def make_buffer() -> RoundBuffer:
    # 3 groups per round, 2 per step: a group is carried over every round.
    return RoundBuffer(num_producers=1, dp_size=1, groups_per_step=2, n_behind=1)


def dealt(assignment) -> list[tuple[str, int, int]]:
    return [(group.payload, group.group_index, group.policy_version) for group in assignment.groups]


def run_rounds(buffer: RoundBuffer, rounds: range) -> list:
    out = []
    for r in rounds:
        buffer.put(r + 1, 0, f"P{r + 1}", 3, policy_version=r) if r + 1 < 6 else None
        out.append(dealt(buffer.take(r, 0, trainer_policy_version=r)))
    return out


def test_restored_buffer_continues_like_the_original_with_carried_and_undealt_rounds():
    original = make_buffer()
    original.put(0, 0, "P0", 3, policy_version=0)
    run_rounds(original, range(0, 3))  # round 3 is delivered (n_behind = 1) but not dealt; one group pooled
    snapshot = original.snapshot()
    assert snapshot.last_dealt_round == 2
    assert set(snapshot.rounds) == {3}
    assert len(snapshot.pool) == 1
    assert snapshot.payloads == ["P3", "P2"]  # each distinct payload once: the pooled group's and round 2's

    # What a checkpoint does: payloads leave as values and come back as new handles.
    restored = make_buffer()
    restored.restore(snapshot.with_payloads(lambda payload: payload))
    expected = run_rounds(original, range(3, 6))
    assert run_rounds(restored, range(3, 6)) == expected
    assert restored.dropped_stale_groups == original.dropped_stale_groups
    assert restored.pooled_groups() == original.pooled_groups()


def test_snapshot_refuses_half_taken_rounds_and_restore_needs_a_fresh_buffer():
    buffer = RoundBuffer(num_producers=1, dp_size=2, groups_per_step=1, n_behind=0)
    buffer.put(0, 0, "A", 2, policy_version=0)
    buffer.take(0, 0, trainer_policy_version=0)
    with pytest.raises(RuntimeError, match="dealt but not taken"):
        buffer.snapshot()
    buffer.take(0, 1, trainer_policy_version=0)
    snapshot = buffer.snapshot()
    with pytest.raises(RuntimeError, match="fresh buffer"):
        buffer.restore(snapshot)
