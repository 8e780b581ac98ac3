"""The RL algorithm math: pure tensor functions and the registries that name them.

Module-level functions of tensors and plain floats only: no configs, no ``self``, and no ray,
torch.distributed or colossalai imports. The training and rollout layers read ``AlgorithmConfig`` and
look functions up here by name; a new estimator or loss is a new registered function.
"""

from colossal_rl.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    dr_grpo_advantages,
    grpo_advantages,
    reinforce_advantages,
    reinforce_ppb_advantages,
    reinforce_ppb_sample_advantages,
    rloo_advantages,
)
from colossal_rl.algorithms.filters import (
    dynamic_sampling_group_mask,
    filter_truncated_response,
    soft_over_length_penalty,
)
from colossal_rl.algorithms.kl import KL_ESTIMATORS, kl_k1, kl_k2, kl_k3
from colossal_rl.algorithms.logprobs import (
    DEFAULT_CHUNK_SIZE,
    align_to_response,
    entropy_from_hidden,
    entropy_from_logits,
    logprobs_from_hidden,
    logprobs_from_logits,
)
from colossal_rl.algorithms.losses import (
    LOSS_AGGREGATIONS,
    POLICY_LOSSES,
    PolicyLossOutput,
    clipped_policy_loss,
    gspo_policy_loss,
    masked_mean,
    sample_level_loss,
    seq_mean_token_sum_loss,
    skip_threshold_mask,
    token_level_loss,
)
from colossal_rl.algorithms.off_policy import off_policy_metrics, truncated_importance_weights
from colossal_rl.algorithms.registry import Registry

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "DEFAULT_CHUNK_SIZE",
    "KL_ESTIMATORS",
    "LOSS_AGGREGATIONS",
    "POLICY_LOSSES",
    "PolicyLossOutput",
    "Registry",
    "align_to_response",
    "clipped_policy_loss",
    "dr_grpo_advantages",
    "dynamic_sampling_group_mask",
    "entropy_from_hidden",
    "entropy_from_logits",
    "filter_truncated_response",
    "grpo_advantages",
    "gspo_policy_loss",
    "kl_k1",
    "kl_k2",
    "kl_k3",
    "logprobs_from_hidden",
    "logprobs_from_logits",
    "masked_mean",
    "off_policy_metrics",
    "reinforce_advantages",
    "reinforce_ppb_advantages",
    "reinforce_ppb_sample_advantages",
    "rloo_advantages",
    "sample_level_loss",
    "seq_mean_token_sum_loss",
    "skip_threshold_mask",
    "soft_over_length_penalty",
    "token_level_loss",
    "truncated_importance_weights",
]
