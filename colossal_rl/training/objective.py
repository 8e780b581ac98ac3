"""The training objective: ``AlgorithmConfig`` -> registered loss functions -> one scalar loss.

This is the only place on the training side that reads ``AlgorithmConfig`` to choose loss math (the advantage
estimator's batch stage is ``step_advantages.py``'s); it looks functions up by name in ``colossal_rl.algorithms``
and never branches on the algorithm's name. It holds
no state and does no communication: the global token and sample counts come from the caller.

``OBJECTIVES`` names the objectives (``algorithm.objective``): ``policy_gradient`` (:func:`policy_objective`:
the clipped-ratio family, GRPO and relatives) and ``dpo`` (:func:`dpo_objective`: online DPO). Each entry
says what the trainer must provide: whole prompt groups in every micro-batch, a reference model, pi_old.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from colossal_rl.algorithms import (
    KL_ESTIMATORS,
    LOSS_AGGREGATIONS,
    POLICY_LOSSES,
    PolicyLossOutput,
    dpo_loss,
    group_pair_margins,
    masked_mean,
    off_policy_metrics,
    sequence_log_ratios,
    skip_threshold_mask,
    truncated_importance_weights,
)
from colossal_rl.algorithms.registry import Registry
from colossal_rl.config import AlgorithmConfig


@dataclass(frozen=True)
class Objective:
    """A training objective and what it needs from the trainer.

    ``loss`` takes keyword arguments only: new/old/behaviour/ref log-probs [B, T], advantages [B],
    response_mask [B, T], loss_mask [B], algo, global_token_count, global_sample_count, max_response_length,
    group_size; and returns (scalar loss, detached metrics).
    """

    loss: Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]
    whole_groups: bool
    """Its loss compares the samples of a prompt group: micro-batches must never split a group."""
    needs_reference: bool
    """It needs the reference model's log-probs whatever ``kl_coeff`` is."""
    uses_old_logprobs: bool
    """It reads pi_old (a ratio): otherwise the trainer skips pi_old's extra forward."""


OBJECTIVES: Registry[Objective] = Registry("training objective")


def objective_for(algo: AlgorithmConfig) -> Objective:
    """The registered objective ``algo.objective``; ``ValueError`` listing the known ones otherwise."""
    return OBJECTIVES.get(algo.objective)


def policy_objective(
    *,
    new_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor | None,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_mask: torch.Tensor,
    algo: AlgorithmConfig,
    global_token_count: float,
    global_sample_count: float,
    max_response_length: int,
    group_size: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """loss = aggregate(w_t * l_t + kl_coeff * kl_t) over the micro-batch, with global denominators.

    ``l_t`` is ``algo.policy_loss`` (ratio new/old, clipped), ``w_t`` the truncated importance weight
    min(exp(old - behaviour), ``algo.truncated_is_cap``) (1 when the cap is None), ``kl_t`` the
    ``algo.kl_estimator`` of KL(new || ref). Tokens count where ``response_mask * loss_mask`` is 1 and the
    sample is not skipped by ``algo.skip_threshold`` (skipped samples stay in the denominators: they
    contribute zero, so every piece of the batch can be scaled before the skip is known).

    Shapes: new/old/behaviour/ref_logprobs [B, T] (old, behaviour and ref carry no gradient),
    advantages [B], response_mask [B, T], loss_mask [B].

    Scaling: ``global_token_count`` = sum of ``response_mask * loss_mask`` and ``global_sample_count`` =
    sum of ``loss_mask`` over *every* micro-batch on *every* data-parallel rank of this optimizer step;
    ``max_response_length`` = max_new_tokens (for ``seq_mean_token_sum``). Then the SUM of the returned
    losses over micro-batches and ranks is the full-batch loss. DDP and ZeRO AVERAGE gradients over the
    dp ranks, so the caller must backpropagate ``loss * dp_size`` for the gradient of that sum.

    Returns the scalar loss and detached metrics that are means over this micro-batch's loss tokens:
    ``train/clip_fraction`` (any clip active) and its parts ``train/clip_fraction_low`` /
    ``train/clip_fraction_high`` / ``train/dual_clip_fraction``, ``train/ratio_mean``, ``train/ppo_kl``
    (mean of old - new log-probs, verl's ``ppo_kl``), ``train/skipped_fraction`` (of samples, when
    ``skip_threshold`` is set), ``train/kl`` (when ``kl_coeff > 0``) and ``off_policy/*``; and
    ``train/ratio_max``, a maximum (names ending in ``_max`` are maxima, not means).
    """
    policy_loss = POLICY_LOSSES.get(algo.policy_loss)
    aggregate = LOSS_AGGREGATIONS.get(algo.loss_aggregation)
    mask = response_mask.bool() & loss_mask.bool().unsqueeze(-1)  # [B, T]
    metrics: dict[str, torch.Tensor] = {}

    if algo.skip_threshold is not None:
        keep = skip_threshold_mask(new_logprobs, old_logprobs, mask, algo.skip_threshold)  # [B]
        metrics["train/skipped_fraction"] = masked_mean((~keep).float(), loss_mask)
        mask = mask & keep.unsqueeze(-1)

    output = policy_loss(
        new_logprobs,
        old_logprobs,
        advantages,
        mask,
        clip_eps_low=algo.clip_eps_low,
        clip_eps_high=algo.clip_eps_high,
        dual_clip=algo.dual_clip,
    )
    per_token_loss = output.loss  # [B, T]
    if algo.truncated_is_cap is not None:
        per_token_loss = per_token_loss * truncated_importance_weights(
            old_logprobs, behaviour_logprobs, algo.truncated_is_cap
        )
    if algo.kl_coeff > 0:
        if ref_logprobs is None:
            raise ValueError(f"kl_coeff = {algo.kl_coeff} needs ref_logprobs from a reference model")
        kl = KL_ESTIMATORS.get(algo.kl_estimator)(new_logprobs, ref_logprobs)  # [B, T]
        per_token_loss = per_token_loss + algo.kl_coeff * kl
        metrics["train/kl"] = masked_mean(kl.detach(), mask)

    loss = aggregate(
        per_token_loss,
        mask,
        global_token_count=global_token_count,
        global_sample_count=global_sample_count,
        max_response_length=max_response_length,
    )
    metrics.update(_ratio_metrics(output, new_logprobs, old_logprobs, mask))
    metrics.update(off_policy_metrics(old_logprobs, behaviour_logprobs, mask, algo.truncated_is_cap))
    return loss, metrics


def dpo_objective(
    *,
    new_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor | None = None,
    behaviour_logprobs: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_mask: torch.Tensor,
    algo: AlgorithmConfig,
    global_token_count: float,
    global_sample_count: float,
    max_response_length: int,
    group_size: int,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Online DPO: sum over this micro-batch's pairs of -log sigmoid(beta (chosen - rejected log-ratio)),
    divided by the step's global pair count.

    ``advantages`` carry the pair (+1 chosen, -1 rejected, 0 neither: the ``dpo_pairs`` estimator) and the
    micro-batch holds whole groups of ``group_size``. With ``algorithm.mask_zero_advantage`` the loss samples
    are exactly the paired ones, so ``global_sample_count / 2`` is the step's pair count over every
    micro-batch and data-parallel rank, and the SUM of the returned losses is the mean DPO loss over pairs.
    A log-ratio is log pi(y|x) - log pi_ref(y|x) summed over the response (fp32). Old and behaviour log-probs
    are not used (DPO has no ratio to pi_old).

    Metrics, means over this micro-batch's pairs: ``train/dpo_accuracy`` (chosen's log-ratio above the
    rejected's), ``train/dpo_margin`` (chosen minus rejected log-ratio), ``train/dpo_chosen_log_ratio``,
    ``train/dpo_rejected_log_ratio``.
    """
    if ref_logprobs is None:
        raise ValueError("the dpo objective needs ref_logprobs from a reference model")
    signs = torch.where(loss_mask.bool(), advantages, 0.0)
    log_ratios = sequence_log_ratios(new_logprobs, ref_logprobs, response_mask)  # [B]
    chosen, rejected, has_pair = group_pair_margins(log_ratios, signs, group_size)  # [B / G]
    per_pair = dpo_loss(chosen, rejected, algo.dpo_beta)
    pairs = max(global_sample_count / 2.0, 1.0)
    loss = torch.where(has_pair, per_pair, 0.0).sum() / pairs
    margin = (chosen - rejected).detach()
    metrics = {
        "train/dpo_accuracy": masked_mean((margin > 0).float(), has_pair),
        "train/dpo_margin": masked_mean(margin, has_pair),
        "train/dpo_chosen_log_ratio": masked_mean(chosen.detach(), has_pair),
        "train/dpo_rejected_log_ratio": masked_mean(rejected.detach(), has_pair),
    }
    return loss, metrics


OBJECTIVES.register("policy_gradient")(
    Objective(policy_objective, whole_groups=False, needs_reference=False, uses_old_logprobs=True)
)
OBJECTIVES.register("dpo")(Objective(dpo_objective, whole_groups=True, needs_reference=True, uses_old_logprobs=False))


def _ratio_metrics(
    output: PolicyLossOutput, new_logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Clip fractions, ratio mean and maximum, and verl's ``ppo_kl`` over the loss tokens ``mask`` [B, T]."""
    return {
        "train/clip_fraction": masked_mean(output.clipped.float(), mask),
        "train/clip_fraction_low": masked_mean(output.clipped_low.float(), mask),
        "train/clip_fraction_high": masked_mean(output.clipped_high.float(), mask),
        "train/dual_clip_fraction": masked_mean(output.dual_clipped.float(), mask),
        "train/ratio_mean": masked_mean(output.ratio, mask),
        "train/ratio_max": torch.where(mask, output.ratio, 0.0).max() if mask.any() else output.ratio.new_zeros(()),
        # log pi_old - log pi_new averaged over tokens: the k1 estimate of KL(old || new).
        "train/ppo_kl": masked_mean((old_logprobs - new_logprobs).detach(), mask),
    }
