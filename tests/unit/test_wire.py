"""Rollout batches as bytes across torch builds (``comm/wire.py``): equal after the round trip, and no call into
torch's own (release-specific) rebuild functions in the bytes."""

from __future__ import annotations

import pickletools

import torch
from test_batch import make_batch

from colossal_rl.comm import wire


def test_a_batch_comes_back_equal_field_by_field():
    batch = make_batch([[1, 2], [1, 2], [3], [3]], [[4, 5, 6], [7], [8, 9], [10]], group_size=2, policy_version=3)
    back = wire.decode(wire.encode(batch))
    assert type(back) is type(batch)
    for name, value in vars(batch).items():
        other = getattr(back, name)
        if isinstance(value, torch.Tensor):
            assert other.dtype == value.dtype and torch.equal(other, value), name
        else:
            assert other == value, name


def test_every_dtype_shape_and_an_empty_tensor_survive():
    tensors = {
        "bf16": torch.randn(3, 4).to(torch.bfloat16),
        "fp16": torch.randn(2).to(torch.float16),
        "long": torch.arange(6).reshape(2, 3),
        "bool": torch.tensor([True, False]),
        "empty": torch.zeros(0, 5),
        "strided": torch.arange(12.0).reshape(3, 4).t(),  # not contiguous
    }
    back = wire.decode(wire.encode(tensors))
    for name, tensor in tensors.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name


def test_the_bytes_name_no_torch_internal_function():
    data = wire.encode({"x": torch.ones(2, 2), "y": [torch.zeros(1)]})
    strings = [str(arg) for _, arg, _ in pickletools.genops(data) if isinstance(arg, str)]
    assert "colossal_rl.comm.wire" in strings and "rebuild_tensor" in strings
    assert not any(s.startswith("torch._") or "_rebuild_tensor" in s or s == "torch.storage" for s in strings)
