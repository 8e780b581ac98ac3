"""How a chunk of a step's samples runs through the policy: plainly, or through ColossalAI's pipeline schedule.

A step runner does a chunk's forward/backward (gradients of its share of the step loss) and its no-grad
log-probs, and says where the step's metrics end up. The training engine picks one at build (``engines/``):
:class:`PlainSteps` (micro-batches in the configured sequence layout, ``training/micro_batch_forward.py``) or
:class:`PipelineSteps` (1F1B pipeline micro-batches, padded); nothing else branches on pipeline parallelism,
so the two paths keep the same interface. No loss math (the :class:`StepLoss` they are given), no optimizer
step, no data-parallel collectives.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from colossal_rl.batch import RolloutBatch
from colossal_rl.training.micro_batch_forward import MicroBatchForward
from colossal_rl.training.policy_forward import model_inputs
from colossal_rl.training.step_loss import StepLoss, StepTotals

if TYPE_CHECKING:
    from colossalai.booster import Booster
    from colossalai.booster.plugin import Plugin

__all__ = ["PipelineSteps", "PlainSteps"]


class PlainSteps:
    """Without pipeline parallelism: ``train.microbatch_size`` samples (or a token budget) per forward."""

    def __init__(self, micro_forward: MicroBatchForward, backward: Callable[[torch.Tensor], None], dp_size: int):
        """``backward``: the engine's backward of a loss. ``dp_size``: data-parallel ranks (their gradients are
        averaged; the loss already divides by global counts, so each backward scales it back up)."""
        self.micro_forward = micro_forward
        self.backward = backward
        self.dp_size = dp_size

    def forward_backward(
        self,
        model: torch.nn.Module,
        chunk: RolloutBatch,
        ref_logprobs: torch.Tensor | None,
        step_loss: StepLoss,
        totals: StepTotals,
    ) -> torch.Tensor:
        """Gradients of ``chunk``'s share of the step loss; returns its log-probs before the update [n, R]
        (detached)."""
        captured = []
        for start, stop in self.micro_forward.micro_ranges(chunk, same_count_on_every_rank=True):
            part = chunk.sample_range(start, stop)
            with self.micro_forward.output_head(model) as head_weight:
                new_logprobs, entropy, forward, router_balance = self.micro_forward.terms(
                    model, part, chunk.group_size, head_weight, with_entropy=True, totals=totals
                )
                loss = step_loss(new_logprobs, entropy, chunk, start, stop, ref_logprobs, totals)
                if router_balance is not None:  # a share of the routers' balance loss, a mean over the step
                    loss = loss + step_loss.router_balance_term(router_balance, part.num_samples, self.dp_size, totals)
                self.backward(loss * self.dp_size)
            totals.add_tokens(forward.real_tokens, forward.computed_tokens)
            captured.append(new_logprobs.detach())
        return torch.cat(captured)

    def logprobs_no_grad(self, model: torch.nn.Module, chunk: RolloutBatch) -> torch.Tensor:
        """Log-probs [n, R] on the device of a chunk already there, under ``model``, without gradient."""
        with torch.no_grad(), self.micro_forward.output_head(model) as head_weight:
            parts = []
            for start, stop in self.micro_forward.micro_ranges(chunk, same_count_on_every_rank=False):
                part = chunk.sample_range(start, stop)
                parts.append(
                    self.micro_forward.terms(model, part, chunk.group_size, head_weight, with_entropy=False)[0]
                )
            return torch.cat(parts)

    def step_metrics(self, totals: StepTotals) -> dict[str, float]:
        """The step's metrics on this rank: its own."""
        return totals.values


class PipelineSteps:
    """Under pipeline parallelism: ColossalAI's 1F1B schedule slices a chunk's padded rows into micro-batches of
    the schedule's ``microbatch_size`` and calls the criterion on the last stage once per micro-batch, in order;
    the criterion picks that micro-batch's samples from the chunk. Outputs exist on the last stage only."""

    def __init__(self, micro_forward: MicroBatchForward, booster: Booster, optimizer, dp_size: int, plugin: Plugin):
        self.micro_forward = micro_forward
        self.booster = booster
        self.optimizer = optimizer
        self.dp_size = dp_size
        self.plugin = plugin

    def _micro_size(self, chunk: RolloutBatch) -> int:
        micro = self.plugin.scheduler.microbatch_size  # the plugin keeps it only on its pipeline schedule
        num_micro = chunk.num_samples // micro
        if num_micro * micro != chunk.num_samples or num_micro < self.plugin.pp_size:
            raise ValueError(
                f"a chunk's {chunk.num_samples} samples must split into at least pp_size = {self.plugin.pp_size} "
                f"pipeline micro-batches of {micro} (train.microbatch_size // pp_size)"
            )
        return micro

    def forward_backward(
        self,
        model: torch.nn.Module,
        chunk: RolloutBatch,
        ref_logprobs: torch.Tensor | None,
        step_loss: StepLoss,
        totals: StepTotals,
    ) -> torch.Tensor | None:
        """The gradients :meth:`PlainSteps.forward_backward` takes, through the pipeline schedule; returns the
        chunk's log-probs on the last stage, None elsewhere."""
        micro = self._micro_size(chunk)
        num_micro = chunk.num_samples // micro
        starts = iter(range(0, chunk.num_samples, micro))
        captured: list[torch.Tensor] = []

        with self.micro_forward.output_head(model) as head_weight:

            def criterion(outputs, inputs) -> torch.Tensor:
                start = next(starts)
                part = chunk.sample_range(start, start + micro)
                new_logprobs, entropy = self.micro_forward.padded_terms(
                    outputs.logits, head_weight, part, with_entropy=True
                )
                loss = step_loss(new_logprobs, entropy, chunk, start, start + micro, ref_logprobs, totals)
                captured.append(new_logprobs.detach())
                return loss * self.dp_size * num_micro  # the schedule divides by the number of micro-batches

            input_ids, attention_mask = chunk.sequences()
            self.booster.execute_pipeline(
                iter([model_inputs(input_ids, attention_mask)]), model, criterion, self.optimizer, return_loss=False
            )
        totals.add_tokens(int(attention_mask.sum()), attention_mask.numel())
        return torch.cat(captured) if captured else None

    def logprobs_no_grad(self, model: torch.nn.Module, chunk: RolloutBatch) -> torch.Tensor | None:
        """Log-probs [n, R] on the last stage (None elsewhere) of a chunk on the device, without gradient."""
        micro = self._micro_size(chunk)
        starts = iter(range(0, chunk.num_samples, micro))
        parts: list[torch.Tensor] = []
        with torch.no_grad(), self.micro_forward.output_head(model) as head_weight:

            def criterion(outputs, inputs) -> torch.Tensor:
                start = next(starts)
                part = chunk.sample_range(start, start + micro)
                parts.append(self.micro_forward.padded_terms(outputs.logits, head_weight, part, with_entropy=False)[0])
                return parts[-1].new_zeros(())

            inputs = model_inputs(*chunk.sequences())
            # no_sync: after a pass ColossalAI all-reduces tied weights' gradients unless syncing is off; a
            # forward-only pass has no gradients to reduce.
            with model.no_sync():
                self.booster.execute_pipeline(iter([inputs]), model, criterion, optimizer=None, return_loss=False)
        return torch.cat(parts) if parts else None

    def step_metrics(self, totals: StepTotals) -> dict[str, float]:
        """The last stage's metrics on every stage (only the last stage computes the loss). Collective over the
        pipeline group."""
        pp_group = self.plugin.pp_group
        last_stage = dist.get_process_group_ranks(pp_group)[-1]
        message = [totals.values if dist.get_rank() == last_stage else None]
        dist.broadcast_object_list(message, src=last_stage, group=pp_group)
        return message[0]
