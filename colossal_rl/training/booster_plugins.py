"""Choosing and building the ColossalAI Booster plugin of the consumers, and starting their process group.

Which plugin trains a layout:

==========================  ===========================  ============================================
layout                      plugin                       notes
==========================  ===========================  ============================================
tp = pp = 1, zero 0, fp32   ``TorchDDPPlugin``           it has no mixed precision and never clips:
                                                         use :func:`clip_and_step`
tp = pp = 1, zero 0, bf16   ``HybridParallelPlugin``     mixed precision with fp32 master weights;
                                                         ``LowLevelZeroPlugin`` stage 1 for a
                                                         vision-language model (no ShardFormer policy)
tp = pp = 1, zero 1/2       ``LowLevelZeroPlugin``       fp32 allowed
tp > 1 or pp > 1            ``HybridParallelPlugin``     ZeRO only with bf16/fp16; ZeRO-2 not with pp
==========================  ===========================  ============================================

ZeRO's and the hybrid plugin's optimizers clip to ``max_norm`` inside ``step()``. On CPU, ZeRO's
communication overlap is off (it needs CUDA streams) and :mod:`cpu_compat` patches must be applied
(:func:`launch_colossalai` does it). Under tensor parallelism ColossalAI 0.5.0's Qwen2 policy always
returns the logits sharded over the (padded) vocabulary, whatever ``parallel_output`` says;
:func:`gather_vocab_parallel_logits` makes them whole for log-probabilities. Sequence parallelism is
offered only in ``split_gather`` mode: ``ring`` mode produces wrong weight gradients in ColossalAI 0.5.0.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging

import torch
import torch.distributed as dist
from colossalai.booster.plugin import HybridParallelPlugin, LowLevelZeroPlugin, Plugin, TorchDDPPlugin
from colossalai.interface import OptimizerWrapper

from colossal_rl.config import ConfigError, ParallelConfig, resolve_precision
from colossal_rl.training.cpu_compat import apply_cpu_compat_patches
from colossal_rl.training.rendezvous import connect_rendezvous_store, open_rendezvous_store

__all__ = ["clip_and_step", "launch_colossalai", "make_plugin", "open_rendezvous_store", "tensor_parallel_group"]

logger = logging.getLogger(__name__)

# fp16 starts at 2**16: ColossalAI's ZeRO default of 2**32 overflows, skipping the first step.
_FP16_INITIAL_SCALE = 2.0**16


def launch_colossalai(
    rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    *,
    on_cpu: bool,
    store: dist.Store | None = None,
    timeout_s: float = 600.0,
) -> None:
    """Start the consumers' default process group: gloo plus the CPU patches on CPU, nccl on GPU.

    What ``colossalai.launch`` does (process group, device, seed 1024, dynamo's DDP flag), over a store that
    rank 0 hosts: ``store`` when rank 0 opened it already (:func:`open_rendezvous_store`), else rank 0 opens it
    on ``master_port`` and the others connect to ``master_addr:master_port``. ColossalAI 0.5.0 picks the backend
    from its accelerator; the backend is checked afterwards so a CPU run on a machine with CUDA (or the reverse)
    fails here instead of inside a collective.
    """
    from colossalai.accelerator import get_accelerator
    from colossalai.utils import set_seed

    backend = "gloo" if on_cpu else "nccl"
    if on_cpu:
        apply_cpu_compat_patches()
    accelerator = get_accelerator()
    store = connect_rendezvous_store(rank, world_size, master_addr, master_port, store=store, timeout_s=timeout_s)
    dist.init_process_group(  # without a timeout torch's default (10 minutes) bounds every collective, not --timeout
        backend=accelerator.communication_backend,
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    if accelerator.support_set_device:
        accelerator.set_device(None)
    set_seed(1024)
    torch._dynamo.config.optimize_ddp = world_size > 1
    actual = dist.get_backend()
    if actual != backend:
        raise RuntimeError(f"expected a {backend} process group (on_cpu={on_cpu}), ColossalAI started {actual}")


def make_plugin(
    parallel: ParallelConfig,
    *,
    microbatch_size: int,
    max_norm: float,
    on_cpu: bool,
    vision_language: bool = False,
    mixture_of_experts: bool = False,
) -> Plugin:
    """The plugin for ``parallel`` (see the module docstring); ``microbatch_size`` is the train micro-batch.
    ``--precision auto`` is the device's (bf16 on GPU, fp32 on CPU), as the driver resolves it.

    ``vision_language``: the policy is a vision-language model, which ColossalAI 0.5.0's ShardFormer has no
    policy for (``HybridParallelPlugin`` raises NotImplementedError at boost, even at tp = pp = 1); its mixed
    precision without ZeRO then runs on ``LowLevelZeroPlugin`` stage 1 (the same mixed-precision arithmetic,
    fp32 master weights, with the optimizer states sharded over the data-parallel ranks).

    ``mixture_of_experts``: the policy has MoE layers (Qwen3-MoE), which ShardFormer has no policy for either
    (``moe/support.py`` refuses tp/pp > 1 before a run starts); mixed precision goes the vision-language way, and
    fp32 DDP looks for unused parameters: an expert no token of a micro-batch chose gets no gradient."""
    parallel = dataclasses.replace(parallel, precision=resolve_precision(parallel.precision, on_gpu=not on_cpu))
    parallel.validate()
    if mixture_of_experts and (parallel.tp_size > 1 or parallel.pp_size > 1):
        raise ConfigError("parallel.tp_size", "a mixture-of-experts policy trains with tp = pp = 1 (DDP or ZeRO)")
    if parallel.tp_size > 1 or parallel.pp_size > 1:
        return make_hybrid_plugin(parallel, microbatch_size=microbatch_size, max_norm=max_norm, on_cpu=on_cpu)
    if parallel.zero_stage > 0:
        return make_low_level_zero_plugin(parallel, max_norm=max_norm, on_cpu=on_cpu)
    if parallel.precision == "fp32":
        return TorchDDPPlugin(find_unused_parameters=True) if mixture_of_experts else TorchDDPPlugin()
    if vision_language or mixture_of_experts:
        logger.info(
            "a %s model in %s without ZeRO trains on LowLevelZeroPlugin stage 1",
            "vision-language" if vision_language else "mixture-of-experts",
            parallel.precision,
        )
        return make_low_level_zero_plugin(dataclasses.replace(parallel, zero_stage=1), max_norm=max_norm, on_cpu=on_cpu)
    return make_hybrid_plugin(parallel, microbatch_size=microbatch_size, max_norm=max_norm, on_cpu=on_cpu)


def make_low_level_zero_plugin(parallel: ParallelConfig, *, max_norm: float, on_cpu: bool) -> LowLevelZeroPlugin:
    """ZeRO-1/2 over every rank (data parallel only); any precision."""
    if parallel.zero_stage not in (1, 2):
        raise ConfigError(
            "parallel.zero_stage", f"LowLevelZeroPlugin needs ZeRO stage 1 or 2, got {parallel.zero_stage}"
        )
    return LowLevelZeroPlugin(
        stage=parallel.zero_stage,
        precision=parallel.precision,
        initial_scale=_FP16_INITIAL_SCALE,
        max_norm=max_norm,
        overlap_communication=not on_cpu,
    )


def make_hybrid_plugin(
    parallel: ParallelConfig,
    *,
    microbatch_size: int,
    max_norm: float,
    on_cpu: bool,
    sequence_parallelism: bool = False,
) -> HybridParallelPlugin:
    """Tensor/pipeline parallelism with data parallelism (ZeRO-1/2 in bf16/fp16) over the remaining ranks.

    The pipeline micro-batch is ``max(1, microbatch_size // pp_size)``, as ColossalChat does; a step's
    samples must split into at least ``pp_size`` of them.
    ``sequence_parallelism`` turns on split_gather sequence parallelism over the tensor-parallel group.
    """
    if parallel.zero_stage > 0 and parallel.precision == "fp32":
        raise ConfigError(
            "parallel.precision",
            "HybridParallelPlugin runs ZeRO only in bf16 or fp16; use zero_stage 0 with fp32, or tp = pp = 1 "
            "(LowLevelZeroPlugin) for fp32 ZeRO",
        )
    if parallel.zero_stage > 1 and parallel.pp_size > 1:
        raise ConfigError("parallel.zero_stage", "pipeline parallelism allows ZeRO stage 0 or 1 only")
    if sequence_parallelism and parallel.tp_size < 2:
        raise ConfigError("parallel.tp_size", "split_gather sequence parallelism needs tp_size > 1")
    pipeline_kwargs = {}
    if parallel.pp_size > 1:
        # Sequence lengths change from step to step: the p2p shape cache would send stale shapes.
        pipeline_kwargs = {
            "microbatch_size": max(1, microbatch_size // parallel.pp_size),
            "pp_style": "1f1b",
            "enable_metadata_cache": False,
        }
    return HybridParallelPlugin(
        tp_size=parallel.tp_size,
        pp_size=parallel.pp_size,
        precision=parallel.precision,
        zero_stage=parallel.zero_stage,
        initial_scale=_FP16_INITIAL_SCALE,
        max_norm=max_norm,
        overlap_communication=not on_cpu,
        enable_sequence_parallelism=sequence_parallelism,
        sequence_parallelism_mode="split_gather" if sequence_parallelism else None,
        # ColossalAI pads the vocabulary to a multiple of 64 * tp by default. With tied embeddings and tp = 1
        # that pads the shared weight itself: the LM head then returns padding logits (0, not -inf) that skew
        # every softmax, pipeline stages all-reduce the tied weight's gradients at different sizes (a gloo
        # crash), and state_dict() raises on the padded parameter. Pad only to a multiple of tp.
        make_vocab_size_divisible_by=1,
        **pipeline_kwargs,
    )


def clip_and_step(model: torch.nn.Module, optimizer: OptimizerWrapper, plugin: Plugin, max_norm: float) -> float | None:
    """Clip to ``max_norm``, step and zero the gradients; returns the global gradient norm before clipping.

    Only ``TorchDDPPlugin`` needs clipping here. The other plugins clip inside ``step()`` with the norm
    over all shards; their gradients live in the optimizer, so clipping ``p.grad`` here would miss them
    (ZeRO) or use a per-shard norm (tensor parallelism). Returns None when no norm was computed
    (``max_norm <= 0``).
    """
    norm = None
    if isinstance(plugin, TorchDDPPlugin) and max_norm > 0:
        params = [p for p in model.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)  # DDP gradients are already averaged
    optimizer.step()
    optimizer.zero_grad()
    if not isinstance(plugin, TorchDDPPlugin) and max_norm > 0:
        norm = optimizer.get_grad_norm()
    return None if norm is None else float(norm)


def tensor_parallel_group(plugin: Plugin) -> dist.ProcessGroup | None:
    """The group the policy's logits are vocab-sharded over; None without tensor parallelism."""
    if isinstance(plugin, HybridParallelPlugin) and plugin.tp_size > 1:
        return plugin.tp_group
    return None


def gather_vocab_parallel_logits(logits: torch.Tensor, tp_group: dist.ProcessGroup, vocab_size: int) -> torch.Tensor:
    """Whole-vocabulary logits [..., vocab_size] from this rank's shard [..., V_padded / tp] (differentiable).

    The shards are concatenated in tensor-parallel rank order; the backward pass hands each rank the
    gradient of its own shard. The vocabulary padding ColossalAI adds (its logits are 0, not -inf) is
    cut off, so a softmax over the result is the unsharded model's.
    """
    from colossalai.shardformer.layer._operation import gather_forward_split_backward

    full = gather_forward_split_backward(logits, -1, tp_group)  # [..., V_padded]
    if full.shape[-1] < vocab_size:
        raise ValueError(f"gathered {full.shape[-1]} logits per token, fewer than the vocabulary ({vocab_size})")
    return full[..., :vocab_size]
