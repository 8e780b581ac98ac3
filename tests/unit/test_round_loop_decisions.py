"""The schedule loop (``colossal_rl/driver/schedule_loop.py``) under the round schedule, on fake actor groups (no
Ray): the calls it submits, in order, are the schedule (docs/concepts.md, "The round schedule"): the first
``n_behind + 1`` rounds' chunks (one per producer, seeded with the round) and the eval before training behind
them, then per round one ``train_steps`` of all its steps, the sync to ``r + 1`` and round ``r + 1 + n_behind``'s
chunks; nothing is produced past the last round, and ``--max-steps`` exactly met ends the run at that round. A
checkpoint waits for the rounds in flight and saves their rollouts; a lost chunk is made again as it was; the
weight sync of a resume, and a due sync, survive a producer death while its group forms.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from fake_actor_groups import all_kept, fake_sync, results
from fake_driver import PROGRESS, FakeDriver, calls, kinds

from colossal_rl.config import GenerationConfig, ParallelConfig, RLConfig, RunConfig, ScheduleConfig, TrainConfig
from colossal_rl.config_resolve import resolve
from colossal_rl.driver import run, schedule_loop
from colossal_rl.driver.actor_messages import ChunkResult, StepResult
from colossal_rl.driver.calls import RunFailed
from colossal_rl.driver.run import Driver, StartupTrace
from colossal_rl.driver.schedule_loop import ScheduleLoop
from colossal_rl.driver.schedules import make_scheduler
from colossal_rl.profiling import PhaseRecorder
from colossal_rl.run_checkpoints.on_disk import RunProgress
from colossal_rl.schedule.events import FinishedGroup


def config(n_behind: int, max_steps: int | None = None, **run_fields) -> RLConfig:
    """1 trainer, 2 producers of 2 prompts a round, steps of 2 groups: 2 optimizer steps a round."""
    run_settings = {"eval_interval": 0, "save_interval": 0, "log_rollout_interval": 0, "final_export": False}
    return resolve(
        RLConfig(
            generation=GenerationConfig(microbatch_size=2),
            train=TrainConfig(batch_size=2, minibatch_size=2),
            parallel=ParallelConfig(num_trainers=1),
            schedule=ScheduleConfig(num_producers=2, inference_batch_size=2, n_behind=n_behind, max_steps=max_steps),
            run=RunConfig(**(run_settings | run_fields)),
        )
    )


def loop_on(config: RLConfig, train_rows: int = 16) -> tuple[ScheduleLoop, FakeDriver]:
    """16 rows: 4 rounds an episode."""
    driver = FakeDriver(config, train_rows)
    scheduler, plan = make_scheduler(config, train_rows)
    return ScheduleLoop(driver, scheduler, plan.total_steps), driver


def play(loop: ScheduleLoop, driver: FakeDriver, kept_per_round: dict[int, int] | None = None) -> None:
    """Run the loop to its end, answering every call at once, oldest first (a round's chunk keeps its first
    ``kept_per_round[r]`` rows, default all); each training order trains every step it names."""
    kept_per_round = kept_per_round or {}
    while True:
        loop._decide()
        if loop.scheduler.finished and not loop._busy_beyond_chunks():
            return
        item = loop.waiting[0]
        loop._forget(item)
        if item.kind == "chunk":
            order = item.subject
            kept = kept_per_round.get(order.sampling_seed_index, len(order.rows))
            groups = tuple(FinishedGroup(row, order.policy_version, 10, i < kept) for i, row in enumerate(order.rows))
            payload = f"payload {order.chunk_id}" if kept else None
            answers = [ChunkResult(order.chunk_id, order.producer_rank, payload, order.rows[:kept], groups, {})]
        elif item.kind == "step":
            steps = item.subject.num_steps * driver.config.train.ppo_epochs
            metrics = {"train/reward": 0.0, "train/loss": 0.0}
            answers = [[StepResult(item.subject.step + k, metrics, [], []) for k in range(steps)]]
        else:
            answers = results(item.calls)
        loop._answer(item, answers, PROGRESS)


def schedule(log: list) -> list[str]:
    """Producer 0's and trainer 0's calls in submission order (every actor of a group gets its call at once)."""
    out = []
    for actor, method, args in log:
        if actor == "producer 0" and method == "produce_chunk":
            out.append(f"round({args[3]})")  # its seed index: the round
        elif actor.endswith(" 0") and method in ("train_steps", "push_weights"):
            out.append(f"{method}({args[1] if method == 'train_steps' else args[0]})")
        elif actor == "producer 0" and method == "evaluate":
            out.append("evaluate")
    return out


@pytest.mark.parametrize("n_behind", [0, 1, 2])
def test_the_loop_submits_the_round_schedule_n_behind_rounds_ahead(n_behind):
    loop, driver = loop_on(config(n_behind))
    play(loop, driver)
    expected = [f"round({r})" for r in range(n_behind + 1)] + ["evaluate"]
    for r in range(4):
        expected += [f"train_steps({r})", f"push_weights({r + 1})"]
        if r + 1 + n_behind < 4:
            expected.append(f"round({r + 1 + n_behind})")
    assert schedule(driver.log) == expected
    assert driver.progress.policy_version == 4 and driver.step == 8 and loop.scheduler.rounds_trained == 4


def test_a_round_is_one_chunk_per_producer_with_its_rows_version_and_seed_and_one_order_of_all_its_steps():
    loop, driver = loop_on(config(0))
    loop._decide()
    chunks = [args for actor, method, args in driver.log if method == "produce_chunk"]
    rows = [row for args in chunks for row in args[1]]
    assert [(args[0], args[2], args[3]) for args in chunks] == [(0, 0, 0), (1, 0, 0)]  # id, version, seed index
    assert len(rows) == len(set(rows)) == 4
    calls(driver)
    for _ in range(2):
        item = next(item for item in loop.waiting if item.kind == "chunk")
        loop._forget(item)
        loop._answer(item, [all_kept(item.subject)], PROGRESS)
    loop._decide()
    ((actor, method, (first_step, version, shares, sample_step)),) = driver.log
    assert (actor, method, first_step, version, sample_step) == ("trainer 0", "train_steps", 0, 0, None)
    assert [len(step) for step in shares] == [1, 1] and [len(step[0]) for step in shares] == [2, 2]  # 2 steps
    trained = [(ref.payload, ref.group_index) for step in shares for ref in step[0]]
    assert trained == [("payload 0", 0), ("payload 0", 1), ("payload 1", 0), ("payload 1", 1)]


@pytest.mark.parametrize("max_steps, rounds_trained", [(4, 2), (5, 3)])
def test_max_steps_exactly_met_ends_the_run_at_that_round(max_steps, rounds_trained):
    """With dynamic sampling a round may train fewer steps (here 2, 2, 1, 2, ...): the round reaching
    ``--max-steps`` (exactly or past it) is the last."""
    cfg = config(1, max_steps=max_steps)
    driver = FakeDriver(cfg)
    scheduler, _ = make_scheduler(cfg, 16)
    scheduler.settings = type(scheduler.settings)(**{**vars(scheduler.settings), "total_rounds": 6})
    loop = ScheduleLoop(driver, scheduler, 12)
    play(loop, driver, kept_per_round={2: 1})  # round 2 keeps 2 of its 4 groups: one step
    trained = [entry for entry in schedule(driver.log) if entry.startswith("train_steps")]
    assert trained == [f"train_steps({r})" for r in range(rounds_trained)]
    assert driver.step >= max_steps and driver.progress.policy_version == rounds_trained


def test_the_rollouts_of_a_step_due_for_the_log_are_asked_for_by_their_index_in_the_round():
    loop, driver = loop_on(config(0, log_rollout_interval=3))
    play(loop, driver)
    asked = [(args[0], args[3]) for _, method, args in driver.log if method == "train_steps"]
    assert asked == [(0, None), (2, 0), (4, 1), (6, None)]  # steps 3 and 6 (1-based) are due


def test_a_checkpoint_waits_for_the_round_in_flight_and_saves_every_untrained_rollout(monkeypatch):
    saved = []
    monkeypatch.setattr(schedule_loop, "save_run", lambda **kw: saved.append(kw))
    monkeypatch.setattr(schedule_loop, "_saved", lambda chunk, timeout_s: chunk.payload)
    monkeypatch.setattr(schedule_loop.ray, "wait", lambda refs, **kwargs: (refs[:1], refs[1:]))
    monkeypatch.setattr(schedule_loop, "call_outcome", lambda ref: ("ok", None))
    monkeypatch.setattr(schedule_loop, "gather", lambda calls, timeout_s: results(calls))
    loop, driver = loop_on(config(1, save_interval=2))
    loop._decide()  # rounds 0 and 1
    for _ in range(2):
        item = next(item for item in loop.waiting if item.kind == "chunk")
        loop._forget(item)
        loop._answer(item, [all_kept(item.subject)], PROGRESS)
    loop._decide()  # round 0's steps, round 1 still generating
    step = next(item for item in loop.waiting if item.kind == "step")
    assert kinds(loop).count("chunk") == 2
    loop._forget(step)
    metrics = {"train/reward": 0.0, "train/loss": 0.0}
    loop._answer(step, [[StepResult(k, metrics, [], []) for k in range(2)]], PROGRESS)
    assert kinds(loop).count("chunk") == 0  # waited for before the save
    (checkpoint,) = saved
    assert checkpoint["progress"].policy_version == 1 and checkpoint["progress"].step == 2
    assert checkpoint["schedule"]["rounds_trained"] == 1
    assert [entry[0] for entry in checkpoint["schedule"]["delivered"]] == [1, 1]  # round 1, both producers
    assert checkpoint["chunks"] == {2: "payload 2", 3: "payload 3"}  # round 1's rollouts, nothing trained


def test_a_lost_round_chunk_is_made_again_as_it_was_after_the_restarted_producer_gets_its_weights(monkeypatch):
    loop, driver = loop_on(config(0))
    loop._decide()
    lost = next(item for item in loop.waiting if item.kind == "chunk" and item.subject.producer_rank == 1)
    driver.restarted_producers = lambda failure, calls, whole_sync: [1]
    monkeypatch.setattr(schedule_loop, "_lost", lambda call: call in lost.calls)
    monkeypatch.setattr(schedule_loop, "redo_lost", lambda calls: [call._replace(ref="again") for call in calls])
    loop._recover(RunFailed("producer 1 died", {lost.calls[0].actor: "died"}), lost)
    again = [item for item in loop.waiting if item.kind == "chunk" and item.subject.producer_rank == 1]
    assert [item.subject for item in again] == [lost.subject]  # the same order: rows, version, seed index
    assert [call.ref for call in again[0].calls] == ["again"]


@pytest.mark.parametrize("interval, evals_at", [(2, [2, 4, 6]), (4, [4]), (8, [])])
def test_the_eval_follows_the_sync_at_a_round_end_reaching_its_interval_and_never_the_last_round(interval, evals_at):
    loop, driver = loop_on(config(0, eval_interval=interval))
    play(loop, driver)
    assert driver.evals[1:] == evals_at and driver.evals[0] == 0  # the eval before training, then the interval's
    order = schedule(driver.log)
    for step in evals_at:
        assert order[order.index(f"push_weights({step // 2})") + 1] == "evaluate"


# --- the sync of a resume: a producer death while its group forms ---------------------------------------------


def fake_driver(monkeypatch, tmp_path: Path) -> Driver:
    """A ``Driver`` on fake groups (built around ``__init__``, which spawns actors): every wait returns the calls'
    results at once."""
    sync, log, ready = fake_sync(num_trainers=1, num_producers=2)
    monkeypatch.setattr(run, "gather", lambda calls, timeout_s: results(calls))
    monkeypatch.setattr(run, "gather_groups", lambda groups, timeout_s: [results(calls) for calls in groups])
    driver = object.__new__(Driver)
    driver.config, driver.run_dir, driver.timeout = config(0), tmp_path, 1.0
    driver.trace = StartupTrace(PhaseRecorder(), reported=True)
    driver.buffer, driver.producers, driver.trainers, driver.sync = "buffer", sync.producers, sync.trainers, sync
    driver.progress, driver.last_saved_step, driver.final_model_dir = RunProgress(), 0, None
    driver.metrics = SimpleNamespace(log=lambda kind, step, values: None)
    driver.log = log
    sync.start(ready, retain=True)
    log.clear()
    return driver


def fail_first_joins(driver: Driver, failures: int) -> list[str]:
    """The sync's waits raise RunFailed (a producer died) on its first ``failures`` formations; what happened."""
    seen: list[str] = []
    wait = driver.sync.wait

    def formation_wait(groups):
        if any(call.method == "join_weight_sync" for calls in groups for call in calls) and len(seen) < failures:
            seen.append("join failed")
            raise RunFailed("producer 1 died", {groups[-1][1].actor: "died"})
        return wait(groups)

    driver.sync.wait = formation_wait
    return seen


def test_a_producer_death_while_the_sync_group_forms_again_is_recovered_and_the_sync_made(monkeypatch, tmp_path):
    driver = fake_driver(monkeypatch, tmp_path)
    restarts: list = []
    driver.restarted_producers = lambda failure, calls, whole_sync: restarts.append((calls, whole_sync)) or [1]
    driver.sync.broken()  # a restart broke the group: the next sync forms it again first
    seen = fail_first_joins(driver, failures=2)  # the second death lands as the group forms after the first
    driver._sync_weights(3, reason="test")
    assert seen == ["join failed"] * 2 and restarts == [([], True)] * 2  # no sync call was made yet either time
    assert driver.progress.policy_version == 3 and not driver.sync.stale
    pushed = [args for actor, method, args in driver.log if method == "push_weights"]
    assert pushed == [(3,)]  # the sync was made once, on the group formed the second time


def test_formation_failures_with_nobody_restarted_end_the_run(monkeypatch, tmp_path):
    driver = fake_driver(monkeypatch, tmp_path)
    driver.restarted_producers = lambda failure, calls, whole_sync: []
    driver.sync.broken()
    fail_first_joins(driver, failures=10)
    with pytest.raises(RunFailed, match="producer 1 died"):
        driver._sync_weights(3, reason="test")


def test_a_producer_death_while_a_due_sync_forms_its_group_again_is_recovered_and_the_schedule_unchanged():
    """After a restart the next sync forms the group again, waiting on every producer: a second death then goes
    through the restart budget (``restarted_producers``), never out of the loop as an unhandled failure."""
    expected_loop, expected_driver = loop_on(config(1))
    play(expected_loop, expected_driver)
    loop, driver = loop_on(config(1))
    restarts: list = []
    driver.restarted_producers = lambda failure, calls, whole_sync: restarts.append((calls, whole_sync)) or [1]
    driver.sync.broken()  # a restart (before the loop's first sync) left the group to be formed again
    seen = fail_first_joins(driver, failures=2)
    play(loop, driver)
    assert seen == ["join failed"] * 2 and restarts == [([], True)] * 2
    assert schedule(driver.log) == schedule(expected_driver.log)


def test_a_due_syncs_formation_failing_again_and_again_with_nobody_restarted_ends_the_run():
    loop, driver = loop_on(config(1))
    driver.restarted_producers = lambda failure, calls, whole_sync: []
    driver.sync.broken()
    fail_first_joins(driver, failures=10)
    with pytest.raises(RunFailed, match="producer 1 died"):
        play(loop, driver)


def test_a_chunk_lost_with_a_producer_that_died_as_a_due_sync_formed_is_made_again_before_that_sync(monkeypatch):
    """Rounds ahead are sampled with the version they were ordered at: a chunk lost with a producer that died as
    the next sync's group formed goes out again (after the restore of the last synced weights) before that sync,
    not after it, where it would be sampled with the new weights (the kill-twice lifecycle test saw staleness 0)."""
    loop, driver = loop_on(config(1))
    loop._decide()
    lost = next(item for item in loop.waiting if item.kind == "chunk" and item.subject.producer_rank == 1)
    driver.restarted_producers = lambda failure, calls, whole_sync: [1]
    monkeypatch.setattr(schedule_loop, "_lost", lambda call: call in lost.calls)

    def redo(calls):
        driver.log.append(("producer 1", "produce_chunk made again", ()))
        return [call._replace(ref="again") for call in calls]

    monkeypatch.setattr(schedule_loop, "redo_lost", redo)
    driver.sync.broken()
    fail_first_joins(driver, failures=1)
    driver.log.clear()
    loop._submit("sync", loop._sync_calls(1, reason="test"), 1)
    made = [method for actor, method, _ in driver.log if method in ("produce_chunk made again", "push_weights")]
    assert made == ["produce_chunk made again", "push_weights"]
    again = [item for item in loop.waiting if item.kind == "chunk" and item.subject.producer_rank == 1]
    assert len(again) == 2 and again[-1].subject == lost.subject  # the next round's chunk, then the one made again
