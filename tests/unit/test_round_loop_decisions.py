"""The round schedule's driver loop (``run.Driver.run``), on fake actor groups (no Ray): the calls it submits, in
order, are the schedule (docs/concepts.md, "The round schedule"): the first ``n_behind + 1`` rounds' ``produce`` and the eval
before training behind round 0's, then per round ``train_round(r)``, the sync to ``r + 1`` and ``produce(r + 1 +
n_behind)``; nothing is produced past the last round, and ``--max-steps`` exactly met ends the run at that round.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from fake_actor_groups import fake_sync, results

from colossal_rl.config import GenerationConfig, ParallelConfig, RLConfig, RunConfig, ScheduleConfig, TrainConfig
from colossal_rl.config_resolve import resolve
from colossal_rl.driver import run
from colossal_rl.driver.actor_messages import RoundResult
from colossal_rl.driver.pending_calls import PendingCalls
from colossal_rl.driver.run import Driver, StartupTrace
from colossal_rl.profiling import PhaseRecorder
from colossal_rl.run_checkpoints.on_disk import RunProgress


def config(n_behind: int, max_steps: int | None = None) -> RLConfig:
    """1 trainer, 2 producers of 2 prompts a round, steps of 2 groups: 2 optimizer steps a round."""
    return resolve(
        RLConfig(
            generation=GenerationConfig(microbatch_size=2),
            train=TrainConfig(batch_size=2, minibatch_size=2),
            parallel=ParallelConfig(num_trainers=1),
            schedule=ScheduleConfig(num_producers=2, inference_batch_size=2, n_behind=n_behind, max_steps=max_steps),
            run=RunConfig(eval_interval=0, save_interval=0, log_rollout_interval=0, final_export=False),
        )
    )


def round_result(round_index: int, steps: int) -> RoundResult:
    return RoundResult(round_index, [{"train/reward": 0.0, "train/loss": 0.0}] * steps, [[]] * steps, [], 0, 0)


def fake_driver(config: RLConfig, monkeypatch, tmp_path: Path, steps_per_round: list[int] | None = None) -> Driver:
    """A ``Driver`` on fake groups (built around ``__init__``, which spawns actors): every wait returns the calls'
    results at once; round ``r`` trains ``steps_per_round[r]`` steps (default all)."""
    sync, log, ready = fake_sync(num_trainers=1, num_producers=2)
    per_round = steps_per_round or [config.optimizer_steps_per_round] * 100
    rounds_submitted = lambda: sum(method == "train_round" for _, method, _ in log)  # noqa: E731
    sync.trainers.results["train_round"] = lambda rank: round_result(0, per_round[rounds_submitted() - 1])
    sync.producers.results["produce"] = lambda rank: {}
    monkeypatch.setattr(run, "gather", lambda calls, timeout_s: results(calls))
    monkeypatch.setattr(run, "gather_groups", lambda groups, timeout_s: [results(calls) for calls in groups])
    driver = object.__new__(Driver)
    driver.config, driver.run_dir, driver.timeout = config, tmp_path, 1.0
    driver.trace = StartupTrace(PhaseRecorder(), reported=True)
    driver.buffer, driver.producers, driver.trainers, driver.sync = "buffer", sync.producers, sync.trainers, sync
    driver.progress, driver.last_saved_step, driver.final_model_dir = RunProgress(), 0, None
    driver.pending = PendingCalls(redo_lost=lambda calls: calls, finished=lambda call, result: call)
    driver.eval_dir = driver.rollout_dir = tmp_path
    driver.metrics = SimpleNamespace(log=lambda kind, step, values: None)
    driver.log_eval = lambda results, step=None: {"math": 0.5}
    driver.log = log
    sync.start(ready, retain=True)
    log.clear()
    return driver


def schedule(log: list) -> list[str]:
    """The calls in submission order, one entry per call kind (every actor of a group gets it at once)."""
    out = []
    for actor, method, args in log:
        entry = f"{method}({args[0]})" if method in ("produce", "train_round", "push_weights") else method
        if method in ("produce", "train_round", "push_weights", "evaluate") and actor.endswith(" 0"):
            out.append(entry)
    return out


@pytest.mark.parametrize("n_behind", [0, 1, 2])
def test_the_round_loop_submits_the_schedule_n_behind_rounds_ahead(n_behind, monkeypatch, tmp_path):
    driver = fake_driver(config(n_behind), monkeypatch, tmp_path)
    driver.run(rounds=4)
    ahead = [f"produce({r})" for r in range(n_behind + 1)]
    expected = ahead[:1] + ["evaluate"] + ahead[1:]
    for r in range(4):
        expected += [f"train_round({r})", f"push_weights({r + 1})"]
        if r + 1 + n_behind < 4:
            expected.append(f"produce({r + 1 + n_behind})")
    assert schedule(driver.log)[: len(expected)] == expected
    assert schedule(driver.log)[len(expected) :] == ["evaluate"]  # the final eval, once
    assert driver.progress.policy_version == 4 and driver.step == 8 and driver.progress.next_round == 4


@pytest.mark.parametrize("max_steps, rounds_trained", [(4, 2), (5, 3)])
def test_max_steps_exactly_met_ends_the_run_at_that_round(max_steps, rounds_trained, monkeypatch, tmp_path):
    """With dynamic sampling a round may train fewer steps (here 2, 1, 2, ...): the round reaching ``--max-steps``
    (exactly or past it) is the last."""
    driver = fake_driver(config(1, max_steps=max_steps), monkeypatch, tmp_path, steps_per_round=[2, 2, 1, 2, 2, 2])
    driver.run(rounds=6)
    trained = [entry for entry in schedule(driver.log) if entry.startswith("train_round")]
    assert trained == [f"train_round({r})" for r in range(rounds_trained)]
    assert driver.step >= max_steps and driver.progress.policy_version == rounds_trained


# --- recovery: a producer death while a sync's group forms again ---------------------------------------------


def fail_first_joins(driver: Driver, failures: int) -> list[str]:
    """The sync's waits raise RunFailed (a producer died) on its first ``failures`` formations; what happened."""
    seen: list[str] = []
    wait = driver.sync.wait

    def formation_wait(groups):
        if any(call.method == "join_weight_sync" for calls in groups for call in calls) and len(seen) < failures:
            seen.append("join failed")
            raise run.RunFailed("producer 1 died", {groups[-1][1].actor: "died"})
        return wait(groups)

    driver.sync.wait = formation_wait
    return seen


def test_a_producer_death_while_the_sync_group_forms_again_is_recovered_and_the_sync_made(monkeypatch, tmp_path):
    driver = fake_driver(config(0), monkeypatch, tmp_path)
    restarts: list = []
    driver.restarted_producers = lambda failure, calls, whole_sync: restarts.append((calls, whole_sync)) or [1]
    driver._redo_lost_rounds = lambda ranks: None
    driver.sync.broken()  # a restart broke the group: the next sync forms it again first
    seen = fail_first_joins(driver, failures=2)  # the second death lands as the group forms after the first
    driver._sync_weights(3, reason="test")
    assert seen == ["join failed"] * 2 and restarts == [([], True)] * 2  # no sync call was made yet either time
    assert driver.progress.policy_version == 3 and not driver.sync.stale
    pushed = [args for actor, method, args in driver.log if method == "push_weights"]
    assert pushed == [(3,)]  # the sync was made once, on the group formed the second time


def test_formation_failures_with_nobody_restarted_end_the_run(monkeypatch, tmp_path):
    driver = fake_driver(config(0), monkeypatch, tmp_path)
    driver.restarted_producers = lambda failure, calls, whole_sync: []
    driver._redo_lost_rounds = lambda ranks: None
    driver.sync.broken()
    fail_first_joins(driver, failures=10)
    with pytest.raises(run.RunFailed, match="producer 1 died"):
        driver._sync_weights(3, reason="test")
