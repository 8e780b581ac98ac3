"""One weight-sync group, one backend: the sender and every receiver take their device from
``process_group.default_device``, so on a GPU all of them speak NCCL and on CPU all speak gloo.

A sender on ``cpu`` (gloo) beside receivers on ``cuda`` (NCCL) forms no group: each side waits out the timeout.
That cannot be seen on a CPU machine, where every side is on ``cpu`` anyway; here CUDA is pretended available
(``torch.cuda.is_available``) and the group factory behind ``--weight-sync-backend torch`` is replaced by one with
its real signature that records what each member asked for and then stops the join. The code under test, the
engine test's sender (``engine_checks.receive_in_workers``) and the vLLM worker extension's join, runs unchanged.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from vllm_engine.engine_checks import receive_in_workers

from colossal_rl.comm.process_group import backend_for_device
from colossal_rl.comm.weight_sync.transports import WEIGHT_SYNC_TRANSPORTS
from colossal_rl.rollout.vllm_worker import WeightLoaderExtension
from colossal_rl.rollout.vllm_worker_receive import routes_to_messages


class GroupRecorded(Exception):
    """Raised by the recording factory once it has noted a member's request: no real group is formed."""


class EngineWorker(WeightLoaderExtension):
    """The extension mixed into a vLLM worker: its tensor-parallel ``rank`` and the configs vLLM gives it."""

    def __init__(self, rank: int, tensor_parallel_size: int):
        self.rank = rank
        self.cache_config = SimpleNamespace(gpu_memory_utilization=0.7)
        self.parallel_config = SimpleNamespace(tensor_parallel_size=tensor_parallel_size)


class WorkersJoining:
    """What ``receive_in_workers`` drives first on ``VllmBackend``: ``join_weight_sync`` runs the extension's join
    on each tensor-parallel worker, as ``collective_rpc`` does (here one after the other)."""

    def __init__(self, tensor_parallel_size: int):
        self.workers = [EngineWorker(rank, tensor_parallel_size) for rank in range(tensor_parallel_size)]

    def join_weight_sync(self, routes, *, timeout_s: float, transport: str) -> None:
        for worker in self.workers:
            try:
                worker.colossal_rl_join_weight_sync(routes_to_messages(routes), timeout_s, transport)
            except GroupRecorded:
                pass
        raise GroupRecorded("every worker asked for its group")


# An id "gpu" would make the conftest skip the case as a GPU test.
@pytest.mark.parametrize("cuda_available", [True, False], ids=["cuda_pretended", "cpu_only"])
def test_the_engine_tests_sender_and_the_vllm_workers_join_over_one_backend(monkeypatch, cuda_available):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda_available)
    asked: dict[int, tuple[str, str]] = {}

    def recording_group(*, rank, world_size, host, port, timeout_s, name, device):
        asked[rank] = (torch.device(device).type, backend_for_device(device))
        raise GroupRecorded(f"rank {rank} of {name!r}")

    monkeypatch.setitem(WEIGHT_SYNC_TRANSPORTS, "torch", recording_group)
    weights = {"model.norm.weight": torch.ones(4)}
    with pytest.raises(GroupRecorded, match="every worker"):
        receive_in_workers(WorkersJoining(tensor_parallel_size=2), weights, tensor_parallel_size=2)
    expected = ("cuda", "nccl") if cuda_available else ("cpu", "gloo")
    assert asked == {0: expected, 1: expected, 2: expected}, f"sender (rank 0), workers (1, 2): {asked}"
