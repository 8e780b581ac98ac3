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
    """Per response: index, sample, response, gt_answer, reward, correct, status; through an environment (``--env``)
    also turns and tool_calls."""
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


def aggregate_eval(
    results_per_producer: list[list[EvalResult]], samples_per_prompt: int
) -> tuple[dict[str, float], dict[str, float], dict[str, list[dict]]]:
    """Every producer's share of every task, joined: (accuracy per task, the metrics to log, records per task).

    Accuracy (mean@k) and pass@k are weighted by each share's prompt count; pass@k is logged only with k > 1.
    """
    correct: dict[str, float] = {}
    passed: dict[str, float] = {}
    counts: dict[str, int] = {}
    records: dict[str, list[dict]] = {}
    for per_producer in results_per_producer:
        for result in per_producer:
            correct[result.task] = correct.get(result.task, 0.0) + result.accuracy * result.num_prompts
            passed[result.task] = passed.get(result.task, 0.0) + (result.pass_at_k or 0.0) * result.num_prompts
            counts[result.task] = counts.get(result.task, 0) + result.num_prompts
            records.setdefault(result.task, []).extend(result.records)
    accuracy = {task: correct[task] / max(counts[task], 1) for task in correct}
    logged = {f"eval/{task}_accuracy": value for task, value in accuracy.items()}
    if samples_per_prompt > 1:
        logged |= {f"eval/{task}_pass@{samples_per_prompt}": passed[task] / max(counts[task], 1) for task in passed}
    logged |= tool_call_rates(records)
    return accuracy, logged, records


def tool_call_rates(records: dict[str, list[dict]]) -> dict[str, float]:
    """``eval/<task>_tool_call_rate``: the fraction of a task's responses that called a tool at least once, for
    tasks evaluated through an environment (their records count ``tool_calls``; single-turn records do not)."""
    return {
        f"eval/{task}_tool_call_rate": sum(r["tool_calls"] > 0 for r in rows) / len(rows)
        for task, rows in records.items()
        if rows and all("tool_calls" in r for r in rows)
    }
