"""Truncated importance weights and behaviour/old mismatch metrics."""

import math

import torch
from torch.testing import assert_close

from colossal_rl.algorithms import off_policy_metrics, truncated_importance_weights


def test_truncated_importance_weights_hand_computed_and_detached():
    old = torch.tensor([[-1.0, -1.0, -1.0]], requires_grad=True)
    behaviour = torch.tensor([[-1.0, -1.5, -3.0]])
    weights = truncated_importance_weights(old, behaviour, cap=2.0)
    assert_close(weights, torch.tensor([[1.0, math.exp(0.5), 2.0]]))
    assert not weights.requires_grad


def test_truncated_importance_weights_below_one_are_not_raised():
    # the cap bounds one side only: a token the behaviour policy liked more than pi_old keeps its small weight,
    # however far below 1 (and below 1 / cap) it is
    old = torch.tensor([[-1.0, -1.0, -1.0, -1.0]])
    behaviour = torch.tensor([[-0.5, 0.0, 2.0, -1.0 + 1e-3]])
    weights = truncated_importance_weights(old, behaviour, cap=2.0)
    assert_close(weights, torch.tensor([[math.exp(-0.5), math.exp(-1.0), math.exp(-3.0), math.exp(-1e-3)]]))


def test_truncated_importance_weights_do_not_overflow():
    weights = truncated_importance_weights(torch.tensor([0.0]), torch.tensor([-1e4]), cap=2.0)
    assert weights.item() == 2.0


def test_off_policy_metrics_hand_computed():
    old = torch.tensor([[-1.0, -1.0, -1.0, 0.0]])
    behaviour = torch.tensor([[-1.0, -2.0, -0.5, -50.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])  # the last token is padding
    metrics = off_policy_metrics(old, behaviour, mask, cap=2.0)
    log_ratios = torch.tensor([0.0, 1.0, -0.5])
    ratios = log_ratios.exp()
    assert_close(metrics["off_policy/logprob_abs_diff"], torch.tensor(0.5))
    assert_close(metrics["off_policy/ratio_mean"], ratios.mean())
    assert_close(metrics["off_policy/capped_fraction"], torch.tensor(1 / 3))
    # min(ratio, 2): e is capped at 2, exp(-0.5) stays
    assert_close(metrics["off_policy/tis_weight_mean"], (1 + 2 + math.exp(-0.5)) / torch.tensor(3.0))
    assert_close(metrics["off_policy/behaviour_kl"], (ratios - log_ratios - 1).mean())
    assert "off_policy/capped_fraction" not in off_policy_metrics(old, behaviour, mask, cap=None)
    assert "off_policy/tis_weight_mean" not in off_policy_metrics(old, behaviour, mask, cap=None)


def test_identical_policies_show_no_mismatch():
    logprobs = -torch.rand(3, 4)
    metrics = off_policy_metrics(logprobs, logprobs.clone(), torch.ones(3, 4), cap=2.0)
    assert metrics["off_policy/logprob_abs_diff"] == 0
    assert metrics["off_policy/ratio_mean"] == 1
    assert metrics["off_policy/capped_fraction"] == 0
    assert metrics["off_policy/behaviour_kl"] == 0
