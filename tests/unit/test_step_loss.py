"""``StepLoss`` and ``StepTotals``: a step's loss cut into micro-batches adds up to the whole step's, and the
metrics add up as the trainer reports them."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from colossal_rl.batch import RolloutBatch
from colossal_rl.config import AlgorithmConfig
from colossal_rl.training.objective import objective_for
from colossal_rl.training.step_loss import StepCounts, StepLoss, StepTotals

GROUP_SIZE = 2


def _chunk(samples: int = 6, length: int = 5, seed: int = 0) -> tuple[RolloutBatch, torch.Tensor, torch.Tensor]:
    """A chunk with uneven response lengths, pi_old set, and (new log-probs, entropy) for it [N, R]."""
    generator = torch.Generator().manual_seed(seed)
    old = -torch.rand(samples, length, generator=generator, dtype=torch.float64)
    new = old + 0.3 * torch.randn(samples, length, generator=generator, dtype=torch.float64)
    response_mask = torch.ones(samples, length, dtype=torch.long)
    response_mask[1::2, 3:] = 0
    loss_mask = torch.ones(samples)
    loss_mask[-1] = 0
    chunk = RolloutBatch(
        prompt_ids=torch.zeros(samples, 1, dtype=torch.long),
        prompt_mask=torch.ones(samples, 1, dtype=torch.long),
        response_ids=torch.zeros(samples, length, dtype=torch.long),
        response_mask=response_mask,
        behaviour_logprobs=old.clone(),
        rewards=torch.zeros(samples),
        answer_correct=torch.zeros(samples),
        loss_mask=loss_mask,
        truncated=torch.zeros(samples, dtype=torch.bool),
        advantages=torch.randn(samples, generator=generator, dtype=torch.float64),
        old_logprobs=old,
        group_size=GROUP_SIZE,
        policy_version=0,
    )
    entropy = torch.rand(samples, length, generator=generator, dtype=torch.float64)
    return chunk, new, entropy


def _step_loss(algorithm: AlgorithmConfig, chunk: RolloutBatch) -> StepLoss:
    return StepLoss(
        objective=objective_for(algorithm),
        algorithm=algorithm,
        max_response_length=chunk.response_ids.shape[1],
        counts=StepCounts(
            trained_tokens=float(chunk.trained_token_mask().sum()), loss_samples=float(chunk.loss_mask.sum())
        ),
        step_samples=chunk.num_samples,
    )


@pytest.mark.parametrize("aggregation", ["token_level", "sample_level", "seq_mean_token_sum"])
def test_micro_batch_losses_and_metrics_add_up_to_the_whole_steps(aggregation):
    algorithm = AlgorithmConfig(loss_aggregation=aggregation, clip_eps_low=0.1, clip_eps_high=0.1)
    chunk, new, entropy = _chunk()
    step_loss = _step_loss(algorithm, chunk)
    whole_totals, split_totals = StepTotals(), StepTotals()
    whole = step_loss(new, entropy, chunk, 0, chunk.num_samples, None, whole_totals)
    split = sum(
        step_loss(new[start:stop], entropy[start:stop], chunk, start, stop, None, split_totals)
        for start, stop in [(0, 2), (2, 4), (4, 6)]
    )
    torch.testing.assert_close(split, whole)
    assert whole_totals.values["train/loss"] == pytest.approx(float(whole))
    assert split_totals.values["train/loss"] == pytest.approx(float(whole))
    mask = chunk.trained_token_mask()
    mean_entropy = float((entropy * mask).sum() / mask.sum())
    assert split_totals.values["train/entropy"] == pytest.approx(mean_entropy)
    # Means weighted by each micro-batch's share of the step's samples; maxima by maximum.
    ratio = (new - chunk.old_logprobs).exp()
    assert split_totals.values["train/ratio_max"] == pytest.approx(float(ratio[mask.bool()].max()))
    assert 0 < split_totals.values["train/clip_fraction"] < 1


def test_pi_old_is_the_step_forward_when_the_samples_carry_none():
    chunk, new, entropy = _chunk()
    chunk = dataclasses.replace(chunk, old_logprobs=None)
    totals = StepTotals()
    _step_loss(AlgorithmConfig(), chunk)(new, entropy, chunk, 0, chunk.num_samples, None, totals)
    assert totals.values["train/ratio_mean"] == pytest.approx(1.0)
    assert totals.values["train/clip_fraction"] == 0.0


def test_a_reference_log_prob_slice_follows_the_micro_batch():
    """The chunk's reference log-probs are cut to the micro-batch's rows: with ref = new only on rows 2..3, the
    KL term of that micro-batch is zero and of another it is not."""
    algorithm = AlgorithmConfig(kl_coeff=0.5)
    chunk, new, entropy = _chunk()
    ref = new - 1.0
    ref[2:4] = new[2:4]
    step_loss = _step_loss(algorithm, chunk)
    on_rows, off_rows = StepTotals(), StepTotals()
    step_loss(new[2:4], entropy[2:4], chunk, 2, 4, ref, on_rows)
    step_loss(new[0:2], entropy[0:2], chunk, 0, 2, ref, off_rows)
    assert on_rows.values["train/kl"] == pytest.approx(0.0)
    assert off_rows.values["train/kl"] > 0.1


def test_totals_add_weighted_means_keep_maxima_and_count_tokens():
    totals = StepTotals()
    totals.add_metrics({"train/ratio_mean": torch.tensor(2.0), "train/ratio_max": torch.tensor(3.0)}, weight=0.25)
    totals.add_metrics({"train/ratio_mean": torch.tensor(4.0), "train/ratio_max": torch.tensor(1.5)}, weight=0.75)
    totals.add_tokens(real=10, computed=16)
    totals.add_tokens(real=5, computed=8)
    assert totals.values == {
        "train/ratio_mean": 2.0 * 0.25 + 4.0 * 0.75,
        "train/ratio_max": 3.0,
        "train/real_tokens": 15,
        "train/computed_tokens": 24,
    }
