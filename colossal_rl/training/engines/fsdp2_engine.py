"""The FSDP2 engine: torch's ``fully_shard`` on each decoder layer, then on the whole model.

Runs wherever torch has FSDP2 — the producers' environment (today's torch and transformers, so the model types of
2026 load) and, for parity tests, the trainers' (torch 2.5.1 ships it as ``torch.distributed._composable.fsdp``). It
imports nothing of ColossalAI. Parameters, gradients and optimizer states are sharded over every trainer (ZeRO-3's
layout); gradients are averaged over the ranks by the reduce-scatter, as under DDP. Under ``bf16`` the sharded
parameters stay fp32 (the optimizer's masters), each layer computes in bf16 and gradients are reduced in fp32.

Decoder layers are found generically, never by model name: the classes a Hugging Face model lists in
``_no_split_modules`` (what ``device_map`` must not split) are the blocks to shard one by one.

Full weights (weight sync, HF export) come from ``get_model_state_dict(full_state_dict=True, cpu_offload=True)``: a
collective that leaves them on rank 0's host. Checkpoints are torch's distributed checkpoint (each rank writes its own
shards, model and optimizer together), so resume is exact.
"""

from __future__ import annotations

import datetime
import logging
import random
from pathlib import Path

import torch
import torch.distributed as dist

from colossal_rl.config import RLConfig, resolve_precision
from colossal_rl.training.engines.base import (
    OptimizerFactory,
    ParallelGroups,
    PolicyTraits,
    SchedulerFactory,
    StateDict,
)
from colossal_rl.training.step_runners import PlainSteps

try:  # torch >= 2.6
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
except ImportError:  # torch 2.5
    from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard

logger = logging.getLogger(__name__)

CHECKPOINT_DIR = "fsdp2"
"""Where :meth:`FSDP2Engine.save_state` writes torch's distributed checkpoint inside the trainer directory."""
LAUNCH_SEED = 1024
"""What ``colossalai.launch`` seeds every RNG with: the same streams under either engine."""
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def decoder_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules to shard one by one: instances of the classes named in the model's ``_no_split_modules`` that are
    not inside another such instance (Hugging Face lists its decoder layers, and vision blocks, there)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    blocks: list[torch.nn.Module] = []
    inside: set[int] = set()
    for module in model.modules():
        if id(module) in inside:
            continue
        if type(module).__name__ in names:
            blocks.append(module)
            inside.update(id(child) for child in module.modules())
    return blocks


def full_norm(norm: torch.Tensor) -> float:
    """A gradient norm as a float: a DTensor's full value (every rank's shards counted), or the tensor's."""
    full_tensor = getattr(norm, "full_tensor", None)
    return float(full_tensor() if callable(full_tensor) else norm)


class FSDP2Engine:
    head_weight_outside_forward = False  # the root's parameters are whole only inside its forward
    forward_is_collective = True  # every forward all-gathers each layer's parameters

    def __init__(self, config: RLConfig):
        self.config = config
        precision = resolve_precision(config.parallel.precision, on_gpu=torch.cuda.is_available())
        if precision not in _DTYPES:
            raise ValueError(f"parallel.precision: fsdp2 trains in fp32 or bf16, not {precision!r}")
        self.compute_dtype = _DTYPES[precision]
        self.model = None
        self.optimizer = None
        self.lr_scheduler = None

    def start_process_group(
        self, rank: int, world_size: int, store: dist.Store, *, on_cpu: bool, timeout_s: float
    ) -> None:
        """gloo on CPU, NCCL on GPU, bounded by ``timeout_s``; RNGs seeded as ``colossalai.launch`` seeds them."""
        dist.init_process_group(
            backend="gloo" if on_cpu else "nccl",
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        random.seed(LAUNCH_SEED)
        torch.manual_seed(LAUNCH_SEED)
        try:
            import numpy

            numpy.random.seed(LAUNCH_SEED)
        except ImportError:
            pass

    def device(self) -> torch.device:
        """The current CUDA device (Ray gives each trainer its own), else the CPU."""
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def load_dtype(self, precision: torch.dtype) -> torch.dtype:
        return torch.float32  # fp32 shards are the masters; layers compute in the training precision

    def _mixed_precision(self) -> MixedPrecisionPolicy:
        if self.compute_dtype == torch.float32:
            return MixedPrecisionPolicy()
        return MixedPrecisionPolicy(param_dtype=self.compute_dtype, reduce_dtype=torch.float32)

    def wrap(
        self,
        model: torch.nn.Module,
        traits: PolicyTraits,
        make_optimizer: OptimizerFactory,
        make_lr_scheduler: SchedulerFactory,
    ) -> None:
        """``fully_shard`` each decoder block, then the root (embeddings, final norm, output head); the optimizer is
        built over the sharded parameters."""
        from torch.distributed.device_mesh import init_device_mesh

        device_type = next(model.parameters()).device.type
        mesh = init_device_mesh(device_type, (dist.get_world_size(),))
        policy = self._mixed_precision()
        blocks = decoder_blocks(model)
        for block in blocks:
            fully_shard(block, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        if dist.get_rank() == 0:
            logger.info(
                "fsdp2: %d blocks sharded over %d rank(s), computing in %s",
                len(blocks),
                dist.get_world_size(),
                str(self.compute_dtype).removeprefix("torch."),
            )
        self.model = model
        self.optimizer = make_optimizer([parameter for parameter in model.parameters() if parameter.requires_grad])
        self.lr_scheduler = make_lr_scheduler(self.optimizer)

    def wrap_reference(self, reference: torch.nn.Module) -> torch.nn.Module:
        """Whole on every rank (frozen, no optimizer state): its forwards are no collective."""
        return reference

    def groups(self) -> ParallelGroups:
        return ParallelGroups(dp_group=dist.group.WORLD)

    def step_runner(self, micro_forward, dp_size: int) -> PlainSteps:
        return PlainSteps(micro_forward, self.backward, dp_size)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def optimizer_step(self, max_norm: float) -> float | None:
        norm = None
        if max_norm > 0:
            parameters = [parameter for parameter in self.model.parameters() if parameter.grad is not None]
            norm = full_norm(torch.nn.utils.clip_grad_norm_(parameters, max_norm))
        self.optimizer.step()
        self.optimizer.zero_grad()
        return norm

    def unwrapped(self) -> torch.nn.Module:
        return self.model

    @property
    def sync_stage(self) -> int | None:
        return 0 if dist.get_rank() == 0 else None

    def stage_state_dict(self) -> StateDict | None:
        return self.full_state_dict()

    def full_state_dict(self) -> StateDict | None:
        """Every parameter whole on rank 0's host, in the training precision (what the producers load). Collective."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = get_model_state_dict(self.model, options=options)
        if dist.get_rank() != 0:
            return None
        return {name: tensor.to(self.compute_dtype) for name, tensor in state.items()}

    def _state(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
        return {"model": model_state, "optimizer": optimizer_state}

    def save_state(self, directory: Path, *, rank: int) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.save(self._state(), checkpoint_id=str(Path(directory) / CHECKPOINT_DIR))

    def load_state(self, directory: Path, *, rank: int) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        path = Path(directory) / CHECKPOINT_DIR
        if not path.is_dir():
            raise FileNotFoundError(f"{path}: missing from the trainer checkpoint (saved by another trainer backend?)")
        state = self._state()
        dcp.load(state, checkpoint_id=str(path))
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
