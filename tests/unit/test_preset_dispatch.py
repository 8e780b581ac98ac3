"""Every preset computes what it configures: its loss and aggregation in the objective, its advantage estimator
on the producer (and, for a batch-level estimator, the trainer's finish over the optimizer step).

The loss is compared with an independent re-implementation of each formula from its paper (written here,
not taken from the registries), on a batch where the new policy differs from pi_old, so that the token
ratio, the sequence ratio and every aggregation give different numbers — a preset silently computed with
another preset's loss or aggregation fails. The batch is checked to tell the formulas apart.
"""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from colossal_rl.algorithms import ADVANTAGE_ESTIMATORS, group_part
from colossal_rl.batch import RolloutBatch
from colossal_rl.config import AlgorithmConfig
from colossal_rl.presets import PRESETS, algorithm_preset
from colossal_rl.rollout.postprocess import postprocess_rollout
from colossal_rl.training.objective import policy_objective
from colossal_rl.training.step_advantages import step_advantages

BATCH, LENGTH = 8, 6
MAX_NEW_TOKENS = 512  # DAPO's over-length shaping starts at 512 - 128 tokens: these responses get none


# --------------------------------------------------------------------------- independent references
def token_clip_loss(new, old, advantages, mask, low, high):
    """PPO/GRPO/DAPO: -A * r_t, pessimistically clipped per token; [B, T]."""
    ratio = (new - old).exp()
    a = advantages[:, None]
    return torch.maximum(-a * ratio, -a * ratio.clamp(1 - low, 1 + high))


def sequence_clip_loss(new, old, advantages, mask, low, high):
    """GSPO: s_i = exp(mean_t(new - old)) over the response, clipped per sequence; the same value on every token."""
    s = (((new - old) * mask).sum(-1) / mask.sum(-1)).exp()
    loss = torch.maximum(-advantages * s, -advantages * s.clamp(1 - low, 1 + high))
    return loss[:, None].expand_as(new)


def token_mean(per_token, mask, max_length):
    """DAPO: every token of the batch weighs the same."""
    return (per_token * mask).sum() / mask.sum()


def sample_mean(per_token, mask, max_length):
    """GRPO: the mean over samples of each sample's token mean."""
    return ((per_token * mask).sum(-1) / mask.sum(-1)).mean()


def constant_length_mean(per_token, mask, max_length):
    """Dr. GRPO: token sums over a constant length, averaged over samples."""
    return ((per_token * mask).sum(-1) / max_length).mean()


REFERENCE_LOSSES = {"clipped": token_clip_loss, "gspo": sequence_clip_loss}
REFERENCE_AGGREGATIONS = {
    "token_level": token_mean,
    "sample_level": sample_mean,
    "seq_mean_token_sum": constant_length_mean,
}


def problem() -> dict[str, torch.Tensor]:
    """pi_old != pi_new (ratios within ~e^{+-0.4}), unequal response lengths, one sample exactly on-policy."""
    generator = torch.Generator().manual_seed(20)  # a seed whose formulas differ by >= 0.018
    old = -torch.rand(BATCH, LENGTH, generator=generator, dtype=torch.float64) * 3
    new = old + torch.randn(BATCH, LENGTH, generator=generator, dtype=torch.float64) * 0.2
    new[0] = old[0]  # GSPO's sequence ratio 1 here: this sample is not clipped
    lengths = torch.tensor([6, 1, 3, 6, 2, 5, 4, 6])
    return {
        "new": new,
        "old": old,
        "advantages": torch.randn(BATCH, generator=generator, dtype=torch.float64),
        "mask": (torch.arange(LENGTH)[None, :] < lengths[:, None]).double(),
    }


def reference_loss(algo: AlgorithmConfig, loss_name: str, aggregation: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, d loss / d new log-probs) of the formula ``loss_name`` aggregated by ``aggregation``."""
    p = problem()
    new = p["new"].clone().requires_grad_()
    per_token = REFERENCE_LOSSES[loss_name](
        new, p["old"], p["advantages"], p["mask"], algo.clip_eps_low, algo.clip_eps_high
    )
    loss = REFERENCE_AGGREGATIONS[aggregation](per_token, p["mask"], LENGTH)
    loss.backward()
    return loss.detach(), new.grad


def objective_loss(algo: AlgorithmConfig) -> tuple[torch.Tensor, torch.Tensor]:
    p = problem()
    new = p["new"].clone().requires_grad_()
    loss, _ = policy_objective(
        new_logprobs=new,
        old_logprobs=p["old"],
        behaviour_logprobs=p["old"],  # on-policy sampling: importance weight 1 under any cap
        ref_logprobs=None,
        advantages=p["advantages"],
        response_mask=p["mask"],
        loss_mask=torch.ones(BATCH, dtype=torch.float64),
        algo=algo,
        global_token_count=float(p["mask"].sum()),
        global_sample_count=float(BATCH),
        max_response_length=LENGTH,
    )
    loss.backward()
    return loss.detach(), new.grad


def preset(name: str) -> AlgorithmConfig:
    return algorithm_preset(name, kl_coeff=0.0, max_new_tokens=MAX_NEW_TOKENS, n_behind=1)


@pytest.mark.parametrize("name", PRESETS.names())
def test_preset_loss_is_its_configured_formula(name):
    algo = preset(name)
    assert algo.kl_coeff == 0 and algo.dual_clip is None  # the references have neither
    loss, grad = objective_loss(algo)
    expected_loss, expected_grad = reference_loss(algo, algo.policy_loss, algo.loss_aggregation)
    assert_close(loss, expected_loss)
    assert_close(grad, expected_grad)
    # The batch tells every other (loss, aggregation) pair apart from the configured one.
    for loss_name in REFERENCE_LOSSES:
        for aggregation in REFERENCE_AGGREGATIONS:
            if (loss_name, aggregation) != (algo.policy_loss, algo.loss_aggregation):
                other, _ = reference_loss(algo, loss_name, aggregation)
                assert abs(float(other - expected_loss)) > 1e-3, (loss_name, aggregation)


def test_gspo_and_grpo_differ_on_the_same_off_policy_batch():
    gspo, gspo_grad = objective_loss(preset("GSPO"))
    grpo, grpo_grad = objective_loss(preset("GRPO"))
    assert abs(float(gspo - grpo)) > 1e-3
    assert not torch.allclose(gspo_grad, grpo_grad)
    # GSPO weighs every token of a sample alike (s / |y_i|, or 0 when the sequence is clipped); GRPO does not.
    mask = problem()["mask"].bool()
    for row, row_mask in zip(gspo_grad, mask, strict=True):
        assert_close(row[row_mask], row[row_mask][:1].expand(int(row_mask.sum())))
    assert any(len(set(row[row_mask].tolist())) > 1 for row, row_mask in zip(grpo_grad, mask, strict=True))


# --------------------------------------------------------------------------- advantages on the producer
GROUP_SIZE = 4


def rollout() -> RolloutBatch:
    """Three groups, each with right and wrong answers (none filtered by DAPO), short unequal responses."""
    n = 3 * GROUP_SIZE
    correct = torch.tensor([1, 0, 0, 0, 1, 1, 0, 1, 0, 1, 1, 1], dtype=torch.float32)
    lengths = torch.tensor([3, 5, 2, 4, 1, 5, 5, 2, 4, 3, 1, 5])
    response_mask = (torch.arange(5)[None, :] < lengths[:, None]).long()
    return RolloutBatch(
        prompt_ids=torch.ones(n, 2, dtype=torch.long),
        prompt_mask=torch.ones(n, 2, dtype=torch.long),
        response_ids=response_mask.clone(),
        response_mask=response_mask,
        behaviour_logprobs=torch.zeros(n, 5),
        rewards=correct.clone(),
        answer_correct=correct,
        loss_mask=torch.ones(n),
        truncated=torch.zeros(n, dtype=torch.bool),
        group_size=GROUP_SIZE,
        policy_version=0,
    )


def estimate(name: str, batch: RolloutBatch, eps: float, estimator=None) -> torch.Tensor:
    return (estimator or ADVANTAGE_ESTIMATORS.get(name))(
        batch.rewards, batch.group_size, eps, valid_mask=batch.loss_mask, response_lengths=batch.response_mask.sum(-1)
    )


@pytest.mark.parametrize("name", PRESETS.names())
def test_preset_advantages_are_its_configured_estimator(name):
    algo, batch = preset(name), rollout()
    processed, metrics = postprocess_rollout(batch, algo, MAX_NEW_TOKENS)
    assert processed is not None and metrics["rollout/groups_filtered"] == 0
    name = algo.advantage_estimator
    assert_close(processed.advantages, estimate(name, batch, algo.advantage_eps, group_part(name)))  # producer's
    processed = step_advantages(processed, algo, lambda moments: moments)  # one rank trains the whole step
    assert_close(processed.advantages, estimate(name, batch, algo.advantage_eps))
    for other in {preset(other).advantage_estimator for other in PRESETS.names()} - {name}:
        assert not torch.allclose(estimate(other, batch, algo.advantage_eps), processed.advantages, atol=1e-3), other
