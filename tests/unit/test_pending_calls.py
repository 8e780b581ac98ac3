"""The driver's pending calls (``driver/pending_calls.py``) keep their rules: a set taken out is not re-issued by
``redo_lost`` (its waiter does that), a lost call in the table is re-issued once per restart, a round is submitted
once, ``settle`` turns rounds into finished calls no restart re-issues, and the per-group gather cuts results back
per group. Calls here are plain values with a fake "lost" flag: no Ray."""

from __future__ import annotations

import pytest

from colossal_rl.driver.calls import ActorId, Call, RunFailed, split_results
from colossal_rl.driver.pending_calls import PendingCalls


class Issued:
    """Counts calls made; a call's ref is ``(name, issue number)`` so a re-issue is visible."""

    def __init__(self):
        self.count = 0
        self.lost: set = set()

    def call(self, rank: int, method: str = "produce") -> Call:
        def make(rank=rank, method=method):
            self.count += 1
            return (f"{method} {rank}", self.count)

        return Call(ActorId("producer", rank), method, make(), make)

    def redo_lost(self, calls):
        return [c.again() if c.ref in self.lost else c for c in calls]


def finished(call: Call, result) -> Call:
    return call._replace(ref=("finished", result), redo=None)


@pytest.fixture
def issued() -> Issued:
    return Issued()


def test_a_set_taken_out_is_left_to_its_waiter_and_the_rest_is_reissued_once(issued):
    pending = PendingCalls(redo_lost=issued.redo_lost, finished=finished)
    pending.submit_round(0, [issued.call(0), issued.call(1)])
    pending.submit_round(1, [issued.call(0), issued.call(1)])
    pending.submit_eval_before([issued.call(0, "evaluate"), issued.call(1, "evaluate")])
    taken = pending.take_round(0)
    issued.lost = {c.ref for c in taken} | {c.ref for c in pending.outstanding() if c.actor.rank == 1}
    before = issued.count

    pending.redo_lost()

    assert issued.count == before + 2  # producer 1's round-1 and eval calls; not the taken round's
    assert 0 not in pending and pending.rounds() == [1]
    assert [c.ref[1] > before for c in pending.outstanding()] == [False, True, False, True]
    pending.redo_lost()  # the re-issued calls are new refs, not lost: nothing is made twice
    assert issued.count == before + 2


def test_a_round_is_submitted_once_and_taken_once(issued):
    pending = PendingCalls(redo_lost=issued.redo_lost, finished=finished)
    pending.submit_round(3, [issued.call(0)])
    with pytest.raises(ValueError, match="round 3"):
        pending.submit_round(3, [issued.call(0)])
    pending.take_round(3)
    with pytest.raises(KeyError, match="round 3 has no produce calls pending"):
        pending.take_round(3)
    pending.submit_eval_before([issued.call(0, "evaluate")])
    with pytest.raises(ValueError, match="submitted already"):
        pending.submit_eval_before([issued.call(0, "evaluate")])
    assert pending.take_eval_before() is not None and pending.take_eval_before() is None
    assert not pending.eval_before_submitted


def test_settle_waits_in_round_order_and_keeps_finished_calls_no_restart_reissues(issued):
    pending = PendingCalls(redo_lost=issued.redo_lost, finished=finished)
    for round_index in (5, 4):
        pending.submit_round(round_index, [issued.call(0), issued.call(1)])
    waited = []

    def wait(calls):
        waited.append((sorted(pending.rounds()), [c.ref for c in calls]))
        return [("metrics of", c.ref[1]) for c in calls]

    settled = pending.settle(wait)

    assert list(settled) == [4, 5] and settled[4] == [("metrics of", 3), ("metrics of", 4)]
    assert waited[0][0] == [5]  # round 4 was out of the table while waited on
    assert all(c.redo is None and c.ref[0] == "finished" for c in pending.outstanding())
    issued.lost = {c.ref for c in pending.outstanding()}
    with pytest.raises(ValueError, match="cannot be made again"):
        pending.redo_lost()  # a finished call that looks lost is a bug, not something to make again


def test_restored_rounds_stand_in_the_table(issued):
    pending = PendingCalls(redo_lost=issued.redo_lost, finished=finished)
    pending.restore({2: [finished(issued.call(0), {"m": 1})]})
    assert 2 in pending and pending.take_round(2)[0].ref == ("finished", {"m": 1})


def test_results_are_cut_back_per_group_and_failures_keyed_by_actor(issued):
    groups = [[issued.call(0), issued.call(1)], [], [issued.call(2)]]
    assert split_results(["a", "b", "c"], groups) == [["a", "b"], [], ["c"]]
    with pytest.raises(ValueError, match="2 results for 3 calls"):
        split_results(["a", "b"], groups)
    failure = RunFailed("x", {ActorId("trainer", 1): "died", ActorId("producer", 0): "failed"})
    assert failure.any_died("trainer") and not failure.any_died("producer")
    assert issued.call(4, "evaluate").name == "producer 4 (evaluate)"
