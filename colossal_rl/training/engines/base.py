"""The trainer's one seam to a training backend: what an engine must do, and nothing about how.

A :class:`TrainEngine` owns the distributed machinery of one consumer rank: the process group, wrapping the policy and
its optimizer, the backward pass, clipping and the optimizer step, gathering full weights (for the weight sync and the
HF export) and saving and loading its state. Everything else — the objective, the sequence layouts, the micro-batch
loop, the step runners, the weight-sync senders — is the trainer's and is shared by every engine (``trainer.py``).
Backends are registered by name in ``engines/__init__.py`` and imported only when chosen, so the ColossalAI engine's
imports never happen in a process that runs FSDP2 (and the reverse).

No module outside ``engines/`` may ask which engine runs: what differs between them is said here, as capabilities.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from colossal_rl.training.micro_batch_forward import MicroBatchForward
    from colossal_rl.training.step_runners import PipelineSteps, PlainSteps

StateDict = dict[str, torch.Tensor]
OptimizerFactory = Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]
"""Builds the optimizer over the parameters the engine trains (after the engine sharded them)."""
SchedulerFactory = Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LRScheduler]


@dataclass(frozen=True, kw_only=True)
class PolicyTraits:
    """What the engine must know about the policy to wrap it (found by the trainer, never by model name)."""

    vision_language: bool = False
    mixture_of_experts: bool = False


@dataclass(frozen=True, kw_only=True)
class ParallelGroups:
    """Where this rank sits: its data-parallel group (gradients averaged, batches dealt) and, when the policy's logits
    come vocabulary-sharded, the tensor-parallel group they are sharded over (None: whole logits)."""

    dp_group: dist.ProcessGroup
    vocab_sharded_over: dist.ProcessGroup | None = None


class TrainEngine(Protocol):
    """One consumer rank's training backend. Every method marked collective is called by every rank."""

    model: torch.nn.Module
    """The wrapped policy: call it like the Hugging Face model (``model(**inputs).logits``)."""
    optimizer: torch.optim.Optimizer
    lr_scheduler: torch.optim.lr_scheduler.LRScheduler

    head_weight_outside_forward: bool
    """Whether the output head's weight may be used after the model's forward (log-probs from hidden states, chunk
    by chunk, ``train.logits_from_hidden``); False when it only exists whole inside the forward (sharded params)."""
    forward_is_collective: bool
    """Whether every forward, no-grad ones included, is a collective over the data-parallel ranks (parameters
    gathered on the fly): every rank must then run as many micro-batch forwards."""

    def start_process_group(
        self, rank: int, world_size: int, store: dist.Store, *, on_cpu: bool, timeout_s: float
    ) -> None:
        """The consumers' default process group over ``store`` (gloo on CPU, NCCL on GPU), once per process."""

    def device(self) -> torch.device:
        """The device this rank trains on (its GPU, or the CPU), once the process group started."""

    def load_dtype(self, precision: torch.dtype) -> torch.dtype:
        """The dtype the policy is loaded in for training in ``precision`` (fp32 where the engine keeps fp32 master
        weights itself and casts for compute)."""

    def wrap(
        self,
        model: torch.nn.Module,
        traits: PolicyTraits,
        make_optimizer: OptimizerFactory,
        make_lr_scheduler: SchedulerFactory,
    ) -> None:
        """Shard or wrap ``model`` (on this rank's device), then build the optimizer over its trainable parameters and
        the learning-rate schedule; sets :attr:`model`, :attr:`optimizer`, :attr:`lr_scheduler`."""

    def wrap_reference(self, reference: torch.nn.Module) -> torch.nn.Module:
        """The frozen reference policy, placed and sharded as this engine needs (collective where it shards)."""

    def groups(self) -> ParallelGroups: ...

    def step_runner(self, micro_forward: MicroBatchForward, dp_size: int) -> PlainSteps | PipelineSteps:
        """How a chunk of a step's samples runs forward/backward (``training/step_runners.py``)."""

    def backward(self, loss: torch.Tensor) -> None: ...

    def optimizer_step(self, max_norm: float) -> float | None:
        """Clip the gradients to ``max_norm`` (global norm over every shard; no clipping at ``<= 0``), step, zero the
        gradients; the norm before clipping, None when none was computed. Collective."""

    def unwrapped(self) -> torch.nn.Module:
        """The Hugging Face module inside the wrapper (its config, its parameter names)."""

    @property
    def sync_stage(self) -> int | None:
        """The pipeline stage whose weights this rank sends to the producers (0 without PP); None if it sends none."""

    def stage_state_dict(self) -> StateDict | None:
        """This rank's share of the weight sync at full shape on its stage's sender, None elsewhere. Collective."""

    def full_state_dict(self) -> StateDict | None:
        """Every parameter at full shape, Hugging Face names, on global rank 0; None elsewhere. Collective."""

    def save_state(self, directory: Path, *, rank: int) -> None:
        """Model, optimizer and LR-schedule state of this rank into ``directory`` (exact resume). Collective."""

    def load_state(self, directory: Path, *, rank: int) -> None:
        """The state :meth:`save_state` wrote. Collective."""
