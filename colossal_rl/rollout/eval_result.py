"""What a producer returns from an eval: plain Python values, so the driver reads it without importing torch."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EvalResult:
    task: str
    accuracy: float
    num_prompts: int
    records: list[dict]
    """Per prompt: index, response, gt_answer, reward, correct, status."""
