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


def _result(task, accuracy, prompts, pass_at_k=None, records=()):
    from colossal_rl.rollout.eval_result import EvalResult

    return EvalResult(task=task, accuracy=accuracy, num_prompts=prompts, records=list(records), pass_at_k=pass_at_k)


def test_producers_shares_are_joined_weighted_by_their_prompts():
    from colossal_rl.rollout.eval_result import aggregate_eval

    shares = [
        [_result("math", 0.5, 30, 0.8, [{"index": 0}]), _result("gsm", 1.0, 1, 1.0)],
        [_result("math", 0.0, 10, 0.2, [{"index": 1}]), _result("gsm", 0.0, 3, 0.0)],
    ]
    accuracy, logged, records = aggregate_eval(shares, samples_per_prompt=4)
    assert accuracy == pytest.approx({"math": 15 / 40, "gsm": 1 / 4})
    assert logged == pytest.approx(
        {"eval/math_accuracy": 15 / 40, "eval/gsm_accuracy": 0.25, "eval/math_pass@4": 26 / 40, "eval/gsm_pass@4": 0.25}
    )
    assert records == {"math": [{"index": 0}, {"index": 1}], "gsm": []}
    _, one_sample, _ = aggregate_eval(shares, samples_per_prompt=1)
    assert set(one_sample) == {"eval/math_accuracy", "eval/gsm_accuracy"}  # no pass@k with one response


def test_environment_evals_log_the_share_of_responses_that_called_a_tool():
    from colossal_rl.rollout.eval_result import aggregate_eval

    calls = [{"index": 0, "tool_calls": 2}, {"index": 1, "tool_calls": 0}, {"index": 2, "tool_calls": 1}]
    shares = [[_result("arith", 2 / 3, 3, records=calls), _result("math", 1.0, 1, records=[{"index": 0}])]]
    _, logged, _ = aggregate_eval(shares, samples_per_prompt=1)
    assert logged == pytest.approx(
        {"eval/arith_accuracy": 2 / 3, "eval/math_accuracy": 1.0, "eval/arith_tool_call_rate": 2 / 3}
    )  # single-turn records (no tool_calls) log no rate
