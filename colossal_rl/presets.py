"""Algorithm presets: vetted ``AlgorithmConfig`` defaults, written as code.

Each preset is a function of the KL coefficient the user asked for (which some presets ignore) and returns
an ``AlgorithmConfig``; any field can be overridden afterwards with ``colossal_rl.config.replace``. The fields
that depend on the rest of the run (DAPO's soft punishment window on the response budget, the truncated
importance weight's cap on the allowed staleness) are left to ``config_resolve.resolve``, so a preset in
``RLConfig(algorithm=dapo())`` and ``-a DAPO`` give the same run. ``PRESETS`` is keyed by the names users
type (``-a GRPO``). Imports no torch.
"""

from __future__ import annotations

from colossal_rl.algorithms.registry import Registry
from colossal_rl.config import TRUNCATED_IS_CAP, AlgorithmConfig
from colossal_rl.config_resolve import resolve_algorithm

__all__ = ["PRESETS", "TRUNCATED_IS_CAP", "algorithm_preset"]

PRESETS = Registry("algorithm preset")


@PRESETS.register("GRPO")
def grpo(*, kl_coeff: float = 0.0) -> AlgorithmConfig:
    """GRPO (Shao et al. 2024): group-normalised advantages, symmetric clip, per-sample token mean."""
    return AlgorithmConfig(
        name="GRPO",
        advantage_estimator="grpo",
        policy_loss="clipped",
        loss_aggregation="sample_level",
        clip_eps_low=0.2,
        clip_eps_high=0.2,
        kl_coeff=kl_coeff,
    )


@PRESETS.register("DAPO")
def dapo(*, kl_coeff: float = 0.0) -> AlgorithmConfig:
    """DAPO (Yu et al. 2025): clip-higher, dynamic sampling, token-level loss, overlong shaping; no KL.

    ``kl_coeff`` is ignored: DAPO drops the KL term (override with ``replace`` to add one back).
    """
    return AlgorithmConfig(
        name="DAPO",
        advantage_estimator="grpo",
        policy_loss="clipped",
        loss_aggregation="token_level",
        clip_eps_low=0.2,
        clip_eps_high=0.28,
        skip_threshold=20.0,
        kl_coeff=0.0,
        filter_range=(0.01, 0.99),
        filter_truncated_response=True,
        soft_over_length_punishment=True,
    )


@PRESETS.register("RLOO")
def rloo(*, kl_coeff: float = 0.0) -> AlgorithmConfig:
    """RLOO (Ahmadian et al. 2024): leave-one-out baseline, clipped ratio, per-sample token mean."""
    return AlgorithmConfig(
        name="RLOO",
        advantage_estimator="rloo",
        policy_loss="clipped",
        loss_aggregation="sample_level",
        kl_coeff=kl_coeff,
    )


@PRESETS.register("REINFORCE_PPB")
def reinforce_ppb(*, kl_coeff: float = 0.0) -> AlgorithmConfig:
    """REINFORCE++ with a group baseline (Hu et al. 2025): group-centred advantages whitened over the batch's
    response tokens, as verl and OpenRLHF compute them."""
    return AlgorithmConfig(
        name="REINFORCE_PPB",
        advantage_estimator="reinforce_ppb",
        policy_loss="clipped",
        loss_aggregation="sample_level",
        kl_coeff=kl_coeff,
    )


@PRESETS.register("DR_GRPO")
def dr_grpo(*, kl_coeff: float = 0.0) -> AlgorithmConfig:
    """Dr. GRPO (Liu et al. 2025): no std normalisation, token sums over a constant length."""
    return AlgorithmConfig(
        name="DR_GRPO",
        advantage_estimator="dr_grpo",
        policy_loss="clipped",
        loss_aggregation="seq_mean_token_sum",
        kl_coeff=kl_coeff,
    )


@PRESETS.register("GSPO")
def gspo(*, kl_coeff: float = 0.0) -> AlgorithmConfig:
    """GSPO (Zheng et al. 2025): sequence-level ratio clipped at 1 - 3e-4 / 1 + 4e-4, per-sample mean."""
    return AlgorithmConfig(
        name="GSPO",
        advantage_estimator="grpo",
        policy_loss="gspo",
        loss_aggregation="sample_level",
        clip_eps_low=3e-4,
        clip_eps_high=4e-4,
        kl_coeff=kl_coeff,
    )


@PRESETS.register("ONLINE_DPO")
def online_dpo(*, kl_coeff: float = 0.0) -> AlgorithmConfig:
    """Online DPO (Guo et al. 2024; verl's "extend to other algorithms" tutorial): each group's best- and
    worst-rewarded responses form a preference pair (ties: no pair), trained with the DPO loss against the
    reference model (``algorithm.dpo_beta``). ``kl_coeff`` is ignored: the reference enters through DPO's
    log-ratios, not a KL term."""
    return AlgorithmConfig(
        name="ONLINE_DPO",
        advantage_estimator="dpo_pairs",
        objective="dpo",
        mask_zero_advantage=True,
        kl_coeff=0.0,
        truncated_is_when_behind=False,
    )


def algorithm_preset(name: str, *, kl_coeff: float, max_new_tokens: int, n_behind: int) -> AlgorithmConfig:
    """The validated preset ``name`` resolved for a run with these facts (what ``resolve`` makes of it there);
    raises ``ValueError`` listing the known presets for an unknown name."""
    config = resolve_algorithm(PRESETS.get(name)(kl_coeff=kl_coeff), max_new_tokens=max_new_tokens, n_behind=n_behind)
    config.validate()
    return config
