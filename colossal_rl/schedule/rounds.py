"""The round schedule (``--schedule rounds``, the default): ColossalChat's, generate a round, train it, sync.

Round ``r``: every producer generates ``prompts_per_producer`` prompts of it (one chunk each, sampled with seed
index ``r``) with version ``max(0, r - n_behind)``, ordered as soon as the sync of that version is; the round is
complete when its slowest chunk is in; then its kept groups join the groups carried over, groups staler than
``n_behind`` versions are dropped, and the pool is cut into whole steps of ``groups_per_step`` (the rest carried
over to the next round). The round's steps are ordered together (one ``StepOrder``: ``--ppo-epochs`` passes go
over all of them), and version ``r + 1`` is due once they are trained. Versions count rounds here, not steps.

Plain class, no ray, no torch: ``driver/schedule_loop.py`` carries out its decisions, as it does the streaming
schedule's, and ``benchmarks/schedule_simulator.py`` drives it the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

from colossal_rl.schedule.events import (
    ChunkOrder,
    FinishedGroup,
    StepOrder,
    TrainGroup,
    group_fields,
    require_setting,
)
from colossal_rl.schedule.prompts import EpochRows, round_slice

SNAPSHOT_FORMAT = 1


@dataclass(frozen=True, kw_only=True)
class RoundSettings:
    num_producers: int
    """Producer actors (-i)."""
    prompts_per_producer: int
    """Prompts each producer generates per round (-ibs)."""
    groups_per_step: int
    """Groups one optimizer step trains, over all data-parallel ranks together."""
    n_behind: int
    """Round r is generated with version max(0, r - n_behind); staler groups are dropped (-nb)."""
    total_rounds: int
    ppo_epochs: int = 1
    """Passes over a round's steps: each pass's steps are optimizer steps (``steps_done`` counts them all)."""
    max_steps: int | None = None
    """Optimizer steps after which no further round is trained (the round reaching them is the last)."""

    def __post_init__(self) -> None:
        for name in ("num_producers", "prompts_per_producer", "groups_per_step", "ppo_epochs"):
            require_setting(getattr(self, name) >= 1, name, f"must be >= 1, got {getattr(self, name)}")
        require_setting(self.n_behind >= 0, "n_behind", f"must be >= 0, got {self.n_behind}")
        require_setting(self.total_rounds >= 0, "total_rounds", f"must be >= 0, got {self.total_rounds}")
        require_setting(
            self.max_steps is None or self.max_steps >= 0, "max_steps", f"must be >= 0, got {self.max_steps}"
        )

    @property
    def rows_per_round(self) -> int:
        return self.num_producers * self.prompts_per_producer


class RoundScheduler:
    """The round schedule's decisions, given the same events as :class:`StreamingScheduler`."""

    settles_before_snapshot = True
    """A checkpoint waits for the rounds in flight (``-nb``): their rollouts are saved, the resume is exact."""

    def __init__(self, settings: RoundSettings, epoch_rows: EpochRows):
        self.settings = settings
        self._epoch_rows = epoch_rows
        self._orders: dict[int, list[int]] = {}  # episode -> its row order
        self.synced_version = 0
        self.rounds_trained = 0
        self.dropped_stale_groups = 0
        self.filtered_groups = 0
        self._next_round = 0  # the next round to order
        self._in_flight: dict[int, ChunkOrder] = {}
        self._delivered: dict[int, dict[int, list[TrainGroup]]] = {}  # round -> producer -> kept groups
        self._pool: list[TrainGroup] = []
        self._dropped_unreported = 0
        self._steps_done = 0
        self._step_open: StepOrder | None = None
        self._arrivals = 0

    @property
    def steps_done(self) -> int:
        """Optimizer steps trained (every ``--ppo-epochs`` pass's)."""
        return self._steps_done

    @property
    def trainer_version(self) -> int:
        return self.rounds_trained

    @property
    def finished(self) -> bool:
        """Every round trained, or the round reaching ``max_steps`` trained."""
        if self._step_open is not None:
            return False
        max_steps = self.settings.max_steps
        return self.rounds_trained >= self.settings.total_rounds or (
            max_steps is not None and self._steps_done >= max_steps
        )

    def groups_in_flight(self) -> int:
        return sum(len(order.rows) for order in self._in_flight.values())

    def waiting_groups(self) -> list[TrainGroup]:
        """Kept groups delivered and not trained yet: of rounds not dealt, and carried over."""
        delivered = [group for r in sorted(self._delivered) for p in sorted(self._delivered[r])
                     for group in self._delivered[r][p]]  # fmt: skip
        return self._pool + delivered

    def rows_for(self, round_index: int, producer_rank: int) -> tuple[int, tuple[int, ...]]:
        """(episode, rows) of a producer's share of a round: ``EpisodeSchedule.rows_for`` over ``epoch_rows``."""
        rows_per_round, size = self.settings.rows_per_round, self.settings.prompts_per_producer
        if 0 not in self._orders:
            self._orders[0] = list(self._epoch_rows(0))
        rounds_per_episode = len(self._orders[0]) // rows_per_round
        require_setting(
            rounds_per_episode > 0, "prompts_per_producer", "a round needs more prompts than an episode has"
        )
        episode, round_in_episode = divmod(round_index, rounds_per_episode)
        if episode not in self._orders:
            self._orders[episode] = list(self._epoch_rows(episode))
        order = self._orders[episode]
        return episode, tuple(round_slice(order, round_in_episode, producer_rank, size, self.settings.num_producers))

    # ------------------------------------------------------------------ decisions
    def admit(self) -> list[ChunkOrder]:
        """Every producer's share of each round whose version's sync is ordered (``r - n_behind <= synced``)."""
        settings, orders = self.settings, []
        while (
            not self.finished
            and self._next_round < settings.total_rounds
            and self._next_round - settings.n_behind <= self.synced_version
        ):
            r = self._next_round
            for rank in range(settings.num_producers):
                episode, rows = self.rows_for(r, rank)
                order = ChunkOrder(r * settings.num_producers + rank, rank, episode, rows, self.synced_version, r)
                self._in_flight[order.chunk_id] = order
                orders.append(order)
            self._delivered[r] = {}
            self._next_round += 1
        return orders

    def next_step(self) -> StepOrder | None:
        """Every step of the round being trained, in one order, once the round is complete and its version synced
        (a round of zero steps counts as trained at once)."""
        while self._step_open is None and not self.finished:
            r = self.rounds_trained
            delivered = self._delivered.get(r)
            if self.synced_version < r or delivered is None or len(delivered) < self.settings.num_producers:
                return None
            del self._delivered[r]
            self._pool.extend(group for rank in sorted(delivered) for group in delivered[rank])
            fresh = [group for group in self._pool if r - group.policy_version <= self.settings.n_behind]
            self.dropped_stale_groups += len(self._pool) - len(fresh)
            self._dropped_unreported += len(self._pool) - len(fresh)
            per_step = self.settings.groups_per_step
            num_steps = len(fresh) // per_step
            self._pool = fresh[num_steps * per_step :]
            if num_steps == 0:
                self.rounds_trained += 1
                continue
            order = StepOrder(
                self._steps_done, r, tuple(fresh[: num_steps * per_step]), self._dropped_unreported, num_steps
            )
            self._dropped_unreported = 0
            self._step_open = order
            return order
        return None

    def sync_due(self) -> int | None:
        return self.rounds_trained if self.rounds_trained > self.synced_version else None

    # ------------------------------------------------------------------ events
    def chunk_done(self, chunk_id: int, groups: list[FinishedGroup]) -> None:
        order = self._in_flight.pop(chunk_id, None)
        if order is None:
            raise ValueError(f"chunk {chunk_id} is not in flight")
        if sorted(group.row for group in groups) != sorted(order.rows):
            raise ValueError(f"chunk {chunk_id}: rows {sorted(g.row for g in groups)} are not {sorted(order.rows)}")
        kept = []
        for group in groups:
            if not group.kept:
                self.filtered_groups += 1
                continue
            kept.append(
                TrainGroup(chunk_id, order.episode, group.row, group.policy_version, group.tokens, self._arrivals)
            )
            self._arrivals += 1
        self._delivered[chunk_id // self.settings.num_producers][order.producer_rank] = kept

    def chunk_lost(self, chunk_id: int) -> ChunkOrder:
        """Its producer died first: the same order is made again (same rows, same seed; the producer is given the
        version it was ordered with before it runs it), so the round is regenerated exactly."""
        order = self._in_flight.get(chunk_id)
        if order is None:
            raise ValueError(f"chunk {chunk_id} is not in flight")
        return order

    def step_done(self) -> None:
        """The round's steps are trained: the trainers hold version ``rounds_trained``."""
        if self._step_open is None:
            raise RuntimeError("step_done without a step ordered")
        self._steps_done += self._step_open.num_steps * self.settings.ppo_epochs
        self._step_open = None
        self.rounds_trained += 1

    def sync_ordered(self, version: int) -> None:
        if not self.synced_version < version <= self.rounds_trained:
            raise ValueError(f"sync of version {version}: not in ({self.synced_version}, {self.rounds_trained}]")
        self.synced_version = version

    # ------------------------------------------------------------------ checkpoint
    def snapshot(self) -> dict:
        """Plain (JSON-able) state between rounds, with no chunk in flight (``settles_before_snapshot``): the
        rounds delivered and not trained, the groups carried over, the counters."""
        if self._step_open is not None or self._in_flight:
            raise RuntimeError("snapshot with a round's steps or chunks in flight: take it between rounds")
        return {
            "format": SNAPSHOT_FORMAT,
            "rounds_trained": self.rounds_trained,
            "next_round": self._next_round,
            "steps_done": self._steps_done,
            "delivered": [[r, rank, [group_fields(g) for g in groups]]
                          for r, by_rank in sorted(self._delivered.items()) for rank, groups in sorted(by_rank.items())],
            "pool": [group_fields(group) for group in self._pool],
            "arrivals": self._arrivals,
            "dropped_stale_groups": self.dropped_stale_groups,
            "dropped_unreported": self._dropped_unreported,
            "filtered_groups": self.filtered_groups,
        }  # fmt: skip

    def restore(self, state: dict) -> None:
        """Continue from :meth:`snapshot` (into a fresh scheduler). The driver then syncs the restored trainers'
        weights, version ``rounds_trained``, to every producer."""
        if self._steps_done or self._in_flight or self._delivered or self._next_round:
            raise RuntimeError("restore needs a fresh scheduler")
        if state.get("format") != SNAPSHOT_FORMAT or "rounds_trained" not in state:
            raise ValueError(f"not a round schedule snapshot of format {SNAPSHOT_FORMAT}")
        self.rounds_trained = self.synced_version = int(state["rounds_trained"])
        self._next_round, self._steps_done = int(state["next_round"]), int(state["steps_done"])
        for r, rank, groups in state["delivered"]:
            self._delivered.setdefault(int(r), {})[int(rank)] = [TrainGroup(*group) for group in groups]
        self._pool = [TrainGroup(*group) for group in state["pool"]]
        self._arrivals = int(state["arrivals"])
        self.dropped_stale_groups = int(state["dropped_stale_groups"])
        self._dropped_unreported = int(state["dropped_unreported"])
        self.filtered_groups = int(state["filtered_groups"])

    def metrics(self) -> dict[str, float]:
        return {
            "schedule/groups_dropped_stale": float(self.dropped_stale_groups),
            "schedule/groups_filtered": float(self.filtered_groups),
            "schedule/groups_carried_over": float(len(self._pool)),
            "schedule/rounds_trained": float(self.rounds_trained),
        }
