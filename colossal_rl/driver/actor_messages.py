"""What actors report to the driver: small frozen dataclasses instead of dicts read by string key.

Torch-free and Ray-free: the driver, the actors (in either environment: producers may run on another torch) and
tests import them. Metrics stay ``dict[str, float]`` (they are logged by name); everything the driver *reads* is a
field here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from colossal_rl.profiling import Span
from colossal_rl.schedule.events import FinishedGroup


@dataclass(frozen=True)
class ProducerReady:
    """A producer's answer to ``ready``: who and where it is, the data it holds, and its start-up phases."""

    rank: int
    node_id: str
    """Ray node id (a restarted producer may land elsewhere): who can read a sender's shared memory."""
    pid: int
    """Its process: a new pid behind a failed call means Ray restarted it."""
    train_rows: int
    """Training prompts it holds after leaving out over-long ones (every producer must agree)."""
    restarted: bool
    """Ray restarted this producer after it died: it holds the base weights until given the current ones."""
    dropped_overlong: int
    startup: list[Span] = field(default_factory=list)


@dataclass(frozen=True)
class TrainerReady:
    """A trainer's answer to ``setup``: who and where it is, which pipeline stage's weights it sends, start-up."""

    rank: int
    node_id: str
    pid: int
    sync_stage: int | None
    """The pipeline stage whose weights this rank sends to the producers; None: it sends none."""
    startup: list[Span] = field(default_factory=list)


@dataclass(frozen=True)
class ChunkResult:
    """A producer's chunk (``ProducerActor.produce_chunk``): the kept groups' payload and every row's facts."""

    chunk_id: int
    producer_rank: int
    payload: Any
    """Object-store handle of the kept groups' batch (``comm/wire.py`` bytes, owned by the buffer actor), None
    when none was kept."""
    batch_rows: tuple[int, ...]
    """The payload's groups' rows: group ``i`` of the batch is row ``batch_rows[i]``."""
    groups: tuple[FinishedGroup, ...]
    """Every row of the chunk, kept or filtered, for the schedule (its scheduler's ``chunk_done``)."""
    metrics: dict[str, float]


@dataclass(frozen=True)
class StepResult:
    """What one trainer rank did in one optimizer step (``TrainerActor.train_steps``)."""

    step: int
    metrics: dict[str, float]
    data_indices: list[int]
    """The training-set rows this rank's share came from (sorted)."""
    samples: list[dict[str, Any]]
    """Rollouts of the step when asked for (``--log-rollout-interval``); empty otherwise."""
