"""Run-time patches that let ColossalAI 0.5.0 train on CPU over gloo.

ColossalAI's CPU accelerator raises on most device APIs, and a few code paths assume CUDA or a
torch with Ascend support. Out of the box only ``TorchDDPPlugin`` trains on CPU; with the patches
below ZeRO-1/2, tensor parallelism (also with split_gather sequence parallelism) and pipeline
parallelism train too, with losses equal to a single-process reference (see
``tests/dist/test_plugin_layouts.py``). Each patch says why it exists; removing any one of them breaks a
layout of that test (or fp16 ZeRO), except ``synchronize`` and ``empty_cache``, which guard code paths
outside it (checkpoint loading, GPU-style training loops).

``apply_cpu_compat_patches()`` must run before ``colossalai.launch`` and boosting. It is idempotent
and does nothing when CUDA is available (the patches only replace CPU fallbacks that raise).
``check_cpu_compat_targets()`` fails loudly, naming the patch, when a patched target no longer exists
or changed its signature (e.g. after a ColossalAI upgrade). This module does not patch anything
that ColossalAI's CUDA path uses, and does not import colossalai until a function is called.

ZeRO's communication overlap needs CUDA streams and ``record_stream``: that is not patched here;
``booster_plugins.py`` turns ``overlap_communication`` off on CPU instead.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

_PATCH_MARK = "__colossal_rl_cpu_patch__"
_ORIGINALS: dict[str, Any] = {}
"""Patch target name -> the object it replaced, so checks still see ColossalAI's own signature."""


class CpuCompatError(RuntimeError):
    """A CPU patch target is missing or changed: the installed ColossalAI is not the one the patches fit."""


def cpu_compat_needed() -> bool:
    """The guard: patches apply only where CUDA is absent."""
    return not torch.cuda.is_available()


# --------------------------------------------------------------------------- the patched behaviour
class _NullStream:
    """Stands in for a CUDA stream on CPU, where every op is synchronous."""

    def wait_stream(self, stream: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


_NULL_STREAM = _NullStream()


def _get_rng_state(self, device=None) -> torch.Tensor:
    # Upstream calls torch.get_rng_state(device), which takes no argument; TP's shardformer
    # randomizer calls get_rng_state() / manual_seed() when it builds the model.
    return torch.get_rng_state()


def _manual_seed(self, seed: int) -> None:
    # Upstream raises; the randomizer seeds, then restores the saved state afterwards.
    torch.manual_seed(seed)


def _current_stream(self, device=None) -> _NullStream:
    # ZeRO's gradient reduction asks for the current stream even without overlap.
    return _NULL_STREAM


def _stream(self, stream_) -> contextlib.AbstractContextManager:
    # ZeRO enters ``with accelerator.stream(s)`` around its reductions.
    return contextlib.nullcontext()


def _stream_class(self, device=None, priority=0, **kwargs) -> _NullStream:
    # ZeRO's bucket store creates a communication stream at construction.
    return _NULL_STREAM


def _synchronize(self, device=None) -> None:
    # Called when optimizer states are loaded from a checkpoint (checkpoint_io.utils) and by ZeRO after
    # backward with overlap on; CPU ops are already complete. (Not reached by the training test.)
    pass


def _empty_cache(self) -> None:
    # Called by ColossalAI's testing helpers and by training loops written for GPUs (ColossalChat's);
    # nothing is cached on CPU. (Not reached by the training test.)
    pass


def _device_count(self) -> int:
    # The fp16 dynamic grad scaler calls device_count() at construction.
    return 1


_ACCELERATOR_PATCHES: dict[str, tuple[Callable[..., Any], list[str]]] = {
    # method name -> (replacement, parameter names the upstream method must have)
    "get_rng_state": (_get_rng_state, ["self", "device"]),
    "manual_seed": (_manual_seed, ["self", "seed"]),
    "current_stream": (_current_stream, ["self", "device"]),
    "stream": (_stream, ["self", "stream_"]),
    "Stream": (_stream_class, ["self", "device", "priority", "kwargs"]),
    "synchronize": (_synchronize, ["self", "device"]),
    "empty_cache": (_empty_cache, ["self"]),
    "device_count": (_device_count, ["self"]),
}


def _zero_sanity_checks_on_cpu(original: Callable[[Any], None]) -> Callable[[Any], None]:
    # LowLevelZeroOptimizer._sanity_checks asserts the accelerator is cuda or npu; on CPU keep only
    # its other check: every parameter ZeRO manages has the optimizer's dtype.
    def _sanity_checks(self) -> None:
        from colossalai.accelerator import get_accelerator

        if get_accelerator().name != "cpu":
            original(self)
            return
        for param_group in self.optim.param_groups:
            for param in param_group["params"]:
                if not getattr(param, "skip_zero_check", False) and param.dtype != self._dtype:
                    raise AssertionError(
                        f"Parameters are expected to have the same dtype `{self._dtype}`, but got `{param.dtype}`"
                    )

    return _sanity_checks


# --------------------------------------------------------------------------- gloo collectives
class _CompletedWork:
    """Handle of a collective that already ran synchronously (returned when ``async_op=True``)."""

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def _is_gloo(group: Any) -> bool:
    return dist.get_backend(group) == dist.Backend.GLOO


def _reduce_scatter(output, input_list, op=dist.ReduceOp.SUM, group=None, async_op=False):
    """``dist.reduce_scatter`` on gloo (which lacks the list form) via ``reduce_scatter_tensor``."""
    if not _is_gloo(group) or not isinstance(input_list, list | tuple):
        return dist.reduce_scatter(output, input_list, op=op, group=group, async_op=async_op)
    # gloo wants the concatenation along dim 0 (not a stack): [world * output.shape[0], *output.shape[1:]]
    concatenated = torch.cat([t.reshape(output.shape) for t in input_list])
    if output.is_contiguous():
        return dist.reduce_scatter_tensor(output, concatenated, op=op, group=group, async_op=async_op)
    result = torch.empty_like(output, memory_format=torch.contiguous_format)
    dist.reduce_scatter_tensor(result, concatenated, op=op, group=group)
    output.copy_(result)
    return _CompletedWork() if async_op else None


def _all_to_all(output_list, input_list, group=None, async_op=False):
    """``dist.all_to_all`` on gloo (which lacks the list form) via ``all_to_all_single``."""
    if not _is_gloo(group):
        return dist.all_to_all(output_list, input_list, group=group, async_op=async_op)
    flat_input = torch.cat([t.reshape(-1) for t in input_list])
    output_sizes = [t.numel() for t in output_list]
    flat_output = flat_input.new_empty(sum(output_sizes))
    dist.all_to_all_single(
        flat_output,
        flat_input,
        output_split_sizes=output_sizes,
        input_split_sizes=[t.numel() for t in input_list],
        group=group,
    )
    for output, chunk in zip(output_list, flat_output.split(output_sizes), strict=True):
        output.copy_(chunk.view(output.shape))
    return _CompletedWork() if async_op else None


class _DistWithGlooListCollectives:
    """``torch.distributed`` as seen by ColossalAI's shardformer ops, with the two list collectives emulated.

    Installed only as the ``dist`` name inside ``colossalai.shardformer.layer._operation`` (where
    split_gather sequence parallelism calls them), so nothing else in the process changes.
    """

    reduce_scatter = staticmethod(_reduce_scatter)
    all_to_all = staticmethod(_all_to_all)

    def __getattr__(self, name: str) -> Any:
        return getattr(dist, name)


# --------------------------------------------------------------------------- apply / check
def _patch_attribute(owner: Any, name: str, replacement: Any, key: str) -> None:
    current = getattr(owner, name)
    if getattr(current, _PATCH_MARK, False):
        return
    _ORIGINALS[key] = current
    try:
        setattr(replacement, _PATCH_MARK, True)
    except AttributeError:  # objects without a __dict__ are marked through the registry only
        pass
    setattr(owner, name, replacement)


def apply_cpu_compat_patches() -> bool:
    """Apply every CPU patch (idempotent). Returns False, changing nothing, when CUDA is available."""
    if not cpu_compat_needed():
        return False
    check_cpu_compat_targets()
    from colossalai.accelerator.cpu_accelerator import CpuAccelerator
    from colossalai.shardformer.layer import _operation
    from colossalai.zero.low_level.low_level_optim import LowLevelZeroOptimizer

    for name, (replacement, _) in _ACCELERATOR_PATCHES.items():
        _patch_attribute(CpuAccelerator, name, replacement, f"CpuAccelerator.{name}")
    original_checks = _ORIGINALS.get("LowLevelZeroOptimizer._sanity_checks", LowLevelZeroOptimizer._sanity_checks)
    _patch_attribute(
        LowLevelZeroOptimizer,
        "_sanity_checks",
        _zero_sanity_checks_on_cpu(original_checks),
        "LowLevelZeroOptimizer._sanity_checks",
    )
    # Pipeline p2p compares the group's backend with Backend.HCCL, which torch 2.5 does not define.
    if not hasattr(dist.Backend, "HCCL"):
        dist.Backend.HCCL = "hccl"
    if not isinstance(_operation.dist, _DistWithGlooListCollectives):
        _ORIGINALS["shardformer._operation.dist"] = _operation.dist
        _operation.dist = _DistWithGlooListCollectives()
    logger.debug("applied ColossalAI CPU compatibility patches")
    return True


def _require_signature(key: str, target: Any, expected: list[str]) -> None:
    original = _ORIGINALS.get(key, target)
    actual = list(inspect.signature(original).parameters)
    if actual != expected:
        raise CpuCompatError(
            f"CPU patch '{key}': ColossalAI's target has parameters {actual}, the patch was written for {expected}; "
            "re-check the patch against the installed ColossalAI."
        )


def _require_attribute(key: str, owner: Any, name: str) -> Any:
    if not hasattr(owner, name):
        raise CpuCompatError(f"CPU patch '{key}': {owner!r} has no attribute {name!r} any more.")
    return getattr(owner, name)


def check_cpu_compat_targets() -> None:
    """Raise :class:`CpuCompatError` naming the patch whose target vanished or changed signature."""
    try:
        from colossalai.accelerator.cpu_accelerator import CpuAccelerator
        from colossalai.pipeline import p2p
        from colossalai.shardformer.layer import _operation
        from colossalai.zero.low_level.low_level_optim import LowLevelZeroOptimizer
    except ImportError as error:
        raise CpuCompatError(f"CPU patches: a patched ColossalAI module is gone ({error})") from error

    for name, (_, expected) in _ACCELERATOR_PATCHES.items():
        key = f"CpuAccelerator.{name}"
        _require_signature(key, _require_attribute(key, CpuAccelerator, name), expected)
    key = "LowLevelZeroOptimizer._sanity_checks"
    _require_signature(key, _require_attribute(key, LowLevelZeroOptimizer, "_sanity_checks"), ["self"])
    # The HCCL attribute exists for this function's comparison.
    _require_attribute("Backend.HCCL", p2p, "_check_for_nccl_hccl_backend")
    key = "shardformer._operation.dist"
    operation_dist = _ORIGINALS.get(key, _require_attribute(key, _operation, "dist"))
    if operation_dist is not dist:
        raise CpuCompatError(
            f"CPU patch '{key}': colossalai.shardformer.layer._operation.dist is not torch.distributed"
        )
    _require_signature(
        "gloo reduce_scatter emulation",
        dist.reduce_scatter_tensor,
        ["output", "input", "op", "group", "async_op"],
    )
    _require_signature(
        "gloo all_to_all emulation",
        dist.all_to_all_single,
        ["output", "input", "output_split_sizes", "input_split_sizes", "group", "async_op"],
    )
