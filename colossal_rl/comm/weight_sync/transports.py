"""Which collective group carries the weight sync: the registry behind ``--weight-sync-backend``.

- ``torch`` (the default): a ``StandaloneGroup`` (``comm/process_group.py``) — torch's ``ProcessGroupGloo``
  for weights on the CPU, ``ProcessGroupNCCL`` for weights on a GPU — over its own ``TCPStore``.
- ``ray_nccl``: a ``RayNcclGroup`` (``comm/ray_nccl_group.py``) — Ray's cupy-based NCCL collective group,
  the "cupy NCCL group" of the design card and ColossalChat's transport; CUDA tensors only.

Neither joins torch.distributed's default process group, so either lives beside ColossalAI's group
in a trainer. ``torch`` is the default because one code path serves CPU and GPU (gloo and NCCL
differ in one constructor call), its timeouts are torch's own (``Work.wait(timeout)``, NCCL's
watchdog) where Ray's NCCL collectives have none and need a worker thread and event polling, its
rendezvous is a ``TCPStore`` that dies with the run where Ray's leaves detached named actors, and
it needs no cupy. ``bucketed.py`` is one implementation over any ``Collective`` these return.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from colossal_rl.comm.process_group import Backend, Collective, backend_for_device, create_standalone_group
from colossal_rl.comm.ray_nccl_group import create_ray_nccl_group
from colossal_rl.comm.weight_sync.stages import GPU_ONLY_TRANSPORTS

GroupFactory = Callable[..., Collective]
"""``factory(rank=, world_size=, host=, port=, timeout_s=, name=, device=)``: every member calls it at once."""


def _torch_group(
    *, rank: int, world_size: int, host: str, port: int, timeout_s: float, name: str, device: torch.device
) -> Collective:
    return create_standalone_group(backend_for_device(device), rank, world_size, host, port, timeout_s, name=name)


def _ray_nccl_group(
    *, rank: int, world_size: int, host: str, port: int, timeout_s: float, name: str, device: torch.device
) -> Collective:
    return create_ray_nccl_group(rank, world_size, host, port, timeout_s, name=name, device=device)


WEIGHT_SYNC_TRANSPORTS: dict[str, GroupFactory] = {"torch": _torch_group, "ray_nccl": _ray_nccl_group}


def transport_backend(transport: str, device: torch.device | str) -> Backend:
    """The wire backend ``transport`` uses for tensors on ``device``; refuses a transport that cannot carry them."""
    if transport not in WEIGHT_SYNC_TRANSPORTS:
        raise ValueError(
            f"unknown weight-sync transport {transport!r}; known: {', '.join(sorted(WEIGHT_SYNC_TRANSPORTS))}"
        )
    backend = backend_for_device(device)
    if transport in GPU_ONLY_TRANSPORTS and backend != "nccl":
        raise ValueError(
            f"--weight-sync-backend {transport} carries CUDA tensors only, but this member's weights travel on "
            f"{torch.device(device)}; use --weight-sync-backend torch without GPUs"
        )
    return backend


def create_group(
    transport: str,
    *,
    rank: int,
    world_size: int,
    host: str,
    port: int,
    timeout_s: float,
    name: str,
    device: torch.device | str,
) -> Collective:
    """Form the weight-sync group ``name`` over ``transport``; every member calls this concurrently.

    Rank 0 is the sender, whose ``host:port`` every member was given. Blocks until all members
    have joined, at most ``timeout_s`` seconds.
    """
    transport_backend(transport, device)
    factory = WEIGHT_SYNC_TRANSPORTS[transport]
    return factory(
        rank=rank,
        world_size=world_size,
        host=host,
        port=port,
        timeout_s=timeout_s,
        name=name,
        device=torch.device(device),
    )
