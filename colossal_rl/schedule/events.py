"""What a schedule and its driver exchange: orders out, finished groups in, and the protocol both schedules keep.

A *chunk* is one producer call: ``rows`` prompts, each sampled ``num_generations`` times into one *group*.
Versions count weight syncs' payloads: version ``v`` is the policy the trainers hold after ``v`` optimizer steps
(streaming) or ``v`` rounds (rounds); a group's staleness is the trainer's version at the step that trains it
minus the version its generation started with.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class ChunkOrder:
    """Generate ``rows`` (dataset row indices, one epoch's) on producer ``producer_rank``."""

    chunk_id: int
    producer_rank: int
    episode: int
    rows: tuple[int, ...]
    policy_version: int
    """The version the producer holds when it starts the chunk: the newest sync ordered before this chunk (the
    producer runs its calls in order, so the driver must submit the chunk after every sync ordered so far)."""
    seed_index: int | None = None
    """What the producer seeds sampling with (with the run seed and its rank); None: ``chunk_id``. A round's
    chunks use the round index, so a chunk made again after its producer died samples the same."""

    @property
    def sampling_seed_index(self) -> int:
        return self.chunk_id if self.seed_index is None else self.seed_index


@dataclass(frozen=True)
class FinishedGroup:
    """One prompt's group, scored and post-processed by its producer."""

    row: int
    policy_version: int
    """The version the group's generation started with."""
    tokens: int = 0
    """Tokens the trainer's forward computes for it (0: not reported)."""
    kept: bool = True
    """False: dynamic sampling filtered it out (every reward equal); it is never trained."""


@dataclass(frozen=True)
class TrainGroup:
    """A kept group waiting to be trained, or in a step order."""

    chunk_id: int
    episode: int
    row: int
    policy_version: int
    tokens: int
    arrival: int
    """Acceptance order (0, 1, ...): ties between equally old groups go to the earlier arrival."""


@dataclass(frozen=True)
class StepOrder:
    """Train ``num_steps`` optimizer steps in one call on ``groups``, step-major (``groups_per_step`` each, all
    data-parallel ranks together; each step's are dealt out by token cost). The streaming schedule orders one
    step at a time; the round schedule a whole round, so ``--ppo-epochs`` passes go over all of it."""

    step: int
    """0-based index of the (first) step among all the run's steps."""
    trainer_version: int
    """The version the trainers hold while training this order."""
    groups: tuple[TrainGroup, ...]
    dropped_stale: int
    """Groups found too stale and dropped while this order was formed."""
    num_steps: int = 1

    def step_groups(self) -> list[tuple[TrainGroup, ...]]:
        """The groups of each step, in order."""
        per_step = len(self.groups) // self.num_steps
        return [self.groups[index * per_step : (index + 1) * per_step] for index in range(self.num_steps)]

    def staleness(self) -> dict[int, int]:
        """Staleness -> number of this step's groups with it."""
        histogram: dict[int, int] = {}
        for group in self.groups:
            lag = self.trainer_version - group.policy_version
            histogram[lag] = histogram.get(lag, 0) + 1
        return histogram


def group_fields(group: TrainGroup) -> list:
    """A group as a JSON-able list (a scheduler's snapshot); ``TrainGroup(*fields)`` makes it again."""
    return [group.chunk_id, group.episode, group.row, group.policy_version, group.tokens, group.arrival]


def require_setting(condition: bool, field_name: str, message: str) -> None:
    """A schedule setting's check: the ValueError names the field."""
    if not condition:
        raise ValueError(f"{field_name}: {message}")


class Scheduler(Protocol):
    """The events (``*_done``, ``*_lost``, ``sync_ordered``) and decisions (the rest) a driver calls, in any order
    it likes; a decision only reflects the events reported before it. ``driver/schedule_loop.py`` carries out
    either schedule's decisions on the actors."""

    settings: Any
    """The schedule's frozen settings (``RoundSettings``, ``StreamingSettings``)."""
    settles_before_snapshot: bool
    """True: a checkpoint waits for every chunk in flight first (their rollouts are saved: an exact resume);
    False: their rows are handed out again on resume."""

    def admit(self) -> list[ChunkOrder]: ...

    def chunk_done(self, chunk_id: int, groups: list[FinishedGroup]) -> None: ...

    def chunk_lost(self, chunk_id: int) -> ChunkOrder | None:
        """Its producer died first: the order to make again as it was, or None (its rows are handed out again)."""
        ...

    def next_step(self) -> StepOrder | None: ...

    def step_done(self) -> None: ...

    def sync_due(self) -> int | None: ...

    def sync_ordered(self, version: int) -> None: ...

    @property
    def steps_done(self) -> int: ...

    @property
    def trainer_version(self) -> int:
        """The version the trainers hold once every ordered step is done."""
        ...

    @property
    def finished(self) -> bool: ...

    def waiting_groups(self) -> list[TrainGroup]:
        """Kept groups delivered and not trained yet."""
        ...

    def snapshot(self) -> dict: ...

    def restore(self, state: dict) -> None: ...

    def metrics(self) -> dict[str, float]: ...
