"""Advantage estimators over scalar sample rewards.

Every estimator has the signature
``fn(rewards [N], group_size, eps, valid_mask [N] | None = None, *, response_lengths [N] | None = None)
-> advantages [N]``; an estimator that does not weight by tokens ignores ``response_lengths`` (None counts
every sample as one token). Samples are group-major: sample ``i`` answers prompt ``i // group_size``.
Samples with ``valid_mask == 0`` (infrastructure errors, filtered responses) neither enter any statistic
nor receive a nonzero advantage. Under the group estimators (grpo, dr_grpo, rloo, reinforce_ppb_sample) a
group whose valid rewards are all equal gets exactly zero advantage (never NaN), whatever ``eps`` is;
``reinforce_ppb`` re-centres over the batch's tokens afterwards, as verl does, so such a group gets the
same small value on every sample. Pure torch; no config objects, no distributed code.
"""

from __future__ import annotations

import torch

from colossal_rl.algorithms.dpo import preference_pair_signs
from colossal_rl.algorithms.registry import Registry

ADVANTAGE_ESTIMATORS = Registry("advantage estimator")
ADVANTAGE_ESTIMATORS.register("dpo_pairs")(preference_pair_signs)  # online DPO: +1 chosen, -1 rejected, 0 rest


def _grouped(
    rewards: torch.Tensor, group_size: int, valid_mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rewards as float [N / G, G] and the valid mask as bool [N / G, G]."""
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    if group_size < 1 or rewards.numel() % group_size != 0:
        raise ValueError(f"{rewards.numel()} rewards are not a whole number of groups of {group_size}")
    grouped = rewards.float().view(-1, group_size)
    if valid_mask is None:
        return grouped, torch.ones_like(grouped, dtype=torch.bool)
    return grouped, valid_mask.view(-1, group_size).bool()


def _center(rewards: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rewards minus the valid mean of their row, and the valid count of each row ([R, C] -> [R, C], [R, 1]).

    Invalid entries and rows whose valid rewards are all equal are exactly 0, so no rounding noise
    survives into a later division.
    """
    count = valid.sum(-1, keepdim=True).float()  # [R, 1]
    mean = torch.where(valid, rewards, 0.0).sum(-1, keepdim=True) / count.clamp(min=1)
    highest = torch.where(valid, rewards, -torch.inf).amax(-1, keepdim=True)
    lowest = torch.where(valid, rewards, torch.inf).amin(-1, keepdim=True)
    constant = highest <= lowest  # also true for rows without valid entries
    return torch.where(valid & ~constant, rewards - mean, 0.0), count


def _divide_by_std(centered: torch.Tensor, count: torch.Tensor, eps: float) -> torch.Tensor:
    """``centered / (std + eps)`` row-wise, with the unbiased std of the (already centred) valid entries.

    Rows of zeros stay zero even when ``eps == 0``.
    """
    std = (centered.square().sum(-1, keepdim=True) / (count - 1).clamp(min=1)).sqrt()
    return centered / torch.where(std > 0, std + eps, 1.0)


def _grouped_lengths(response_lengths: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Response lengths [N] as float, shaped as ``like`` ([N / G, G]); ``ValueError`` on a wrong shape."""
    if response_lengths.shape != (like.numel(),):
        raise ValueError(f"response_lengths must have shape [{like.numel()}], got {tuple(response_lengths.shape)}")
    return response_lengths.float().view_as(like)


_WHITEN_EPS = 1e-8  # verl's masked_whiten: (x - mean) * rsqrt(var + 1e-8)


def _token_whiten(values: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``(x - mean) * rsqrt(var + 1e-8)`` with the ``weights``-weighted mean and Bessel-corrected variance.

    A weight is a token count: the statistics equal those over a flat list where ``x_i`` appears ``w_i``
    times. Entries of weight 0 get 0; a whole batch of at most one token gives zeros.
    """
    tokens = weights.sum()
    mean = (weights * values).sum() / tokens.clamp(min=1)
    variance = (weights * (values - mean).square()).sum() / (tokens - 1).clamp(min=1)
    return torch.where(weights > 0, (values - mean) * torch.rsqrt(variance + _WHITEN_EPS), 0.0)


@ADVANTAGE_ESTIMATORS.register("grpo")
def grpo_advantages(
    rewards: torch.Tensor,
    group_size: int,
    eps: float,
    valid_mask: torch.Tensor | None = None,
    *,
    response_lengths: torch.Tensor | None = None,
) -> torch.Tensor:
    """A_i = (r_i - mean_group(r)) / (std_group(r) + eps).

    GRPO, Shao et al. 2024, "DeepSeekMath" (arXiv:2402.03300). The std is the unbiased one over the
    valid samples of the group. rewards [N], valid_mask [N] -> advantages [N].
    """
    grouped, valid = _grouped(rewards, group_size, valid_mask)
    centered, count = _center(grouped, valid)
    return _divide_by_std(centered, count, eps).view(-1)


@ADVANTAGE_ESTIMATORS.register("dr_grpo")
def dr_grpo_advantages(
    rewards: torch.Tensor,
    group_size: int,
    eps: float,
    valid_mask: torch.Tensor | None = None,
    *,
    response_lengths: torch.Tensor | None = None,
) -> torch.Tensor:
    """A_i = r_i - mean_group(r)  (no std division; ``eps`` is unused).

    Dr. GRPO, Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical Perspective"
    (arXiv:2503.20783). rewards [N], valid_mask [N] -> advantages [N].
    """
    grouped, valid = _grouped(rewards, group_size, valid_mask)
    centered, _ = _center(grouped, valid)
    return centered.view(-1)


@ADVANTAGE_ESTIMATORS.register("rloo")
def rloo_advantages(
    rewards: torch.Tensor,
    group_size: int,
    eps: float,
    valid_mask: torch.Tensor | None = None,
    *,
    response_lengths: torch.Tensor | None = None,
) -> torch.Tensor:
    """A_i = r_i - mean_{j != i} r_j = k / (k - 1) * (r_i - mean_group(r)), k = valid samples in the group.

    RLOO, Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style Optimization for Learning from
    Human Feedback in LLMs" (arXiv:2402.14740). A group with one valid sample gets 0. ``eps`` is unused.
    rewards [N], valid_mask [N] -> advantages [N].
    """
    grouped, valid = _grouped(rewards, group_size, valid_mask)
    centered, count = _center(grouped, valid)
    return (centered * count / (count - 1).clamp(min=1)).view(-1)


@ADVANTAGE_ESTIMATORS.register("reinforce_ppb")
def reinforce_ppb_advantages(
    rewards: torch.Tensor,
    group_size: int,
    eps: float,
    valid_mask: torch.Tensor | None = None,
    *,
    response_lengths: torch.Tensor | None = None,
) -> torch.Tensor:
    """A_i = (a_i - mean_tok(a)) * rsqrt(var_tok(a) + 1e-8) with a_i = r_i - mean_group(r).

    REINFORCE++ with a group-mean baseline, Hu et al. 2025, "REINFORCE++" (arXiv:2501.03262), as verl's
    ``compute_reinforce_plus_plus_baseline_outcome_advantage`` and OpenRLHF's ``reinforce_baseline`` compute
    it: every response token carries its sample's ``a_i``, and the whitening statistics run over the tokens
    of the valid samples, so sample ``i`` weighs ``response_lengths[i]`` (1 each when None). ``var_tok`` is
    Bessel-corrected over tokens and 1e-8 is verl's ``masked_whiten`` constant (OpenRLHF: biased variance,
    ``max(var, 1e-8)``), so ``eps`` is unused. Differences from verl: a group with one valid sample is centred
    to 0 here (verl keeps the raw score of a prompt with a single response), and a batch with one token gives
    0 (verl raises). Samples without tokens get 0. rewards, valid_mask, response_lengths [N] -> advantages [N].
    """
    grouped, valid = _grouped(rewards, group_size, valid_mask)
    centered, _ = _center(grouped, valid)
    tokens = torch.ones_like(centered) if response_lengths is None else _grouped_lengths(response_lengths, centered)
    weights = torch.where(valid, tokens, 0.0)
    return _token_whiten(centered, weights).view(-1)


@ADVANTAGE_ESTIMATORS.register("reinforce_ppb_sample")
def reinforce_ppb_sample_advantages(
    rewards: torch.Tensor,
    group_size: int,
    eps: float,
    valid_mask: torch.Tensor | None = None,
    *,
    response_lengths: torch.Tensor | None = None,
) -> torch.Tensor:
    """A_i = a_i / (std_batch(a) + eps) with a_i = r_i - mean_group(r)  (``response_lengths`` is unused).

    The per-sample variant of ``reinforce_ppb``: no token weighting and no re-centring (the group baseline
    already makes the batch mean of ``a`` zero over samples), so equal-reward groups keep exactly 0. The std
    is the unbiased sample-level batch std of the valid ``a`` — a division: ColossalChat multiplies by the
    std, a bug. rewards [N], valid_mask [N] -> advantages [N].
    """
    grouped, valid = _grouped(rewards, group_size, valid_mask)
    centered, _ = _center(grouped, valid)
    batch_count = valid.sum().float().view(1, 1)
    return _divide_by_std(centered.view(1, -1), batch_count, eps).view(-1)


@ADVANTAGE_ESTIMATORS.register("reinforce")
def reinforce_advantages(
    rewards: torch.Tensor,
    group_size: int,
    eps: float,
    valid_mask: torch.Tensor | None = None,
    *,
    response_lengths: torch.Tensor | None = None,
) -> torch.Tensor:
    """A_i = r_i - mean_batch(r)  (batch-mean baseline; ``group_size`` and ``eps`` are unused).

    REINFORCE, Williams 1992, "Simple statistical gradient-following algorithms for connectionist
    reinforcement learning". Unlike the group estimators, a group with equal rewards still gets a
    nonzero advantage here. rewards [N], valid_mask [N] -> advantages [N].
    """
    grouped, valid = _grouped(rewards, max(rewards.numel(), 1), valid_mask)
    centered, _ = _center(grouped, valid)
    return centered.view(-1)
