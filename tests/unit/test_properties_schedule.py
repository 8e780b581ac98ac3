"""Property-based tests of the schedules' staleness windows and admission counts (``colossal_rl/schedule/``).

Hypothesis draws a schedule's settings and a driver's arbitrary sequence of events (admit, a chunk reported whole
or in part, a chunk lost with its producer, a step, a sync, in any order the ``Scheduler`` protocol allows) and
checks after every event what the schedule promises: admission never commits more groups than the staleness
bound allows, no step trains a group staler than the bound, steps take the oldest groups, a row is trained at most
once an episode, and no producer holds more chunks than its limit.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

from colossal_rl.schedule.events import FinishedGroup, StepOrder
from colossal_rl.schedule.rounds import RoundScheduler, RoundSettings
from colossal_rl.schedule.streaming import StreamingScheduler, StreamingSettings

PROPERTY = settings(max_examples=200, deadline=None, derandomize=True, database=None)
EVENTS = ("admit", "admit", "report", "report", "report", "report_one", "lose", "step", "step", "sync", "sync")
event_lists = st.lists(
    st.tuples(st.sampled_from(EVENTS), st.integers(0, 7), st.integers(0, 255)), min_size=30, max_size=80
)


def rows_of(num_rows: int):
    """Each episode a different rotation of the rows: every row once."""
    return lambda episode: [(row + episode) % num_rows for row in range(num_rows)]


@st.composite
def streaming_settings(draw) -> StreamingSettings:
    sync_every_steps = draw(st.integers(1, 3))
    return StreamingSettings(
        num_producers=draw(st.integers(1, 3)),
        groups_per_step=draw(st.integers(1, 3)),
        prompts_per_chunk=draw(st.integers(1, 3)),
        max_staleness=draw(st.integers(sync_every_steps - 1, sync_every_steps + 1)),
        total_steps=draw(st.integers(1, 6)),
        sync_every_steps=sync_every_steps,
        chunks_in_flight_per_producer=draw(st.integers(1, 2)),
        num_episodes=draw(st.sampled_from([None, 1, 2])),
        on_straggler=draw(st.sampled_from(["drop", "wait"])),
    )


@dataclass
class Trained:
    """What the driver saw trained."""

    rows: set[tuple[int, int]] = field(default_factory=set)
    """(episode, row) of every trained group."""
    straggler_rows: tuple[tuple[int, int], ...] = ()
    """(episode, row) of the held-back chunk's groups, once it was reported."""


def check_step(order: StepOrder, trained: Trained, bound: int, groups_per_step: int, versions) -> None:
    assert len(order.groups) == order.num_steps * groups_per_step
    for group in order.groups:
        lag = order.trainer_version - group.policy_version
        assert 0 <= lag <= bound, f"group of version {group.policy_version} trained at {order.trainer_version}"
        assert group.policy_version == versions[group.chunk_id], "a group's version is its chunk's"
        key = (group.episode, group.row)
        assert key not in trained.rows, f"row {group.row} of episode {group.episode} trained twice"
        trained.rows.add(key)


def drive(scheduler, events, *, straggle_for: int | None, on_order, on_step) -> Iterator[Trained]:
    """Carry out ``events`` (each where it applies, else skipped) and yield after each; ``on_order(order)`` checks
    each chunk ordered, ``on_step(order, trained, versions)`` each step. A chunk's groups start with its version.

    ``straggle_for``: the first chunk ordered is held back until ``straggle_for`` steps were taken after its version
    (the staleness bound's edge), then reported, followed by the others, an admission and a step."""
    events = deque(events)
    in_flight: dict[int, list[int]] = {}  # chunk id -> rows not reported yet
    versions: dict[int, int] = {}
    episodes: dict[int, int] = {}
    held: list[int] = []
    trained = Trained()
    while events:
        kind, pick, kept_bits = events.popleft()
        if kind == "admit":
            for order in scheduler.admit():
                assert order.policy_version == scheduler.synced_version <= scheduler.trainer_version
                on_order(order)
                in_flight[order.chunk_id], versions[order.chunk_id] = list(order.rows), order.policy_version
                episodes[order.chunk_id] = order.episode
                if straggle_for is not None and len(versions) == 1:
                    held.append(order.chunk_id)
        elif kind in ("report", "report_one", "lose", "release"):
            candidates = [chunk for chunk in (held if kind == "release" else sorted(in_flight)) if chunk in in_flight]
            candidates = candidates if kind == "release" else [chunk for chunk in candidates if chunk not in held]
            if candidates:
                report(scheduler, kind, candidates[-1 - pick % len(candidates)], kept_bits, in_flight, versions)
        elif kind == "step":
            order = scheduler.next_step()
            if order is not None:
                on_step(order, trained, versions)
                scheduler.step_done()
        elif kind == "sync" and (version := scheduler.sync_due()) is not None:
            scheduler.sync_ordered(version)
        if held and held[0] in in_flight and scheduler.steps_done - versions[held[0]] >= straggle_for:
            trained.straggler_rows = tuple((episodes[held[0]], row) for row in in_flight[held[0]])
            events.extendleft(reversed([("release", 0, 0), *[("report", 0, 0)] * 3, ("admit", 0, 0), ("step", 0, 0)]))
            held.clear()
        yield trained


def report(scheduler, kind: str, chunk_id: int, kept_bits: int, in_flight, versions) -> None:
    """A chunk lost, or reported whole, or its first row only (``report_one``, where the schedule takes parts)."""
    rows = in_flight[chunk_id]
    if kind == "lose":
        if scheduler.chunk_lost(chunk_id) is None:  # its rows are handed out again (streaming)
            del in_flight[chunk_id]
        return  # else (rounds) the same order is made again: still in flight
    reported = rows[:1] if kind == "report_one" and hasattr(scheduler, "groups_done") else rows
    kept = [(kept_bits >> (2 * index % 8)) & 3 != 3 for index in range(len(reported))]  # two set bits: filtered
    groups = [FinishedGroup(row, versions[chunk_id], 1, keep) for row, keep in zip(reported, kept, strict=True)]
    if reported == rows:
        del in_flight[chunk_id]
        scheduler.chunk_done(chunk_id, groups)
    else:
        in_flight[chunk_id] = rows[1:]
        scheduler.groups_done(chunk_id, groups)


@PROPERTY
@given(settings_=streaming_settings(), num_rows=st.integers(2, 9), events=event_lists)
def test_streaming_admission_and_steps_keep_within_the_staleness_bound(settings_, num_rows, events):
    """After any event: groups committed (trained, waiting, in flight) within (S + v + 1) x groups_per_step for the
    newest synced version v and within the run's total; no producer over its chunk limit; every step has
    groups_per_step groups, none staler than S, the oldest waiting first, no row twice an episode; with
    ``on_straggler="wait"`` nothing is ever dropped as stale."""
    scheduler = StreamingScheduler(settings_, rows_of(num_rows))
    bound, per_step = settings_.max_staleness, settings_.groups_per_step

    def on_step(order, trained, versions):
        check_step(order, trained, bound, per_step, versions)
        assert order.trainer_version == scheduler.steps_done
        left = scheduler.waiting_groups()
        assert all(group.policy_version <= other.policy_version for group in order.groups for other in left)

    for _ in drive(scheduler, events, straggle_for=None, on_order=lambda order: None, on_step=on_step):
        committed = scheduler.committed_groups()
        assert committed <= (bound + scheduler.synced_version + 1) * per_step
        assert committed <= settings_.total_steps * per_step
        for rank in range(settings_.num_producers):
            assert scheduler.chunks_in_flight(rank) <= settings_.chunks_in_flight_per_producer
        if settings_.on_straggler == "wait":
            assert scheduler.counters.dropped_stale_groups == 0


@st.composite
def edge_settings(draw) -> StreamingSettings:
    """Chunks of one prompt and small steps: a held-back chunk can reach the staleness bound's edge."""
    sync_every_steps = draw(st.integers(1, 2))
    return StreamingSettings(
        num_producers=draw(st.integers(1, 2)),
        groups_per_step=draw(st.integers(1, 2)),
        prompts_per_chunk=1,
        max_staleness=draw(st.integers(max(sync_every_steps - 1, 1), sync_every_steps + 1)),
        total_steps=8,
        sync_every_steps=sync_every_steps,
        on_straggler=draw(st.sampled_from(["drop", "wait"])),
    )


@PROPERTY
@given(settings_=edge_settings(), events=event_lists)
def test_a_straggler_arriving_one_step_too_stale_is_dropped_or_waited_for(settings_, events):
    """The first chunk is held back until S + 1 steps were taken after its version. ``drop``: when it then arrives
    its group is dropped as stale, never trained (not even at staleness exactly S + 1); ``wait``: no step is taken
    that would make it that stale, so it is never held that long and nothing is dropped."""
    scheduler = StreamingScheduler(settings_, rows_of(20))
    bound, per_step = settings_.max_staleness, settings_.groups_per_step
    check = lambda order, seen, versions: check_step(order, seen, bound, per_step, versions)  # noqa: E731
    *_, trained = drive(scheduler, events, straggle_for=bound + 1, on_order=lambda order: None, on_step=check)
    if settings_.on_straggler == "wait":
        assert not trained.straggler_rows and scheduler.counters.dropped_stale_groups == 0
    elif trained.straggler_rows:
        assert not set(trained.straggler_rows) & trained.rows
        assert scheduler.counters.dropped_stale_groups >= len(trained.straggler_rows)


@st.composite
def round_settings(draw) -> tuple[RoundSettings, int]:
    num_producers, prompts = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    rounds_per_episode = draw(st.integers(1, 3))
    settings_ = RoundSettings(
        num_producers=num_producers,
        prompts_per_producer=prompts,
        groups_per_step=draw(st.integers(1, 3)),
        n_behind=draw(st.integers(0, 2)),
        total_rounds=draw(st.integers(1, 5)),
        ppo_epochs=draw(st.integers(1, 2)),
    )
    return settings_, num_producers * prompts * rounds_per_episode + draw(st.integers(0, 2))


@PROPERTY
@given(drawn=round_settings(), events=event_lists)
def test_rounds_are_ordered_at_most_n_behind_and_train_nothing_staler(drawn, events):
    """Round r is ordered only once version r - n_behind is synced (its chunks carry a version >= r - n_behind),
    so at most n_behind + 1 rounds are ordered and untrained; each round's steps train whole steps of groups no
    staler than n_behind versions, no row twice an episode."""
    settings_, num_rows = drawn
    scheduler = RoundScheduler(settings_, rows_of(num_rows))
    bound, per_step = settings_.n_behind, settings_.groups_per_step
    ordered_rounds = set()

    def on_order(order):
        round_index = order.seed_index  # a round's chunks are seeded with its index
        assert order.policy_version >= round_index - bound, f"round {round_index} with version {order.policy_version}"
        ordered_rounds.add(round_index)

    def on_step(order, trained, versions):
        assert order.trainer_version == scheduler.rounds_trained
        check_step(order, trained, bound, per_step, versions)

    for _ in drive(scheduler, events, straggle_for=None, on_order=on_order, on_step=on_step):
        untrained = [round_index for round_index in ordered_rounds if round_index >= scheduler.rounds_trained]
        assert len(untrained) <= bound + 1
