"""--weight-sync-backend from flag to group: which group each transport builds for each device, the
config and CLI errors, the GPU check at launch, and the weight sync end to end over gloo with the
transport threaded through ``host_as_sender``/``join_as_receiver`` (threads, no extra processes)."""

from __future__ import annotations

import importlib.util
import sys
from typing import get_args

import pytest
import torch
from fake_ray_collective import FakeCuda, FakeRayCollective
from process_members import run_members
from torch._subclasses.fake_tensor import FakeTensorMode

from colossal_rl.comm import ray_nccl_group
from colossal_rl.comm.process_group import StandaloneGroup, find_free_port
from colossal_rl.comm.ray_nccl_group import RayNcclGroup
from colossal_rl.comm.weight_sync.bucketed import host_as_sender, join_as_receiver
from colossal_rl.comm.weight_sync.transports import (
    WEIGHT_SYNC_TRANSPORTS,
    create_group,
    transport_backend,
)
from colossal_rl.config import ConfigError, RunConfig, WeightSyncBackend
from colossal_rl.driver.placement import PlacementError, check_transport_for_cluster
from rl_example import UsageError, build_parser, config_from_args


def test_registry_config_and_flag_offer_the_same_transports():
    flag = next(a for a in build_parser()._actions if "--weight-sync-backend" in a.option_strings)
    assert set(WEIGHT_SYNC_TRANSPORTS) == set(get_args(WeightSyncBackend)) == set(flag.choices)
    assert RunConfig().weight_sync_backend == flag.default == "torch"


@pytest.mark.parametrize(
    ("transport", "device", "backend"),
    [("torch", "cpu", "gloo"), ("torch", "cuda", "nccl"), ("torch", "cuda:1", "nccl"), ("ray_nccl", "cuda:0", "nccl")],
)
def test_wire_backend_of_each_transport_and_device(transport, device, backend):
    assert transport_backend(transport, device) == backend


def test_unknown_transport_and_ray_nccl_on_cpu_are_refused():
    with pytest.raises(ValueError, match="unknown weight-sync transport 'mpi'; known: ray_nccl, torch"):
        transport_backend("mpi", "cpu")
    with pytest.raises(ValueError, match="ray_nccl carries CUDA tensors only, but this member's weights travel on cpu"):
        transport_backend("ray_nccl", "cpu")


def test_torch_transport_on_cpu_builds_a_standalone_gloo_group():
    group = create_group(
        "torch", rank=0, world_size=1, host="127.0.0.1", port=find_free_port(), timeout_s=10.0, name="t", device="cpu"
    )
    assert isinstance(group, StandaloneGroup) and group.backend == "gloo"
    group.close()


def test_ray_nccl_transport_on_a_gpu_builds_a_ray_nccl_group(monkeypatch):
    fake = FakeRayCollective()
    monkeypatch.setitem(sys.modules, "ray.util.collective", fake)  # what import_ray_collective() imports
    monkeypatch.setattr(ray_nccl_group, "DEFAULT_CUDA", FakeCuda())
    with FakeTensorMode():
        group = create_group(
            "ray_nccl", rank=1, world_size=2, host="10.0.0.7", port=29555, timeout_s=5.0, name="s0", device="cuda:0"
        )
    assert isinstance(group, RayNcclGroup) and group.device == torch.device("cuda", 0)
    assert fake.calls[0] == ("init_collective_group", 2, 1, "nccl", "colossal_rl/s0@10.0.0.7:29555")


def test_ray_nccl_transport_on_cpu_fails_before_touching_ray(monkeypatch):
    fake = FakeRayCollective()
    monkeypatch.setitem(sys.modules, "ray.util.collective", fake)
    with pytest.raises(ValueError, match="CUDA tensors only"):
        join_as_receiver(host="127.0.0.1", port=1, rank=1, world_size=2, timeout_s=5.0, transport="ray_nccl")
    assert fake.calls == []


def ray_nodes(gpus_per_node: list[int]) -> list[dict]:
    return [
        {"NodeID": f"n{i}", "NodeManagerAddress": f"10.0.0.{i}", "Alive": True, "Resources": {"CPU": 8, "GPU": gpus}}
        for i, gpus in enumerate(gpus_per_node)
    ]


def test_launch_refuses_ray_nccl_on_a_cluster_without_gpus():
    with pytest.raises(PlacementError, match="--weight-sync-backend ray_nccl needs GPUs.*the Ray cluster has none"):
        check_transport_for_cluster("ray_nccl", ray_nodes([0, 0]))
    check_transport_for_cluster("ray_nccl", ray_nodes([0, 8]))
    check_transport_for_cluster("torch", ray_nodes([0, 0]))
    dead_gpu_node = ray_nodes([0, 8])
    dead_gpu_node[1]["Alive"] = False
    with pytest.raises(PlacementError):
        check_transport_for_cluster("ray_nccl", dead_gpu_node)


def test_config_validation_names_the_field():
    RunConfig(weight_sync_backend="ray_nccl").validate()
    with pytest.raises(ConfigError, match="run.weight_sync_backend: must be one of torch, ray_nccl, got 'mpi'"):
        RunConfig(weight_sync_backend="mpi").validate()  # type: ignore[arg-type]


def test_cli_flag_reaches_the_config_and_its_errors_name_the_flag(capsys):
    assert config_from_args(build_parser().parse_args([])).run.weight_sync_backend == "torch"
    args = build_parser().parse_args(["--weight-sync-backend", "torch"])
    args.weight_sync_backend = "mpi"  # what argparse's choices keep out; the config check names the flag
    with pytest.raises(UsageError, match="--weight-sync-backend: must be one of torch, ray_nccl, got .mpi."):
        config_from_args(args)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--weight-sync-backend", "gloo"])
    assert "--weight-sync-backend: invalid choice: 'gloo'" in capsys.readouterr().err


@pytest.mark.skipif(importlib.util.find_spec("cupy") is not None, reason="cupy is installed")
def test_cli_refuses_ray_nccl_without_cupy():
    with pytest.raises(UsageError, match=r"--weight-sync-backend ray_nccl: .*need cupy.*\.\[gpu\]"):
        config_from_args(build_parser().parse_args(["--weight-sync-backend", "ray_nccl"]))


def test_weight_sync_end_to_end_over_the_torch_transport():
    """One sender and two receivers built by host_as_sender/join_as_receiver with transport="torch": two versions
    arrive bit-identical."""
    port = find_free_port()
    versions = {1: {"w": torch.randn(33, 7).bfloat16(), "b": torch.arange(5.0)}, 2: {}}
    versions[2] = {name: tensor + 1 for name, tensor in versions[1].items()}

    def sender() -> None:
        end = host_as_sender(
            host="127.0.0.1", port=port, world_size=3, state_dict=versions[1], timeout_s=20.0, transport="torch",
            bucket_bytes=256,
        )  # fmt: skip
        for version in (1, 2):
            end.send(versions[version], version)
        end.close()

    def receiver(rank: int) -> list:
        end = join_as_receiver(host="127.0.0.1", port=port, rank=rank, world_size=3, timeout_s=20.0, transport="torch")
        received = []
        for _ in range(2):  # the tensors are views the next receive overwrites: copy each version first
            version, tensors = end.receive()
            received.append((version, {name: tensor.clone() for name, tensor in tensors.items()}))
        end.close()
        return received

    outcomes = run_members([sender, lambda: receiver(1), lambda: receiver(2)], timeout_s=30)
    results = dict(enumerate(outcomes))
    if results[0] is None:
        del results[0]
    assert 0 not in results, results.get(0)
    for rank in (1, 2):
        received = results[rank]
        assert not isinstance(received, BaseException), received
        assert [version for version, _ in received] == [1, 2]
        for version, tensors in received:
            assert list(tensors) == ["w", "b"]
            for name, tensor in versions[version].items():
                assert tensors[name].dtype == tensor.dtype and torch.equal(tensors[name], tensor), (rank, version, name)
