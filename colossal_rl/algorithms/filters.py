"""Sample and group filters, and reward shaping by response length (DAPO).

Samples are group-major: sample ``i`` answers prompt ``i // group_size``.
Pure torch; no config objects, no distributed code.
"""

from __future__ import annotations

import torch


def dynamic_sampling_group_mask(
    answer_correct: torch.Tensor,
    group_size: int,
    low: float,
    high: float,
    valid_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """keep_g = low <= mean_{i in g, valid} correct_i <= high.

    DAPO's dynamic sampling, Yu et al. 2025 (arXiv:2503.14476): a group whose samples are all right or
    all wrong has zero advantage and only dilutes the batch. The accuracy counts valid samples only;
    a group without valid samples is dropped. answer_correct [N], valid_mask [N] -> keep [N / G] bool.
    """
    if answer_correct.numel() % group_size != 0:
        raise ValueError(f"{answer_correct.numel()} samples are not a whole number of groups of {group_size}")
    correct = answer_correct.float().view(-1, group_size)
    valid = torch.ones_like(correct) if valid_mask is None else valid_mask.float().view(-1, group_size)
    count = valid.sum(-1)
    accuracy = (correct * valid).sum(-1) / count.clamp(min=1)
    return (count > 0) & (accuracy >= low) & (accuracy <= high)


def filter_truncated_response(truncated: torch.Tensor) -> torch.Tensor:
    """keep_i = not truncated_i: responses that hit max_new_tokens without EOS leave the loss.

    DAPO's overlong filtering, Yu et al. 2025 (arXiv:2503.14476). truncated [N] bool -> keep [N] float.
    """
    return (~truncated.bool()).float()


def soft_over_length_penalty(response_lengths: torch.Tensor, max_new_tokens: int, cache_length: int) -> torch.Tensor:
    """R_len = 0 if L <= L_max - L_cache; ((L_max - L_cache) - L) / L_cache if L <= L_max; -1 beyond.

    DAPO's soft overlong punishment, Yu et al. 2025 (arXiv:2503.14476), eq. 13, added to the reward:
    linear from 0 down to -1 over the last ``cache_length`` tokens. response_lengths [N] -> penalty [N].
    """
    lengths = response_lengths.float()
    if cache_length == 0:
        return torch.where(lengths > max_new_tokens, -1.0, 0.0)
    expected = max_new_tokens - cache_length
    return ((expected - lengths) / cache_length).clamp(min=-1.0, max=0.0)
