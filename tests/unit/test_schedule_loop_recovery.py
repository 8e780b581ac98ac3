"""The schedule loop's recovery after a producer restart (``schedule_loop.ScheduleLoop._recover``) for the calls that
are neither a chunk nor a sync: the eval before training (subject None) and an eval of the weights of step k
(subject k). A lost eval is made again with the same subject, only its lost calls made again (the others still
waited on), in submission order, and answering it logs the eval where the lost one would have; the calls of a
training order in flight, and an eval none of whose calls was lost, are left alone. Under both schedules, on fake
actor groups (no Ray); which calls a death failed is given (``_lost``) and "made again" is a new ref.
"""

from __future__ import annotations

import pytest
from fake_actor_groups import Ref, results
from fake_driver import PROGRESS, FakeDriver, calls, kinds

from colossal_rl.config import GenerationConfig, ParallelConfig, RLConfig, RunConfig, ScheduleConfig, TrainConfig
from colossal_rl.config_resolve import resolve
from colossal_rl.driver import schedule_loop
from colossal_rl.driver.calls import RunFailed
from colossal_rl.driver.schedule_loop import ScheduleLoop, Waiting
from colossal_rl.driver.schedules import make_scheduler

SCHEDULES = ["rounds", "stream"]


def config(mode: str) -> RLConfig:
    """1 trainer, 2 producers of 2 prompts, steps of 2 groups."""
    schedule = {"max_staleness": 1} if mode == "stream" else {}
    return resolve(
        RLConfig(
            generation=GenerationConfig(microbatch_size=2),
            train=TrainConfig(batch_size=2, minibatch_size=2),
            parallel=ParallelConfig(num_trainers=1),
            schedule=ScheduleConfig(mode=mode, num_producers=2, inference_batch_size=2, **schedule),
            run=RunConfig(eval_interval=0, save_interval=0, log_rollout_interval=0, final_export=False),
        )
    )


def loop_on(mode: str) -> tuple[ScheduleLoop, FakeDriver]:
    driver = FakeDriver(config(mode), train_rows=16)
    scheduler, plan = make_scheduler(driver.config, 16)
    return ScheduleLoop(driver, scheduler, plan.total_steps), driver


def producer_died(monkeypatch, loop: ScheduleLoop, driver: FakeDriver, rank: int) -> list:
    """Producer ``rank`` died and was restarted: every call of it in flight failed; made again, a call is the same
    call with a new ref. Returns the lost calls."""
    lost = [
        call
        for item in loop.waiting
        for call in item.calls
        if call.actor.rank == rank and call.actor.kind == "producer"
    ]
    driver.restarted_producers = lambda failure, calls, whole_sync: [rank]
    monkeypatch.setattr(schedule_loop, "_lost", lambda call: call in lost)
    monkeypatch.setattr(
        schedule_loop,
        "redo_lost",
        lambda calls: [call._replace(ref=Ref(call.ref.result)) if call in lost else call for call in calls],
    )
    return lost


def failure_of(call) -> RunFailed:
    return RunFailed(f"{call.name} died", {call.actor: "died"})


def the_eval(loop: ScheduleLoop) -> Waiting:
    (item,) = [item for item in loop.waiting if item.kind == "eval"]
    return item


@pytest.mark.parametrize("mode", SCHEDULES)
@pytest.mark.parametrize("failed_first", ["chunk", "eval"])
def test_the_eval_before_training_lost_with_its_producer_is_made_again_as_the_eval_before(
    monkeypatch, mode, failed_first
):
    loop, driver = loop_on(mode)
    loop._decide()
    assert kinds(loop)[-1] == "eval" and set(kinds(loop)) == {"chunk", "eval"}  # behind the first chunks
    before = the_eval(loop)
    assert before.subject is None
    lost = producer_died(monkeypatch, loop, driver, rank=1)
    failed = next(item for item in loop.waiting if item.kind == failed_first and set(item.calls) & set(lost))
    calls(driver)
    loop._recover(failure_of(next(c for c in failed.calls if c in lost)), failed)

    again = the_eval(loop)
    assert again is not before and again.subject is None
    assert [call.actor.rank for call in again.calls] == [0, 1]
    assert again.calls[0] == before.calls[0]  # producer 0's eval still runs: waited on, not asked again
    assert again.calls[1].ref is not before.calls[1].ref and again.calls[1].method == "evaluate"
    assert before.calls[1].ref not in loop._unanswered
    assert {call.ref for call in again.calls} <= loop._unanswered
    assert kinds(loop)[-1] == "eval"  # made again in submission order: behind the chunk made again with it
    assert calls(driver) == []  # nothing but the lost calls (fakes: no new call is logged by a redo)

    loop._forget(again)
    loop._answer(again, results(again.calls), PROGRESS)
    assert driver.evals == [0] and driver.progress.eval_accuracy_before == {"math": 0.5}


@pytest.mark.parametrize("mode", SCHEDULES)
def test_an_eval_of_step_k_lost_with_its_producer_is_made_again_for_step_k(monkeypatch, mode):
    loop, driver = loop_on(mode)
    loop.eval_before_ordered = True
    driver.progress.eval_accuracy_before = {"math": 0.25}
    loop._submit("eval", driver.producers.evaluate(min_version=2), 4)
    loop._decide()  # the chunks admitted behind it
    eval_of_4 = the_eval(loop)
    lost = producer_died(monkeypatch, loop, driver, rank=0)
    loop._recover(failure_of(eval_of_4.calls[0]), eval_of_4)

    again = the_eval(loop)
    assert again is not eval_of_4 and again.subject == 4
    assert again.calls[0] not in lost and again.calls[1] == eval_of_4.calls[1]
    assert [call.method for call in again.calls] == ["evaluate"] * 2
    loop._forget(again)
    loop._answer(again, results(again.calls), PROGRESS)
    assert driver.evals == [4]
    assert driver.progress.eval_accuracy_before == {"math": 0.25}  # an eval of step 4 is not the eval before


@pytest.mark.parametrize("mode", SCHEDULES)
def test_a_restart_leaves_a_training_order_and_an_eval_that_lost_nothing_as_they_were(monkeypatch, mode):
    loop, driver = loop_on(mode)
    loop._decide()
    loop._submit("step", driver.trainers.train_steps(0, 0, [], None), "a training order")
    eval_before = the_eval(loop)
    step = next(item for item in loop.waiting if item.kind == "step")
    chunk = next(item for item in loop.waiting if item.kind == "chunk" and item.calls[0].actor.rank == 1)
    driver.restarted_producers = lambda failure, calls, whole_sync: [1]
    monkeypatch.setattr(schedule_loop, "_lost", lambda call: call in chunk.calls)  # the eval's calls had finished
    monkeypatch.setattr(schedule_loop, "redo_lost", lambda calls: [call._replace(ref=Ref(None)) for call in calls])
    loop._recover(failure_of(chunk.calls[0]), chunk)
    assert any(item is step for item in loop.waiting) and any(item is eval_before for item in loop.waiting)
    assert {call.ref for call in step.calls + eval_before.calls} <= loop._unanswered
