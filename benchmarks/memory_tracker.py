"""Live tensor-storage bytes and their peak, on any device, from inside torch's dispatcher.

torch's CPU allocator keeps no peak statistics (``torch.cuda.max_memory_allocated`` has no CPU
counterpart) and RSS mixes tensors with allocator caching and kernel scratch. :class:`StorageTracker`
is a ``TorchDispatchMode``: every aten op run while it is active passes through it, and each output
whose storage is new — not the storage of one of the op's inputs, not already tracked — is counted
until the storage is freed (a ``weakref.finalize`` on the storage object, which torch keeps alive
exactly as long as the storage itself). The count is the sum of storage sizes, views counted once.

What it sees: every tensor an op returns, in forward and in backward (the autograd engine runs CPU
and meta backward passes on the calling thread, inside the mode), including tensors saved for
backward, gradient buffers and recomputation under checkpointing. What it does not see: storages
created before it was entered (weights, pre-allocated gradients, inputs: "held before the step"),
scratch memory a kernel allocates and frees internally, and tensors built without an aten op (e.g.
``torch.get_rng_state()``, 5 KB per layer under gradient checkpointing). Works on fake/meta tensors
too (their storages have sizes but no data), so the same count can be taken without computing.

:class:`AllocatorPeak` is the independent check for real (CPU) runs: the peak of CPU allocator bytes
allocated inside the block and not yet freed, from torch profiler's memory events — every block the
allocator hands out, kernel scratch included, without a dispatch mode in the way. It needs real
tensors, so only :class:`StorageTracker` can count fake ones.

Used by ``train_step_memory.py`` (for ``train_memory.py``); tested by ``tests/unit/test_memory_tracker.py``. Not part of the package.
"""

from __future__ import annotations

import weakref
from types import TracebackType
from typing import Any

import torch
from torch.autograd import DeviceType
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def _storage(tensor: torch.Tensor) -> torch.UntypedStorage | None:
    """The tensor's storage, or None for layouts without one (sparse, nested)."""
    if tensor.layout != torch.strided:
        return None
    return tensor.untyped_storage()


class StorageTracker(TorchDispatchMode):
    """Counts the bytes of storages created while active and still alive; keeps their peak.

    ``live_bytes``: storages created inside the mode and not yet freed. ``peak_bytes``: the largest
    ``live_bytes`` since entry or the last :meth:`reset_peak`. Storages outlive the mode (and keep
    being counted down when freed) so a result taken after ``__exit__`` is still accurate.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live_bytes = 0
        self.peak_bytes = 0
        self._sizes: dict[int, int] = {}  # storage id (its StorageImpl address) -> bytes counted for it

    def reset_peak(self) -> None:
        self.peak_bytes = self.live_bytes

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        outputs = func(*args, **(kwargs or {}))
        input_storages = {
            storage._cdata
            for tensor in tree_leaves((args, kwargs))
            if isinstance(tensor, torch.Tensor) and (storage := _storage(tensor)) is not None
        }
        for tensor in tree_leaves(outputs):
            if isinstance(tensor, torch.Tensor) and (storage := _storage(tensor)) is not None:
                self._count(storage, input_storages)
        return outputs

    def _count(self, storage: torch.UntypedStorage, input_storages: set[int]) -> None:
        key, size = storage._cdata, storage.nbytes()
        if key in self._sizes:  # an in-place or out= op on a storage created here: it may have been resized
            self._add(size - self._sizes[key])
            self._sizes[key] = size
        elif key not in input_storages:  # new; an untracked input's storage existed before the mode
            self._sizes[key] = size
            finalizer = weakref.finalize(storage, self._release, key)
            finalizer.atexit = False
            self._add(size)

    def _add(self, size: int) -> None:
        self.live_bytes += size
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def _release(self, key: int) -> None:
        self.live_bytes -= self._sizes.pop(key, 0)


class AllocatorPeak:
    """Peak bytes the CPU allocator handed out inside the block and had not got back, from profiler events.

    torch's CPU allocator reports each allocation and each free of a block it saw allocated while memory
    profiling was on (frees of older blocks are not reported), so the running sum of the profiler's
    memory events is exactly the live bytes allocated inside the block. ``peak_bytes`` and ``end_bytes``
    are set on exit.
    """

    def __init__(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        self._profile = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self.peak_bytes = 0
        self.end_bytes = 0

    def __enter__(self) -> AllocatorPeak:
        self._profile.__enter__()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self._profile.__exit__(kind, error, traceback)
        events = [
            event
            for event in self._profile.profiler.kineto_results.events()
            if event.name() == "[memory]" and event.device_type() == DeviceType.CPU
        ]
        live = 0
        for event in sorted(events, key=lambda event: event.start_ns()):  # stable: ties keep recorded order
            live += event.nbytes()
            self.peak_bytes = max(self.peak_bytes, live)
        self.end_bytes = live


def status_kib(field: str) -> int:
    """A ``/proc/self/status`` field in KiB (``VmRSS``: resident now; ``VmHWM``: the process's peak)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")
