"""Per-token estimators of KL(pi || pi_ref) from samples of pi (Schulman's k1, k2, k3).

Every estimator has the signature ``fn(logprobs [B, T], ref_logprobs [B, T]) -> kl [B, T]``; the
caller masks and aggregates. Reference: J. Schulman, "Approximating KL Divergence" (2020),
http://joschu.net/blog/kl-approx.html. Pure torch; no config objects, no distributed code.
"""

from __future__ import annotations

import torch

from colossal_rl.algorithms.losses import MAX_LOG_RATIO
from colossal_rl.algorithms.registry import Registry

KL_ESTIMATORS = Registry("KL estimator")


@KL_ESTIMATORS.register("k1")
def kl_k1(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k1 = logp - logp_ref  (unbiased, high variance, can be negative). [B, T], [B, T] -> [B, T]."""
    return logprobs - ref_logprobs


@KL_ESTIMATORS.register("k2")
def kl_k2(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k2 = (logp - logp_ref)^2 / 2  (biased, low variance, >= 0). [B, T], [B, T] -> [B, T]."""
    return 0.5 * (logprobs - ref_logprobs).square()


@KL_ESTIMATORS.register("k3")
def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k3 = exp(logp_ref - logp) - (logp_ref - logp) - 1  (unbiased, low variance, >= 0; GRPO's KL).

    The log-ratio is clamped to +-20 before ``exp``. [B, T], [B, T] -> [B, T].
    """
    log_ratio = (ref_logprobs - logprobs).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    return log_ratio.exp() - log_ratio - 1
