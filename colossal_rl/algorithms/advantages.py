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

Batch-level estimators (reinforce, reinforce_ppb, reinforce_ppb_sample) run in two stages so that their batch
is the optimizer step's whatever the schedule: a per-group part (``group_part``, run by the producers on
whatever groups they hold) and a batch stage (``BATCH_STAGES``) over the step's samples. The batch stage needs
only the additive ``batch_moments`` of the per-group values, so the training layer sums them over its
data-parallel ranks (as it does its token counts) and every rank finishes its own share with the global
statistics. Each registered full-batch estimator is the two stages run over one batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

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


_WHITEN_EPS = 1e-8  # verl's masked_whiten: (x - mean) * rsqrt(var + 1e-8)


def batch_moments(values: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``[sum w, sum w * x, sum w * x^2]`` in float64: sufficient statistics of a weighted batch.

    Additive over any split of the batch (producer batches, data-parallel shares), so the training layer sums
    them over its ranks. float64 keeps the sums of float32 values exact for any practical batch (an all-equal
    batch then has a mean exactly equal to its values). values, weights [N] -> [3].
    """
    values, weights = values.double(), weights.double()
    return torch.stack([weights.sum(), (weights * values).sum(), (weights * values.square()).sum()])


def _weighted_mean_and_variance(moments: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The weighted mean and Bessel-corrected variance of :func:`batch_moments` (mean 0 without weight; variance
    0 with at most one unit of weight): the statistics of a flat list where ``x_i`` appears ``w_i`` times."""
    count, total, squares = moments.double().unbind()
    mean = total / count.clamp(min=1)
    deviations = (squares - 2 * mean * total + mean.square() * count).clamp(min=0)  # sum w (x - mean)^2
    return mean, deviations / (count - 1).clamp(min=1)


def whiten_with_moments(values: torch.Tensor, weights: torch.Tensor, moments: torch.Tensor, eps: float) -> torch.Tensor:
    """``(x - mean) * rsqrt(var + 1e-8)`` with the weighted mean and Bessel-corrected variance of ``moments``.

    verl's ``masked_whiten`` when a weight is a token count; ``eps`` is unused (verl's 1e-8 is fixed). Entries of
    weight 0 get 0; a batch of at most one token gives zeros. values, weights [N], moments [3] -> [N].
    """
    mean, variance = _weighted_mean_and_variance(moments)
    whitened = (values.double() - mean) * torch.rsqrt(variance + _WHITEN_EPS)
    return torch.where(weights > 0, whitened, 0.0).to(values.dtype)


def divide_by_moments_std(
    values: torch.Tensor, weights: torch.Tensor, moments: torch.Tensor, eps: float
) -> torch.Tensor:
    """``x / (std + eps)`` with ``std = sqrt(sum w x^2 / (sum w - 1))``: the unbiased std of values already
    centred (no re-centring). A batch of zeros stays zero even when ``eps == 0``; entries of weight 0 get 0.
    values, weights [N], moments [3] -> [N]."""
    count, _, squares = moments.double().unbind()
    std = (squares / (count - 1).clamp(min=1)).sqrt()
    scaled = values.double() / torch.where(std > 0, std + eps, 1.0)
    return torch.where(weights > 0, scaled, 0.0).to(values.dtype)


def subtract_moments_mean(
    values: torch.Tensor, weights: torch.Tensor, moments: torch.Tensor, eps: float
) -> torch.Tensor:
    """``x - mean_w(x)`` with the weighted mean of ``moments`` (``eps`` is unused); entries of weight 0 get 0, and
    a batch whose weighted values are all equal gets exactly 0. values, weights [N], moments [3] -> [N]."""
    mean, _ = _weighted_mean_and_variance(moments)
    return torch.where(weights > 0, values.double() - mean, 0.0).to(values.dtype)


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


@dataclass(frozen=True)
class BatchStage:
    """The batch-level stage of an estimator, and the per-group part it finishes.

    ``group_part`` is estimator-shaped (this module's signature) and sees only each sample's own group, so a
    producer can run it on any groups it holds; ``finish`` completes the values with the ``batch_moments`` of
    the whole optimizer step's batch. Calling a stage runs both over one batch: the full-batch estimator.
    """

    group_part: Callable[..., torch.Tensor]
    """rewards [N], group_size, eps, valid_mask [N] | None, *, response_lengths [N] | None -> values [N]."""
    finish: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]
    """(values [N], weights [N], moments [3] of the step's batch, eps) -> advantages [N]."""
    token_weighted: bool
    """A valid sample weighs its response length in the statistics (else 1); an invalid one weighs 0."""

    def weights(
        self, rewards: torch.Tensor, valid_mask: torch.Tensor | None, response_lengths: torch.Tensor | None
    ) -> torch.Tensor:
        """Each sample's weight in the batch statistics, float [N] (``rewards`` [N] gives the count and device)."""
        n = rewards.numel()
        valid = torch.ones(n, device=rewards.device) if valid_mask is None else valid_mask.float()
        if not self.token_weighted or response_lengths is None:
            return valid
        if response_lengths.shape != (n,):
            raise ValueError(f"response_lengths must have shape [{n}], got {tuple(response_lengths.shape)}")
        return torch.where(valid > 0, response_lengths.float(), 0.0)

    def __call__(
        self,
        rewards: torch.Tensor,
        group_size: int,
        eps: float,
        valid_mask: torch.Tensor | None = None,
        *,
        response_lengths: torch.Tensor | None = None,
    ) -> torch.Tensor:
        values = self.group_part(rewards, group_size, eps, valid_mask, response_lengths=response_lengths)
        weights = self.weights(rewards, valid_mask, response_lengths)
        return self.finish(values, weights, batch_moments(values, weights), eps)


BATCH_STAGES: Registry[BatchStage] = Registry("batch advantage stage")
"""Estimator name -> its batch stage, for the estimators whose statistics span the batch, not only a group."""


def batch_stage(name: str) -> BatchStage | None:
    """The batch stage of estimator ``name``; None for one whose statistics stay within a group."""
    ADVANTAGE_ESTIMATORS.get(name)  # ValueError naming the known estimators
    return BATCH_STAGES.get(name) if name in BATCH_STAGES else None


def group_part(name: str) -> Callable[..., torch.Tensor]:
    """What a producer computes for estimator ``name``: the estimator itself, or the per-group part of a
    batch-level one (the trainer finishes it over the optimizer step's batch)."""
    stage = batch_stage(name)
    return ADVANTAGE_ESTIMATORS.get(name) if stage is None else stage.group_part


def valid_rewards(
    rewards: torch.Tensor,
    group_size: int,
    eps: float,
    valid_mask: torch.Tensor | None = None,
    *,
    response_lengths: torch.Tensor | None = None,
) -> torch.Tensor:
    """r_i where valid, else 0 (float): REINFORCE's per-group part, nothing to compute within a group.
    rewards [N], valid_mask [N] -> [N]."""
    grouped, valid = _grouped(rewards, group_size, valid_mask)
    return torch.where(valid, grouped, 0.0).view(-1)


_REINFORCE_PPB = BATCH_STAGES.register("reinforce_ppb")(
    BatchStage(group_part=dr_grpo_advantages, finish=whiten_with_moments, token_weighted=True)
)
_REINFORCE_PPB_SAMPLE = BATCH_STAGES.register("reinforce_ppb_sample")(
    BatchStage(group_part=dr_grpo_advantages, finish=divide_by_moments_std, token_weighted=False)
)
_REINFORCE = BATCH_STAGES.register("reinforce")(
    BatchStage(group_part=valid_rewards, finish=subtract_moments_mean, token_weighted=False)
)


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
    0 (verl raises). Samples without tokens get 0. Stages: ``a`` per group (dr_grpo), whitening over the batch.
    rewards, valid_mask, response_lengths [N] -> advantages [N].
    """
    return _REINFORCE_PPB(rewards, group_size, eps, valid_mask, response_lengths=response_lengths)


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
    std, a bug. Stages: ``a`` per group (dr_grpo), the std over the batch. rewards [N], valid_mask [N] ->
    advantages [N].
    """
    return _REINFORCE_PPB_SAMPLE(rewards, group_size, eps, valid_mask, response_lengths=response_lengths)


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
    nonzero advantage here. Stages: nothing per group, the mean over the batch. rewards [N], valid_mask [N]
    -> advantages [N].
    """
    return _REINFORCE(rewards, max(rewards.numel(), 1), eps, valid_mask, response_lengths=response_lengths)
