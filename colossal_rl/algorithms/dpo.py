"""Online DPO's math: which samples of a group form the preference pair, and the DPO loss of a pair.

Online DPO (Guo et al. 2024, "Direct Language Model Alignment from Online AI Feedback", arXiv:2402.04792;
the recipe of verl's "extend to other algorithms" tutorial) samples G responses per prompt from the current
policy, scores them, and trains DPO (Rafailov et al. 2023, arXiv:2305.18290) on one pair per prompt: the
best-scored response as chosen, the worst as rejected. A group whose valid rewards are all equal has no
pair. Pure torch; no config objects, no distributed code.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def preference_pair_signs(
    rewards: torch.Tensor,
    group_size: int,
    eps: float = 0.0,
    valid_mask: torch.Tensor | None = None,
    *,
    response_lengths: torch.Tensor | None = None,
) -> torch.Tensor:
    """+1 for each group's chosen sample, -1 for its rejected one, 0 for every other sample; [N] -> [N].

    Chosen: the first valid sample with the group's highest reward; rejected: the first valid sample with its
    lowest. Groups whose valid rewards are all equal (ties, a single valid sample, none) get all zeros.
    Shaped like an advantage estimator (``eps`` and ``response_lengths`` are unused), so it plugs in as the
    ``dpo_pairs`` estimator and the pair travels in ``RolloutBatch.advantages``.
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    if group_size < 1 or rewards.numel() % group_size != 0:
        raise ValueError(f"{rewards.numel()} rewards are not a whole number of groups of {group_size}")
    grouped = rewards.float().view(-1, group_size)
    valid = torch.ones_like(grouped, dtype=torch.bool) if valid_mask is None else valid_mask.view_as(grouped).bool()
    best = torch.where(valid, grouped, -torch.inf).argmax(-1)  # argmax returns the first maximal index
    worst = torch.where(valid, grouped, torch.inf).argmin(-1)
    highest = grouped.gather(-1, best[:, None]).squeeze(-1)
    lowest = grouped.gather(-1, worst[:, None]).squeeze(-1)
    has_pair = valid.any(-1) & (highest > lowest)
    signs = torch.zeros_like(grouped)
    rows = has_pair.nonzero().flatten()
    signs[rows, best[rows]] = 1.0
    signs[rows, worst[rows]] = -1.0
    return signs.view(-1)


def sequence_log_ratios(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """log pi(y|x) - log pi_ref(y|x) per sample: the masked sum over response tokens; [B, T] x3 -> [B] (fp32)."""
    return torch.where(mask.bool(), logprobs.float() - ref_logprobs.float(), 0.0).sum(-1)


def group_pair_margins(
    log_ratios: torch.Tensor, signs: torch.Tensor, group_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per group: (chosen log-ratio, rejected log-ratio, has a pair); [B], [B] -> [B / G] x2, bool [B / G].

    ``signs`` as :func:`preference_pair_signs` makes them (0 where a sample is out of the loss). Groups
    without both a +1 and a -1 sample have no pair; their log-ratios are 0.
    """
    if log_ratios.numel() % group_size != 0:
        raise ValueError(f"{log_ratios.numel()} samples are not whole groups of {group_size}: a pair must not be split")
    ratios = log_ratios.view(-1, group_size)
    signs = signs.view(-1, group_size)
    chosen, rejected = signs > 0, signs < 0
    has_pair = chosen.any(-1) & rejected.any(-1)
    chosen_ratio = torch.where(chosen, ratios, 0.0).sum(-1)
    rejected_ratio = torch.where(rejected, ratios, 0.0).sum(-1)
    zero = torch.zeros_like(chosen_ratio)
    return torch.where(has_pair, chosen_ratio, zero), torch.where(has_pair, rejected_ratio, zero), has_pair


def dpo_loss(chosen_log_ratio: torch.Tensor, rejected_log_ratio: torch.Tensor, beta: float) -> torch.Tensor:
    """-log sigmoid(beta * (chosen_log_ratio - rejected_log_ratio)) per pair; [P], [P] -> [P].

    Each log-ratio is log pi(y|x) - log pi_ref(y|x) of the whole response (:func:`sequence_log_ratios`).
    """
    return -F.logsigmoid(beta * (chosen_log_ratio - rejected_log_ratio))
