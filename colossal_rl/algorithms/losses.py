"""Policy-gradient losses per token, and the aggregations that turn them into one number.

Sign convention: every loss is to be *minimised*; the per-token policy loss is ``-A * ratio`` (clipped),
so at ratio 1 a ``sample_level`` loss equals ``-mean(advantages)``.

Policy losses share one signature::

    fn(new_logprobs [B, T], old_logprobs [B, T], advantages [B], response_mask [B, T], *,
       clip_eps_low, clip_eps_high, dual_clip) -> PolicyLossOutput

Aggregations share one signature::

    fn(per_token_loss [B, T], mask [B, T], *, global_token_count, global_sample_count, max_response_length)

The denominators are *global* (all micro-batches and data-parallel ranks of one optimizer step), computed
by the training layer and passed in, so summing the aggregated losses of the pieces gives the full-batch
loss at any scale. Pure torch; no config objects, no distributed code.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from colossal_rl.algorithms.registry import Registry

POLICY_LOSSES = Registry("policy loss")
LOSS_AGGREGATIONS = Registry("loss aggregation")

MAX_LOG_RATIO = 20.0
"""Log-ratios are clamped to +-20 before ``exp`` so padding garbage or a wild policy cannot overflow to inf."""


class PolicyLossOutput(NamedTuple):
    loss: torch.Tensor
    """[B, T] per-token loss to minimise; positions outside the mask are not zeroed (aggregation masks)."""
    ratio: torch.Tensor
    """[B, T] the importance ratio the loss used, detached (per token, or the sequence ratio broadcast)."""
    clipped: torch.Tensor
    """[B, T] bool, true where a clip (or the dual clip) is active, i.e. the token gives no gradient."""
    clipped_low: torch.Tensor
    """[B, T] bool: the lower clip is active (ratio < 1 - eps_low with a negative advantage)."""
    clipped_high: torch.Tensor
    """[B, T] bool: the upper clip is active (ratio > 1 + eps_high with a positive advantage)."""
    dual_clipped: torch.Tensor
    """[B, T] bool: the dual clip is active (ratio > dual_clip with a negative advantage)."""


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """sum(values * mask) / max(sum(mask), 1) over all elements; values and mask of one shape -> scalar."""
    mask = mask.bool()
    return torch.where(mask, values, 0.0).sum() / mask.sum().clamp(min=1)


def _clip_objective(
    ratio: torch.Tensor, advantages: torch.Tensor, clip_eps_low: float, clip_eps_high: float, dual_clip: float | None
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """max(-A r, -A clip(r, 1 - low, 1 + high)), then min(., -c A) where A < 0 (dual clip); [B, T], [B] -> [B, T].

    Also returns where each clip is active ([B, T] bool masks ``clipped``, ``clipped_low``, ``clipped_high``,
    ``dual_clipped``): an active clip means the token's loss is constant in the ratio (zero gradient).
    """
    advantages = advantages.unsqueeze(-1)  # [B, 1]
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - clip_eps_low, 1 + clip_eps_high)
    loss = torch.maximum(unclipped, clipped)
    is_clipped = clipped > unclipped
    above = ratio > 1 + clip_eps_high
    masks = {"clipped_low": is_clipped & ~above, "clipped_high": is_clipped & above}
    dual_clipped = torch.zeros_like(is_clipped)
    if dual_clip is not None:
        # Dual clip bounds the loss of a negative-advantage token at c * |A| however large the ratio grows.
        bound = -advantages * dual_clip
        dual_clipped = (advantages < 0) & (loss > bound)
        loss = torch.where(dual_clipped, bound, loss)
    masks["dual_clipped"] = dual_clipped
    masks["clipped"] = is_clipped | dual_clipped
    return loss, masks


@POLICY_LOSSES.register("clipped")
def clipped_policy_loss(
    new_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_eps_low: float,
    clip_eps_high: float,
    dual_clip: float | None = None,
) -> PolicyLossOutput:
    """l_t = max(-A r_t, -A clip(r_t, 1 - eps_low, 1 + eps_high)), r_t = exp(logp_new_t - logp_old_t).

    PPO (Schulman et al. 2017, arXiv:1707.06347) with DAPO's decoupled clip bounds (Yu et al. 2025,
    arXiv:2503.14476); GRPO is this loss with eps_low == eps_high. ``dual_clip`` = c > 1 additionally caps
    the loss of negative-advantage tokens at c * |A| (Ye et al. 2020, arXiv:1912.09729).
    new/old_logprobs [B, T], advantages [B], response_mask [B, T] (unused: per-token) -> loss [B, T].
    """
    log_ratio = (new_logprobs - old_logprobs).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    ratio = log_ratio.exp()
    loss, masks = _clip_objective(ratio, advantages, clip_eps_low, clip_eps_high, dual_clip)
    return PolicyLossOutput(loss=loss, ratio=ratio.detach(), **masks)


@POLICY_LOSSES.register("gspo")
def gspo_policy_loss(
    new_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_eps_low: float,
    clip_eps_high: float,
    dual_clip: float | None = None,
) -> PolicyLossOutput:
    """l_t = max(-A s, -A clip(s, 1 - eps_low, 1 + eps_high)), s = exp(mean_t(logp_new_t - logp_old_t)).

    GSPO, Zheng et al. 2025, "Group Sequence Policy Optimization" (arXiv:2507.18071): the ratio is the
    geometric mean of the token ratios over the response, clipped per sequence. Written in the paper's
    GSPO-token form s_t = sg[s] * p_t / sg[p_t] (value s, gradient s * grad logp_t), which with
    ``sample_level`` aggregation has exactly GSPO's gradient. Typical eps: 3e-4 / 4e-4.
    new/old_logprobs [B, T], advantages [B], response_mask [B, T] -> loss [B, T].
    """
    mask = response_mask.bool()
    token_log_ratio = torch.where(mask, (new_logprobs - old_logprobs).detach(), 0.0)
    sequence_log_ratio = token_log_ratio.sum(-1) / mask.sum(-1).clamp(min=1)  # [B]
    sequence_log_ratio = sequence_log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    ratio = (new_logprobs - new_logprobs.detach() + sequence_log_ratio.unsqueeze(-1)).exp()  # [B, T]
    loss, masks = _clip_objective(ratio, advantages, clip_eps_low, clip_eps_high, dual_clip)
    return PolicyLossOutput(loss=loss, ratio=ratio.detach(), **masks)


def skip_threshold_mask(
    new_logprobs: torch.Tensor, old_logprobs: torch.Tensor, response_mask: torch.Tensor, threshold: float
) -> torch.Tensor:
    """keep_i = mean_t exp(logp_new_t - logp_old_t) <= threshold (detached).

    Samples whose mean token ratio has run away are dropped from the loss (ColossalChat's DAPO
    ``skip_threshold``). new/old_logprobs [B, T], response_mask [B, T] -> keep [B] bool.
    """
    mask = response_mask.bool()
    ratio = (new_logprobs - old_logprobs).detach().clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO).exp()
    mean_ratio = torch.where(mask, ratio, 0.0).sum(-1) / mask.sum(-1).clamp(min=1)
    return mean_ratio <= threshold


def _masked_token_sums(per_token_loss: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample sum of the loss over masked-in tokens, and the per-sample token count; [B, T] -> [B], [B]."""
    mask = mask.bool()
    return torch.where(mask, per_token_loss, 0.0).sum(-1), mask.sum(-1)


@LOSS_AGGREGATIONS.register("token_level")
def token_level_loss(
    per_token_loss: torch.Tensor,
    mask: torch.Tensor,
    *,
    global_token_count: float,
    global_sample_count: float,
    max_response_length: int,
) -> torch.Tensor:
    """L = sum_{i,t} m_it l_it / global_token_count  (every token weighs the same; DAPO).

    DAPO, Yu et al. 2025 (arXiv:2503.14476). per_token_loss [B, T], mask [B, T] -> scalar.
    """
    token_sums, _ = _masked_token_sums(per_token_loss, mask)
    return token_sums.sum() / max(global_token_count, 1.0)


@LOSS_AGGREGATIONS.register("sample_level")
def sample_level_loss(
    per_token_loss: torch.Tensor,
    mask: torch.Tensor,
    *,
    global_token_count: float,
    global_sample_count: float,
    max_response_length: int,
) -> torch.Tensor:
    """L = sum_i (sum_t m_it l_it / sum_t m_it) / global_sample_count  (every sample weighs the same; GRPO).

    GRPO, Shao et al. 2024 (arXiv:2402.03300). A sample without masked-in tokens adds 0.
    per_token_loss [B, T], mask [B, T] -> scalar.
    """
    token_sums, token_counts = _masked_token_sums(per_token_loss, mask)
    return (token_sums / token_counts.clamp(min=1)).sum() / max(global_sample_count, 1.0)


@LOSS_AGGREGATIONS.register("seq_mean_token_sum")
def seq_mean_token_sum_loss(
    per_token_loss: torch.Tensor,
    mask: torch.Tensor,
    *,
    global_token_count: float,
    global_sample_count: float,
    max_response_length: int,
) -> torch.Tensor:
    """L = sum_i (sum_t m_it l_it / max_response_length) / global_sample_count  (no length bias; Dr. GRPO).

    Dr. GRPO, Liu et al. 2025 (arXiv:2503.20783): a constant divides the token sum instead of the
    sample's own length. per_token_loss [B, T], mask [B, T] -> scalar.
    """
    token_sums, _ = _masked_token_sums(per_token_loss, mask)
    return token_sums.sum() / max_response_length / max(global_sample_count, 1.0)
