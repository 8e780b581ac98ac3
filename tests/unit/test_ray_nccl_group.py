"""RayNcclGroup up to the GPU: every call into ray.util.collective (replaced by a recording fake with the
real module's signatures) and every wait's deadline. CUDA tensors are FakeTensorMode tensors; the CUDA
runtime calls (default-stream check, completion events) are a fake too. Nothing here runs NCCL."""

from __future__ import annotations

import inspect
import time

import pytest
import torch
from fake_ray_collective import FakeCuda, FakeRayCollective, FakeReduceOp
from torch._subclasses.fake_tensor import FakeTensorMode

from colossal_rl.comm.process_group import CollectiveError, CollectiveTimeoutError
from colossal_rl.comm.ray_nccl_group import RayNcclGroup, create_ray_nccl_group, ray_group_name

TIMEOUT_S = 0.5
GROUP_NAME = "colossal_rl/weight_sync/stage0@10.0.0.7:29555"


@pytest.fixture
def fake_mode():
    with FakeTensorMode():
        yield


@pytest.fixture
def ray_collective():
    fake = FakeRayCollective()
    yield fake
    fake.release.set()  # lets a deliberately hung worker thread finish


def make_group(collective, cuda=None, *, rank=1, world_size=3, timeout_s=TIMEOUT_S) -> RayNcclGroup:
    return create_ray_nccl_group(
        rank,
        world_size,
        "10.0.0.7",
        29555,
        timeout_s,
        name="weight_sync/stage0",
        device=torch.device("cuda", 0),
        collective=collective,
        cuda=cuda or FakeCuda(),
    )


def test_fake_has_the_signatures_of_the_pinned_ray_collective():
    """The fake stays faithful: every function the group calls exists in ray.util.collective with these parameters."""
    import ray.util.collective as real

    for name in ("nccl_available", "init_collective_group", "broadcast", "allreduce", "destroy_collective_group"):
        fake_parameters = list(inspect.signature(getattr(FakeRayCollective, name)).parameters)[1:]  # without self
        assert list(inspect.signature(getattr(real, name)).parameters) == fake_parameters, name
    assert real.types.ReduceOp.MAX.name == "MAX"
    assert str(real.types.Backend("nccl")).lower() == "nccl"  # accepted (Ray 2.60 spells it NCCL)


def test_forming_the_group_registers_it_and_builds_the_communicator_with_one_max_all_reduce(fake_mode, ray_collective):
    cuda = FakeCuda()
    group = make_group(ray_collective, cuda, rank=2, world_size=3)
    assert ray_group_name("weight_sync/stage0", "10.0.0.7", 29555) == GROUP_NAME
    assert ray_collective.calls[0] == ("init_collective_group", 3, 2, "nccl", GROUP_NAME)
    name, tensor, group_name, op = ray_collective.calls[1]
    assert (name, group_name, op) == ("allreduce", GROUP_NAME, FakeReduceOp.MAX)
    assert (tensor.device, tensor.numel()) == (torch.device("cuda", 0), 1)
    assert len(ray_collective.calls) == 2
    assert cuda.recorded_on == [torch.device("cuda", 0)]  # the all-reduce was waited for through its event
    assert (group.rank, group.world_size, group.backend) == (2, 3, "nccl")


def test_broadcasts_reach_ray_in_submission_order_with_source_and_group(fake_mode, ray_collective):
    cuda = FakeCuda()
    group = make_group(ray_collective, cuda)
    tensors = [torch.empty(size, dtype=torch.uint8, device="cuda") for size in (16, 32, 64)]
    pending = [group.broadcast_async(tensor, 0) for tensor in tensors]
    for handle in pending:
        handle.wait()
    broadcasts = [call for call in ray_collective.calls if call[0] == "broadcast"]
    assert [(call[1] is tensor, call[2], call[3]) for call, tensor in zip(broadcasts, tensors, strict=True)] == [
        (True, 0, GROUP_NAME)
    ] * 3
    assert len(cuda.recorded_on) == 1 + 3  # one completion event per collective, barrier included
    assert cuda.stream_checks == 1 + 3


def test_all_reduce_max_and_barrier_use_max_over_the_group(fake_mode, ray_collective):
    group = make_group(ray_collective)
    flag = torch.zeros(1, dtype=torch.int64, device="cuda")
    group.all_reduce_max(flag)
    group.barrier()
    reduces = [call for call in ray_collective.calls if call[0] == "allreduce"]
    assert len(reduces) == 3  # forming + all_reduce_max + barrier
    assert reduces[1][1] is flag
    assert all(call[2:] == (GROUP_NAME, FakeReduceOp.MAX) for call in reduces)


@pytest.mark.parametrize(
    ("make_tensor", "message"),
    [
        (lambda: torch.empty(4, dtype=torch.uint8), r"group's device cuda:0, got one on cpu"),
        (lambda: torch.empty(4, dtype=torch.uint8, device="cuda:1"), r"got one on cuda:1"),
        (lambda: torch.empty(4, 4, device="cuda").t(), "contiguous"),
        (lambda: torch.empty(4, dtype=torch.uint16, device="cuda"), "no NCCL type for torch.uint16"),
    ],
)
def test_tensors_ray_would_mishandle_are_refused_before_reaching_it(fake_mode, ray_collective, make_tensor, message):
    group = make_group(ray_collective)
    before = len(ray_collective.calls)
    with pytest.raises(ValueError, match=message):
        group.broadcast_async(make_tensor(), 0)
    with pytest.raises(ValueError, match=r"source 3 is not a member"):
        group.broadcast_async(torch.empty(4, dtype=torch.uint8, device="cuda"), 3)
    assert len(ray_collective.calls) == before


def test_a_ray_call_that_never_returns_times_out_within_the_bound_and_breaks_the_group(fake_mode, ray_collective):
    group = make_group(ray_collective)
    ray_collective.hang_ops = True
    tensor = torch.empty(8, dtype=torch.uint8, device="cuda")
    started = time.monotonic()
    with pytest.raises(CollectiveTimeoutError, match=r"broadcast of 8 x torch.uint8 from 0 did not finish within 0.5s"):
        group.broadcast(tensor, 0)
    assert time.monotonic() - started >= TIMEOUT_S  # not before the bound (how long after: no speed target here)
    with pytest.raises(CollectiveError, match="unusable"):  # no second call reaches Ray
        group.broadcast_async(tensor, 0)
    group.close()
    assert "destroy_collective_group" not in ray_collective.names()  # a stuck communicator is left alone


def test_a_kernel_that_never_finishes_times_out_within_the_bound(fake_mode, ray_collective):
    cuda = FakeCuda()
    group = make_group(ray_collective, cuda)
    cuda.kernels_finish = False
    handle = group.broadcast_async(torch.empty(8, dtype=torch.uint8, device="cuda"), 0)
    started = time.monotonic()
    with pytest.raises(CollectiveTimeoutError, match="the NCCL kernel did not finish"):
        handle.wait()
    assert time.monotonic() - started >= TIMEOUT_S  # not before the bound (how long after: no speed target here)


def test_forming_times_out_when_a_member_never_joins(fake_mode, ray_collective):
    ray_collective.hang_ops = True  # the communicator-building all-reduce waits for the missing member
    started = time.monotonic()
    with pytest.raises(CollectiveTimeoutError, match=r"rank 1 could not gather all 3 members within 0.5s"):
        make_group(ray_collective)
    assert time.monotonic() - started >= TIMEOUT_S  # not before the bound (how long after: no speed target here)


def test_a_failing_ray_call_raises_collective_error(fake_mode, ray_collective):
    group = make_group(ray_collective)
    ray_collective.fail_ops = RuntimeError("NCCL error: unhandled system error")
    with pytest.raises(CollectiveError, match="unhandled system error"):
        group.all_reduce_max(torch.zeros(1, dtype=torch.int64, device="cuda"))


def test_close_destroys_rays_group_once_and_later_calls_are_refused(fake_mode, ray_collective):
    group = make_group(ray_collective)
    group.close()
    group.close()
    assert ray_collective.calls[-1] == ("destroy_collective_group", GROUP_NAME)
    assert ray_collective.names().count("destroy_collective_group") == 1
    with pytest.raises(CollectiveError, match="closed"):
        group.broadcast_async(torch.empty(8, dtype=torch.uint8, device="cuda"), 0)


def test_without_cupy_ray_reports_nccl_unavailable_and_we_say_what_to_install(ray_collective):
    ray_collective.available = False
    with pytest.raises(CollectiveError, match=r"needs cupy.*\.\[gpu\]"):
        make_group(ray_collective)
    assert ray_collective.calls == []


def test_a_cpu_device_is_refused():
    with pytest.raises(ValueError, match="needs a CUDA device"):
        RayNcclGroup(
            name="weight_sync",
            group_name=GROUP_NAME,
            rank=0,
            world_size=2,
            device=torch.device("cpu"),
            timeout_s=1.0,
            collective=FakeRayCollective(),
        )
