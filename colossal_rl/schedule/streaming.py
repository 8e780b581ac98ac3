"""The streaming rollout schedule (issue 35): groups flow to training as soon as they are scored.

Producers generate chunks of prompts back to back (``chunks_in_flight_per_producer`` ordered at a time, so one
is queued behind the running one and a producer never waits for the driver); every kept group joins a waiting
pool when its chunk reports it; the trainers take an optimizer step as soon as ``groups_per_step`` usable groups
wait, oldest version first; a weight sync is due every ``sync_every_steps`` steps.

Bounded staleness ``S`` (``max_staleness``): a group is trained only while the trainers' version minus the
version its generation started with is at most ``S``; staler groups are dropped and counted. Admission follows
AReaL's rule (Fu et al. 2025, "AReaL: a large-scale asynchronous RL system", section 5.1): a chunk of ``n``
prompts starting with version ``v`` is ordered only while

    accepted + in flight + n <= (S + v + 1) * groups_per_step

with ``accepted`` the kept groups trained or waiting (filtered and dropped groups leave it, so dynamic sampling's
losses are made up by further admissions) and ``v`` the newest sync ordered, which is at most the steps done:
AReaL's bound with "steps done" holds a fortiori, and the tighter one keeps ``sync_every_steps > 1`` from
generating what would be stale. Groups are trained in admission-order-independent "oldest version first", so
in the steady state nothing goes stale; a group far slower than the rest can still be overtaken and dropped
(``on_straggler="drop"``) unless the trainers wait for it (``"wait"``).

Plain class, no ray, no torch: the driver reports events (:meth:`chunk_done`, :meth:`step_done`,
:meth:`sync_ordered`) and asks for decisions (:meth:`admit`, :meth:`next_step`, :meth:`sync_due`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Literal

from colossal_rl.schedule.events import (
    ChunkOrder,
    FinishedGroup,
    StepOrder,
    TrainGroup,
    group_fields,
    require_setting,
)
from colossal_rl.schedule.prompts import EpochOrder, EpochRows

SNAPSHOT_FORMAT = 1


@dataclass(frozen=True, kw_only=True)
class StreamingSettings:
    num_producers: int
    """Producer actors (-i)."""
    groups_per_step: int
    """Groups one optimizer step trains, over all data-parallel ranks together."""
    prompts_per_chunk: int
    """Prompts a producer generates per call (the generate micro-batch by default)."""
    max_staleness: int
    """S: a group is trained only when the trainers' version minus its generation's version is at most S."""
    total_steps: int
    """Optimizer steps of the run."""
    sync_every_steps: int = 1
    """A weight sync is due after every this many optimizer steps (and after the last)."""
    chunks_in_flight_per_producer: int = 2
    """Chunks ordered to one producer and not reported yet: 2 is one running and one queued."""
    num_episodes: int | None = None
    """Passes over the prompts at most; None: as many as ``total_steps`` needs."""
    on_straggler: Literal["drop", "wait"] = "drop"
    """``wait``: no step is taken that would make a group still in flight too stale (nothing generated is
    dropped; trainers may idle); ``drop``: take it, and drop the straggler when it arrives."""

    def __post_init__(self) -> None:
        for name in ("num_producers", "groups_per_step", "prompts_per_chunk", "sync_every_steps"):
            require_setting(getattr(self, name) >= 1, name, f"must be >= 1, got {getattr(self, name)}")
        require_setting(
            self.chunks_in_flight_per_producer >= 1,
            "chunks_in_flight_per_producer",
            f"must be >= 1, got {self.chunks_in_flight_per_producer}",
        )
        require_setting(self.max_staleness >= 0, "max_staleness", f"must be >= 0, got {self.max_staleness}")
        require_setting(self.total_steps >= 0, "total_steps", f"must be >= 0, got {self.total_steps}")
        require_setting(
            self.num_episodes is None or self.num_episodes >= 1,
            "num_episodes",
            f"must be >= 1 or None, got {self.num_episodes}",
        )
        require_setting(
            self.on_straggler in ("drop", "wait"),
            "on_straggler",
            f"must be 'drop' or 'wait', got {self.on_straggler!r}",
        )
        problem = staleness_bound_problem(self.max_staleness, self.sync_every_steps)
        require_setting(problem is None, "max_staleness", problem or "")


def staleness_bound_problem(max_staleness: int, sync_every_steps: int) -> str | None:
    """Why a staleness bound ``max_staleness`` cannot hold with a sync every ``sync_every_steps`` steps (None: it
    can). The one statement of the rule, for the scheduler's settings and the config's flags alike."""
    if max_staleness >= sync_every_steps - 1:
        return None
    return (
        f"must be >= sync_every_steps - 1 = {sync_every_steps - 1}, got {max_staleness}: groups generated with a "
        "version synced every that many steps are staler than that before they are trained"
    )


@dataclass
class StreamingCounters:
    """Cumulative counts for metrics."""

    admitted_groups: int = 0
    trained_groups: int = 0
    dropped_stale_groups: int = 0
    filtered_groups: int = 0
    requeued_groups: int = 0
    """Rows of lost chunks (their producer died) handed out again."""
    staleness: dict[int, int] = field(default_factory=dict)
    """Staleness -> trained groups with it."""


@dataclass
class _Flight:
    order: ChunkOrder
    unreported: set[int]


class StreamingScheduler:
    """Decides what producers generate, what the next optimizer step trains and when weights are synced."""

    settles_before_snapshot = False
    """A checkpoint does not wait for chunks in flight: on resume their rows are handed out again."""

    def __init__(self, settings: StreamingSettings, epoch_rows: EpochRows):
        self.settings = settings
        self.prompts = EpochOrder(epoch_rows, settings.num_episodes)
        self.counters = StreamingCounters()
        self.synced_version = 0
        """The newest weights version ordered to every producer."""
        self._steps_done = 0
        self._step_open = False
        self._in_flight: dict[int, _Flight] = {}
        self._waiting: list[TrainGroup] = []
        self._next_chunk_id = 0
        self._next_arrival = 0
        self._dropped_unreported = 0  # dropped since the last step order (which reports them)

    # ------------------------------------------------------------------ state
    @property
    def steps_done(self) -> int:
        return self._steps_done

    @property
    def trainer_version(self) -> int:
        return self._steps_done

    def groups_in_flight(self) -> int:
        return sum(len(flight.unreported) for flight in self._in_flight.values())

    def chunks_in_flight(self, producer_rank: int | None = None) -> int:
        flights = self._in_flight.values()
        return sum(producer_rank is None or f.order.producer_rank == producer_rank for f in flights)

    def groups_waiting(self) -> int:
        return len(self._waiting)

    def waiting_groups(self) -> list[TrainGroup]:
        """Kept groups not trained yet that may still be (not too stale): their chunks' rollouts are kept."""
        return [group for group in self._waiting if self._usable(group)]

    def committed_groups(self) -> int:
        """Accepted (trained or waiting) plus in-flight groups: what the admission rule bounds."""
        return self.counters.trained_groups + len(self._waiting) + self.groups_in_flight()

    def admission_limit(self, version: int) -> int:
        """The most groups committed once a chunk starting with ``version`` is ordered."""
        settings = self.settings
        bound = (settings.max_staleness + version + 1) * settings.groups_per_step
        return min(bound, settings.total_steps * settings.groups_per_step)

    @property
    def finished(self) -> bool:
        """Every step trained, or the prompts used up and too few usable groups left for another step."""
        if self._steps_done >= self.settings.total_steps:
            return True
        if self._step_open or self._in_flight or not self.prompts.exhausted():
            return False
        usable = sum(self._usable(group) for group in self._waiting)
        return usable < self.settings.groups_per_step

    def _usable(self, group: TrainGroup) -> bool:
        return self._steps_done - group.policy_version <= self.settings.max_staleness

    # ------------------------------------------------------------------ decisions
    def admit(self) -> list[ChunkOrder]:
        """Chunks to order now, each to be submitted to its producer after every sync ordered so far.

        A producer gets chunks while it has fewer than ``chunks_in_flight_per_producer`` in flight and the
        admission rule allows; the fewest-in-flight producer first (lowest rank on ties). A chunk smaller than
        ``prompts_per_chunk`` is ordered only to a producer that would otherwise idle (or at an episode's end)."""
        self._drop_stale()
        settings, orders = self.settings, []
        while True:
            room = self.admission_limit(self.synced_version) - self.committed_groups()
            loads = [(self.chunks_in_flight(rank), rank) for rank in range(settings.num_producers)]
            load, rank = min(loads)
            if room <= 0 or load >= settings.chunks_in_flight_per_producer:
                return orders
            size = min(settings.prompts_per_chunk, room)
            if size < settings.prompts_per_chunk and load > 0:
                return orders
            episode, rows = self.prompts.take(size)
            if not rows:
                return orders
            orders.append(self._order(rank, episode, rows))

    def _order(self, rank: int, episode: int, rows: list[int]) -> ChunkOrder:
        order = ChunkOrder(self._next_chunk_id, rank, episode, tuple(rows), self.synced_version)
        self._next_chunk_id += 1
        self._in_flight[order.chunk_id] = _Flight(order, set(order.rows))
        self.counters.admitted_groups += len(rows)
        return order

    def next_step(self) -> StepOrder | None:
        """The groups of the next optimizer step (oldest version first), or None: too few usable groups wait, a
        step is still open, every step is done, or (``on_straggler="wait"``) a group in flight would go stale."""
        settings = self.settings
        if self._step_open or self._steps_done >= settings.total_steps:
            return None
        self._drop_stale()
        if len(self._waiting) < settings.groups_per_step:
            return None
        if settings.on_straggler == "wait" and self._straggler_in_flight():
            return None
        self._waiting.sort(key=lambda group: (group.policy_version, group.arrival))
        chosen = tuple(self._waiting[: settings.groups_per_step])
        del self._waiting[: settings.groups_per_step]
        order = StepOrder(self._steps_done, self._steps_done, chosen, self._dropped_unreported)
        self._dropped_unreported = 0
        self._step_open = True
        self.counters.trained_groups += len(chosen)
        for lag, count in order.staleness().items():
            self.counters.staleness[lag] = self.counters.staleness.get(lag, 0) + count
        return order

    def _straggler_in_flight(self) -> bool:
        """Whether a group in flight would be too stale for the step after the one about to be taken."""
        oldest = min((f.order.policy_version for f in self._in_flight.values()), default=None)
        return oldest is not None and self._steps_done + 1 - oldest > self.settings.max_staleness

    def _drop_stale(self) -> None:
        fresh = [group for group in self._waiting if self._usable(group)]
        dropped = len(self._waiting) - len(fresh)
        self._waiting = fresh
        self._dropped_unreported += dropped
        self.counters.dropped_stale_groups += dropped

    def sync_due(self) -> int | None:
        """The version to sync to every producer now (the trainers' current one), or None."""
        behind = self._steps_done - self.synced_version
        last = self._steps_done >= self.settings.total_steps
        if behind >= self.settings.sync_every_steps or (last and behind > 0):
            return self._steps_done
        return None

    # ------------------------------------------------------------------ events
    def groups_done(self, chunk_id: int, groups: list[FinishedGroup]) -> None:
        """Some groups of a chunk in flight are scored (any subset not reported before; streaming producers may
        report group by group). The chunk leaves flight when all its rows are reported."""
        flight = self._in_flight.get(chunk_id)
        if flight is None:
            raise ValueError(f"chunk {chunk_id} is not in flight")
        rows = [group.row for group in groups]
        unknown = sorted(set(rows) - flight.unreported)
        if unknown or len(set(rows)) != len(rows):
            raise ValueError(f"chunk {chunk_id}: rows {sorted(rows)} are not its unreported rows (bad: {unknown})")
        for group in groups:
            if group.kept:
                self._waiting.append(self._accepted(flight.order, group))
            else:
                self.counters.filtered_groups += 1
        flight.unreported -= set(rows)
        if not flight.unreported:
            del self._in_flight[chunk_id]

    def _accepted(self, order: ChunkOrder, group: FinishedGroup) -> TrainGroup:
        accepted = TrainGroup(
            order.chunk_id, order.episode, group.row, group.policy_version, group.tokens, self._next_arrival
        )
        self._next_arrival += 1
        return accepted

    def chunk_done(self, chunk_id: int, groups: list[FinishedGroup]) -> None:
        """A chunk finished: ``groups`` are all its rows' not reported before."""
        flight = self._in_flight.get(chunk_id)
        missing = set() if flight is None else flight.unreported - {group.row for group in groups}
        if missing:
            raise ValueError(f"chunk {chunk_id} reported done without rows {sorted(missing)}")
        self.groups_done(chunk_id, groups)

    def chunk_lost(self, chunk_id: int) -> None:
        """A chunk's producer died before reporting (the rest of) it: its unreported rows leave flight and are
        handed out again first (each still at most once per episode: they were never accepted). Nothing is made
        again as it was (None)."""
        flight = self._in_flight.pop(chunk_id, None)
        if flight is None:
            raise ValueError(f"chunk {chunk_id} is not in flight")
        rows = [row for row in flight.order.rows if row in flight.unreported]
        self.prompts.requeue(flight.order.episode, rows)
        self.counters.requeued_groups += len(rows)

    def step_done(self) -> None:
        """The trainers finished the step last ordered: they now hold version ``steps_done``."""
        if not self._step_open:
            raise RuntimeError("step_done without a step ordered")
        self._step_open = False
        self._steps_done += 1

    def sync_ordered(self, version: int) -> None:
        """The driver ordered every producer to load ``version`` (after the calls ordered before it)."""
        if not self.synced_version < version <= self._steps_done:
            raise ValueError(f"sync of version {version}: not in ({self.synced_version}, {self._steps_done}]")
        self.synced_version = version

    # ------------------------------------------------------------------ checkpoint
    def snapshot(self) -> dict:
        """Plain (JSON-able) state between steps: the prompt cursor, chunks in flight, waiting groups, counters."""
        if self._step_open:
            raise RuntimeError("snapshot while a step is open: take it after step_done")
        counters = asdict(self.counters)
        counters["staleness"] = sorted(self.counters.staleness.items())
        return {
            "format": SNAPSHOT_FORMAT,
            "prompts": self.prompts.snapshot(),
            "in_flight": [[f.order.episode, sorted(f.unreported)] for _, f in sorted(self._in_flight.items())],
            "waiting": [group_fields(group) for group in self._waiting],
            "steps_done": self._steps_done,
            "next_chunk_id": self._next_chunk_id,
            "next_arrival": self._next_arrival,
            "dropped_unreported": self._dropped_unreported,
            "counters": counters,
        }

    def restore(self, state: dict, *, requeue_waiting: bool = False) -> None:
        """Continue from :meth:`snapshot` (into a fresh scheduler). Rows of chunks in flight are handed out again
        first; with ``requeue_waiting`` so are the waiting groups' rows (when their payloads were not saved).
        The driver then syncs the restored trainers' weights, version ``steps_done``, to every producer."""
        if self._steps_done or self._in_flight or self._waiting or self._next_chunk_id:
            raise RuntimeError("restore needs a fresh scheduler")
        if state["format"] != SNAPSHOT_FORMAT:
            raise ValueError(f"snapshot format {state['format']}, expected {SNAPSHOT_FORMAT}")
        self.prompts.restore(state["prompts"])
        for episode, rows in state["in_flight"]:
            self.prompts.requeue(episode, rows)
        waiting = [TrainGroup(*entry) for entry in state["waiting"]]
        if requeue_waiting:
            for group in sorted(waiting, key=lambda group: group.arrival):
                self.prompts.requeue(group.episode, [group.row])
        else:
            self._waiting = waiting
        self._steps_done = self.synced_version = int(state["steps_done"])
        self._next_chunk_id, self._next_arrival = int(state["next_chunk_id"]), int(state["next_arrival"])
        self._dropped_unreported = int(state["dropped_unreported"])
        counters = {"requeued_groups": 0} | dict(state["counters"])  # snapshots from before chunk_lost lack it
        counters["staleness"] = {int(lag): int(count) for lag, count in counters["staleness"]}
        self.counters = StreamingCounters(**counters)

    def metrics(self) -> dict[str, float]:
        """Counters for the metrics log."""
        trained = self.counters.trained_groups
        lag_sum = sum(lag * count for lag, count in self.counters.staleness.items())
        return {
            "schedule/groups_trained": float(trained),
            "schedule/groups_dropped_stale": float(self.counters.dropped_stale_groups),
            "schedule/groups_filtered": float(self.counters.filtered_groups),
            "schedule/groups_requeued": float(self.counters.requeued_groups),
            "schedule/chunks_in_flight": float(self.chunks_in_flight()),
            "schedule/groups_in_flight": float(self.groups_in_flight()),
            "schedule/groups_waiting": float(len(self._waiting)),
            "schedule/staleness_mean": lag_sum / trained if trained else 0.0,
        }
