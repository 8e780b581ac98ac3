"""Batch-level advantage statistics over the optimizer step's batch, whatever the schedule.

Producers attach each sample's advantage computed within its group (``rollout/postprocess.py``); for the
estimators whose statistics span the batch (``algorithms.advantages.BATCH_STAGES``: reinforce, reinforce_ppb,
reinforce_ppb_sample) that is only the per-group part, and a producer batch is a round's share, a stream
chunk or one group. The trainer finishes them here, once per optimizer step, over every sample of the step:
this rank's share's ``batch_moments``, summed over the data-parallel ranks by the caller's ``sum_over_ranks``
(the global statistic: identity in one process), then the estimator's ``finish`` on this rank's share.
Every tensor- and pipeline-parallel rank of a data-parallel rank holds the same share and gets the same sums,
so they all train on the same advantages. Looks the stage up by name; no communication of its own.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from colossal_rl.algorithms import batch_moments, batch_stage
from colossal_rl.batch import RolloutBatch
from colossal_rl.config import AlgorithmConfig

__all__ = ["step_advantages"]


def step_advantages(
    batch: RolloutBatch, algo: AlgorithmConfig, sum_over_ranks: Callable[[torch.Tensor], torch.Tensor]
) -> RolloutBatch:
    """``batch`` (this rank's share of one optimizer step) with its advantages finished over the whole step.

    Unchanged, and no ``sum_over_ranks`` call, for group-level estimators (their advantages are final).
    ``sum_over_ranks``: float64 [3] -> the elementwise sum over the step's data-parallel ranks (every rank
    calls it, in step). The samples' weights are their ``loss_mask`` (times their policy tokens for a
    token-weighted estimator), as the producers' valid mask was.
    """
    stage = batch_stage(algo.advantage_estimator)
    if stage is None:
        return batch
    if batch.advantages is None:
        raise ValueError(f"{algo.advantage_estimator} needs the producers' per-group advantages; the batch has none")
    lengths = batch.policy_token_mask().sum(-1)  # multi-turn: the policy's own tokens, as the producer counted
    weights = stage.weights(batch.advantages, batch.loss_mask, lengths)
    moments = sum_over_ranks(batch_moments(batch.advantages, weights))
    return batch.with_advantages(stage.finish(batch.advantages, weights, moments, algo.advantage_eps))
