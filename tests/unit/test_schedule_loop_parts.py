"""The schedule loop's pure parts (``colossal_rl/driver/schedule_loop.py``, ``schedules.py``): how many steps a
streaming run has, the scheduler settings a config makes, a step's schedule metrics, and what a failed sync
without a producer death does. The loop's decisions: test_round_loop_decisions.py, test_stream_loop_decisions.py;
the loop itself runs in tests/e2e/."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from colossal_rl.config import GenerationConfig, ParallelConfig, RLConfig, ScheduleConfig, TrainConfig
from colossal_rl.data import DataError
from colossal_rl.driver import schedule_loop
from colossal_rl.driver.calls import ActorId, Call, RunFailed
from colossal_rl.driver.schedule_loop import ScheduleLoop, Waiting, step_metrics
from colossal_rl.driver.schedules import stream_settings, stream_total_steps
from colossal_rl.schedule.events import StepOrder, TrainGroup


def config(**schedule) -> RLConfig:
    return RLConfig(
        generation=GenerationConfig(microbatch_size=4),
        train=TrainConfig(batch_size=4, minibatch_size=4),
        parallel=ParallelConfig(num_trainers=2),
        schedule=ScheduleConfig(mode="stream", num_producers=2, inference_batch_size=8, **schedule),
    )


def test_total_steps_are_every_episode_in_whole_steps_at_most_max_steps():
    assert stream_total_steps(config(), 100) == 100 // 8
    assert stream_total_steps(config(num_episodes=3), 100) == 300 // 8
    assert stream_total_steps(config(num_episodes=3, max_steps=5), 100) == 5
    with pytest.raises(DataError, match="7 prompts, fewer than one optimizer step trains"):
        stream_total_steps(config(), 7)


def test_settings_take_chunks_of_the_generate_micro_batch_and_steps_over_every_dp_rank():
    settings = stream_settings(config(max_staleness=3, sync_every_steps=2, num_episodes=2), total_steps=9)
    assert (settings.prompts_per_chunk, settings.groups_per_step, settings.num_producers) == (4, 8, 2)
    assert (settings.max_staleness, settings.sync_every_steps, settings.num_episodes) == (3, 2, 2)
    assert settings.total_steps == 9


def test_step_metrics_histogram_of_staleness():
    groups = tuple(TrainGroup(0, 0, row, version, 10, row) for row, version in enumerate([5, 4, 4, 3]))
    metrics = step_metrics(StepOrder(step=5, trainer_version=5, groups=groups, dropped_stale=2))
    assert metrics == {
        "schedule/step_staleness_0": 1.0,
        "schedule/step_staleness_1": 2.0,
        "schedule/step_staleness_2": 1.0,
        "schedule/step_staleness_max": 2.0,
        "schedule/step_dropped_stale": 2.0,
        "schedule/trainer_version": 5.0,
    }


def test_a_sync_failing_on_a_live_producer_ends_the_run_naming_the_error(monkeypatch):
    """A producer's ``receive_weights`` raising (alive, not restarted: no death to recover from) is re-raised. It was
    once swallowed: the sync stayed waiting for ever, no later sync was ordered, every later group was dropped as
    stale and the run ended "stalled", without the error."""
    producer = ActorId("producer", 0)
    sync = Waiting(
        "sync",
        [Call(ActorId("trainer", 0), "push_weights", ref=object()), Call(producer, "receive_weights", ref=object())],
        1,
    )
    loop = object.__new__(ScheduleLoop)  # only what ``_recover`` reads
    loop.driver = SimpleNamespace(restarted_producers=lambda failure, calls, whole_sync: [])
    loop.waiting, loop._unanswered = [sync], set()
    monkeypatch.setattr(schedule_loop, "_lost", lambda call: False)  # no call failed by a death or a restart
    failure = RunFailed("producer 0 failed: AttributeError: boom", {producer: "failed"})
    with pytest.raises(RunFailed, match="AttributeError: boom"):
        loop._recover(failure, sync)
