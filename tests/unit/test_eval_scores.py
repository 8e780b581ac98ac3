"""Eval scores with several responses per prompt: mean@k and pass@k."""

from __future__ import annotations

import pytest

from colossal_rl.rollout.eval_result import mean_and_pass_at_k


def test_mean_at_k_averages_responses_and_pass_at_k_counts_prompts_with_one_correct():
    correct = [[True, False, False, False], [False, False, False, False], [True, True, True, True]]
    mean_at_k, pass_at_k = mean_and_pass_at_k(correct)
    assert mean_at_k == pytest.approx((0.25 + 0.0 + 1.0) / 3)
    assert pass_at_k == pytest.approx(2 / 3)


def test_one_response_per_prompt_makes_both_the_plain_accuracy():
    assert mean_and_pass_at_k([[True], [False], [True], [True]]) == (0.75, 0.75)


def test_no_prompts_score_zero():
    assert mean_and_pass_at_k([]) == (0.0, 0.0)
