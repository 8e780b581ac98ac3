"""Who syncs when, in one place: :class:`SyncOrchestrator` brings producers to a policy version by the route that
fits, for every caller (the schedule loop under either schedule, a resume, a producer restart).

Two routes. Every producer: the trainers push the version over the sync group (``--weight-sync-mode``: a
broadcast group, a shared-memory region or sync files, one per pipeline stage) and every producer receives it; the
group is formed again first when it broke (a producer restarted, a sync failed). Some producers (restarted ones,
which left the group): each loads the object-store copy of the last completed sync's weights that the senders
kept. The orchestrator only *issues* calls; its callers wait on them (with their recovery) and report a completed
sync back (:meth:`SyncOrchestrator.synced`). Torch-free, Ray-free: the groups and the wait are given, so the
routes are tested on fakes (``tests/unit/test_weight_sync_orchestrator.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path

from colossal_rl.comm.weight_sync.modes import plan_routes
from colossal_rl.comm.weight_sync.stages import stage_senders
from colossal_rl.driver.calls import Calls, RunFailed

logger = logging.getLogger(__name__)

WaitGroups = Callable[[Sequence[Calls]], list[list]]
"""Wait (bounded) for several groups' calls; their results, one list per group."""
CancelCalls = Callable[[Calls], None]
"""Cancel calls made pointless (``calls.cancel_calls``)."""


class SyncOrchestrator:
    """The weight sync as formed now, and the one way to bring producers to a version (not in ``RunProgress``: a
    resume forms it anew)."""

    def __init__(
        self,
        trainers,
        producers,
        *,
        mode: str,
        receivers_per_producer: int,
        run_dir: Path,
        producer_nodes: Callable[[], Sequence[str]],
        wait: WaitGroups,
        cancel: CancelCalls,
    ):
        """``producer_nodes()``: each producer's Ray node id now (a restarted one may be elsewhere); ``cancel``: how
        the calls of a formation a member died in are cancelled."""
        self.trainers, self.producers = trainers, producers
        self.mode = mode
        self.receivers_per_producer = receivers_per_producer
        self.run_dir = run_dir
        self.producer_nodes = producer_nodes
        self.wait = wait
        self.cancel = cancel
        self.senders: list[int] = []
        """Trainer ranks that send the weights, one per pipeline stage."""
        self.trainer_nodes: list[str] = []
        """Ray node ids (by rank): whether a producer can read a sender's shared memory."""
        self.formations = 0
        """Times the sync was formed (each formation gets fresh region names and file prefixes)."""
        self.stale = False
        """The group broke (a producer restarted, a sync failed): form it again before the next sync."""
        self.retained_weights: list = []
        """Object-store copies (one per sync stage) of the last synced version's weights: a restarted producer's."""

    def start(self, trainers_ready: list, *, retain: bool) -> None:
        """Form the sync for the first time from the trainers' ``setup`` answers (node, stage each sends).
        ``retain``: keep the senders' copy of the weights they hold now (a fresh run's version 0)."""
        self.trainer_nodes = [info.node_id for info in trainers_ready]
        self.senders = stage_senders([info.sync_stage for info in trainers_ready])
        self._form(retain=retain)

    def sync_to(self, version: int, *, producers: Sequence[int] | None = None, reason: str) -> Calls:
        """The calls that bring ``producers`` (None: every producer) to ``version``; ``reason`` names the caller
        (logs). Every producer: the trainers push, the producers receive (trainers' calls first; the group formed
        again first if it broke). Some producers: each loads the retained copy, which must be ``version``'s (the
        last completed sync's); they left the group, so it is formed again before the next sync."""
        logger.debug("weight sync to version %d (%s): producers %s", version, reason, producers or "all")
        if producers is None:
            if self.stale:
                self._form(retain=False)
            return self.trainers.push_weights(version) + self.producers.receive_weights(version)
        self.stale = True
        return self.producers.restore_weights(list(producers), version, self.retained_weights)

    def broken(self) -> None:
        """A sync failed on the group: the next :meth:`sync_to` of every producer forms it again first."""
        self.stale = True

    def synced(self, results: list) -> None:
        """A sync of every producer completed with ``results`` (``sync_to``'s calls' results, in order): the
        senders' copies of its weights replace the previous version's (freed)."""
        retained = [ref for refs in results[: len(self.trainers)] for ref in refs]
        if retained:
            self.retained_weights = retained

    def _form(self, *, retain: bool) -> None:
        """(Re)form every pipeline stage's route: its sender trainer hosts a group, a shared-memory region or sync
        files, every producer joins. ``retain``: keep the senders' copy of the weights they hold."""
        self.stale = True  # until this formation completes
        (addresses,) = self.wait([self.trainers.weight_sync_address(self.senders)])
        self.formations += 1
        send_routes, receive_routes = plan_routes(
            self.mode,
            sender_nodes=[self.trainer_nodes[rank] for rank in self.senders],
            producer_nodes=self.producer_nodes(),
            addresses=addresses,
            run_dir=self.run_dir,
            formation=self.formations,
            receivers_per_producer=[self.receivers_per_producer] * len(self.producers),
        )
        formation = [
            self.trainers.setup_weight_sync(send_routes, retain),
            self.producers.join_weight_sync(receive_routes),
        ]
        try:
            senders, _ = self.wait(formation)
        except RunFailed:  # a member died: the others stop waiting for it (the caller's recovery forms it anew)
            self.cancel([call for calls in formation for call in calls])
            raise
        if retain:
            self.retained_weights = [ref for refs in senders for ref in refs]
        self.stale = False
