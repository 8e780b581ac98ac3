"""DAPO's dynamic sampling, overlong filtering and soft overlong punishment."""

import pytest
import torch
from torch.testing import assert_close

from colossal_rl.algorithms import dynamic_sampling_group_mask, filter_truncated_response, soft_over_length_penalty


def test_dynamic_sampling_keeps_groups_with_mixed_accuracy():
    correct = torch.tensor([1, 1, 1, 1, 0, 0, 0, 0, 1, 0, 0, 0, 1, 1, 1, 0], dtype=torch.float32)
    keep = dynamic_sampling_group_mask(correct, group_size=4, low=0.01, high=0.99)
    assert keep.tolist() == [False, False, True, True]


def test_dynamic_sampling_bounds_are_inclusive():
    correct = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0])
    assert dynamic_sampling_group_mask(correct, 4, low=0.25, high=0.75).tolist() == [True, True]
    assert dynamic_sampling_group_mask(correct, 4, low=0.26, high=0.74).tolist() == [False, False]


def test_dynamic_sampling_counts_only_valid_samples():
    correct = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0])
    valid = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 0.0])  # group 0 is all-correct among valid, group 1 empty
    assert dynamic_sampling_group_mask(correct, 3, 0.01, 0.99, valid_mask=valid).tolist() == [False, False]
    with pytest.raises(ValueError, match="groups of 4"):
        dynamic_sampling_group_mask(correct, 4, 0.01, 0.99)


def test_dynamic_sampling_accuracy_over_valid_samples_hand_computed():
    # group 0: valid samples 0, 2, 3 with one correct -> 1/3 (2/3 if the invalid correct sample counted,
    # 1/4 if the invalid sample counted as a wrong one); group 1: valid 4, 5 both correct -> 1
    correct = torch.tensor([1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0])
    valid = torch.tensor([1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0])
    assert dynamic_sampling_group_mask(correct, 4, 0.3, 0.4, valid_mask=valid).tolist() == [True, False]
    assert dynamic_sampling_group_mask(correct, 4, 0.9, 1.0, valid_mask=valid).tolist() == [False, True]
    assert dynamic_sampling_group_mask(correct, 4, 0.3, 0.4).tolist() == [False, False]  # all valid: 1/2 and 1/2


def test_filter_truncated_response():
    assert_close(filter_truncated_response(torch.tensor([True, False, True])), torch.tensor([0.0, 1.0, 0.0]))


def test_soft_over_length_penalty_hand_computed():
    lengths = torch.tensor([10, 80, 81, 90, 100, 101])
    penalty = soft_over_length_penalty(lengths, max_new_tokens=100, cache_length=20)
    assert_close(penalty, torch.tensor([0.0, 0.0, -0.05, -0.5, -1.0, -1.0]))


def test_soft_over_length_penalty_without_cache_only_punishes_beyond_the_budget():
    penalty = soft_over_length_penalty(torch.tensor([99, 100, 101]), max_new_tokens=100, cache_length=0)
    assert_close(penalty, torch.tensor([0.0, 0.0, -1.0]))
