"""The driver's calls on the producers that are submitted and not yet consumed: each round's ``produce`` calls until
that round is trained, and the eval before training until it is logged.

The rules, kept by the methods (``tests/unit/test_pending_calls.py``):
- A set of calls is either *in the table* or *taken out* by whoever waits on it (``take_round``,
  ``take_eval_before``). After a producer restart, ``redo_lost`` makes the lost calls *in the table* again, once;
  a taken set is never touched — its waiter re-issues what it lost itself (``run.Driver._gather``). So no
  call is made twice by both.
- A round is submitted once; submitting it again is a bug in the schedule and raises.
- ``settle`` waits on every round in the table (in round order, each taken out while waited on) and puts back its
  results as finished calls, which no restart can lose and no ``redo_lost`` re-issues: what a checkpoint saves.
- ``restore`` puts back the finished rounds a checkpoint saved (their metrics only: the rollouts are in the buffer).

Torch-free; Ray only through the ``redo_lost`` and ``finished`` functions it is given (the driver passes
``producer_restarts.redo_lost`` and one that ``ray.put``s a result), so the rules are tested without Ray.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from colossal_rl.driver.calls import Call, Calls

RedoLost = Callable[[Calls], Calls]
"""The calls, each lost one (its actor died and was restarted) made again."""
Finished = Callable[[Call, Any], Call]
"""A call standing for a result already in hand (cannot be made again)."""
Wait = Callable[[Calls], list]
"""Wait for calls (surviving producer restarts) and return their results."""


class PendingCalls:
    def __init__(self, *, redo_lost: RedoLost, finished: Finished):
        self._redo_lost = redo_lost
        self._finished = finished
        self._rounds: dict[int, Calls] = {}
        self._eval_before: Calls | None = None

    # --------------------------------------------------------------- produce calls, by round
    def submit_round(self, round_index: int, calls: Calls) -> None:
        if round_index in self._rounds:
            raise ValueError(f"round {round_index}'s produce calls were submitted already")
        self._rounds[round_index] = list(calls)

    def __contains__(self, round_index: int) -> bool:
        return round_index in self._rounds

    def rounds(self) -> list[int]:
        return sorted(self._rounds)

    def take_round(self, round_index: int) -> Calls:
        """Round ``round_index``'s calls, out of the table: the caller waits on them and re-issues their lost calls."""
        if round_index not in self._rounds:
            raise KeyError(f"round {round_index} has no produce calls pending (submitted: {self.rounds()})")
        return self._rounds.pop(round_index)

    # --------------------------------------------------------------- the eval before training
    def submit_eval_before(self, calls: Calls) -> None:
        if self._eval_before is not None:
            raise ValueError("the eval before training was submitted already")
        self._eval_before = list(calls)

    @property
    def eval_before_submitted(self) -> bool:
        return self._eval_before is not None

    def take_eval_before(self) -> Calls | None:
        """The eval's calls, out of the table (None when none is pending)."""
        calls, self._eval_before = self._eval_before, None
        return calls

    # --------------------------------------------------------------- producer restarts, checkpoints
    def redo_lost(self) -> None:
        """After producers were restarted: every call in the table that they lost is made again (taken sets are
        their waiters' to re-issue)."""
        for round_index in sorted(self._rounds):
            self._rounds[round_index] = self._redo_lost(self._rounds[round_index])
        if self._eval_before is not None:
            self._eval_before = self._redo_lost(self._eval_before)

    def outstanding(self) -> Calls:
        """Every call in the table, in round order, then the eval's."""
        return [call for r in sorted(self._rounds) for call in self._rounds[r]] + list(self._eval_before or [])

    def settle(self, wait: Wait) -> dict[int, list]:
        """Wait on every round in the table (each taken out meanwhile) and keep its results as finished calls;
        returns round -> results, what a checkpoint saves."""
        settled = {}
        for round_index in self.rounds():
            calls = self.take_round(round_index)
            results = wait(calls)
            settled[round_index] = results
            self._rounds[round_index] = [self._finished(c, r) for c, r in zip(calls, results, strict=True)]
        return settled

    def restore(self, finished_rounds: dict[int, Calls]) -> None:
        """Rounds a checkpoint saved as finished (their results stand in for the calls)."""
        for round_index, calls in finished_rounds.items():
            self.submit_round(round_index, calls)
