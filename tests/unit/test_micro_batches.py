"""Micro-batch plans: by count, by token budget, and stretched to a count every data-parallel rank shares."""

from __future__ import annotations

import random

import pytest

from colossal_rl.training.micro_batches import (
    by_budget,
    by_budget_in_exactly,
    by_count,
    computed_tokens,
    make_units,
    sample_ranges,
)


def covers_in_order(ranges: list[tuple[int, int]], num_samples: int) -> bool:
    return (
        ranges[0][0] == 0
        and ranges[-1][1] == num_samples
        and all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))
    )


def test_computed_tokens_per_layout():
    units = make_units([5, 5, 3, 3], [2, 4, 1, 1], samples_per_unit=2)  # two groups of two
    assert computed_tokens(units, padded=True, shared_prompt=False) == 4 * (5 + 4)
    assert computed_tokens(units, padded=False, shared_prompt=False) == 5 + 2 + 5 + 4 + 3 + 1 + 3 + 1
    assert computed_tokens(units, padded=False, shared_prompt=True) == 5 + 2 + 4 + 3 + 1 + 1


def test_by_count_keeps_whole_units():
    samples = make_units([4] * 8, [1] * 8, samples_per_unit=1)
    assert by_count(samples, 3) == [(0, 3), (3, 6), (6, 8)]
    groups = make_units([4] * 8, [1] * 8, samples_per_unit=4)
    assert by_count(groups, 3) == [(0, 4), (4, 8)]  # fewer samples than a group: one group each


def test_by_budget_stays_within_the_budget_unless_one_unit_exceeds_it():
    units = make_units([3] * 6, [1, 9, 2, 2, 2, 20], samples_per_unit=1)
    parts = by_budget(units, 12, padded=False, shared_prompt=False)
    assert [[u.start for u in part] for part in parts] == [[0], [1], [2, 3], [4], [5]]
    for part in parts:
        assert len(part) == 1 or computed_tokens(part, padded=False, shared_prompt=False) <= 12


@pytest.mark.parametrize("seed", range(5))
def test_exact_count_covers_every_sample_in_order_and_no_worse_than_greedy(seed):
    rng = random.Random(seed)
    n = 24
    units = make_units([rng.randint(2, 30) for _ in range(n)], [rng.randint(1, 40) for _ in range(n)], 1)
    greedy = by_budget(units, 120, padded=True, shared_prompt=False)
    for count in range(len(greedy), n + 1, 5):
        parts = by_budget_in_exactly(units, count, padded=True, shared_prompt=False)
        assert len(parts) == count and all(parts)
        assert covers_in_order(sample_ranges(parts), n)
        worst = max(computed_tokens(part, padded=True, shared_prompt=False) for part in parts)
        assert worst <= max(computed_tokens(part, padded=True, shared_prompt=False) for part in greedy)


def test_exact_count_refuses_more_parts_than_units():
    units = make_units([3, 3], [1, 1], samples_per_unit=1)
    with pytest.raises(ValueError, match="cannot cut 2 units into 3"):
        by_budget_in_exactly(units, 3, padded=False, shared_prompt=False)
