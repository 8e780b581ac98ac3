"""What a trainer is handed of the rollouts it trains: one prompt group's place in a chunk's payload.

The payloads themselves are objects in Ray's object store, owned by the buffer actor
(``driver/actors.BufferActor.keep``) so they outlive their producer; the schedule loop
(``driver/schedule_loop.py``) names each step's groups by :class:`GroupRef` and the trainers fetch them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class GroupRef:
    """One prompt group: the payload handle of its chunk's batch and its index inside that batch."""

    payload: Any
    group_index: int
    policy_version: int
    chunk_id: int
    tokens: int = 0
    """Tokens the trainer's forward computes for this group (0: not reported)."""
