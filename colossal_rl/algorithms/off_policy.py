"""Off-policy correction between the producer's (behaviour) policy and the trainer's old policy.

With asynchronous producers (``n_behind > 0``) and inference engines whose numerics differ from the
trainer's, the tokens were sampled from ``pi_behaviour``, not from ``pi_old``. A truncated importance
weight per token corrects the policy gradient; the metrics show how far apart the two policies are.
Pure torch; no config objects, no distributed code.
"""

from __future__ import annotations

import math

import torch

from colossal_rl.algorithms.losses import MAX_LOG_RATIO, masked_mean


def truncated_importance_weights(
    old_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, cap: float
) -> torch.Tensor:
    """w_t = min(exp(logp_old_t - logp_behaviour_t), cap), detached.

    Truncated importance sampling, Espeholt et al. 2018, "IMPALA" (arXiv:1802.01561), as applied to
    LLM RL by Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training".
    old/behaviour_logprobs [B, T] -> weights [B, T].
    """
    log_ratio = (old_logprobs - behaviour_logprobs).detach()
    return log_ratio.clamp(max=math.log(cap)).exp()


def off_policy_metrics(
    old_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, response_mask: torch.Tensor, cap: float | None
) -> dict[str, torch.Tensor]:
    """Mismatch between behaviour and old policy over the masked-in tokens (detached scalars).

    ``off_policy/logprob_abs_diff`` = mean |logp_old - logp_behaviour|; ``off_policy/ratio_mean`` = mean
    exp(logp_old - logp_behaviour); ``off_policy/capped_fraction`` = fraction of tokens whose ratio exceeds
    ``cap`` and ``off_policy/tis_weight_mean`` = mean min(ratio, cap) (only when ``cap`` is set);
    ``off_policy/ratio_max`` (a maximum); ``off_policy/behaviour_kl`` = k3 estimate of KL(behaviour || old).
    old/behaviour_logprobs [B, T], response_mask [B, T].
    """
    log_ratio = (old_logprobs - behaviour_logprobs).detach().clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    ratio = log_ratio.exp()
    metrics = {
        "off_policy/logprob_abs_diff": masked_mean(log_ratio.abs(), response_mask),
        "off_policy/ratio_mean": masked_mean(ratio, response_mask),
        "off_policy/behaviour_kl": masked_mean(ratio - log_ratio - 1, response_mask),
    }
    mask = response_mask.bool()
    metrics["off_policy/ratio_max"] = torch.where(mask, ratio, 0.0).max() if mask.any() else ratio.new_zeros(())
    if cap is not None:
        metrics["off_policy/capped_fraction"] = masked_mean((ratio > cap).float(), response_mask)
        metrics["off_policy/tis_weight_mean"] = masked_mean(ratio.clamp(max=cap), response_mask)
    return metrics
