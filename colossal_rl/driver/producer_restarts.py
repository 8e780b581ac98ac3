"""Surviving producer deaths (``--max-actor-restarts``): which producers Ray restarted behind a failed wait, and
giving a restarted producer the weights of the last completed sync.

The driver (``run.Driver._gather``) owns the schedule: it decides that a dead trainer ends the run, and it
re-issues the calls a dead producer lost. This module knows the producers' processes (pid, node), counts their
restarts against the budget, and ends the run naming the budget when it is used up. Torch-free.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import ray

from colossal_rl.driver.actor_groups import ProducerGroup
from colossal_rl.driver.actor_messages import ProducerReady
from colossal_rl.driver.calls import Call, Calls, RunFailed, call_outcome, gather

logger = logging.getLogger(__name__)
PRODUCER = ProducerGroup.kind


def redo_lost(calls: Calls) -> Calls:
    """The calls, each one that finished with an error made again (on the restarted actor)."""

    def lost(call: Call) -> bool:
        ready, _ = ray.wait([call.ref], timeout=0)
        return call.redo is not None and bool(ready) and call_outcome(call.ref)[0] != "ok"

    return [c.again() if lost(c) else c for c in calls]


class ProducerRestarts:
    """The producers' processes as the driver last saw them, and the restarts each has used."""

    def __init__(self, producers: ProducerGroup, *, max_restarts: int, timeout_s: float):
        self.producers = producers
        self.max_restarts = max_restarts
        self.timeout = timeout_s
        self.pids: list[int | None] = [None] * len(producers)
        self.nodes: list[str] = []
        """Ray node id of each producer (Ray may place a restarted one on another node)."""
        self.counts = [0] * len(producers)

    @property
    def total(self) -> int:
        return sum(self.counts)

    def record_ready(self, infos: list[ProducerReady]) -> None:
        """The producers' ``ready`` answers at start-up."""
        self.pids = [info.pid for info in infos]
        self.nodes = [info.node_id for info in infos]

    def restarted(self, failure: RunFailed, calls: Calls, *, whole_sync: bool) -> list[int]:
        """Producer ranks Ray restarted (new processes) behind ``failure`` of a wait on ``calls``; re-raises it when
        it is not a producer death the run survives. ``whole_sync``: the calls are one weight sync (made again
        whole, so a trainer's failure in it is a symptom, not a cause)."""
        if self.max_restarts == 0 or not failure.outcomes:  # none allowed, or a hang
            raise failure
        producer_refs = [c.ref for c in calls if c.actor.kind == PRODUCER]
        settled, _ = ray.wait(producer_refs, num_returns=len(producer_refs), timeout=self.timeout)
        settled = set(settled)
        outcomes = {c.actor: call_outcome(c.ref)[0] for c in calls if c.ref in settled} | failure.outcomes
        trainer_failed = any(actor.kind != PRODUCER and o != "ok" for actor, o in outcomes.items())
        suspects = sorted(actor.rank for actor, o in outcomes.items() if actor.kind == PRODUCER and o != "ok")
        if not suspects or (trainer_failed and not whole_sync):
            raise failure
        infos = self._alive(suspects, failure)
        restarted = [rank for rank, info in zip(suspects, infos, strict=True) if info.pid != self.pids[rank]]
        lost_calls = [c for c in calls if c.ref in settled and call_outcome(c.ref)[0] in ("died", "restarted")]
        if not restarted and not lost_calls and not whole_sync:
            raise failure  # producers that are alive and were not restarted failed: a real error
        for rank, info in zip(suspects, infos, strict=True):
            if rank in restarted:
                self.pids[rank] = info.pid
                self.nodes[rank] = info.node_id
        return restarted

    def _alive(self, ranks: list[int], failure: RunFailed) -> list[ProducerReady]:
        """Each producer's ``ready`` info once Ray has it running again; a producer past its restarts ends the run."""
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                return gather(self.producers.ready(ranks), max(1.0, deadline - time.monotonic()))
            except RunFailed as error:
                restarting = "The actor is restarting" in str(error)  # Ray refuses calls while it restarts one
                if restarting and time.monotonic() < deadline:
                    time.sleep(0.5)
                    continue
                raise RunFailed(f"{failure}; {self._used_up()}: {error}", error.outcomes) from None

    def restore_weights(self, ranks: list[int], sync_to: Callable[[list[int]], Calls]) -> None:
        """Count the restarts of ``ranks`` and give them the last synced weights (``sync_to(ranks)``: the calls
        doing so, ``SyncOrchestrator.sync_to``'s). A producer killed again meanwhile is restarted again while
        its budget allows, and given the weights again; past the budget the run ends naming it."""
        self._count(ranks)
        while True:
            calls: Calls = []  # none if forming the sync group again failed (it waits on every producer)
            try:
                calls = sync_to(ranks)
                gather(calls, self.timeout)
                return
            except RunFailed as error:  # killed again while being given its weights back
                if all(self.counts[rank] >= self.max_restarts for rank in ranks):
                    raise RunFailed(f"{error}; {self._used_up()}", error.outcomes) from None
                again = self.restarted(error, calls, whole_sync=False)
                if not again:
                    raise
                self._count(again)

    def _used_up(self) -> str:
        return f"not restarted again (--max-actor-restarts {self.max_restarts} used up)"

    def _count(self, ranks: list[int]) -> None:
        for rank in ranks:
            self.counts[rank] += 1
            logger.warning(
                "producer %d died and was restarted (%d of --max-actor-restarts %d); it regenerates its lost rounds",
                rank, self.counts[rank], self.max_restarts,
            )  # fmt: skip
