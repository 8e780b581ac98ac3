"""A second device for CPU tests: tensors that compute on the CPU but live, for every check, on "the accelerator".

On a GPU machine a trainer that forgets to move an input, a reference model or a collective's scalar to
its device fails at once (``Expected all tensors to be on the same device``; NCCL takes CUDA tensors
only). On a CPU-only machine every tensor is on the CPU, so the same mistake passes every test. Inside
:class:`FakeAccelerator`:

- the device ``FAKE_DEVICE`` (torch's ``meta``) stands for the accelerator: creating a tensor there or
  moving one there (``.to``, ``torch.tensor(..., device=)``, factories) gives an :class:`OnAccelerator`
  tensor whose values are real (computed on the CPU) but whose ``.device`` is the accelerator;
- an operator that mixes accelerator tensors with host tensors of one element or more raises, as CUDA does
  (host 0-dim scalars may mix, and ``copy_`` copies across, as with CUDA);
- a collective (``c10d`` operator) given a host tensor raises, as NCCL does;
- indexing an accelerator tensor with host index tensors works (CUDA moves the indices), the reverse raises;
- moving an accelerator tensor to ``cpu`` gives back a host tensor (``.cpu()``, ``.item()``, ``.tolist()``).

This is a fake of the *device*, which sits around the code under test; the code under test runs unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

FAKE_DEVICE = torch.device("meta")


class DeviceMixError(RuntimeError):
    """An operator received tensors from the accelerator and from the host (a real GPU raises here too)."""


class OnAccelerator(torch.Tensor):
    """A CPU tensor ``elem`` that reports ``FAKE_DEVICE``; only meaningful inside :class:`FakeAccelerator`."""

    elem: torch.Tensor

    @staticmethod
    def __new__(cls, elem: torch.Tensor) -> OnAccelerator:
        wrapper = torch.Tensor._make_wrapper_subclass(
            cls,
            elem.size(),
            strides=elem.stride(),
            storage_offset=elem.storage_offset(),
            dtype=elem.dtype,
            layout=elem.layout,
            device=FAKE_DEVICE,
            requires_grad=elem.requires_grad,
        )
        wrapper.elem = elem.detach() if elem.requires_grad else elem
        return wrapper

    def __repr__(self) -> str:
        return f"OnAccelerator({self.elem!r})"

    def tolist(self) -> Any:
        """As on CUDA: the values, copied to the host (torch refuses ``tolist`` on wrapper subclasses)."""
        return self.elem.tolist()

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(f"{func} on an OnAccelerator tensor outside FakeAccelerator")


_TRANSFERS = {torch.ops.aten.copy_.default, torch.ops.aten._to_copy.default}
"""Operators that legitimately take one device's tensor into another's (as on CUDA)."""
_INDEXING = {
    torch.ops.aten.index.Tensor: (0,),
    torch.ops.aten.index_put.default: (0, 2),
    torch.ops.aten.index_put_.default: (0, 2),
    torch.ops.aten._index_put_impl_.default: (0, 2),
}
"""Indexing operators and their non-index arguments. CUDA indexes a device tensor with host index tensors (ATen
moves the indices to the indexed tensor's device), forward and backward; Hugging Face's Qwen2.5-VL vision tower
does (``rot_pos_emb``). Indexing a host tensor with device indices fails, on CUDA and here."""


def _is_host(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and not isinstance(value, OnAccelerator) and value.device.type == "cpu"


def _targets_fake(device: Any) -> bool:
    return device is not None and torch.device(device) == FAKE_DEVICE


class _TensorConstructors(TorchFunctionMode):
    """``torch.tensor(data, device=FAKE_DEVICE)`` builds on the host and then moves (torch builds such tensors
    with Python dispatch excluded, so :class:`FakeAccelerator` alone would see an empty meta tensor)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in (torch.tensor, torch.as_tensor) and _targets_fake(kwargs.get("device")):
            kwargs["device"] = torch.device("cpu")
            return func(*args, **kwargs).to(FAKE_DEVICE)
        return func(*args, **kwargs)


class FakeAccelerator(TorchDispatchMode):
    """Within ``with FakeAccelerator():`` the ``meta`` device is a real-valued second device (see module doc)."""

    def __enter__(self) -> FakeAccelerator:
        # torch has no autocast for the meta device: ask for the host's (code such as Qwen2's rotary
        # embedding opens ``torch.autocast(x.device.type, enabled=False)`` on every forward).
        self._autocast_init = torch.autocast.__init__
        original = self._autocast_init

        def autocast_init(autocast, device_type, *args, **kwargs):
            original(autocast, "cpu" if device_type == FAKE_DEVICE.type else device_type, *args, **kwargs)

        torch.autocast.__init__ = autocast_init
        # ``module.to(device)`` must keep parameters the same objects (tied weights stay tied), as moving
        # to CUDA does; a CPU tensor and an OnAccelerator are not shallow-copy compatible, so swap them.
        self._swap = torch.__future__.get_swap_module_params_on_conversion()
        torch.__future__.set_swap_module_params_on_conversion(True)
        self._constructors = _TensorConstructors()
        self._constructors.__enter__()
        return super().__enter__()

    def __exit__(self, *exc_info) -> None:
        super().__exit__(*exc_info)
        self._constructors.__exit__(*exc_info)
        torch.__future__.set_swap_module_params_on_conversion(self._swap)
        torch.autocast.__init__ = self._autocast_init

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        flat, _ = tree_flatten((args, kwargs))
        on_accelerator = any(isinstance(value, OnAccelerator) for value in flat)
        if func.namespace == "c10d":
            host = [tuple(t.shape) for t in flat if _is_host(t)]
            if host:
                raise DeviceMixError(f"{func}: a collective got host tensors {host} (NCCL takes device tensors only)")
        elif on_accelerator and func not in _TRANSFERS:
            checked = flat
            if func in _INDEXING and isinstance(args[0], OnAccelerator):
                checked = [args[i] for i in _INDEXING[func]]  # the indices may stay on the host
            host = [tuple(t.shape) for t in checked if _is_host(t) and t.dim() > 0]
            if host:
                raise DeviceMixError(
                    f"{func}: expected all tensors to be on the same device, got accelerator tensors and host "
                    f"tensors of shapes {host}"
                )
        wrap_outputs = on_accelerator
        if "device" in kwargs:
            if _targets_fake(kwargs["device"]):
                kwargs["device"] = torch.device("cpu")
                wrap_outputs = True
            elif torch.device(kwargs["device"]).type == "cpu":
                wrap_outputs = False  # moved to the host
        inputs = {}
        for value in flat:
            if isinstance(value, OnAccelerator):
                inputs[id(value.elem)] = value

        def unwrap(value: Any) -> Any:
            return value.elem if isinstance(value, OnAccelerator) else value

        result = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))
        if func is torch.ops.aten._local_scalar_dense.default:
            return result

        def wrap(value: Any) -> Any:
            if not isinstance(value, torch.Tensor) or isinstance(value, OnAccelerator):
                return value
            if value.device == FAKE_DEVICE:
                raise RuntimeError(f"{func} made a value-less meta tensor: a construction path the fake does not cover")
            if id(value) in inputs:  # in-place or out= result: the caller's own tensor
                return inputs[id(value)]
            return OnAccelerator(value) if wrap_outputs else value

        return tree_map(wrap, result)
