"""Which path each pipeline stage's weights take to each producer (``--weight-sync-mode``), and opening it.

``plan_routes`` is pure: given the mode, where the senders and producers run and the broadcast addresses, it
says per stage what the sender sets up (``SendRoute``) and per producer and stage how it receives
(``ReceiveRoute``). ``broadcast``: every producer joins the stage's group (``bucketed.py``). ``shm``:
producers on the sender's node read ``shared_memory.py``'s region; the others join a broadcast group of
just them (ranks renumbered 1..n). ``files``: every producer loads ``files.py``'s files.
A producer may receive in several processes (a vLLM engine's tensor-parallel workers, each joining the sync
itself): it then holds that many consecutive broadcast ranks, and each of its processes opens the route as one
``member``.

Every formation of the sync (the start, and again after a producer restarted) gets fresh region names and
file prefixes, so a receiver never mistakes a file or slot of an earlier formation for the sync it waits for.
All senders and receivers share one interface: ``send(state_dict, policy_version)`` / ``receive() ->
(policy_version, name -> tensor)``, ``close()``, ``last_policy_version``.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    import torch

WEIGHT_SYNC_DIR = "weight_sync"  # inside the run directory, for the files mode
RouteKind = Literal["broadcast", "shm", "files"]


@dataclass(frozen=True)
class SendRoute:
    """What one stage's sender sets up: a broadcast group (if anyone reads it), a region, or files."""

    stage: int
    broadcast_world_size: int  # 1 + producers receiving by broadcast; 1: no group is formed
    address: tuple[str, int] | None
    shm_region: str | None = None
    files_dir: str | None = None
    file_prefix: str = ""


@dataclass(frozen=True)
class ReceiveRoute:
    """How one producer receives one stage's weights."""

    kind: RouteKind
    stage: int
    rank: int = 0  # in the broadcast group: the first of this producer's ranks
    world_size: int = 1
    address: tuple[str, int] | None = None
    location: str = ""  # shm region, or the sync files' directory
    file_prefix: str = ""
    members: int = 1  # this producer's receiving processes (vLLM's tensor-parallel workers): ranks rank, rank+1..


def shm_readers(sender_node: str, producer_nodes: Sequence[str]) -> list[bool]:
    """Per producer: True if it runs on the sender's node (reads shared memory), False if it needs the broadcast."""
    return [node == sender_node for node in producer_nodes]


def _region_prefix(run_dir: str | Path) -> str:
    run_hash = hashlib.sha256(str(Path(run_dir).resolve()).encode()).hexdigest()[:12]
    return f"colossal_rl-{run_hash}-{os.getpid()}-"


def region_name(run_dir: str | Path, formation: int, stage: int, shm_root: str | Path = "/dev/shm") -> str:
    """Unique per run (run directory hash, driver pid), formation and stage."""
    return str(Path(shm_root) / f"{_region_prefix(run_dir)}f{formation}-s{stage}")


def remove_leftover_regions(run_dir: str | Path, shm_root: str | Path = "/dev/shm") -> list[Path]:
    """Delete this run's regions still in ``shm_root`` (a sender killed before its ``close``); returns them.

    Called by the driver at shutdown, on the driver's node: a region on another node (the sender trainer placed
    elsewhere) is not reached from here."""
    root = Path(shm_root)
    leftovers = sorted(root.glob(f"{_region_prefix(run_dir)}*")) if root.is_dir() else []
    for path in leftovers:
        path.unlink(missing_ok=True)
    return leftovers


def plan_routes(
    mode: RouteKind,
    *,
    sender_nodes: Sequence[str],
    producer_nodes: Sequence[str],
    addresses: Sequence[tuple[str, int]],
    run_dir: str | Path,
    formation: int,
    receivers_per_producer: Sequence[int] | None = None,
) -> tuple[list[SendRoute], list[list[ReceiveRoute]]]:
    """Per stage its ``SendRoute``; per producer (rank order) its ``ReceiveRoute`` of every stage.

    ``receivers_per_producer``: how many processes of each producer receive (default 1; a vLLM producer whose
    engine workers receive themselves: its tensor-parallel size). Each gets a broadcast rank of its own."""
    if mode not in ("broadcast", "shm", "files"):  # "auto" is resolved at launch (placement.py), never planned
        raise ValueError(f"weight-sync mode must be broadcast, shm or files here, got {mode!r}")
    if len(sender_nodes) != len(addresses):
        raise ValueError(f"{len(sender_nodes)} sender nodes but {len(addresses)} broadcast addresses")
    members = list(receivers_per_producer) if receivers_per_producer is not None else [1] * len(producer_nodes)
    if len(members) != len(producer_nodes) or min(members, default=1) < 1:
        raise ValueError(f"receivers_per_producer {members} must give each of {len(producer_nodes)} producers >= 1")
    sends: list[SendRoute] = []
    receives: list[list[ReceiveRoute]] = [[] for _ in producer_nodes]
    for stage, (sender_node, address) in enumerate(zip(sender_nodes, addresses, strict=True)):
        if mode == "files":
            directory, prefix = str(Path(run_dir) / WEIGHT_SYNC_DIR), f"f{formation}-stage{stage}"
            sends.append(SendRoute(stage, 1, None, files_dir=directory, file_prefix=prefix))
            for routes, n in zip(receives, members, strict=True):
                routes.append(ReceiveRoute("files", stage, location=directory, file_prefix=prefix, members=n))
            continue
        local = shm_readers(sender_node, producer_nodes) if mode == "shm" else [False] * len(producer_nodes)
        world = 1 + sum(n for n, on_host in zip(members, local, strict=True) if not on_host)
        region = region_name(run_dir, formation, stage) if any(local) else None
        sends.append(SendRoute(stage, world, address if world > 1 else None, shm_region=region))
        next_rank = 1
        for routes, on_host, n in zip(receives, local, members, strict=True):
            if on_host:
                routes.append(ReceiveRoute("shm", stage, location=region or "", members=n))
            else:
                routes.append(ReceiveRoute("broadcast", stage, next_rank, world, address, members=n))
                next_rank += n
    return sends, receives


class FanOutSender:
    """Several senders of one stage (shared memory for local producers, broadcast for the rest) as one."""

    def __init__(self, senders: Sequence):
        self.senders = list(senders)
        self.last_policy_version: int | None = None

    def send(self, state_dict: Mapping[str, torch.Tensor], policy_version: int) -> None:
        for sender in self.senders:  # shared memory first: it does not wait for anyone
            sender.send(state_dict, policy_version)
        self.last_policy_version = policy_version

    def close(self) -> None:
        for sender in self.senders:
            sender.close()


def open_sender(
    route: SendRoute,
    state_dict: Mapping[str, torch.Tensor],
    *,
    timeout_s: float,
    transport: str,
    group_name: str,
    device: torch.device | str,
):
    """The sender ``route`` asks for (collective for the broadcast part: every broadcast receiver joins)."""
    from colossal_rl.comm.weight_sync.bucketed import host_as_sender
    from colossal_rl.comm.weight_sync.files import FileSender
    from colossal_rl.comm.weight_sync.shared_memory import host_shared_memory

    if route.files_dir is not None:
        return FileSender(route.files_dir, route.file_prefix)
    senders = []
    if route.shm_region is not None:
        senders.append(host_shared_memory(route.shm_region, state_dict, timeout_s))
    if route.broadcast_world_size > 1:
        assert route.address is not None
        host, port = route.address
        senders.append(
            host_as_sender(
                host=host,
                port=port,
                world_size=route.broadcast_world_size,
                state_dict=state_dict,
                timeout_s=timeout_s,
                transport=transport,
                name=group_name,
                device=device,
            )
        )
    return senders[0] if len(senders) == 1 else FanOutSender(senders)


def open_receivers(
    routes: Sequence[ReceiveRoute],
    *,
    timeout_s: float,
    transport: str,
    device,
    member: int = 0,
    before_allocating: Callable[[int, int], None] | None = None,
) -> list:
    """One receiver per pipeline stage's route (stage order), each on its stage's group; ``member`` and
    ``before_allocating`` as below."""
    from colossal_rl.comm.weight_sync.stages import stage_group_name

    return [
        open_receiver(
            route,
            timeout_s=timeout_s,
            transport=transport,
            group_name=stage_group_name(route.stage),
            device=device,
            member=member,
            before_allocating=before_allocating,
        )  # fmt: skip
        for route in routes
    ]


def open_receiver(
    route: ReceiveRoute,
    *,
    timeout_s: float,
    transport: str,
    group_name: str,
    device,
    member: int = 0,
    before_allocating: Callable[[int, int], None] | None = None,
):
    """The receiver ``route`` asks for; ``member``: which of the producer's receiving processes this is.
    ``before_allocating``: a broadcast receiver's check of its buffers' and largest tensor's bytes on ``device`` (``join_as_receiver``);
    shared memory and files are read into host memory and skip it."""
    if not 0 <= member < route.members:
        raise ValueError(f"member {member} of a route with {route.members} receiving processes")
    from colossal_rl.comm.weight_sync.bucketed import join_as_receiver
    from colossal_rl.comm.weight_sync.files import FileReceiver
    from colossal_rl.comm.weight_sync.shared_memory import SharedMemoryReceiver

    if route.kind == "files":
        return FileReceiver(route.location, route.file_prefix, timeout_s)
    if route.kind == "shm":
        return SharedMemoryReceiver(route.location, timeout_s)
    assert route.address is not None
    host, port = route.address
    return join_as_receiver(
        host=host,
        port=port,
        rank=route.rank + member,
        world_size=route.world_size,
        timeout_s=timeout_s,
        transport=transport,
        name=group_name,
        device=device,
        before_allocating=before_allocating,
    )
