"""verl's REINFORCE++-baseline advantage, re-implemented from its math as the reference for our estimator.

Shared by the estimator tests (``test_advantages.py``) and the step-level ones (``test_step_advantages.py``).
"""

from __future__ import annotations

import torch


def verl_reinforce_ppb(scores: torch.Tensor, response_mask: torch.Tensor, index: list) -> torch.Tensor:
    """verl's compute_reinforce_plus_plus_baseline_outcome_advantage and masked_whiten, transcribed from their
    math in float64: group mean (a prompt with one response keeps its score), broadcast over the response
    tokens, whitened with the masked token mean and the Bessel-corrected masked token variance. [N, T]."""
    scores, mask = scores.double().clone(), response_mask.double()
    groups = {}
    for i, prompt in enumerate(index):
        groups.setdefault(prompt, []).append(i)
    for members in groups.values():
        baseline = scores[members].mean() if len(members) > 1 else 0.0
        scores[members] = scores[members] - baseline
    tokens = scores[:, None] * mask
    count = mask.sum()
    mean = (tokens * mask).sum() / (count + 1e-8)
    variance = ((tokens - mean).square() * mask).sum() / (count + 1e-8) * count / (count - 1)
    return (tokens - mean) * torch.rsqrt(variance + 1e-8) * mask
