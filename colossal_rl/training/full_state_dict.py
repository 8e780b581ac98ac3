"""The full, unsharded weights of a boosted model, for the weight sync to the producers.

Contract (every consumer rank must call these functions: they contain collectives):

- :func:`gather_full_state_dict` returns every parameter, with Hugging Face names and full shapes,
  on global rank 0 (data-, tensor- and pipeline-parallel rank 0) and None on every other rank.
- :func:`gather_stage_state_dict` returns the keys of one pipeline stage on that stage's sender
  (its data- and tensor-parallel rank 0; :func:`sync_stage` says which stage) and None elsewhere.
  This is what the weight sync sends: each stage's sender over its own group, merged by the
  producers; without pipeline parallelism it equals :func:`gather_full_state_dict`.

How each layout gets there: DDP and ZeRO ranks all hold full working parameters once ZeRO's pending
all-gathers are waited on, so data-parallel rank 0 takes the unwrapped model's state dict. Under tensor
parallelism taking the state dict is a collective over the tensor-parallel group (ColossalAI's parallel
layers gather their shards and strip vocabulary padding). Under pipeline parallelism each stage holds
only its own layers; the merge is one ``gather_object`` over the pipeline group.

The tensors are the working weights: bf16/fp16 in bf16/fp16 runs (not the fp32 masters), which is
what the producers load. Without tensor parallelism they share storage with the live parameters:
consume (send or copy) them before the next optimizer step. The merged pipeline dict is in host memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from colossalai.booster.plugin import HybridParallelPlugin, Plugin
from colossalai.interface import ModelWrapper, OptimizerWrapper

StateDict = dict[str, torch.Tensor]


@dataclass(frozen=True)
class _Coordinates:
    """Where this rank sits in the plugin's mesh; ``pp_group`` is None without pipeline parallelism."""

    dp_rank: int
    sp_rank: int
    tp_rank: int
    pp_group: dist.ProcessGroup | None


def _coordinates(plugin: Plugin) -> _Coordinates:
    if not isinstance(plugin, HybridParallelPlugin):  # DDP and LowLevelZero: every rank is a data-parallel rank
        return _Coordinates(dp_rank=dist.get_rank(), sp_rank=0, tp_rank=0, pp_group=None)
    # split_gather sequence parallelism shares the tensor-parallel group and has sp_size 1.
    return _Coordinates(
        dp_rank=dist.get_rank(plugin.dp_group),
        sp_rank=dist.get_rank(plugin.sp_group) if plugin.sp_size > 1 else 0,
        tp_rank=dist.get_rank(plugin.tp_group),
        pp_group=plugin.pp_group if plugin.pp_size > 1 else None,
    )


def sync_stage(plugin: Plugin) -> int | None:
    """The pipeline stage whose weights this rank sends to the producers (0 without PP); None if it sends none.

    One sender per stage: its data-, sequence- and tensor-parallel rank 0, exactly the ranks where
    :func:`gather_stage_state_dict` returns a dict.
    """
    where = _coordinates(plugin)
    if where.dp_rank != 0 or where.sp_rank != 0 or where.tp_rank != 0:
        return None
    return 0 if where.pp_group is None else dist.get_rank(where.pp_group)


def wait_for_pending_all_gathers(booster_model: ModelWrapper, optimizer: OptimizerWrapper | None = None) -> None:
    """ZeRO with ``overlap_allgather`` leaves parameter all-gathers in flight after ``step()``: finish them."""
    wait_model = getattr(booster_model, "_force_wait_all_gather", None)
    if wait_model is not None:
        wait_model()
    inner_optimizer = getattr(optimizer, "optim", None)
    wait_optimizer = getattr(inner_optimizer, "_force_wait_all_gather", None)
    if wait_optimizer is not None:
        wait_optimizer()


def gather_stage_state_dict(
    booster_model: ModelWrapper, plugin: Plugin, optimizer: OptimizerWrapper | None = None
) -> StateDict | None:
    """This pipeline stage's parameters at full shape on its sender (dp = sp = tp = 0); None elsewhere."""
    wait_for_pending_all_gathers(booster_model, optimizer)
    where = _coordinates(plugin)
    if where.dp_rank != 0 or where.sp_rank != 0:
        return None  # replicas of data-parallel rank 0: their tensor-parallel groups all skip together
    model = booster_model.unwrap()
    state_dict = model.state_dict()  # a collective over the tensor-parallel group
    return strip_vocab_padding(dict(state_dict), model) if where.tp_rank == 0 else None


def strip_vocab_padding(state_dict: StateDict, model: torch.nn.Module) -> StateDict:
    """Cut the output embedding back to ``config.vocab_size`` rows.

    Under tensor parallelism ColossalAI pads the vocabulary (to a multiple of tp: see ``make_hybrid_plugin``). Its parallel
    embedding strips the padding from its state dict, but with tied embeddings the LM head (a plain
    column-parallel linear in the Qwen2 policy) shares the padded weight and returns it whole: the
    producers would get ``lm_head.weight`` with more rows than their model has.
    """
    vocab_size = getattr(getattr(model, "config", None), "vocab_size", None)
    get_output_embeddings = getattr(model, "get_output_embeddings", None)
    output_embeddings = get_output_embeddings() if get_output_embeddings is not None else None
    if vocab_size is None or output_embeddings is None:
        return state_dict
    prefix = next((name for name, module in model.named_modules() if module is output_embeddings), None)
    for suffix in ("weight", "bias"):
        key = f"{prefix}.{suffix}" if prefix else suffix
        tensor = state_dict.get(key)
        if tensor is not None and tensor.shape[0] > vocab_size:
            state_dict[key] = tensor[:vocab_size]
    return state_dict


def merge_pipeline_stages(stage_state_dict: StateDict, pp_group: dist.ProcessGroup) -> StateDict | None:
    """Gather every stage's dict onto the group's first rank (a collective over ``pp_group``), in host memory.

    Each stage moves its tensors to the host before the gather: pickled device tensors would be rebuilt on
    the destination's GPU, stacking the whole model there beside its own stage and optimizer states."""
    destination = dist.get_process_group_ranks(pp_group)[0]
    is_destination = dist.get_rank() == destination
    gathered: list[StateDict | None] | None = [None] * dist.get_world_size(pp_group) if is_destination else None
    on_host = {name: tensor.detach().cpu() for name, tensor in stage_state_dict.items()}
    dist.gather_object(on_host, gathered, dst=destination, group=pp_group)
    if not is_destination:
        return None
    merged: StateDict = {}
    for part in gathered:
        merged.update(part)
    return merged


def gather_full_state_dict(
    booster_model: ModelWrapper, plugin: Plugin, optimizer: OptimizerWrapper | None = None
) -> StateDict | None:
    """Every parameter at full shape on global rank 0; None on every other rank. All ranks must call."""
    stage_state_dict = gather_stage_state_dict(booster_model, plugin, optimizer)
    pp_group = _coordinates(plugin).pp_group
    if stage_state_dict is not None and pp_group is not None:
        # Only the stage senders (dp = sp = tp = 0) hold a dict; they form one whole pipeline group.
        stage_state_dict = merge_pipeline_stages(stage_state_dict, pp_group)
    if stage_state_dict is not None and dist.get_rank() != 0:
        raise RuntimeError(f"rank {dist.get_rank()} gathered the full state dict; the mesh does not put rank 0 first")
    return stage_state_dict
