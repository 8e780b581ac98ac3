"""The schedule loop's own bookkeeping (``colossal_rl/driver/schedule_loop.py``) under the streaming schedule, on fake
actor groups (no Ray): which calls go to which actors after each event, in which order; which chunks' payloads it keeps or frees;
what a lost chunk re-issues; when a sync, an eval and a checkpoint are due — each at its boundary (an admission
budget exactly met, a step's groups exactly there, a chunk exactly S versions stale, an interval exactly reached).
"""

from __future__ import annotations

import pytest
from fake_actor_groups import results
from fake_driver import PROGRESS, FakeDriver, calls, kinds

from colossal_rl.config import GenerationConfig, ParallelConfig, RLConfig, RunConfig, ScheduleConfig, TrainConfig
from colossal_rl.config_resolve import resolve
from colossal_rl.driver import schedule_loop
from colossal_rl.driver.actor_messages import ChunkResult, StepResult
from colossal_rl.driver.calls import RunFailed
from colossal_rl.driver.schedule_loop import ScheduleLoop
from colossal_rl.driver.schedules import stream_settings
from colossal_rl.schedule.events import FinishedGroup, TrainGroup
from colossal_rl.schedule.prompts import episode_rows
from colossal_rl.schedule.streaming import StreamingScheduler


def config(**run) -> RLConfig:
    """1 trainer, 2 producers, chunks of 2 prompts, steps of 2 groups, S = 1, a sync after every step."""
    return resolve(
        RLConfig(
            generation=GenerationConfig(microbatch_size=2),
            train=TrainConfig(batch_size=2, minibatch_size=2),
            parallel=ParallelConfig(num_trainers=1),
            schedule=ScheduleConfig(mode="stream", num_producers=2, inference_batch_size=2, max_staleness=1),
            run=RunConfig(**{"eval_interval": 0, "save_interval": 0, **run}),
        )
    )


def loop_on(config: RLConfig, total_steps: int = 8) -> tuple[ScheduleLoop, FakeDriver]:
    driver = FakeDriver(config)
    scheduler = StreamingScheduler(stream_settings(config, total_steps), episode_rows(driver.train_rows, 0))
    return ScheduleLoop(driver, scheduler, total_steps), driver


def answer(loop: ScheduleLoop, kind: str, kept: int | None = None):
    """Report the oldest waited-on item of ``kind`` finished (a chunk: its first ``kept`` rows kept, default all)."""
    item = next(item for item in loop.waiting if item.kind == kind)
    loop._forget(item)
    if kind == "chunk":
        order = item.subject
        kept = len(order.rows) if kept is None else kept
        groups = tuple(
            FinishedGroup(row, order.policy_version, 10, index < kept) for index, row in enumerate(order.rows)
        )
        payload = f"payload {order.chunk_id}" if kept else None
        finished = [ChunkResult(order.chunk_id, order.producer_rank, payload, order.rows[:kept], groups, {})]
    elif kind == "step":
        finished = [[StepResult(item.subject.step, {"train/reward": 0.0, "train/loss": 0.0}, [], [])]]
    else:
        finished = results(item.calls)
    loop._answer(item, finished, PROGRESS)
    return item.subject


def test_first_decisions_fill_the_admission_budget_exactly_then_queue_the_eval_before_behind_the_chunks():
    loop, driver = loop_on(config())
    loop._decide()
    # (S + 0 + 1) x 2 groups = 4 rows: one chunk of 2 each, the budget met exactly, so no third chunk
    assert calls(driver) == [
        ("producer 0", "produce_chunk"),
        ("producer 1", "produce_chunk"),
        ("producer 0", "evaluate"),
        ("producer 1", "evaluate"),
    ]
    assert kinds(loop) == ["chunk", "chunk", "eval"]
    loop._decide()  # nothing changed: nothing more is ordered, the eval before is not ordered twice
    assert calls(driver) == []


def test_a_step_is_ordered_once_its_groups_are_exactly_there_and_shares_point_into_the_kept_payloads():
    loop, driver = loop_on(config())
    loop._decide()
    answer(loop, "chunk", kept=1)  # one group waiting of the two a step needs: no step
    loop._decide()
    assert "step" not in kinds(loop)
    answer(loop, "chunk")  # three usable now: the oldest two (by arrival) are trained
    calls(driver)
    loop._decide()
    assert [(actor, method) for actor, method, _ in driver.log] == [("trainer 0", "train_steps")]
    step, version, ((share,),), sample_step = driver.log[-1][2]
    assert (step, version, sample_step) == (0, 0, None)
    assert [(ref.payload, ref.group_index, ref.chunk_id) for ref in share] == [
        ("payload 0", 0, 0),
        ("payload 1", 0, 1),
    ]


def test_a_due_sync_goes_to_every_producer_before_the_chunks_admitted_with_its_version():
    loop, driver = loop_on(config())
    loop._decide()
    answer(loop, "chunk")
    answer(loop, "chunk")
    loop._decide()
    calls(driver)
    answer(loop, "step")  # the trainers hold version 1 now: a sync is due (every step)
    loop._decide()
    made = calls(driver)
    sync = [("trainer 0", "push_weights"), ("producer 0", "receive_weights"), ("producer 1", "receive_weights")]
    assert made[:3] == sync
    chunk_orders = [item.subject for item in loop.waiting if item.kind == "chunk"]
    assert chunk_orders and all(order.policy_version == 1 for order in chunk_orders)
    # then the chunks admitted (version 1's budget), then the step of the two groups still waiting
    assert {method for _, method in made[3:-1]} == {"produce_chunk"} and made[-1] == ("trainer 0", "train_steps")


def test_one_sync_is_in_flight_at_a_time_and_the_next_one_is_ordered_when_it_answers():
    loop, driver = loop_on(config(), total_steps=8)
    loop._decide()
    for _ in range(2):
        answer(loop, "chunk")
    loop._decide()
    answer(loop, "step")
    loop._decide()  # sync to 1 ordered
    assert kinds(loop).count("sync") == 1
    while "step" not in kinds(loop):
        answer(loop, "chunk")
        loop._decide()
    answer(loop, "step")  # version 2 due, but the sync to 1 has not answered
    calls(driver)
    loop._decide()
    assert ("trainer 0", "push_weights") not in calls(driver) and kinds(loop).count("sync") == 1
    assert answer(loop, "sync") == 1 and driver.progress.policy_version == 1
    loop._decide()
    assert calls(driver)[0] == ("trainer 0", "push_weights")
    assert [item.subject for item in loop.waiting if item.kind == "sync"] == [2]


@pytest.mark.parametrize("steps_done, kept", [(1, [0, 1]), (2, [1])])
def test_a_chunk_exactly_s_versions_stale_keeps_its_payload_and_one_staler_is_freed(steps_done, kept):
    loop, _ = loop_on(config())
    for version in (0, 1):  # chunk ``version``: one group waiting, generated with that version
        groups = (FinishedGroup(version, version, 10),)
        loop.chunks[version] = ChunkResult(version, 0, f"payload {version}", (version,), groups, {})
        loop.scheduler._waiting.append(TrainGroup(version, 0, version, version, 10, version))
    loop.scheduler._steps_done = steps_done  # S = 1: version steps_done - 1 is still usable
    loop._forget_trained_chunks()
    assert sorted(loop.chunks) == kept


def test_a_chunk_with_no_kept_group_keeps_no_payload():
    loop, _ = loop_on(config())
    loop._decide()
    answer(loop, "chunk", kept=0)
    assert loop.chunks == {}


def test_a_chunk_lost_with_its_producer_hands_its_rows_out_again_first(monkeypatch):
    loop, driver = loop_on(config())
    loop._decide()
    lost = next(item for item in loop.waiting if item.kind == "chunk" and item.subject.producer_rank == 1)
    driver.restarted_producers = lambda failure, calls, whole_sync: [1]
    monkeypatch.setattr(schedule_loop, "_lost", lambda call: call in lost.calls)
    calls(driver)
    loop._recover(RunFailed("producer 1 died", {lost.calls[0].actor: "died"}), lost)
    assert lost not in loop.waiting and loop.scheduler.counters.requeued_groups == 2
    loop._decide()
    again = [item.subject for item in loop.waiting if item.kind == "chunk" and item.subject.chunk_id > 1]
    assert [order.rows for order in again] == [lost.subject.rows]


def test_when_every_chunk_in_flight_is_lost_the_loop_decides_again_and_orders_their_rows(monkeypatch):
    """The producer of every call in flight died (one producer, continuous batching: all its chunks at once): the
    wait deals with the death and hands back no item, so the loop orders the rows again instead of finding nothing
    in flight and ending the run as stalled."""
    loop, driver = loop_on(config())
    loop._decide()
    lost = next(item for item in loop.waiting if item.kind == "chunk" and item.subject.producer_rank == 1)
    for item in [item for item in loop.waiting if item is not lost]:
        loop._forget(item)
    failure = RunFailed("producer 1 died", {lost.calls[0].actor: "died"})
    driver.restarted_producers = lambda failure, calls, whole_sync: [1]
    monkeypatch.setattr(schedule_loop, "_lost", lambda call: call in lost.calls)
    monkeypatch.setattr(schedule_loop.ray, "wait", lambda refs, num_returns, timeout: (refs[:1], refs[1:]))
    monkeypatch.setattr(schedule_loop, "call_outcome", lambda ref: ("died", None))
    monkeypatch.setattr(schedule_loop, "gather", lambda calls, timeout: (_ for _ in ()).throw(failure))
    calls(driver)
    assert loop._wait_one() is None
    assert not loop.waiting and loop.scheduler.counters.requeued_groups == 2
    loop._decide()
    again = [item.subject for item in loop.waiting if item.kind == "chunk"]
    assert lost.subject.rows in [order.rows for order in again]


@pytest.mark.parametrize("interval", [2, 3])
def test_the_eval_is_ordered_behind_the_sync_of_exactly_its_step_and_never_at_the_last(interval):
    loop, driver = loop_on(config(eval_interval=interval), total_steps=3)
    driver.progress.eval_accuracy_before = {"math": 0.0}  # no eval before (a resumed run's)
    driver.progress.next_eval_step = interval
    loop.eval_before_ordered = True
    evals_at = []
    for _ in range(3):
        while "step" not in kinds(loop):
            loop._decide()
            if "step" not in kinds(loop):
                answer(loop, "chunk")
        answer(loop, "step")
        if "sync" in kinds(loop):
            answer(loop, "sync")
        loop._decide()
        made = calls(driver)
        if ("producer 0", "evaluate") in made:
            assert made.index(("producer 0", "receive_weights")) < made.index(("producer 0", "evaluate"))
            evals_at.append(driver.step)
    assert evals_at == ([2] if interval == 2 else [])  # step 3 is the last: the final eval is run's own


@pytest.mark.parametrize(
    "step, last_saved, last, due",
    [(1, 0, False, False), (2, 0, False, True), (3, 2, False, False), (4, 2, False, True), (3, 2, True, True)],
)
def test_a_checkpoint_is_due_when_the_interval_is_exactly_reached_or_at_the_last_step(step, last_saved, last, due):
    driver = FakeDriver(config(save_interval=2))
    driver.progress.step, driver.last_saved_step = step, last_saved
    assert driver.checkpoint_due(last) is due


def test_a_checkpoint_between_steps_saves_the_trainers_version_and_the_schedulers_snapshot(monkeypatch):
    saved = []
    monkeypatch.setattr(schedule_loop, "save_run", lambda **kw: saved.append(kw))
    monkeypatch.setattr(schedule_loop, "_saved", lambda chunk, timeout_s: chunk.payload)
    loop, driver = loop_on(config(save_interval=2), total_steps=8)
    for _ in range(2):
        while "step" not in kinds(loop):
            loop._decide()
            if "step" not in kinds(loop):
                answer(loop, "chunk")
        answer(loop, "step")
        if driver.step == 1:
            assert saved == []
    assert [kw["progress"].policy_version for kw in saved] == [2]  # versions count steps
    assert saved[0]["schedule"]["steps_done"] == 2 and driver.last_saved_step == 2
    waiting = {group.chunk_id for group in loop.scheduler.waiting_groups()}
    assert set(saved[0]["chunks"]) == waiting  # the rollouts of every group not trained, and only those


def test_a_producer_death_while_a_broken_sync_forms_again_is_recovered_then_the_sync_made_again(monkeypatch):
    loop, driver = loop_on(config())
    loop._decide()
    answer(loop, "chunk"), answer(loop, "chunk")
    loop._decide()  # the step
    answer(loop, "step")
    loop._decide()  # the sync to version 1
    sync = next(item for item in loop.waiting if item.kind == "sync")
    monkeypatch.setattr(schedule_loop.ray, "wait", lambda refs, **kwargs: (refs, []))
    formations, restarts = [], []
    wait = driver.sync.wait

    def formation_wait(groups):
        if any(call.method == "join_weight_sync" for calls in groups for call in calls):
            formations.append(len(formations))
            if len(formations) == 1:
                raise RunFailed("producer 0 died", {groups[-1][0].actor: "died"})
        return wait(groups)

    driver.sync.wait = formation_wait
    driver.restarted_producers = lambda failure, calls, whole_sync: restarts.append(whole_sync) or [0]
    calls(driver)
    loop._remake_sync(sync)
    assert formations == [0, 1] and restarts == [True]
    remade = [item for item in loop.waiting if item.kind == "sync"]
    assert [item.subject for item in remade] == [sync.subject] and remade[0] is not sync
    assert calls(driver)[-3:] == [("trainer 0", "push_weights"), ("producer 0", "receive_weights"),
                                  ("producer 1", "receive_weights")]  # fmt: skip


def test_a_sync_that_cannot_form_three_times_ends_the_run(monkeypatch):
    loop, driver = loop_on(config())
    loop._decide()
    answer(loop, "chunk"), answer(loop, "chunk")
    loop._decide()
    answer(loop, "step")
    loop._decide()
    sync = next(item for item in loop.waiting if item.kind == "sync")
    monkeypatch.setattr(schedule_loop.ray, "wait", lambda refs, **kwargs: (refs, []))

    def formation_wait(groups):
        raise RunFailed("producer 0 died", {groups[-1][0].actor: "died"})

    driver.sync.wait = formation_wait
    driver.restarted_producers = lambda failure, calls, whole_sync: [0]
    with pytest.raises(RunFailed, match="producer 0 died"):
        loop._remake_sync(sync)
