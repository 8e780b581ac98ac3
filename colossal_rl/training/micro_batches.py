"""Which samples of a chunk go through one forward/backward: micro-batches by count or by token budget.

A micro-batch is a contiguous range of *units*: samples, or whole prompt groups when the layout shares a
group's prompt. By count, each holds ``microbatch_size`` samples (at least one unit). By token budget
(``train.max_tokens_per_microbatch``, verl's dynamic batch size), units are added while the tokens the
layout computes stay within the budget (a unit alone may exceed it). Data-parallel ranks must run the same
number of backward passes (each one all-reduces gradients), so a budgeted plan can be stretched to a given
count: the smallest budget that needs no more than that many micro-batches, then the largest split further.

Pure functions over lengths; no tensors, no communication.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Unit:
    """Samples that stay together in a micro-batch: one sample, or one prompt group."""

    start: int
    """First sample (within the chunk)."""
    prompt_length: int
    response_lengths: tuple[int, ...]

    @property
    def stop(self) -> int:
        return self.start + len(self.response_lengths)


def make_units(prompt_lengths: list[int], response_lengths: list[int], samples_per_unit: int) -> list[Unit]:
    """Consecutive units of ``samples_per_unit`` samples (a group shares its first sample's prompt length)."""
    return [
        Unit(
            start=start,
            prompt_length=prompt_lengths[start],
            response_lengths=tuple(response_lengths[start : start + samples_per_unit]),
        )
        for start in range(0, len(prompt_lengths), samples_per_unit)
    ]


def computed_tokens(units: list[Unit], *, padded: bool, shared_prompt: bool) -> int:
    """Tokens one forward over ``units`` computes: n x (longest prompt + longest response) when padded, else
    the real tokens (each group's prompt once when ``shared_prompt``)."""
    if padded:
        samples = sum(len(unit.response_lengths) for unit in units)
        return samples * (max(u.prompt_length for u in units) + max(max(u.response_lengths) for u in units))
    prompts = sum(u.prompt_length * (1 if shared_prompt else len(u.response_lengths)) for u in units)
    return prompts + sum(sum(u.response_lengths) for u in units)


def by_count(units: list[Unit], microbatch_size: int) -> list[tuple[int, int]]:
    """Sample ranges of ``microbatch_size`` samples, rounded down to whole units (at least one unit)."""
    per_unit = len(units[0].response_lengths) if units else 1
    units_per_micro = max(1, microbatch_size // per_unit)
    return [
        (units[i].start, units[min(i + units_per_micro, len(units)) - 1].stop)
        for i in range(0, len(units), units_per_micro)
    ]


def by_budget(units: list[Unit], max_tokens: int, *, padded: bool, shared_prompt: bool) -> list[list[Unit]]:
    """Greedy: consecutive units while ``computed_tokens`` stays within ``max_tokens`` (each part >= 1 unit)."""
    parts: list[list[Unit]] = []
    current: list[Unit] = []
    for unit in units:
        if current and computed_tokens([*current, unit], padded=padded, shared_prompt=shared_prompt) > max_tokens:
            parts.append(current)
            current = []
        current.append(unit)
    if current:
        parts.append(current)
    return parts


def by_budget_in_exactly(units: list[Unit], count: int, *, padded: bool, shared_prompt: bool) -> list[list[Unit]]:
    """``count`` consecutive parts as even in computed tokens as greedy packing makes them.

    The smallest budget whose greedy plan needs at most ``count`` parts (binary search), then the parts
    with the most tokens are halved until there are ``count``.
    """
    if count > len(units):
        raise ValueError(f"cannot cut {len(units)} units into {count} non-empty micro-batches")
    cost = lambda part: computed_tokens(part, padded=padded, shared_prompt=shared_prompt)  # noqa: E731
    low, high = max(cost([unit]) for unit in units), cost(units)
    while low < high:
        middle = (low + high) // 2
        if len(by_budget(units, middle, padded=padded, shared_prompt=shared_prompt)) <= count:
            high = middle
        else:
            low = middle + 1
    parts = by_budget(units, low, padded=padded, shared_prompt=shared_prompt)
    while len(parts) < count:
        index = max((i for i, part in enumerate(parts) if len(part) > 1), key=lambda i: cost(parts[i]))
        part = parts[index]
        parts[index : index + 1] = [part[: len(part) // 2], part[len(part) // 2 :]]
    return parts


def sample_ranges(parts: list[list[Unit]]) -> list[tuple[int, int]]:
    return [(part[0].start, part[-1].stop) for part in parts]
