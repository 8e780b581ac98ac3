"""``ProducerRestarts.restore_weights``: a producer killed again while it is given its weights back is restarted
while its budget allows, and past the budget the run ends naming ``--max-actor-restarts``, wherever the kill lands
(in the sync's calls, or while the sync group is formed again before them). ``redo_lost`` and the driver's own
waits outside the schedule loop (the final eval): only the calls a death failed are made again."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from colossal_rl.driver import producer_restarts, run
from colossal_rl.driver.calls import ActorId, Call, RunFailed
from colossal_rl.driver.producer_restarts import ProducerRestarts, redo_lost
from colossal_rl.driver.run import Driver

PRODUCER_0 = ActorId("producer", 0)


def killed_while_joining(ranks):
    raise RunFailed("producer 0 (join_weight_sync) died: the actor is dead", {PRODUCER_0: "died"})


def test_a_producer_killed_while_its_sync_group_forms_again_past_its_budget_ends_the_run_naming_the_budget():
    restarts = ProducerRestarts([object()], max_restarts=1, timeout_s=1.0)
    with pytest.raises(RunFailed, match=r"join_weight_sync\) died.*--max-actor-restarts 1 used up") as failed:
        restarts.restore_weights([0], killed_while_joining)
    assert failed.value.outcomes == {PRODUCER_0: "died"}
    assert restarts.counts == [1]


# --- calls a death lost, outside the schedule loop: the run's final eval ----------------------------------------


class Done:
    """A fake finished call's ref: its outcome (``call_outcome``'s first value) and result."""

    def __init__(self, outcome: str, result=None):
        self.outcome, self.result = outcome, result


def finished_calls(monkeypatch, pending: set) -> None:
    """``ray.wait`` and ``call_outcome`` on ``Done`` refs; refs in ``pending`` have not finished."""
    monkeypatch.setattr(
        producer_restarts.ray, "wait", lambda refs, timeout=None: ([r for r in refs if r not in pending], [])
    )

    def call_outcome(ref):
        assert ref not in pending, "the outcome of a call still running was asked for: ray.get would block"
        return ref.outcome, None

    monkeypatch.setattr(producer_restarts, "call_outcome", call_outcome)


def evaluate_calls(outcomes: list[str], asked: list) -> list[Call]:
    """Each producer's ``evaluate`` call, finished with ``outcomes[rank]``; made again, it answers ``again <rank>``."""

    def redo(rank: int):
        asked.append(rank)
        return Done("ok", f"again {rank}")

    return [
        Call(ActorId("producer", rank), "evaluate", Done(outcome, f"first {rank}"), lambda rank=rank: redo(rank))
        for rank, outcome in enumerate(outcomes)
    ]


def test_only_finished_calls_that_failed_and_can_be_made_again_are_made_again(monkeypatch):
    asked: list = []
    calls = evaluate_calls(["ok", "died", "restarted", "ok"], asked)
    calls[3] = calls[3]._replace(ref=Done("died"), redo=None)  # a call that cannot be made again stays as it was
    running = evaluate_calls(["ok"], asked)[0]._replace(actor=ActorId("producer", 4))
    finished_calls(monkeypatch, pending={running.ref})
    again = redo_lost([*calls, running])
    assert asked == [1, 2]
    assert [call.ref.result for call in again] == ["first 0", "again 1", "again 2", None, "first 0"]
    assert again[0] is calls[0] and again[3] is calls[3] and again[4] is running


def test_the_final_eval_survives_a_producer_restart_asking_only_the_restarted_producer_again(monkeypatch, tmp_path):
    """``Driver.evaluate`` (after training, outside the loop): producer 1 died in it and was restarted; its call is
    made again, producer 0's result kept, and the eval's results are both producers', in rank order."""
    asked: list = []
    evaluations = evaluate_calls(["ok", "died"], asked)
    finished_calls(monkeypatch, pending=set())
    attempts: list = []

    def gather_groups(groups, timeout_s):
        attempts.append(groups)
        assert len(attempts) <= 3, "the lost call was never made again"
        failed = {call.actor: "died" for group in groups for call in group if call.ref.outcome != "ok"}
        if failed:
            raise RunFailed("producer 1 (evaluate) died", failed)
        return [[call.ref.result for call in group] for group in groups]

    monkeypatch.setattr(run, "gather_groups", gather_groups)
    driver = object.__new__(Driver)
    driver.timeout, driver.run_dir = 1.0, tmp_path
    driver.producers = SimpleNamespace(evaluate=lambda: evaluations)
    restarts: list = []
    driver.restarted_producers = lambda failure, calls, whole_sync: (
        restarts.append((failure.outcomes, whole_sync)) or [1]
    )
    driver.log_eval = lambda results: results
    assert driver.evaluate() == ["first 0", "again 1"]
    assert asked == [1] and len(attempts) == 2
    assert restarts == [({ActorId("producer", 1): "died"}, False)]
