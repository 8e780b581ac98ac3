"""What a schedule and its driver exchange: orders out, finished groups in, and the protocol both schedules keep.

A *chunk* is one producer call: ``rows`` prompts, each sampled ``num_generations`` times into one *group*.
Versions count weight syncs' payloads: version ``v`` is the policy the trainers hold after ``v`` optimizer steps
(streaming) or ``v`` rounds (rounds); a group's staleness is the trainer's version at the step that trains it
minus the version its generation started with.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


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
    """Train one optimizer step on ``groups`` (all data-parallel ranks together; deal them out by token cost)."""

    step: int
    """0-based index of the step among all the run's steps."""
    trainer_version: int
    """The version the trainers hold while training this step."""
    groups: tuple[TrainGroup, ...]
    dropped_stale: int
    """Groups found too stale and dropped while this order was formed."""

    def staleness(self) -> dict[int, int]:
        """Staleness -> number of this step's groups with it."""
        histogram: dict[int, int] = {}
        for group in self.groups:
            lag = self.trainer_version - group.policy_version
            histogram[lag] = histogram.get(lag, 0) + 1
        return histogram


def require_setting(condition: bool, field_name: str, message: str) -> None:
    """A schedule setting's check: the ValueError names the field."""
    if not condition:
        raise ValueError(f"{field_name}: {message}")


class Scheduler(Protocol):
    """The events (``*_done``, ``sync_ordered``) and decisions (the rest) a driver calls, in any order it likes;
    a decision only reflects the events reported before it."""

    def admit(self) -> list[ChunkOrder]: ...

    def chunk_done(self, chunk_id: int, groups: list[FinishedGroup]) -> None: ...

    def next_step(self) -> StepOrder | None: ...

    def step_done(self) -> None: ...

    def sync_due(self) -> int | None: ...

    def sync_ordered(self, version: int) -> None: ...

    @property
    def steps_done(self) -> int: ...

    @property
    def finished(self) -> bool: ...
