"""The streaming schedule (colossal_rl/schedule/streaming.py): exact orders on small hand-built cases, and
properties over seeded random event sequences (tests/unit/schedule_driving.py): the admission bound, no stale
group trained, each row at most once per epoch, nothing lost across a snapshot."""

from __future__ import annotations

import json
from collections import Counter

import pytest
from schedule_driving import RandomDriver

from colossal_rl.schedule.events import ChunkOrder, FinishedGroup
from colossal_rl.schedule.prompts import episode_rows
from colossal_rl.schedule.streaming import StreamingScheduler, StreamingSettings


def identity_rows(num_rows: int):
    return lambda episode: list(range(num_rows))


def settings(**overrides) -> StreamingSettings:
    values = dict(num_producers=2, groups_per_step=2, prompts_per_chunk=2, max_staleness=1, total_steps=3)
    return StreamingSettings(**(values | overrides))


def kept(rows, version=0):
    return [FinishedGroup(row, version, tokens=1) for row in rows]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("num_producers", 0),
        ("groups_per_step", 0),
        ("prompts_per_chunk", 0),
        ("max_staleness", -1),
        ("total_steps", -1),
        ("sync_every_steps", 0),
        ("chunks_in_flight_per_producer", 0),
        ("num_episodes", 0),
        ("on_straggler", "skip"),
    ],
)
def test_bad_settings_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"^{field}: "):
        settings(**{field: value})


def test_staleness_below_the_sync_interval_is_refused():
    with pytest.raises(ValueError, match="^max_staleness: must be >= sync_every_steps - 1 = 2"):
        settings(max_staleness=1, sync_every_steps=3)
    settings(max_staleness=2, sync_every_steps=3)


def test_exact_orders_with_a_filtered_group_and_a_partial_chunk():
    scheduler = StreamingScheduler(settings(), identity_rows(10))
    # (S + v + 1) * B = (1 + 0 + 1) * 2 = 4 groups: one chunk of 2 to each producer
    assert scheduler.admit() == [ChunkOrder(0, 0, 0, (0, 1), 0), ChunkOrder(1, 1, 0, (2, 3), 0)]
    assert scheduler.admit() == []
    scheduler.chunk_done(1, [FinishedGroup(2, 0, kept=False), FinishedGroup(3, 0, tokens=7)])
    # the filtered group frees one place: producer 1 is idle, so it gets a chunk of 1 prompt
    assert scheduler.admit() == [ChunkOrder(2, 1, 0, (4,), 0)]
    assert scheduler.next_step() is None  # one usable group waits, two are needed
    scheduler.chunk_done(0, kept([0, 1]))
    step = scheduler.next_step()
    assert (step.step, step.trainer_version, step.dropped_stale) == (0, 0, 0)
    assert [group.row for group in step.groups] == [3, 0]  # same version: arrival order
    assert step.groups[0].tokens == 7
    assert scheduler.next_step() is None  # a step is open
    assert scheduler.sync_due() is None
    scheduler.step_done()
    assert scheduler.sync_due() == 1
    scheduler.sync_ordered(1)
    # committed: 2 trained + 1 waiting (row 1) + 1 in flight (row 4) = 4; limit (1 + 1 + 1) * 2 = 6
    assert scheduler.admit() == [ChunkOrder(3, 0, 0, (5, 6), 1)]
    assert scheduler.counters.filtered_groups == 1
    assert scheduler.counters.staleness == {0: 2}


def straggler_case(on_straggler: str) -> tuple[StreamingScheduler, list]:
    """Two producers, one-group steps, S = 1: row 0 (producer 0) is slow, rows 1 and 2 overtake it."""
    scheduler = StreamingScheduler(
        settings(groups_per_step=1, prompts_per_chunk=1, total_steps=4, on_straggler=on_straggler),
        identity_rows(10),
    )
    steps = []
    assert scheduler.admit() == [ChunkOrder(0, 0, 0, (0,), 0), ChunkOrder(1, 1, 0, (1,), 0)]
    scheduler.chunk_done(1, kept([1]))
    steps.append(scheduler.next_step())
    scheduler.step_done()
    scheduler.sync_ordered(scheduler.sync_due())
    assert scheduler.admit() == [ChunkOrder(2, 1, 0, (2,), 1)]
    scheduler.chunk_done(2, kept([2], version=1))
    steps.append(scheduler.next_step())
    return scheduler, steps


def test_a_straggler_overtaken_past_the_bound_is_dropped_not_trained():
    scheduler, steps = straggler_case("drop")
    assert [[group.row for group in step.groups] for step in steps] == [[1], [2]]
    scheduler.step_done()
    scheduler.sync_ordered(scheduler.sync_due())
    scheduler.chunk_done(0, kept([0], version=0))  # trainers hold version 2: staleness 2 > 1
    assert scheduler.next_step() is None
    assert scheduler.counters.dropped_stale_groups == 1
    orders = scheduler.admit()  # the dropped group is made up for
    assert [order.rows for order in orders] == [(3,), (4,)]
    scheduler.chunk_done(orders[0].chunk_id, kept([3], version=2))
    step = scheduler.next_step()
    assert step.dropped_stale == 1 and [group.row for group in step.groups] == [3]


def test_waiting_for_a_straggler_trains_it_instead():
    scheduler, steps = straggler_case("wait")
    assert steps[1] is None  # step 1 would leave row 0 (version 0) with staleness 2
    scheduler.chunk_done(0, kept([0], version=0))
    step = scheduler.next_step()
    assert [group.row for group in step.groups] == [0]  # oldest version first
    assert step.staleness() == {1: 1}
    assert scheduler.counters.dropped_stale_groups == 0


def test_filtered_groups_lead_to_more_admissions():
    def admitted_after_first_chunk(keep: bool) -> list[ChunkOrder]:
        scheduler = StreamingScheduler(settings(num_producers=1, max_staleness=0), identity_rows(10))
        (order,) = scheduler.admit()
        scheduler.chunk_done(order.chunk_id, [FinishedGroup(row, 0, kept=keep) for row in order.rows])
        return scheduler.admit()

    assert admitted_after_first_chunk(keep=True) == []
    assert admitted_after_first_chunk(keep=False) == [ChunkOrder(1, 0, 0, (2, 3), 0)]


def test_syncs_every_two_steps_and_after_the_last():
    scheduler = StreamingScheduler(
        settings(num_producers=1, groups_per_step=1, prompts_per_chunk=1, total_steps=3, sync_every_steps=2),
        identity_rows(10),
    )
    due = []
    for _ in range(3):
        for order in scheduler.admit():
            scheduler.chunk_done(order.chunk_id, kept(order.rows, order.policy_version))
        scheduler.next_step()
        scheduler.step_done()
        due.append(scheduler.sync_due())
        if due[-1] is not None:
            scheduler.sync_ordered(due[-1])
    assert due == [None, 2, 3]
    with pytest.raises(ValueError, match="sync of version 3"):
        scheduler.sync_ordered(3)
    assert scheduler.finished


def test_chunks_never_mix_episodes_and_episodes_end():
    scheduler = StreamingScheduler(
        settings(num_producers=1, max_staleness=9, total_steps=9, num_episodes=2, chunks_in_flight_per_producer=9),
        identity_rows(5),
    )
    orders = scheduler.admit()
    assert [(order.episode, order.rows) for order in orders] == [
        (0, (0, 1)), (0, (2, 3)), (0, (4,)), (1, (0, 1)), (1, (2, 3)), (1, (4,)),
    ]  # fmt: skip
    for order in orders:
        scheduler.chunk_done(order.chunk_id, kept(order.rows))
    for _ in range(5):
        scheduler.next_step()
        scheduler.step_done()
    assert scheduler.finished and scheduler.steps_done == 5  # one group left, a step needs two


def bound_checker(scheduler: StreamingScheduler):
    def check(orders: list[ChunkOrder]) -> None:
        s = scheduler.settings
        committed = scheduler.committed_groups()
        assert committed <= (s.max_staleness + scheduler.steps_done + 1) * s.groups_per_step  # AReaL's rule
        assert committed <= scheduler.admission_limit(scheduler.synced_version)
        for rank in range(s.num_producers):
            assert scheduler.chunks_in_flight(rank) <= s.chunks_in_flight_per_producer
        for order in orders:
            assert order.policy_version == scheduler.synced_version

    return check


CASES = [
    dict(num_producers=1, groups_per_step=4, prompts_per_chunk=2, max_staleness=0),
    dict(num_producers=3, groups_per_step=4, prompts_per_chunk=2, max_staleness=1),
    dict(num_producers=4, groups_per_step=3, prompts_per_chunk=5, max_staleness=2, sync_every_steps=3),
    dict(num_producers=2, groups_per_step=6, prompts_per_chunk=1, max_staleness=4, chunks_in_flight_per_producer=1),
]


@pytest.mark.parametrize("on_straggler", ["drop", "wait"])
@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("seed", range(5))
def test_random_event_orders_keep_every_bound(case, seed, on_straggler):
    num_rows, episodes = 36, 2
    total_steps = num_rows * episodes // CASES[case]["groups_per_step"]
    scheduler = StreamingScheduler(
        StreamingSettings(**CASES[case], total_steps=total_steps, num_episodes=episodes, on_straggler=on_straggler),
        episode_rows(num_rows, seed),
    )
    driver = RandomDriver(scheduler, seed, keep=0.7, partial=seed % 2 == 1, on_admit=bound_checker(scheduler))
    driver.run()
    s = scheduler.settings
    for step in driver.steps:
        assert len(step.groups) == s.groups_per_step
        assert all(0 <= lag <= s.max_staleness for lag in step.staleness())
    handed_out = Counter((order.episode, row) for order in driver.admitted for row in order.rows)
    assert max(handed_out.values()) == 1 and len(handed_out) == num_rows * episodes  # all, each once
    trained = driver.trained_rows()
    assert len(set(trained)) == len(trained)
    if on_straggler == "wait":
        assert scheduler.counters.dropped_stale_groups == 0
    total = scheduler.counters
    assert total.trained_groups + total.dropped_stale_groups + total.filtered_groups + scheduler.groups_waiting() == (
        num_rows * episodes
    )


@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("seed", range(3))
def test_without_filtering_every_row_is_trained_exactly_once(case, seed):
    num_rows, episodes = 36, 2
    total_steps = num_rows * episodes // CASES[case]["groups_per_step"]
    scheduler = StreamingScheduler(
        StreamingSettings(**CASES[case], total_steps=total_steps, on_straggler="wait"), episode_rows(num_rows, 7)
    )
    driver = RandomDriver(scheduler, seed, on_admit=bound_checker(scheduler))
    driver.run()
    assert scheduler.steps_done == total_steps
    assert sorted(driver.trained_rows()) == [(e, row) for e in range(episodes) for row in range(num_rows)]


@pytest.mark.parametrize("requeue_waiting", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_a_snapshot_mid_flight_loses_no_row_and_trains_none_twice(seed, requeue_waiting):
    num_rows, episodes = 30, 2
    make = lambda: StreamingScheduler(  # noqa: E731
        StreamingSettings(**CASES[1], total_steps=num_rows * episodes // 4, on_straggler="wait"),
        episode_rows(num_rows, seed),
    )
    first = make()
    before = RandomDriver(first, seed, partial=True)
    while first.steps_done < 6 or not first.chunks_in_flight():
        before.decide()
        if before.open_step is not None:
            first.step_done()
            before.open_step = None
        elif before.in_flight:
            before.report_chunk(min(before.in_flight))
    assert first.groups_in_flight() > 0
    in_flight = {(order.episode, row) for order, rows in before.in_flight.values() for row in rows}
    waiting = {(group.episode, group.row) for group in first._waiting}
    state = json.loads(json.dumps(first.snapshot()))

    second = make()
    second.restore(state, requeue_waiting=requeue_waiting)
    assert second.steps_done == second.synced_version == first.steps_done
    assert second.counters == first.counters
    after = RandomDriver(second, seed + 100, partial=True)
    after.decide()
    handed_again = {(order.episode, row) for order in after.admitted for row in order.rows}
    assert in_flight <= handed_again  # re-queued rows are handed out first
    after.run()
    trained = before.trained_rows() + after.trained_rows()
    assert sorted(trained) == [(e, row) for e in range(episodes) for row in range(num_rows)]
    if requeue_waiting:
        assert waiting <= {(order.episode, row) for order in after.admitted for row in order.rows}


def test_restore_needs_a_fresh_scheduler_and_no_open_step():
    scheduler = StreamingScheduler(settings(), identity_rows(10))
    state = scheduler.snapshot()
    orders = scheduler.admit()
    with pytest.raises(RuntimeError, match="fresh"):
        scheduler.restore(state)
    for order in orders:
        scheduler.chunk_done(order.chunk_id, kept(order.rows))
    scheduler.next_step()
    with pytest.raises(RuntimeError, match="open"):
        scheduler.snapshot()


def test_reports_of_rows_not_in_flight_are_refused():
    scheduler = StreamingScheduler(settings(), identity_rows(10))
    scheduler.admit()
    with pytest.raises(ValueError, match="not in flight"):
        scheduler.chunk_done(7, kept([0]))
    with pytest.raises(ValueError, match="bad: \\[5\\]"):
        scheduler.groups_done(0, kept([5]))
    with pytest.raises(ValueError, match="without rows \\[1\\]"):
        scheduler.chunk_done(0, kept([0]))
    scheduler.groups_done(0, kept([0]))
    with pytest.raises(ValueError, match="bad: \\[0\\]"):
        scheduler.groups_done(0, kept([0]))


def test_a_partial_chunk_goes_only_to_a_producer_with_nothing_in_flight():
    scheduler = StreamingScheduler(settings(num_producers=1), identity_rows(10))
    assert [order.rows for order in scheduler.admit()] == [(0, 1), (2, 3)]
    scheduler.chunk_done(0, [FinishedGroup(0, 0, kept=False), FinishedGroup(1, 0)])
    assert scheduler.admit() == []  # room for 1 prompt, and the producer still has chunk 1 to run
    scheduler.chunk_done(1, kept([2, 3]))
    assert scheduler.admit() == [ChunkOrder(2, 0, 0, (4,), 0)]


def test_a_lost_chunk_is_handed_out_again_first():
    scheduler = StreamingScheduler(settings(), identity_rows(10))
    assert scheduler.admit() == [ChunkOrder(0, 0, 0, (0, 1), 0), ChunkOrder(1, 1, 0, (2, 3), 0)]
    scheduler.groups_done(0, kept([0]))
    scheduler.chunk_lost(0)  # producer 0 died after reporting row 0
    assert scheduler.chunks_in_flight() == 1 and scheduler.counters.requeued_groups == 1
    assert scheduler.admit() == [ChunkOrder(2, 0, 0, (1,), 0)]  # row 1 again, before rows 4, 5...
    with pytest.raises(ValueError, match="chunk 0 is not in flight"):
        scheduler.chunk_lost(0)
    assert scheduler.metrics()["schedule/groups_requeued"] == 1.0


@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("seed", range(3))
def test_losing_random_chunks_still_trains_every_row_exactly_once(case, seed):
    num_rows, episodes = 36, 2
    total_steps = num_rows * episodes // CASES[case]["groups_per_step"]
    scheduler = StreamingScheduler(
        StreamingSettings(**CASES[case], total_steps=total_steps, on_straggler="wait", num_episodes=episodes),
        episode_rows(num_rows, seed),
    )
    driver = RandomDriver(scheduler, seed, partial=True, on_admit=bound_checker(scheduler))
    for _ in range(100_000):
        driver.decide()
        if scheduler.finished and driver.open_step is None:
            break
        if driver.in_flight and driver.rng.random() < 0.15:  # its producer died
            chunk_id = driver.rng.choice(sorted(driver.in_flight))
            scheduler.chunk_lost(chunk_id)
            del driver.in_flight[chunk_id]
        elif driver.open_step is not None and (not driver.in_flight or driver.rng.random() < 0.5):
            scheduler.step_done()
            driver.open_step = None
        elif driver.in_flight:
            driver.report_chunk(driver.rng.choice(sorted(driver.in_flight)))
        else:
            scheduler.sync_ordered(scheduler.sync_due())
    assert scheduler.steps_done == total_steps and scheduler.counters.requeued_groups > 0
    assert sorted(driver.trained_rows()) == [(e, row) for e in range(episodes) for row in range(num_rows)]
