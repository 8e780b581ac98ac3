"""The ColossalAI engine: the policy under a Booster plugin (DDP, ZeRO 1/2, tensor and pipeline parallelism).

Runs in the trainers' environment (torch 2.5.1, transformers 4.51.3, ColossalAI 0.5.0). Which plugin trains a layout
is ``booster_plugins.py``'s; getting full weights out of each layout is ``full_state_dict.py``'s; the checkpoint goes
through the Booster's checkpoint IO (each rank writes its shards).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.distributed as dist
from colossalai.booster import Booster
from colossalai.booster.plugin import Plugin

from colossal_rl.config import RLConfig
from colossal_rl.training.booster_plugins import clip_and_step, launch_colossalai, make_plugin, tensor_parallel_group
from colossal_rl.training.engines.base import (
    OptimizerFactory,
    ParallelGroups,
    PolicyTraits,
    SchedulerFactory,
    StateDict,
)
from colossal_rl.training.full_state_dict import gather_full_state_dict, gather_stage_state_dict, sync_stage
from colossal_rl.training.step_runners import PipelineSteps, PlainSteps

logger = logging.getLogger(__name__)

MODEL_DIR = "model"
OPTIMIZER_DIR = "optimizer"


class ColossalAIEngine:
    head_weight_outside_forward = True
    forward_is_collective = False  # DDP and ZeRO 1/2 hold full parameters; TP/PP forwards are in-group collectives

    def __init__(self, config: RLConfig, plugin: Plugin | None = None):
        """``plugin``: instead of ``make_plugin``'s choice for ``config.parallel`` (tests train one layout under
        several plugins in one process group)."""
        self.config = config
        self.plugin = plugin
        self.booster: Booster | None = None
        self.model = None
        self.optimizer = None
        self.lr_scheduler = None

    def start_process_group(
        self, rank: int, world_size: int, store: dist.Store, *, on_cpu: bool, timeout_s: float
    ) -> None:
        launch_colossalai(rank, world_size, "", 0, on_cpu=on_cpu, store=store, timeout_s=timeout_s)

    def device(self) -> torch.device:
        """ColossalAI's accelerator's current device (its GPU, or the CPU)."""
        from colossalai.accelerator import get_accelerator

        return torch.device(get_accelerator().get_current_device())

    def load_dtype(self, precision: torch.dtype) -> torch.dtype:
        return precision  # the mixed-precision plugins keep their own fp32 masters

    def wrap(
        self,
        model: torch.nn.Module,
        traits: PolicyTraits,
        make_optimizer: OptimizerFactory,
        make_lr_scheduler: SchedulerFactory,
    ) -> None:
        """The plugin, the optimizer over the trainable parameters and the boosted model (ColossalAI's plugins take
        the optimizer before they wrap, and shard its states themselves)."""
        train = self.config.train
        self.plugin = self.plugin or make_plugin(
            self.config.parallel,
            microbatch_size=train.microbatch_size,
            max_norm=train.max_norm,
            on_cpu=not torch.cuda.is_available(),
            vision_language=traits.vision_language,
            mixture_of_experts=traits.mixture_of_experts,
        )
        self.booster = Booster(plugin=self.plugin)
        optimizer = make_optimizer([parameter for parameter in model.parameters() if parameter.requires_grad])
        lr_scheduler = make_lr_scheduler(optimizer)
        self.model, self.optimizer, _, _, self.lr_scheduler = self.booster.boost(
            model, optimizer, lr_scheduler=lr_scheduler
        )

    def wrap_reference(self, reference: torch.nn.Module) -> torch.nn.Module:
        """Sharded like the policy (through the booster) under tensor or pipeline parallelism, as ColossalChat does."""
        parallel = self.config.parallel
        if parallel.tp_size > 1 or parallel.pp_size > 1:
            reference, *_ = self.booster.boost(reference)
        return reference

    def groups(self) -> ParallelGroups:
        plugin_group = getattr(self.plugin, "dp_group", None)
        return ParallelGroups(
            dp_group=plugin_group if plugin_group is not None else dist.group.WORLD,
            vocab_sharded_over=tensor_parallel_group(self.plugin),
        )

    def step_runner(self, micro_forward, dp_size: int) -> PlainSteps | PipelineSteps:
        if self.config.parallel.pp_size > 1:
            return PipelineSteps(micro_forward, self.booster, self.optimizer, dp_size, self.plugin)
        return PlainSteps(micro_forward, self.backward, dp_size)

    def backward(self, loss: torch.Tensor) -> None:
        self.booster.backward(loss, self.optimizer)

    def optimizer_step(self, max_norm: float) -> float | None:
        return clip_and_step(self.model, self.optimizer, self.plugin, max_norm)

    def unwrapped(self) -> torch.nn.Module:
        return self.model.unwrap()

    @property
    def sync_stage(self) -> int | None:
        return sync_stage(self.plugin)

    def stage_state_dict(self) -> StateDict | None:
        return gather_stage_state_dict(self.model, self.plugin, self.optimizer)

    def full_state_dict(self) -> StateDict | None:
        return gather_full_state_dict(self.model, self.plugin, self.optimizer)

    def save_state(self, directory: Path, *, rank: int) -> None:
        self.booster.save_model(self.model, str(directory / MODEL_DIR), shard=True)  # tied weights: no safetensors
        self.booster.save_optimizer(self.optimizer, str(directory / OPTIMIZER_DIR), shard=True)

    def load_state(self, directory: Path, *, rank: int) -> None:
        for needed in (directory / MODEL_DIR, directory / OPTIMIZER_DIR):
            if not needed.exists():
                raise FileNotFoundError(f"{needed}: missing from the trainer checkpoint")
        self.booster.load_model(self.model, str(directory / MODEL_DIR))
        self.booster.load_optimizer(self.optimizer, str(directory / OPTIMIZER_DIR))
