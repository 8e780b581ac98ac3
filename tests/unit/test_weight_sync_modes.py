"""``--weight-sync-mode``: who reads what (``comm/weight_sync/modes.py``), shared memory (no torn reads), sync files."""

from __future__ import annotations

import errno
import multiprocessing
import os
import threading
import time
from pathlib import Path

import pytest
import torch

from colossal_rl.comm.weight_sync import shared_memory
from colossal_rl.comm.weight_sync.bucketed import WeightLayout
from colossal_rl.comm.weight_sync.files import FileReceiver, FileSender, sync_file_name, sync_files
from colossal_rl.comm.weight_sync.modes import (
    FanOutSender,
    ReceiveRoute,
    SendRoute,
    open_receiver,
    open_sender,
    plan_routes,
    region_name,
    shm_readers,
)
from colossal_rl.comm.weight_sync.shared_memory import (
    SharedMemoryReceiver,
    SharedMemorySender,
    SharedMemorySpaceError,
    region_bytes,
    region_paths,
)


def state_dict(fill: float, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    return {
        "embed.weight": torch.full((64, 32), fill, dtype=dtype),
        "layer.bias": torch.full((7,), fill, dtype=torch.bfloat16),
        "layer.weight": torch.full((256, 129), fill, dtype=dtype),
        "step": torch.full((1,), int(fill), dtype=torch.int64),
    }


def one_version(tensors: dict[str, torch.Tensor]) -> set[float]:
    return {float(value) for tensor in tensors.values() for value in tensor.float().unique().tolist()}


@pytest.fixture
def region(tmp_path: Path) -> str:
    return str(tmp_path / "region")  # a real /dev/shm region in production; any directory works the same


# ---------------------------------------------------------------- who reads what
def test_shm_readers_are_the_producers_on_the_senders_node():
    assert shm_readers("node-a", ["node-a", "node-b", "node-a"]) == [True, False, True]


def test_shm_plan_puts_off_host_producers_in_a_broadcast_group_of_just_them():
    sends, receives = plan_routes(
        "shm",
        sender_nodes=["node-a"],
        producer_nodes=["node-a", "node-b", "node-a", "node-c"],
        addresses=[("10.0.0.1", 1234)],
        run_dir="/runs/x",
        formation=1,
    )
    (send,) = sends
    assert send.broadcast_world_size == 3 and send.address == ("10.0.0.1", 1234) and send.shm_region
    kinds = [routes[0].kind for routes in receives]
    assert kinds == ["shm", "broadcast", "shm", "broadcast"]
    assert [(r[0].rank, r[0].world_size) for r in receives if r[0].kind == "broadcast"] == [(1, 3), (2, 3)]
    assert {r[0].location for r in receives if r[0].kind == "shm"} == {send.shm_region}


def test_shm_plan_with_every_producer_on_host_forms_no_group():
    sends, receives = plan_routes(
        "shm", sender_nodes=["a"], producer_nodes=["a", "a"], addresses=[("h", 1)], run_dir="/r", formation=1
    )
    assert sends[0].broadcast_world_size == 1 and sends[0].address is None
    assert all(routes[0].kind == "shm" for routes in receives)


def test_broadcast_plan_is_todays_group_and_files_plan_has_none():
    addresses = [("h", 1), ("h", 2)]
    sends, receives = plan_routes(
        "broadcast", sender_nodes=["a", "b"], producer_nodes=["a", "c"], addresses=addresses, run_dir="/r", formation=1
    )
    assert [s.broadcast_world_size for s in sends] == [3, 3] and [s.shm_region for s in sends] == [None, None]
    assert [[(r.stage, r.rank, r.address) for r in routes] for routes in receives] == [
        [(0, 1, ("h", 1)), (1, 1, ("h", 2))],
        [(0, 2, ("h", 1)), (1, 2, ("h", 2))],
    ]
    sends, receives = plan_routes(
        "files", sender_nodes=["a", "b"], producer_nodes=["a", "c"], addresses=addresses, run_dir="/r", formation=2
    )
    assert [(s.broadcast_world_size, s.files_dir, s.file_prefix) for s in sends] == [
        (1, "/r/weight_sync", "f2-stage0"),
        (1, "/r/weight_sync", "f2-stage1"),
    ]
    assert all(r.kind == "files" for routes in receives for r in routes)


def test_region_names_differ_per_run_formation_and_stage():
    names = {region_name("/runs/a", 1, 0), region_name("/runs/b", 1, 0), region_name("/runs/a", 2, 0)}
    names.add(region_name("/runs/a", 1, 1))
    assert len(names) == 4 and all(name.startswith("/dev/shm/colossal_rl-") for name in names)
    assert str(os.getpid()) in region_name("/runs/a", 1, 0)


# ---------------------------------------------------------------- shared memory
def test_shm_round_trip_views_and_cleanup(region: str):
    sender = SharedMemorySender(region, WeightLayout.from_state_dict(state_dict(0.0)), timeout_s=5)
    receiver = SharedMemoryReceiver(region, timeout_s=5)
    for version in (1, 2, 3):
        sender.send(state_dict(float(version)), version)
        received_version, tensors = receiver.receive()
        assert received_version == version and one_version(tensors) == {float(version)}
        assert list(tensors) == list(state_dict(0.0))
        assert tensors["layer.bias"].dtype == torch.bfloat16
    receiver.close()
    sender.close()
    data, layout, locks = region_paths(region)
    assert not any(path.exists() for path in (data, layout, *locks))


def test_shm_sender_reserves_the_regions_space_up_front(region: str):
    """A truncated file is sparse: on a tmpfs without room the first write into it dies of SIGBUS. The data file
    holds its blocks before anything is written (``posix_fallocate``)."""
    sender = SharedMemorySender(region, WeightLayout.from_state_dict(state_dict(1.0)), timeout_s=5)
    data_path = region_paths(region)[0]
    assert os.stat(data_path).st_blocks * 512 >= os.stat(data_path).st_size == region_bytes(sender.layout)
    sender.close()


def test_shm_sender_refuses_a_region_its_file_system_has_no_room_for_in_one_line(region: str, monkeypatch):
    """Docker's default /dev/shm is 64 MB: the refusal names the size needed and --shm-size, and leaves no file."""
    layout = WeightLayout.from_state_dict(state_dict(1.0))
    monkeypatch.setattr(shared_memory, "free_bytes", lambda directory: 64 * 2**10)
    with pytest.raises(SharedMemorySpaceError) as refused:
        SharedMemorySender(region, layout, timeout_s=5)
    message = str(refused.value)
    assert f"the region needs {region_bytes(layout) / 1e9:.2f} GB" in message and "--shm-size=1g" in message
    assert "\n" not in message and "--weight-sync-mode broadcast" in message
    assert list(Path(region).parent.iterdir()) == []


def test_shm_sender_takes_a_file_system_with_exactly_the_regions_room(region: str, monkeypatch):
    """Free space equal to the region is enough to reserve it; a byte less is refused before any file is made."""
    layout = WeightLayout.from_state_dict(state_dict(1.0))
    monkeypatch.setattr(shared_memory, "free_bytes", lambda directory: region_bytes(layout))
    SharedMemorySender(region, layout, timeout_s=5).close()
    monkeypatch.setattr(shared_memory, "free_bytes", lambda directory: region_bytes(layout) - 1)
    with pytest.raises(SharedMemorySpaceError):
        SharedMemorySender(region, layout, timeout_s=5)
    assert list(Path(region).parent.iterdir()) == []


def test_shm_sender_turns_enospc_from_the_reservation_into_the_same_refusal(region: str, monkeypatch):
    """The free-space probe is a hint (another process may take the room first): ENOSPC from ``posix_fallocate``
    itself is refused the same way, and the file is removed."""

    def no_room(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", no_room)
    with pytest.raises(SharedMemorySpaceError, match="--shm-size"):
        SharedMemorySender(region, WeightLayout.from_state_dict(state_dict(1.0)), timeout_s=5)
    assert list(Path(region).parent.iterdir()) == []


def test_shm_receiver_waits_for_a_newer_version_and_times_out_naming_the_region(region: str):
    sender = SharedMemorySender(region, WeightLayout.from_state_dict(state_dict(0.0)), timeout_s=5)
    receiver = SharedMemoryReceiver(region, timeout_s=0.2)
    sender.send(state_dict(1.0), 1)
    assert receiver.receive()[0] == 1
    with pytest.raises(TimeoutError, match=f"{region}.*no version newer than 1"):
        receiver.receive()
    receiver.close()
    sender.close()


def test_shm_receiver_refuses_a_version_written_for_another_layout(region: str):
    """The plan checksum in each slot's stamp is checked, not just that the bytes fit: a sender recreating the
    region with another layout of the same size (a tensor renamed) is refused, never read as this layout."""
    sender = SharedMemorySender(region, WeightLayout.from_state_dict(state_dict(0.0)), timeout_s=5)
    receiver = SharedMemoryReceiver(region, timeout_s=5)
    renamed = {name.replace("layer.", "block."): tensor for name, tensor in state_dict(0.0).items()}
    other = SharedMemorySender(region, WeightLayout.from_state_dict(renamed), timeout_s=5)
    assert other.slot_bytes == sender.slot_bytes and other.checksum != receiver.checksum
    other.send({name: torch.full_like(tensor, 2.0) for name, tensor in renamed.items()}, 1)
    with pytest.raises(RuntimeError, match=f"{region}: plan checksum {other.checksum} differs"):
        receiver.receive()
    receiver.close()
    other.close()
    sender.close()


def test_shm_receiver_without_a_sender_times_out_naming_the_region(region: str):
    with pytest.raises(TimeoutError, match=f"{region}: no sender"):
        SharedMemoryReceiver(region, timeout_s=0.1)


def test_shm_sender_refuses_to_overwrite_a_slot_a_reader_still_holds(region: str):
    sender = SharedMemorySender(region, WeightLayout.from_state_dict(state_dict(0.0)), timeout_s=0.2)
    receiver = SharedMemoryReceiver(region, timeout_s=5)
    sender.send(state_dict(1.0), 1)
    _, held = receiver.receive()  # holds slot 0
    sender.send(state_dict(2.0), 2)  # slot 1: free
    with pytest.raises(TimeoutError, match="a reader still holds version 1"):
        sender.send(state_dict(3.0), 3)
    assert one_version(held) == {1.0}  # untouched
    assert receiver.receive()[0] == 2  # moving on releases slot 0
    sender.send(state_dict(3.0), 3)
    receiver.close()
    sender.close()


def _write_versions(region: str, versions: int, started, timeout_s: float) -> None:
    sender = SharedMemorySender(region, WeightLayout.from_state_dict(state_dict(0.0)), timeout_s=timeout_s)
    started.set()
    for version in range(1, versions + 1):
        sender.send(state_dict(float(version)), version)
    time.sleep(1.0)  # let the reader see the last one before the region goes
    sender.close()


def test_a_reader_racing_a_writer_process_sees_one_whole_version_every_time(region: str):
    """A writer process writes versions 1..N back to back while this process reads: every read is one version."""
    versions = 150
    context = multiprocessing.get_context("spawn")
    started = context.Event()
    writer = context.Process(target=_write_versions, args=(region, versions, started, 30.0))
    writer.start()
    try:
        assert started.wait(60)
        receiver = SharedMemoryReceiver(region, timeout_s=30)
        seen = []
        while not seen or seen[-1] < versions:
            version, tensors = receiver.receive()
            fills = one_version(tensors)  # read while the writer keeps writing the other slot
            assert fills == {float(version)}, f"torn read: version {version} holds {sorted(fills)}"
            seen.append(version)
        receiver.close()
    finally:
        writer.join(60)
    assert writer.exitcode == 0
    assert seen == sorted(set(seen))


def test_shm_readers_in_threads_never_see_a_torn_version(region: str):
    sender = SharedMemorySender(region, WeightLayout.from_state_dict(state_dict(0.0)), timeout_s=30)
    errors: list[str] = []

    def read() -> None:
        receiver = SharedMemoryReceiver(region, timeout_s=30)
        last = 0
        while last < 60:
            version, tensors = receiver.receive()
            if one_version(tensors) != {float(version)}:
                errors.append(f"version {version}: {sorted(one_version(tensors))}")
            last = version
        receiver.close()

    readers = [threading.Thread(target=read) for _ in range(3)]
    for reader in readers:
        reader.start()
    for version in range(1, 61):
        sender.send(state_dict(float(version)), version)
    for reader in readers:
        reader.join(60)
    sender.close()
    assert errors == []


# ---------------------------------------------------------------- sync files
def test_file_sync_round_trip_keeps_the_newest_two_and_cleans_up(tmp_path: Path):
    sender = FileSender(tmp_path / "weight_sync", "f1-stage0")
    receiver = FileReceiver(tmp_path / "weight_sync", "f1-stage0", timeout_s=5)
    for version in (1, 2, 3, 4):
        sender.send(state_dict(float(version)), version)
        received_version, tensors = receiver.receive()
        assert received_version == version and one_version(tensors) == {float(version)}
        assert tensors["layer.bias"].dtype == torch.bfloat16
    assert [version for version, _ in sync_files(tmp_path / "weight_sync", "f1-stage0")] == [3, 4]
    assert not [p for p in (tmp_path / "weight_sync").iterdir() if ".tmp" in p.name]
    sender.close()
    assert not (tmp_path / "weight_sync").exists()  # emptied and removed


def test_file_receiver_takes_the_newest_and_ignores_other_prefixes(tmp_path: Path):
    FileSender(tmp_path, "f1-stage0").send(state_dict(9.0), 9)  # an earlier formation's file
    sender = FileSender(tmp_path, "f2-stage0")
    receiver = FileReceiver(tmp_path, "f2-stage0", timeout_s=5)
    sender.send(state_dict(1.0), 1)
    sender.send(state_dict(2.0), 2)
    assert receiver.receive()[0] == 2


def test_file_receiver_times_out_naming_the_files(tmp_path: Path):
    receiver = FileReceiver(tmp_path / "weight_sync", "f1-stage0", timeout_s=0.1)
    with pytest.raises(TimeoutError, match=r"weight_sync/f1-stage0-v\*\.safetensors: no version newer than None"):
        receiver.receive()


def test_file_write_is_atomic_a_reader_never_sees_a_partial_file(tmp_path: Path, monkeypatch):
    """The file appears under its name only once whole: a crash while writing leaves no file and no temp."""
    import colossal_rl.comm.weight_sync.files as files

    def crash(tensors, path, metadata):
        Path(path).write_bytes(b"half a file")
        raise OSError("disk full")

    monkeypatch.setattr(files, "save_file", crash)
    with pytest.raises(OSError, match="disk full"):
        FileSender(tmp_path, "f1-stage0").send(state_dict(1.0), 1)
    assert list(tmp_path.iterdir()) == []


def test_file_sender_handles_tied_weights(tmp_path: Path):
    shared = torch.ones(4, 4)
    FileSender(tmp_path, "p").send({"embed": shared, "lm_head": shared}, 1)
    version, tensors = FileReceiver(tmp_path, "p", timeout_s=1).receive()
    assert version == 1 and set(tensors) == {"embed", "lm_head"}
    assert (tmp_path / sync_file_name("p", 1)).exists()


# ---------------------------------------------------------------- one interface for all
def test_fan_out_sender_feeds_shm_and_files_through_open_sender_and_open_receiver(tmp_path: Path):
    region = str(tmp_path / "region")
    shm = open_sender(
        SendRoute(0, 1, None, shm_region=region), state_dict(0.0), timeout_s=5, transport="torch", group_name="g",
        device="cpu",
    )  # fmt: skip
    files = open_sender(
        SendRoute(0, 1, None, files_dir=str(tmp_path / "ws"), file_prefix="f1-stage0"),
        state_dict(0.0), timeout_s=5, transport="torch", group_name="g", device="cpu",
    )  # fmt: skip
    sender = FanOutSender([shm, files])
    receivers = [
        open_receiver(ReceiveRoute("shm", 0, location=region), timeout_s=5, transport="torch", group_name="g",
                      device="cpu"),
        open_receiver(ReceiveRoute("files", 0, location=str(tmp_path / "ws"), file_prefix="f1-stage0"),
                      timeout_s=5, transport="torch", group_name="g", device="cpu"),
    ]  # fmt: skip
    sender.send(state_dict(5.0), 5)
    assert sender.last_policy_version == 5
    for receiver in receivers:
        version, tensors = receiver.receive()
        assert version == 5 and one_version(tensors) == {5.0}
        assert receiver.last_policy_version == 5
        receiver.close()
    sender.close()


def test_shm_copy_in_pieces_over_threads_matches_a_single_copy(region: str, monkeypatch):
    import colossal_rl.comm.weight_sync.shared_memory as shared_memory

    monkeypatch.setattr(shared_memory, "COPY_PIECE_BYTES", 1000)  # many pieces per tensor
    generator = torch.Generator().manual_seed(0)
    state = {name: torch.rand(t.shape, generator=generator).to(t.dtype) for name, t in state_dict(0.0).items()}
    state["strided"] = torch.rand(40, 30, generator=generator).t()  # not contiguous: copied whole
    sender = SharedMemorySender(region, WeightLayout.from_state_dict(state), timeout_s=5, copy_threads=3)
    receiver = SharedMemoryReceiver(region, timeout_s=5)
    sender.send(state, 1)
    _, tensors = receiver.receive()
    for name, tensor in state.items():
        torch.testing.assert_close(tensors[name], tensor, rtol=0, atol=0)
    receiver.close()
    sender.close()


def test_shm_plan_end_to_end_one_producer_on_host_one_off_host_over_a_real_gloo_group(tmp_path: Path):
    """Planned routes opened for real: the on-host producer reads shared memory, the off-host one is rank 1 of a
    two-member broadcast group; the sender's one ``send`` reaches both (three processes, as in a run)."""
    from process_members import run_members

    from colossal_rl.comm.process_group import find_free_port

    sends, receives = plan_routes(
        "shm",
        sender_nodes=["node-a"],
        producer_nodes=["node-a", "node-b"],
        addresses=[("127.0.0.1", find_free_port())],
        run_dir=tmp_path,
        formation=1,
    )
    sends = [SendRoute(0, s.broadcast_world_size, s.address, shm_region=str(tmp_path / "region")) for s in sends]
    receives = [
        [r if r.kind == "broadcast" else ReceiveRoute("shm", 0, location=sends[0].shm_region)] for (r,) in receives
    ]
    options = dict(timeout_s=20, transport="torch", group_name="weight_sync/stage0", device="cpu")

    def send():
        torch.set_num_threads(1)  # forked after this process ran OpenMP-parallel copies: no new OpenMP team
        sender = open_sender(sends[0], state_dict(0.0), **options)
        sender.send(state_dict(3.0), 3)
        time.sleep(1.0)  # the shm reader maps the region before it is removed
        sender.close()
        return type(sender).__name__

    def receive(rank: int):
        def run():
            torch.set_num_threads(1)
            receiver = open_receiver(receives[rank][0], **options)
            version, tensors = receiver.receive()
            result = (receives[rank][0].kind, version, sorted(one_version(tensors)))
            receiver.close()
            return result

        return run

    results = run_members([send, receive(0), receive(1)], timeout_s=60)
    assert results == ["FanOutSender", ("shm", 3, [3.0]), ("broadcast", 3, [3.0])], results


def test_leftover_regions_of_this_run_are_removed_and_others_kept(tmp_path: Path):
    from colossal_rl.comm.weight_sync.modes import region_name, remove_leftover_regions

    ours = [Path(region_name(tmp_path / "run", formation, 0, shm_root=tmp_path)) for formation in (0, 1)]
    theirs = Path(region_name(tmp_path / "other_run", 0, 0, shm_root=tmp_path))
    for path in [*ours, theirs]:
        path.write_bytes(b"slot")
    assert remove_leftover_regions(tmp_path / "run", shm_root=tmp_path) == sorted(ours)
    assert [p.name for p in tmp_path.iterdir()] == [theirs.name]


# ---------------------------------------------------------------- producers receiving in several processes
def test_a_producer_with_several_receiving_processes_holds_consecutive_broadcast_ranks():
    """vLLM producers whose tensor-parallel workers receive themselves: 2 + 1 + 3 members after the sender."""
    sends, receives = plan_routes(
        "broadcast", sender_nodes=["a"], producer_nodes=["a", "b", "c"], addresses=[("h", 1)], run_dir="/r",
        formation=1, receivers_per_producer=[2, 1, 3],
    )  # fmt: skip
    assert sends[0].broadcast_world_size == 1 + 2 + 1 + 3
    assert [(r[0].rank, r[0].members, r[0].world_size) for r in receives] == [(1, 2, 7), (3, 1, 7), (4, 3, 7)]
    sends, receives = plan_routes(
        "shm", sender_nodes=["a"], producer_nodes=["a", "b", "a", "c"], addresses=[("h", 1)], run_dir="/r",
        formation=1, receivers_per_producer=[2, 2, 2, 2],
    )  # fmt: skip
    assert sends[0].broadcast_world_size == 1 + 2 + 2  # only the off-host producers' workers join the group
    assert [(r[0].kind, r[0].rank, r[0].members) for r in receives] == [
        ("shm", 0, 2), ("broadcast", 1, 2), ("shm", 0, 2), ("broadcast", 3, 2),
    ]  # fmt: skip
    _, receives = plan_routes(
        "files", sender_nodes=["a"], producer_nodes=["a"], addresses=[("h", 1)], run_dir="/r", formation=1,
        receivers_per_producer=[4],
    )  # fmt: skip
    assert receives[0][0].members == 4


def test_receiving_process_counts_are_checked():
    for counts in ([1], [1, 0]):
        with pytest.raises(ValueError, match="receivers_per_producer"):
            plan_routes("broadcast", sender_nodes=["a"], producer_nodes=["a", "b"], addresses=[("h", 1)],
                        run_dir="/r", formation=1, receivers_per_producer=counts)  # fmt: skip
    _, receives = plan_routes(
        "broadcast", sender_nodes=["a"], producer_nodes=["a"], addresses=[("h", 1)], run_dir="/r", formation=1,
        receivers_per_producer=[2],
    )  # fmt: skip
    with pytest.raises(ValueError, match="member 2 of a route with 2"):
        open_receiver(receives[0][0], timeout_s=1.0, transport="torch", group_name="g", device="cpu", member=2)
