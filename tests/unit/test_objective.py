"""policy_objective: config -> registered functions -> scalar loss with global denominators."""

import math

import pytest
import torch
from torch.testing import assert_close

from colossal_rl.config import AlgorithmConfig, replace
from colossal_rl.presets import algorithm_preset
from colossal_rl.training.objective import policy_objective

BATCH, LENGTH = 8, 6


def _problem(seed=0):
    generator = torch.Generator().manual_seed(seed)
    old = -torch.rand(BATCH, LENGTH, generator=generator) * 3
    lengths = torch.randint(1, LENGTH + 1, (BATCH,), generator=generator)
    return {
        "new_logprobs": old + torch.randn(BATCH, LENGTH, generator=generator) * 0.3,
        "old_logprobs": old,
        "behaviour_logprobs": old + torch.randn(BATCH, LENGTH, generator=generator) * 0.5,
        "ref_logprobs": old + torch.randn(BATCH, LENGTH, generator=generator) * 0.2,
        "advantages": torch.randn(BATCH, generator=generator),
        "response_mask": (torch.arange(LENGTH)[None, :] < lengths[:, None]).float(),
        "loss_mask": torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0]),
    }


def _counts(problem):
    return {
        "global_token_count": float((problem["response_mask"] * problem["loss_mask"][:, None]).sum()),
        "global_sample_count": float(problem["loss_mask"].sum()),
        "max_response_length": LENGTH,
    }


def _objective(problem, algo, rows=slice(None), counts=None):
    """Loss and gradient w.r.t. new_logprobs of the given rows (a micro-batch on some rank)."""
    new = problem["new_logprobs"][rows].clone().requires_grad_()
    pieces = {name: None if value is None else value[rows] for name, value in problem.items() if name != "new_logprobs"}
    loss, metrics = policy_objective(new_logprobs=new, **pieces, algo=algo, **(counts or _counts(problem)))
    loss.backward()
    return loss.detach(), new.grad, metrics


def test_hand_computed_token_level_loss_and_metrics():
    algo = AlgorithmConfig(loss_aggregation="token_level", clip_eps_low=0.2, clip_eps_high=0.2)
    old = torch.zeros(2, 2)
    new = torch.tensor([[math.log(1.5), 0.0], [math.log(3.0), 0.0]], requires_grad=True)
    loss, metrics = policy_objective(
        new_logprobs=new,
        old_logprobs=old,
        behaviour_logprobs=old,
        ref_logprobs=None,
        advantages=torch.tensor([1.0, -1.0]),
        response_mask=torch.ones(2, 2),
        loss_mask=torch.ones(2),
        algo=algo,
        global_token_count=4.0,
        global_sample_count=2.0,
        max_response_length=2,
    )
    # per token: A=+1 -> [-1.2 (clipped), -1];  A=-1 -> [3, 1]
    assert_close(loss, torch.tensor((-1.2 - 1.0 + 3.0 + 1.0) / 4))
    assert_close(metrics["train/clip_fraction"], torch.tensor(0.25))
    assert_close(metrics["train/ratio_mean"], torch.tensor((1.5 + 1 + 3 + 1) / 4))
    assert metrics["off_policy/ratio_mean"] == 1


def test_grpo_equals_dapo_when_clip_bounds_are_equal():
    problem = _problem(seed=1)
    grpo = algorithm_preset("GRPO", kl_coeff=0.0, max_new_tokens=LENGTH, n_behind=1)
    dapo = algorithm_preset("DAPO", kl_coeff=0.0, max_new_tokens=LENGTH, n_behind=1)
    dapo_like_grpo = replace(dapo, clip_eps_high=dapo.clip_eps_low, loss_aggregation=grpo.loss_aggregation)
    grpo_with_skip = replace(grpo, skip_threshold=dapo.skip_threshold)
    grpo_loss, grpo_grad, _ = _objective(problem, grpo_with_skip)
    dapo_loss, dapo_grad, _ = _objective(problem, dapo_like_grpo)
    assert_close(dapo_loss, grpo_loss)
    assert_close(dapo_grad, grpo_grad)
    asymmetric_loss, _, _ = _objective(problem, replace(dapo, loss_aggregation=grpo.loss_aggregation))
    assert not torch.equal(asymmetric_loss, grpo_loss)


def test_ratio_one_gives_minus_mean_advantage():
    problem = _problem(seed=2)
    problem["new_logprobs"] = problem["old_logprobs"].clone()
    problem["behaviour_logprobs"] = problem["old_logprobs"].clone()
    loss, _, _ = _objective(problem, AlgorithmConfig(loss_aggregation="sample_level", truncated_is_cap=2.0))
    kept = problem["loss_mask"].bool()
    assert_close(loss, -problem["advantages"][kept].mean())


FULL_ALGO = AlgorithmConfig(
    clip_eps_low=0.1,
    clip_eps_high=0.2,
    dual_clip=3.0,
    skip_threshold=1.3,
    kl_coeff=0.1,
    kl_estimator="k3",
    truncated_is_cap=1.5,
)


@pytest.mark.parametrize("policy_loss", ["clipped", "gspo"])
@pytest.mark.parametrize("aggregation", ["token_level", "sample_level", "seq_mean_token_sum"])
@pytest.mark.parametrize("pieces", [[3, 5], [2, 2, 1, 3], [1] * 8])
def test_micro_batches_and_ranks_sum_to_the_full_batch_loss_and_gradient(policy_loss, aggregation, pieces):
    problem = _problem(seed=3)
    algo = replace(FULL_ALGO, policy_loss=policy_loss, loss_aggregation=aggregation)
    full_loss, full_grad, full_metrics = _objective(problem, algo)
    assert 0 < full_metrics["train/skipped_fraction"] < 1  # the skip is exercised
    total, grads, start = torch.tensor(0.0), [], 0
    for size in pieces:
        loss, grad, _ = _objective(problem, algo, slice(start, start + size), counts=_counts(problem))
        total, start = total + loss, start + size
        grads.append(grad)
    assert_close(total, full_loss)
    assert_close(torch.cat(grads), full_grad)


def test_masked_tokens_skipped_and_loss_masked_samples_get_zero_gradient():
    problem = _problem(seed=4)
    padding = problem["response_mask"] == 0
    problem["new_logprobs"] = torch.where(padding, 40.0, problem["new_logprobs"])  # garbage on padding
    _, grad, metrics = _objective(problem, FULL_ALGO)
    assert torch.isfinite(grad).all()
    assert torch.all(grad[padding] == 0)
    assert torch.all(grad[problem["loss_mask"] == 0] == 0)
    ratio = (problem["new_logprobs"] - problem["old_logprobs"]).exp()
    mask = problem["response_mask"] * problem["loss_mask"][:, None]
    keep = (ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1) <= FULL_ALGO.skip_threshold
    assert (~keep).any() and torch.all(grad[~keep] == 0)
    assert_close(metrics["train/skipped_fraction"], (~keep)[problem["loss_mask"].bool()].float().mean())


def test_truncated_importance_weights_scale_the_policy_loss():
    problem = _problem(seed=5)
    base = AlgorithmConfig(loss_aggregation="token_level")
    plain_loss, _, _ = _objective(problem, base)
    problem["behaviour_logprobs"] = problem["old_logprobs"] - 0.25  # every weight exp(0.25)
    weighted_loss, _, metrics = _objective(problem, replace(base, truncated_is_cap=2.0))
    assert_close(weighted_loss, plain_loss * math.exp(0.25))
    assert metrics["off_policy/capped_fraction"] == 0
    problem["behaviour_logprobs"] = problem["old_logprobs"] - 1.0  # exp(1) is capped at 2
    capped_loss, _, metrics = _objective(problem, replace(base, truncated_is_cap=2.0))
    assert_close(capped_loss, plain_loss * 2.0)
    assert metrics["off_policy/capped_fraction"] == 1
    problem["behaviour_logprobs"] = problem["old_logprobs"] + 1.0  # exp(-1) < 1 / 2: below the cap, kept
    small_loss, _, metrics = _objective(problem, replace(base, truncated_is_cap=2.0))
    assert_close(small_loss, plain_loss * math.exp(-1.0))
    assert metrics["off_policy/capped_fraction"] == 0


def test_kl_term_is_added_with_its_coefficient():
    problem = _problem(seed=6)
    base = AlgorithmConfig(loss_aggregation="sample_level")
    plain_loss, _, _ = _objective(problem, base)
    with_kl, _, metrics = _objective(problem, replace(base, kl_coeff=0.5, kl_estimator="k1"))
    mask = problem["response_mask"] * problem["loss_mask"][:, None]
    kl = problem["new_logprobs"] - problem["ref_logprobs"]
    per_sample_kl = (kl * mask).sum(-1) / mask.sum(-1)
    assert_close(with_kl, plain_loss + 0.5 * per_sample_kl[problem["loss_mask"].bool()].mean())
    assert_close(metrics["train/kl"], (kl * mask).sum() / mask.sum())


def test_kl_without_reference_logprobs_is_refused():
    problem = _problem()
    problem["ref_logprobs"] = None
    with pytest.raises(ValueError, match="needs ref_logprobs"):
        _objective(problem, AlgorithmConfig(kl_coeff=0.1))


def test_unknown_names_are_refused_with_the_known_ones():
    with pytest.raises(ValueError, match="unknown policy loss 'ppo2'; known: clipped, gspo"):
        _objective(_problem(), AlgorithmConfig(policy_loss="ppo2"))
