"""Today's round schedule (``driver/run.py``'s ``Driver.run``) on the streaming schedule's event/decision interface.

Round ``r``: every producer generates ``prompts_per_producer`` prompts of it with version ``max(0, r - n_behind)``
(ordered as soon as the sync of that version is); the round is complete when its slowest chunk is in; then its
kept groups join the carried-over pool, groups staler than ``n_behind`` versions are dropped, and the pool is cut
into whole steps of ``groups_per_step`` (the rest carried over, as ``comm/buffer.py``'s ``RoundBuffer`` does);
version ``r + 1`` is due after the round's last step. Versions count rounds here, not steps.

It exists so the schedule simulator compares both schedules through one driving loop; ``Driver.run`` keeps its
own round loop. Plain class, no ray, no torch.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from colossal_rl.schedule.events import ChunkOrder, FinishedGroup, StepOrder, TrainGroup, require_setting
from colossal_rl.schedule.prompts import EpochRows, round_slice


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

    def __post_init__(self) -> None:
        for name in ("num_producers", "prompts_per_producer", "groups_per_step"):
            require_setting(getattr(self, name) >= 1, name, f"must be >= 1, got {getattr(self, name)}")
        require_setting(self.n_behind >= 0, "n_behind", f"must be >= 0, got {self.n_behind}")
        require_setting(self.total_rounds >= 0, "total_rounds", f"must be >= 0, got {self.total_rounds}")

    @property
    def rows_per_round(self) -> int:
        return self.num_producers * self.prompts_per_producer


class RoundScheduler:
    """The round schedule's decisions, given the same events as :class:`StreamingScheduler`."""

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
        self._steps: deque[tuple[TrainGroup, ...]] = deque()  # the dealt round's steps not ordered yet
        self._round_dealt = False
        self._dropped_unreported = 0
        self._steps_done = 0
        self._step_open = False
        self._arrivals = 0

    @property
    def steps_done(self) -> int:
        return self._steps_done

    @property
    def steps_per_version(self) -> int:
        """Optimizer steps a round feeds when nothing is filtered."""
        return self.settings.rows_per_round // self.settings.groups_per_step

    @property
    def finished(self) -> bool:
        return self.rounds_trained >= self.settings.total_rounds

    def groups_in_flight(self) -> int:
        return sum(len(order.rows) for order in self._in_flight.values())

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
        while self._next_round < settings.total_rounds and self._next_round - settings.n_behind <= self.synced_version:
            r = self._next_round
            for rank in range(settings.num_producers):
                episode, rows = self.rows_for(r, rank)
                order = ChunkOrder(r * settings.num_producers + rank, rank, episode, rows, self.synced_version)
                self._in_flight[order.chunk_id] = order
                orders.append(order)
            self._delivered[r] = {}
            self._next_round += 1
        return orders

    def next_step(self) -> StepOrder | None:
        """The next step of the round being trained; a round is dealt once complete and its version synced."""
        if self._step_open or self.finished:
            return None
        if not self._steps and not self._deal():
            return None
        groups = self._steps.popleft()
        order = StepOrder(self._steps_done, self.rounds_trained, groups, self._dropped_unreported)
        self._dropped_unreported = 0
        self._step_open = True
        return order

    def _deal(self) -> bool:
        """Deal round ``rounds_trained`` into steps if it can be; a round of zero steps counts as trained."""
        r = self.rounds_trained
        delivered = self._delivered.get(r)
        if self._round_dealt or self.synced_version < r or delivered is None:
            return False
        if len(delivered) < self.settings.num_producers:
            return False
        del self._delivered[r]
        self._pool.extend(group for rank in sorted(delivered) for group in delivered[rank])
        fresh = [group for group in self._pool if r - group.policy_version <= self.settings.n_behind]
        self.dropped_stale_groups += len(self._pool) - len(fresh)
        self._dropped_unreported += len(self._pool) - len(fresh)
        per_step = self.settings.groups_per_step
        num_steps = len(fresh) // per_step
        self._steps.extend(tuple(fresh[i * per_step : (i + 1) * per_step]) for i in range(num_steps))
        self._pool = fresh[num_steps * per_step :]
        if num_steps == 0:
            self.rounds_trained += 1
            return False
        self._round_dealt = True
        return True

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

    def step_done(self) -> None:
        if not self._step_open:
            raise RuntimeError("step_done without a step ordered")
        self._step_open = False
        self._steps_done += 1
        if not self._steps:
            self._round_dealt = False
            self.rounds_trained += 1

    def sync_ordered(self, version: int) -> None:
        if not self.synced_version < version <= self.rounds_trained:
            raise ValueError(f"sync of version {version}: not in ({self.synced_version}, {self.rounds_trained}]")
        self.synced_version = version
