"""Rollout batches as bytes between processes that run different torch builds.

The vLLM producers run torch 2.13, the trainers torch 2.5.1. Pickling a tensor writes calls to torch-internal
rebuild functions, which change between releases; these bytes instead carry each tensor as (dtype name, shape, raw
bytes), rebuilt by ``rebuild_tensor`` below in whatever torch the reader has. Everything else (our dataclasses,
lists, strings, numbers) pickles as usual: both sides run this same checkout. Bytes also let the buffer take
ownership of a batch (``ray.put`` of what it received) without importing torch.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch


def tensor_parts(tensor: torch.Tensor) -> tuple[str, tuple[int, ...], bytes]:
    """(dtype name, shape, raw bytes) of ``tensor``, read back by ``rebuild_tensor`` in any torch build."""
    host = tensor.detach().to("cpu").contiguous()
    raw = host.view(torch.uint8).numpy().tobytes() if host.numel() else b""
    return str(host.dtype).removeprefix("torch."), tuple(host.shape), raw


def rebuild_tensor(dtype_name: str, shape: tuple[int, ...], raw: bytes) -> torch.Tensor:
    dtype = getattr(torch, dtype_name)
    if not raw:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape)


class _TensorAsBytesPickler(pickle.Pickler):
    def reducer_override(self, obj: Any):
        if isinstance(obj, torch.Tensor):
            return rebuild_tensor, tensor_parts(obj)
        return NotImplemented


def encode(obj: Any) -> bytes:
    """``obj`` (a ``RolloutBatch``, or anything holding tensors) as bytes any torch build can read back."""
    buffer = io.BytesIO()
    _TensorAsBytesPickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buffer.getvalue()


def decode(data: bytes) -> Any:
    return pickle.loads(data)
