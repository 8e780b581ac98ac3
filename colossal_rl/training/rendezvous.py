"""The consumers' rendezvous: rank 0 hosts the TCP store every engine's process group starts on."""

from __future__ import annotations

import datetime

import torch.distributed as dist


def open_rendezvous_store(port: int, world_size: int, *, timeout_s: float = 600.0) -> dist.TCPStore:
    """Rank 0's store of the consumers' process group, listening on ``port`` (0: a free one, see ``.port``)."""
    return dist.TCPStore(
        "0.0.0.0", port, world_size, is_master=True, timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )  # fmt: skip


def connect_rendezvous_store(
    rank: int, world_size: int, master_addr: str, master_port: int, *, store: dist.Store | None, timeout_s: float
) -> dist.Store:
    """``store`` when rank 0 opened it already, else rank 0 opens it on ``master_port`` and the others connect."""
    if store is not None:
        return store
    if rank == 0:
        return open_rendezvous_store(master_port, world_size, timeout_s=timeout_s)
    timeout = datetime.timedelta(seconds=timeout_s)
    return dist.TCPStore(master_addr, master_port, world_size, is_master=False, timeout=timeout)
