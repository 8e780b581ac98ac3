"""The round schedule (colossal_rl/schedule/rounds.py): round r ordered with version max(0, r - n_behind) and
sampled with seed index r, dealt only whole into one order of all its steps, leftovers carried over and stale ones
dropped; a checkpoint's snapshot between rounds continues exactly; a lost chunk is made again as it was."""

from __future__ import annotations

import json
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
        ChunkOrder(0, 0, 0, (0, 1), 0, 0), ChunkOrder(1, 1, 0, (2, 3), 0, 0),
        ChunkOrder(2, 0, 0, (4, 5), 0, 1), ChunkOrder(3, 1, 0, (6, 7), 0, 1),
    ]  # fmt: skip
    assert scheduler.admit() == []  # round 2 waits for version 1
    scheduler.chunk_done(1, kept([2, 3]))
    assert scheduler.next_step() is None  # round 0 is not complete
    scheduler.chunk_done(0, [FinishedGroup(0, 0, kept=False), FinishedGroup(1, 0)])
    step = scheduler.next_step()
    assert (step.step, step.trainer_version, step.num_steps, rows_of(step)) == (0, 0, 1, [1, 2])  # 3 carried over
    assert scheduler.next_step() is None and scheduler.sync_due() is None  # the round's order is open
    scheduler.step_done()
    assert scheduler.sync_due() == 1 and scheduler.steps_done == 1
    scheduler.sync_ordered(1)
    assert scheduler.admit() == [ChunkOrder(4, 0, 1, (0, 1), 1, 2), ChunkOrder(5, 1, 1, (2, 3), 1, 2)]
    scheduler.chunk_done(3, kept([6, 7]))
    scheduler.chunk_done(2, kept([4, 5]))
    step = scheduler.next_step()  # the whole round in one order: ``--ppo-epochs`` passes go over all of it
    assert (step.step, step.trainer_version, step.num_steps) == (1, 1, 2)
    assert [[group.row for group in groups] for groups in step.step_groups()] == [[3, 4], [5, 6]]
    scheduler.step_done()
    assert scheduler.sync_due() == 2 and scheduler.filtered_groups == 1 and scheduler.steps_done == 3


def test_ppo_epochs_count_every_pass_and_max_steps_ends_at_the_round_reaching_them():
    settings = RoundSettings(num_producers=1, prompts_per_producer=4, groups_per_step=2, n_behind=0, total_rounds=5,
                             ppo_epochs=2, max_steps=5)  # fmt: skip
    scheduler = RoundScheduler(settings, identity_rows(20))
    for round_index in range(2):
        (order,) = scheduler.admit()
        scheduler.chunk_done(order.chunk_id, kept(order.rows, version=round_index))
        step = scheduler.next_step()
        assert (step.step, step.num_steps) == (4 * round_index, 2)  # 2 steps a round, 2 passes: 4 optimizer steps
        assert not scheduler.finished
        scheduler.step_done()
        scheduler.sync_ordered(scheduler.sync_due())
    assert scheduler.steps_done == 8 and scheduler.finished  # 8 >= max_steps 5: the round reaching them was last
    assert scheduler.admit() == [] and scheduler.next_step() is None


def test_max_steps_exactly_met_ends_the_run_and_one_short_does_not():
    def after_one_round(max_steps: int) -> RoundScheduler:
        settings = RoundSettings(num_producers=1, prompts_per_producer=4, groups_per_step=2, n_behind=0,
                                 total_rounds=5, max_steps=max_steps)  # fmt: skip
        scheduler = RoundScheduler(settings, identity_rows(20))
        (order,) = scheduler.admit()
        scheduler.chunk_done(order.chunk_id, kept(order.rows))
        scheduler.next_step()
        scheduler.step_done()
        return scheduler

    assert after_one_round(max_steps=2).finished
    assert not after_one_round(max_steps=3).finished


def test_a_lost_chunk_is_made_again_as_it_was_and_a_finished_one_cannot_be_lost():
    scheduler = RoundScheduler(
        RoundSettings(num_producers=2, prompts_per_producer=2, groups_per_step=2, n_behind=0, total_rounds=2),
        identity_rows(8),
    )
    first, second = scheduler.admit()
    assert scheduler.chunk_lost(second.chunk_id) == second  # same rows, version and seed index
    scheduler.chunk_done(first.chunk_id, kept(first.rows))
    with pytest.raises(ValueError, match="not in flight"):
        scheduler.chunk_lost(first.chunk_id)
    scheduler.chunk_done(second.chunk_id, kept(second.rows))
    assert rows_of(scheduler.next_step()) == [0, 1, 2, 3]


def test_a_snapshot_between_rounds_continues_exactly_as_the_uninterrupted_schedule():
    def fresh() -> RoundScheduler:
        settings = RoundSettings(num_producers=2, prompts_per_producer=3, groups_per_step=4, n_behind=1,
                                 total_rounds=6)  # fmt: skip
        return RoundScheduler(settings, episode_rows(12, 3))

    def play(scheduler: RoundScheduler, rounds: int, log: list) -> None:
        """``rounds`` rounds: deliver what is in flight (every third group filtered), train, sync."""
        for _ in range(rounds):
            log.extend(scheduler.admit())
            for chunk_id in sorted(scheduler._in_flight):
                order = scheduler._in_flight[chunk_id]
                groups = [FinishedGroup(row, order.policy_version, 5, kept=row % 3 != 0) for row in order.rows]
                scheduler.chunk_done(chunk_id, groups)
            order = scheduler.next_step()
            log.append(order)
            if order is not None:
                scheduler.step_done()
            if scheduler.sync_due() is not None:
                scheduler.sync_ordered(scheduler.sync_due())

    whole, log = fresh(), []
    play(whole, 5, log)
    first, resumed_log = fresh(), []
    play(first, 2, resumed_log)
    state = json.loads(json.dumps(first.snapshot()))  # what state.json holds
    resumed = fresh()
    resumed.restore(state)
    play(resumed, 3, resumed_log)
    assert resumed_log == log
    assert (resumed.steps_done, resumed.rounds_trained, resumed.dropped_stale_groups, resumed.filtered_groups) == (
        whole.steps_done, whole.rounds_trained, whole.dropped_stale_groups, whole.filtered_groups)  # fmt: skip
    with pytest.raises(RuntimeError, match="fresh"):
        resumed.restore(state)


def test_a_snapshot_with_chunks_in_flight_is_refused():
    scheduler = RoundScheduler(
        RoundSettings(num_producers=1, prompts_per_producer=2, groups_per_step=2, n_behind=0, total_rounds=2),
        identity_rows(4),
    )
    scheduler.admit()
    with pytest.raises(RuntimeError, match="between rounds"):
        scheduler.snapshot()


def test_groups_staler_than_n_behind_are_dropped():
    scheduler = RoundScheduler(
        RoundSettings(num_producers=1, prompts_per_producer=3, groups_per_step=2, n_behind=0, total_rounds=2),
        identity_rows(9),
    )
    (order,) = scheduler.admit()
    scheduler.chunk_done(order.chunk_id, kept(order.rows))
    assert rows_of(scheduler.next_step()) == [0, 1]  # row 2 carried over
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
            assert order.sampling_seed_index == order.chunk_id // 3  # the round's index

    driver = RandomDriver(scheduler, seed, on_admit=check)
    driver.run()
    assert scheduler.steps_done == 8 * 3  # nothing filtered: every round feeds 3 steps
    for step in driver.steps:
        assert all(0 <= lag <= n_behind for lag in step.staleness())
        assert step.num_steps == 3 and step.trainer_version == driver.steps.index(step)  # a round an order
    assert Counter(driver.trained_rows()) == Counter((e, row) for e in range(2) for row in range(24))
