"""One optimizer step's loss, micro-batch by micro-batch, and the metrics the micro-batches add up to.

The trainer makes a :class:`StepLoss` per optimizer step (after counting the step's loss tokens and samples
over the data-parallel ranks) and a :class:`StepTotals` to collect its metrics; a step runner
(``training/step_runners.py``) calls the loss once per micro-batch. The math itself is the registered
objective's (``training/objective.py``): this module only cuts the micro-batch out of its chunk, hands the
objective the step's global denominators, and adds up metrics. No communication, no model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from colossal_rl.batch import RolloutBatch
from colossal_rl.config import AlgorithmConfig
from colossal_rl.training.objective import Objective

__all__ = ["StepCounts", "StepLoss", "StepTotals"]


@dataclass(frozen=True)
class StepCounts:
    """Global counts of one optimizer step, summed over the data-parallel ranks: the loss's denominators."""

    trained_tokens: float
    """Response tokens the loss covers (``RolloutBatch.trained_token_mask``), at least 1."""
    loss_samples: float
    """Samples the loss covers (``loss_mask``), at least 1."""


class StepTotals:
    """The metrics of one optimizer step on this rank, added to by each micro-batch (mutable, per step)."""

    def __init__(self) -> None:
        self.values: dict[str, float] = {}

    def add(self, name: str, value: float) -> None:
        self.values[name] = self.values.get(name, 0.0) + value

    def add_metrics(self, metrics: dict[str, torch.Tensor], weight: float) -> None:
        """One micro-batch's metrics: names ending in ``_max`` by maximum, the rest weighted by ``weight``."""
        for name, value in metrics.items():
            if name.endswith("_max"):
                self.values[name] = max(self.values.get(name, float("-inf")), float(value))
            else:
                self.add(name, float(value) * weight)

    def add_tokens(self, real: int, computed: int) -> None:
        """One training forward's tokens: real ones (each sample on its own) and the positions computed."""
        self.add("train/real_tokens", real)
        self.add("train/computed_tokens", computed)


@dataclass(frozen=True)
class StepLoss:
    """The objective of one optimizer step's micro-batches, scaled by the step's global counts.

    Summed over every micro-batch and data-parallel rank of the step, the returned losses are the step's loss
    (the objective's contract, ``training/objective.py``).
    """

    objective: Objective
    algorithm: AlgorithmConfig
    max_response_length: int
    """``generation.max_new_tokens`` (the ``seq_mean_token_sum`` aggregation divides by it)."""
    counts: StepCounts
    step_samples: int
    """Samples of this rank's step (weights of the mean metrics)."""
    router_aux_loss_coef: float = 0.0
    """``train.router_aux_loss_coef``: the weight of a mixture-of-experts policy's balance loss."""

    def __call__(
        self,
        new_logprobs: torch.Tensor,
        entropy: torch.Tensor,
        chunk: RolloutBatch,
        start: int,
        stop: int,
        ref_logprobs: torch.Tensor | None,
        totals: StepTotals,
    ) -> torch.Tensor:
        """The loss of samples [start, stop) of ``chunk`` given their log-probs and entropy [n, R]; adds the
        micro-batch's metrics to ``totals``.

        ``ref_logprobs``: the whole chunk's [N, R] (or None). pi_old is the samples' ``old_logprobs`` when set,
        else ``new_logprobs`` detached (the step's own forward, before its update). An objective comparing a
        group's samples gets ``chunk.group_size`` (its micro-batches are whole groups). ``train/entropy`` is
        summed over the micro-batch's loss tokens and divided by the step's global token count, so after the
        sum over data-parallel ranks it is the mean entropy per trained token.
        """
        micro = chunk.sample_range(start, stop)
        old_logprobs = new_logprobs.detach() if micro.old_logprobs is None else micro.old_logprobs
        loss, metrics = self.objective.loss(
            new_logprobs=new_logprobs,
            old_logprobs=old_logprobs,
            behaviour_logprobs=micro.behaviour_logprobs,
            ref_logprobs=None if ref_logprobs is None else ref_logprobs[start:stop],
            advantages=micro.advantages,
            response_mask=micro.policy_token_mask(),  # multi-turn: the environment's tokens are context only
            loss_mask=micro.loss_mask,
            algo=self.algorithm,
            global_token_count=self.counts.trained_tokens,
            global_sample_count=self.counts.loss_samples,
            max_response_length=self.max_response_length,
            group_size=chunk.group_size,
        )
        totals.add("train/loss", float(loss.detach()))
        trained_entropy = float((entropy * micro.trained_token_mask()).sum())
        totals.add("train/entropy", trained_entropy / self.counts.trained_tokens)
        totals.add_metrics(metrics, weight=micro.num_samples / self.step_samples)
        return loss

    def router_balance_term(
        self, balance: torch.Tensor, num_samples: int, dp_size: int, totals: StepTotals
    ) -> torch.Tensor:
        """A micro-batch of ``num_samples`` samples' share of ``router_aux_loss_coef`` x the routers' balance loss
        (``moe/routing.py``): summed over the step's micro-batches, and averaged over the data-parallel ranks by
        their gradient all-reduce (each backward scales by ``dp_size``), it is the coefficient times the mean
        balance loss. ``train/router_balance_loss``: this rank's sample-weighted mean."""
        share = num_samples / self.step_samples
        totals.add("train/router_balance_loss", float(balance.detach()) * share)
        return self.router_aux_loss_coef * balance * share / dp_size
