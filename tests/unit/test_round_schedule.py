"""Today's round schedule on the streaming interface (colossal_rl/schedule/rounds.py): round r ordered with
version max(0, r - n_behind), dealt only whole, leftovers carried and stale ones dropped as RoundBuffer does."""

from __future__ import annotations

from collections import Counter

import pytest
from schedule_driving import RandomDriver

from colossal_rl.schedule.events import ChunkOrder, FinishedGroup
from colossal_rl.schedule.prompts import episode_rows
from colossal_rl.schedule.rounds import RoundScheduler, RoundSettings


def identity_rows(num_rows: int):
    return lambda episode: list(range(num_rows))


def kept(rows, version=0):
    return [FinishedGroup(row, version) for row in rows]


def rows_of(step):
    return [group.row for group in step.groups]


def test_exact_orders_carry_over_and_versions():
    scheduler = RoundScheduler(
        RoundSettings(num_producers=2, prompts_per_producer=2, groups_per_step=2, n_behind=1, total_rounds=3),
        identity_rows(8),
    )
    assert scheduler.admit() == [
        ChunkOrder(0, 0, 0, (0, 1), 0), ChunkOrder(1, 1, 0, (2, 3), 0),
        ChunkOrder(2, 0, 0, (4, 5), 0), ChunkOrder(3, 1, 0, (6, 7), 0),
    ]  # fmt: skip
    assert scheduler.admit() == []  # round 2 waits for version 1
    scheduler.chunk_done(1, kept([2, 3]))
    assert scheduler.next_step() is None  # round 0 is not complete
    scheduler.chunk_done(0, [FinishedGroup(0, 0, kept=False), FinishedGroup(1, 0)])
    step = scheduler.next_step()
    assert (step.step, step.trainer_version, rows_of(step)) == (0, 0, [1, 2])  # row 3 carried over
    scheduler.step_done()
    assert scheduler.sync_due() == 1
    scheduler.sync_ordered(1)
    assert scheduler.admit() == [ChunkOrder(4, 0, 1, (0, 1), 1), ChunkOrder(5, 1, 1, (2, 3), 1)]
    scheduler.chunk_done(3, kept([6, 7]))
    scheduler.chunk_done(2, kept([4, 5]))
    steps = [scheduler.next_step()]
    assert scheduler.next_step() is None  # the first is still open
    scheduler.step_done()
    steps.append(scheduler.next_step())
    assert [rows_of(step) for step in steps] == [[3, 4], [5, 6]]
    assert [step.trainer_version for step in steps] == [1, 1]
    scheduler.step_done()
    assert scheduler.sync_due() == 2 and scheduler.filtered_groups == 1


def test_groups_staler_than_n_behind_are_dropped():
    scheduler = RoundScheduler(
        RoundSettings(num_producers=1, prompts_per_producer=3, groups_per_step=2, n_behind=0, total_rounds=2),
        identity_rows(9),
    )
    (order,) = scheduler.admit()
    scheduler.chunk_done(order.chunk_id, kept(order.rows))
    assert rows_of(scheduler.next_step()) == [0, 1]
    scheduler.step_done()
    scheduler.sync_ordered(scheduler.sync_due())
    (order,) = scheduler.admit()
    assert order.policy_version == 1
    scheduler.chunk_done(order.chunk_id, kept(order.rows, version=1))
    step = scheduler.next_step()
    assert rows_of(step) == [3, 4] and step.dropped_stale == 1  # row 2, version 0, trained at version 1
    scheduler.step_done()
    assert scheduler.finished and scheduler.dropped_stale_groups == 1


def test_a_round_with_too_few_kept_groups_for_a_step_still_ends():
    scheduler = RoundScheduler(
        RoundSettings(num_producers=1, prompts_per_producer=2, groups_per_step=2, n_behind=1, total_rounds=1),
        identity_rows(4),
    )
    (order,) = scheduler.admit()
    scheduler.chunk_done(order.chunk_id, [FinishedGroup(0, 0, kept=False), FinishedGroup(1, 0)])
    assert scheduler.next_step() is None
    assert scheduler.rounds_trained == 1 and scheduler.sync_due() == 1 and scheduler.finished


@pytest.mark.parametrize("n_behind", [0, 1, 2])
@pytest.mark.parametrize("seed", range(4))
def test_random_event_orders_follow_the_round_rules(n_behind, seed):
    settings = RoundSettings(num_producers=3, prompts_per_producer=2, groups_per_step=2, n_behind=n_behind,
                             total_rounds=8)  # fmt: skip
    scheduler = RoundScheduler(settings, episode_rows(24, seed))  # 4 rounds per episode

    def check(orders: list[ChunkOrder]) -> None:
        for order in orders:
            assert order.policy_version == max(0, order.chunk_id // 3 - n_behind)

    driver = RandomDriver(scheduler, seed, on_admit=check)
    driver.run()
    assert scheduler.steps_done == 8 * 3  # nothing filtered: every round feeds 3 steps
    for step in driver.steps:
        assert all(0 <= lag <= n_behind for lag in step.staleness())
    assert Counter(driver.trained_rows()) == Counter((e, row) for e in range(2) for row in range(24))
