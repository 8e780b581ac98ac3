"""The RL algorithm math: pure tensor functions and the registries that name them.

Module-level functions of tensors and plain floats only: no configs, no ``self``, and no ray,
torch.distributed or colossalai imports. The training and rollout layers read ``AlgorithmConfig`` and
look functions up here by name; a new estimator or loss is a new registered function.

Names are imported from their modules on first use (PEP 562): importing one light module of this package
(``registry``) does not pull in torch.
"""

from __future__ import annotations

from colossal_rl.lazy_exports import lazy_exports

_EXPORTS = {
    "ADVANTAGE_ESTIMATORS": "colossal_rl.algorithms.advantages",
    "BATCH_STAGES": "colossal_rl.algorithms.advantages",
    "BatchStage": "colossal_rl.algorithms.advantages",
    "batch_moments": "colossal_rl.algorithms.advantages",
    "batch_stage": "colossal_rl.algorithms.advantages",
    "group_part": "colossal_rl.algorithms.advantages",
    "dr_grpo_advantages": "colossal_rl.algorithms.advantages",
    "grpo_advantages": "colossal_rl.algorithms.advantages",
    "reinforce_advantages": "colossal_rl.algorithms.advantages",
    "reinforce_ppb_advantages": "colossal_rl.algorithms.advantages",
    "reinforce_ppb_sample_advantages": "colossal_rl.algorithms.advantages",
    "rloo_advantages": "colossal_rl.algorithms.advantages",
    "dpo_loss": "colossal_rl.algorithms.dpo",
    "group_pair_margins": "colossal_rl.algorithms.dpo",
    "preference_pair_signs": "colossal_rl.algorithms.dpo",
    "sequence_log_ratios": "colossal_rl.algorithms.dpo",
    "dynamic_sampling_group_mask": "colossal_rl.algorithms.filters",
    "filter_truncated_response": "colossal_rl.algorithms.filters",
    "soft_over_length_penalty": "colossal_rl.algorithms.filters",
    "KL_ESTIMATORS": "colossal_rl.algorithms.kl",
    "kl_k1": "colossal_rl.algorithms.kl",
    "kl_k2": "colossal_rl.algorithms.kl",
    "kl_k3": "colossal_rl.algorithms.kl",
    "DEFAULT_CHUNK_SIZE": "colossal_rl.algorithms.logprobs",
    "align_to_response": "colossal_rl.algorithms.logprobs",
    "entropy_from_hidden": "colossal_rl.algorithms.logprobs",
    "entropy_from_logits": "colossal_rl.algorithms.logprobs",
    "logprobs_from_hidden": "colossal_rl.algorithms.logprobs",
    "logprobs_from_logits": "colossal_rl.algorithms.logprobs",
    "LOSS_AGGREGATIONS": "colossal_rl.algorithms.losses",
    "POLICY_LOSSES": "colossal_rl.algorithms.losses",
    "PolicyLossOutput": "colossal_rl.algorithms.losses",
    "clipped_policy_loss": "colossal_rl.algorithms.losses",
    "gspo_policy_loss": "colossal_rl.algorithms.losses",
    "masked_mean": "colossal_rl.algorithms.losses",
    "sample_level_loss": "colossal_rl.algorithms.losses",
    "seq_mean_token_sum_loss": "colossal_rl.algorithms.losses",
    "skip_threshold_mask": "colossal_rl.algorithms.losses",
    "token_level_loss": "colossal_rl.algorithms.losses",
    "off_policy_metrics": "colossal_rl.algorithms.off_policy",
    "truncated_importance_weights": "colossal_rl.algorithms.off_policy",
    "Registry": "colossal_rl.algorithms.registry",
}
"""Exported name -> the module that defines it."""

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
