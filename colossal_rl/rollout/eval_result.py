"""What a producer returns from an eval, and the scores made of it: plain Python, so the driver reads it
without importing torch."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EvalResult:
    task: str
    accuracy: float
    """mean@k: the fraction of correct responses over every prompt's ``samples_per_prompt`` responses."""
    num_prompts: int
    records: list[dict]
    """Per response: index, sample, response, gt_answer, reward, correct, status."""
    pass_at_k: float | None = None
    """The fraction of prompts with at least one correct response; None with one response per prompt."""
    samples_per_prompt: int = 1


def mean_and_pass_at_k(correct: list[list[bool]]) -> tuple[float, float]:
    """(mean@k, pass@k) of per-prompt lists of k correctness flags (k samples each: pass@k is exact, not
    estimated). Empty input scores (0, 0)."""
    if not correct:
        return 0.0, 0.0
    mean_at_k = sum(sum(flags) / len(flags) for flags in correct) / len(correct)
    pass_at_k = sum(any(flags) for flags in correct) / len(correct)
    return mean_at_k, pass_at_k
