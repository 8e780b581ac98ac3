"""``RewardScorer``: what every scorer is (built-in, plug-in, a mix of them) and what a producer calls."""

from __future__ import annotations

from typing import Any, Protocol

from .records import RewardRecord


class RewardScorer(Protocol):
    def score_batch(self, responses: list[str], rows: list[dict[str, Any]]) -> list[RewardRecord]: ...

    def close(self) -> None: ...
