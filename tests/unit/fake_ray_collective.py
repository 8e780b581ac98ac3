"""Fakes of what surrounds a ``RayNcclGroup``: the ``ray.util.collective`` module and the CUDA runtime calls.

``FakeRayCollective`` has the real module's function signatures (``test_ray_nccl_group`` checks them
against the pinned Ray) and records every call; its collectives can be made to hang or fail.
"""

from __future__ import annotations

import threading

import torch


class FakeReduceOp:
    SUM = "sum"
    MAX = "max"


class FakeTypes:
    ReduceOp = FakeReduceOp


class FakeRayCollective:
    """Stands in for ``ray.util.collective``: records calls; ops can be made to hang or to fail."""

    types = FakeTypes

    def __init__(self, *, available: bool = True):
        self.available = available
        self.calls: list[tuple] = []
        self.hang_ops = False  # broadcast/allreduce block until ``release`` is set
        self.fail_ops: Exception | None = None
        self.release = threading.Event()

    def nccl_available(self):
        return self.available

    def init_collective_group(self, world_size, rank, backend="nccl", group_name="default", gloo_timeout=30000):
        self.calls.append(("init_collective_group", world_size, rank, backend, group_name))

    def broadcast(self, tensor, src_rank=0, group_name="default"):
        self.calls.append(("broadcast", tensor, src_rank, group_name))
        self._run_op()

    def allreduce(self, tensor, group_name="default", op=FakeReduceOp.SUM):
        self.calls.append(("allreduce", tensor, group_name, op))
        self._run_op()

    def destroy_collective_group(self, group_name="default"):
        self.calls.append(("destroy_collective_group", group_name))

    def _run_op(self):
        if self.hang_ops:
            self.release.wait(30)
        if self.fail_ops is not None:
            raise self.fail_ops

    def names(self) -> list[str]:
        return [call[0] for call in self.calls]


class FakeCompletion:
    def __init__(self, cuda: FakeCuda):
        self._cuda = cuda

    def query(self) -> bool:
        return self._cuda.kernels_finish


class FakeCuda:
    """Stands in for the CUDA runtime calls: records where events were recorded; kernels finish or never do."""

    def __init__(self):
        self.kernels_finish = True
        self.recorded_on: list[torch.device] = []
        self.stream_checks = 0

    def check_default_stream(self, device):
        self.stream_checks += 1

    def record(self, device):
        self.recorded_on.append(device)
        return FakeCompletion(self)
