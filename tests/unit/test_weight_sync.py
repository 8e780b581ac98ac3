"""Weight layout, bucket planning and pack/unpack, in one process; plus the send/receive protocol over
a two-member gloo group run in two threads (no extra processes)."""

from __future__ import annotations

import pytest
import torch
from process_members import run_members

from colossal_rl.comm.process_group import create_standalone_group, find_free_port
from colossal_rl.comm.weight_sync.bucketed import (
    ALIGNMENT_BYTES,
    HEADER_BYTES,
    WeightLayout,
    WeightReceiver,
    WeightSender,
    chunk_ranges,
    merge_stage_parts,
    pack_bucket,
    plan_buckets,
    plan_checksum,
    receive_stages,
    unpack_bucket,
)
from colossal_rl.comm.weight_sync.stages import stage_group_name, stage_senders


def mixed_state_dict(seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)

    def normal(*shape: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(dtype)

    return {
        "embed.weight": normal(50, 16, dtype=torch.bfloat16),
        "layer.0.bias": normal(7, dtype=torch.float32),
        "layer.0.scale": normal(3, dtype=torch.float16),
        "step": torch.tensor(12345678901, dtype=torch.int64),  # 0-dim
        "layer.0.weight": normal(16, 16, dtype=torch.float32).t(),  # not contiguous
        "mask": torch.rand(5, generator=generator) > 0.5,
        "empty": torch.empty(0, 4, dtype=torch.float16),
        "head.weight": normal(33, 17, dtype=torch.bfloat16),
    }


def assert_bit_identical(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert list(actual) == list(expected)
    for name, tensor in expected.items():
        got = actual[name]
        assert (got.dtype, got.shape) == (tensor.dtype, tensor.shape), name
        assert torch.equal(got.reshape(-1).view(torch.uint8), tensor.contiguous().reshape(-1).view(torch.uint8)), name


def round_trip(state_dict: dict[str, torch.Tensor], bucket_bytes: int) -> dict[str, torch.Tensor]:
    layout = WeightLayout.from_state_dict(state_dict)
    unpacked: dict[str, torch.Tensor] = {}
    for bucket in plan_buckets(layout, bucket_bytes):
        buffer = torch.full((bucket.nbytes,), 0xAB, dtype=torch.uint8)
        pack_bucket(bucket, state_dict, buffer)
        unpacked.update(unpack_bucket(bucket, buffer))
    return unpacked


@pytest.mark.parametrize("bucket_bytes", [ALIGNMENT_BYTES + HEADER_BYTES, 256, 1024, 1 << 20])
def test_pack_unpack_round_trip_is_bit_identical(bucket_bytes):
    state_dict = mixed_state_dict()
    assert_bit_identical(round_trip(state_dict, bucket_bytes), state_dict)


def test_buckets_respect_size_and_give_oversized_tensors_their_own():
    state_dict = {f"small.{i}": torch.zeros(10, dtype=torch.float32) for i in range(20)}  # 40 bytes each
    state_dict["big"] = torch.zeros(1000, dtype=torch.bfloat16)  # 2000 bytes
    state_dict["after"] = torch.zeros(3, dtype=torch.float16)
    buckets = plan_buckets(WeightLayout.from_state_dict(state_dict), bucket_bytes=512)
    names = [[slot.spec.name for slot in bucket.slots] for bucket in buckets]
    assert [name for bucket in names for name in bucket] == list(state_dict)  # order kept
    assert ["big"] in names
    for bucket in buckets:
        assert bucket.nbytes <= 512 or len(bucket.slots) == 1
        assert all(slot.offset % ALIGNMENT_BYTES == 0 for slot in bucket.slots)
    assert [bucket.carries_header for bucket in buckets] == [True, False, False, False, False]
    assert buckets[0].slots[0].offset >= HEADER_BYTES  # the header owns the start of bucket 0
    # 8 small tensors fit in 512 bytes at 64-byte alignment, 7 beside the header: 7 + 8 + 5, big, after
    assert [len(bucket.slots) for bucket in buckets] == [7, 8, 5, 1, 1]


def test_header_is_a_bucket_of_its_own_when_the_first_tensor_is_too_big_to_share():
    state_dict = {"embed": torch.zeros(1000, dtype=torch.bfloat16), "bias": torch.zeros(4)}
    buckets = plan_buckets(WeightLayout.from_state_dict(state_dict), bucket_bytes=512)
    assert [(b.carries_header, [s.spec.name for s in b.slots], b.nbytes) for b in buckets] == [
        (True, [], HEADER_BYTES),
        (False, ["embed"], 2000),
        (False, ["bias"], 16),
    ]


def test_chunk_ranges_cover_a_bucket_in_bucket_sized_pieces():
    assert chunk_ranges(0, 512) == []
    assert chunk_ranges(512, 512) == [(0, 512)]
    assert chunk_ranges(1300, 512) == [(0, 512), (512, 1024), (1024, 1300)]


def test_layout_json_round_trip_and_checksum():
    layout = WeightLayout.from_state_dict(mixed_state_dict())
    assert WeightLayout.from_json(layout.to_json()) == layout
    assert plan_checksum(layout, 1024) == plan_checksum(WeightLayout.from_json(layout.to_json()), 1024)
    assert plan_checksum(layout, 1024) != plan_checksum(layout, 2048)
    assert 0 <= plan_checksum(layout, 1024) < 2**63


def test_empty_state_dict_is_refused():
    with pytest.raises(ValueError, match="empty"):
        WeightLayout.from_state_dict({})


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda sd: sd.pop("layer.0.bias"), "lacks 'layer.0.bias'"),
        (lambda sd: sd.update({"layer.0.scale": torch.zeros(4, dtype=torch.float16)}), "'layer.0.scale' is \\(4,\\)"),
        (lambda sd: sd.update({"embed.weight": torch.zeros(50, 16)}), "'embed.weight' is .* torch.float32"),
        (lambda sd: sd.update({"extra": torch.zeros(1)}), "has 'extra'"),
    ],
)
def test_layout_check_names_the_first_mismatching_key(change, message):
    layout = WeightLayout.from_state_dict(mixed_state_dict())
    state_dict = mixed_state_dict()
    change(state_dict)
    with pytest.raises(ValueError, match=message):
        layout.check(state_dict)


def test_merge_stage_parts_refuses_overlapping_keys():
    first, second = {"a": torch.zeros(1)}, {"b": torch.ones(1)}
    assert list(merge_stage_parts([first, second])) == ["a", "b"]
    with pytest.raises(ValueError, match="'a' was sent by pipeline stages 0 and 1"):
        merge_stage_parts([first, {"a": torch.ones(1)}])


def quiesce(group) -> None:
    """Every member past every collective before any member tears its group down, then destroyed."""
    group.barrier()
    group.destroy()


def run_pair(sender_fn, receiver_fn, timeout_s: float = 20.0):
    """Run ``sender_fn(group)`` and ``receiver_fn(group)`` on a two-member gloo group, in two processes."""
    port = find_free_port()

    def member(rank: int, fn):
        def run():
            group = create_standalone_group("gloo", rank, 2, "127.0.0.1", port, timeout_s=timeout_s)
            result = fn(group)
            quiesce(group)
            return result

        return run

    sender, receiver = run_members([member(0, sender_fn), member(1, receiver_fn)], timeout_s)
    return sender, receiver


def test_send_receive_two_versions_with_bucket_callback():
    bucket_bytes = 512

    def send(group):
        sender = WeightSender(group, WeightLayout.from_state_dict(mixed_state_dict()), bucket_bytes)
        for version in (1, 2):
            sender.send(mixed_state_dict(seed=version), version)
        with pytest.raises(ValueError, match="must increase"):
            sender.send(mixed_state_dict(), 2)
        return sender.buckets

    def receive(group):
        receiver = WeightReceiver(group, WeightLayout.from_state_dict(mixed_state_dict()), bucket_bytes)
        received = []
        for _ in range(2):
            arrived: list[list[str]] = []
            version, tensors = receiver.receive(on_bucket=lambda views, arrived=arrived: arrived.append(list(views)))
            received.append((version, {name: t.clone() for name, t in tensors.items()}, arrived))
        return received

    buckets, received = run_pair(send, receive)
    assert not isinstance(buckets, BaseException), buckets
    assert not isinstance(received, BaseException), received
    for version, (got_version, tensors, arrived) in zip((1, 2), received, strict=True):
        assert got_version == version
        assert_bit_identical(tensors, mixed_state_dict(seed=version))
        assert arrived == [[slot.spec.name for slot in bucket.slots] for bucket in buckets if bucket.slots]
    assert buckets[0].carries_header and not buckets[0].slots  # the 1600-byte embedding does not fit beside it


def test_both_ends_refuse_at_construction_when_they_cut_different_buckets():
    """Checked before any bucket moves: gloo would abort the process on a bucket-size mismatch."""
    layout = WeightLayout.from_state_dict(mixed_state_dict())

    def send(group):
        with pytest.raises(RuntimeError, match="a member's weight layout or bucket size differs"):
            WeightSender(group, layout, bucket_bytes=512)

    def receive(group):
        with pytest.raises(RuntimeError, match="differs from this receiver's"):
            WeightReceiver(group, layout, bucket_bytes=1024)

    assert run_pair(send, receive) == (None, None)


def test_receiver_refuses_a_version_that_does_not_increase_and_stays_in_step():
    layout = WeightLayout.from_state_dict(mixed_state_dict())

    def send(group):
        sender = WeightSender(group, layout, bucket_bytes=512)
        sender.send(mixed_state_dict(seed=1), 5)
        sender.last_policy_version = None  # a sender that forgot its history sends an old version
        sender.send(mixed_state_dict(seed=2), 4)
        sender.send(mixed_state_dict(seed=3), 6)

    def receive(group):
        receiver = WeightReceiver(group, layout, bucket_bytes=512)
        assert receiver.receive()[0] == 5
        with pytest.raises(RuntimeError, match="went from 5 to 4"):
            receiver.receive()
        version, tensors = receiver.receive()
        return version, {name: t.clone() for name, t in tensors.items()}

    sent, (version, tensors) = run_pair(send, receive)
    assert sent is None and version == 6
    assert_bit_identical(tensors, mixed_state_dict(seed=3))


def test_receiver_refuses_a_sync_with_another_plan_checksum_and_stays_in_step():
    """The per-sync header check: a sender whose plan changed after the handshake (here: a sender object
    that claims another checksum, with buckets of the same sizes, so the bytes still fit) is refused."""
    layout = WeightLayout.from_state_dict(mixed_state_dict())

    def send(group):
        sender = WeightSender(group, layout, bucket_bytes=512)
        agreed = sender.checksum
        sender.checksum = agreed ^ 1
        sender.send(mixed_state_dict(seed=1), 1)
        sender.checksum = agreed
        sender.send(mixed_state_dict(seed=2), 2)

    def receive(group):
        receiver = WeightReceiver(group, layout, bucket_bytes=512)
        with pytest.raises(RuntimeError, match=rf"plan checksum is {receiver.checksum ^ 1}, not {receiver.checksum}"):
            receiver.receive()
        assert receiver.last_policy_version is None  # the refused sync is not taken
        version, tensors = receiver.receive()
        return version, {name: t.clone() for name, t in tensors.items()}

    sent, (version, tensors) = run_pair(send, receive)
    assert sent is None and version == 2
    assert_bit_identical(tensors, mixed_state_dict(seed=2))


class CountingGroup:
    """Around a real group: counts the broadcasts one member posts."""

    def __init__(self, group):
        self.group = group
        self.backend, self.rank, self.world_size = group.backend, group.rank, group.world_size
        self.broadcasts = 0

    def broadcast(self, tensor, src):
        self.broadcasts += 1
        self.group.broadcast(tensor, src)

    def broadcast_async(self, tensor, src):
        self.broadcasts += 1
        return self.group.broadcast_async(tensor, src)

    def all_reduce_max(self, tensor):
        self.group.all_reduce_max(tensor)

    def barrier(self):
        self.group.barrier()

    def close(self):
        self.group.close()


@pytest.mark.parametrize("bucket_bytes", [512, 1 << 20])
def test_a_sync_is_one_broadcast_per_bucket_piece_and_nothing_else(bucket_bytes):
    layout = WeightLayout.from_state_dict(mixed_state_dict())
    pieces = sum(len(chunk_ranges(b.nbytes, bucket_bytes)) for b in plan_buckets(layout, bucket_bytes))

    def member(make):
        def run(group):
            counting = CountingGroup(group)
            end = make(counting)
            before = counting.broadcasts
            for version in (1, 2):
                if isinstance(end, WeightSender):
                    end.send(mixed_state_dict(seed=version), version)
                else:
                    assert end.receive()[0] == version
            return counting.broadcasts - before

        return run

    sent, received = run_pair(
        member(lambda group: WeightSender(group, layout, bucket_bytes)),
        member(lambda group: WeightReceiver(group, layout, bucket_bytes)),
    )
    assert (sent, received) == (2 * pieces, 2 * pieces)
    if bucket_bytes == 1 << 20:
        assert pieces == 1  # header and every tensor in a single broadcast


def test_sender_refuses_a_mismatching_state_dict_before_sending():
    layout = WeightLayout.from_state_dict(mixed_state_dict())

    def send(group):
        sender = WeightSender(group, layout, bucket_bytes=512)
        wrong = mixed_state_dict()
        wrong["head.weight"] = wrong["head.weight"].float()
        with pytest.raises(ValueError, match="'head.weight'"):
            sender.send(wrong, 1)
        sender.send(mixed_state_dict(), 1)  # the group is still in step

    def receive(group):
        return WeightReceiver(group, layout, bucket_bytes=512).receive()[0]

    assert run_pair(send, receive) == (None, 1)


@pytest.mark.parametrize(
    ("sync_stages", "senders"),
    [
        ([0, None], [0]),  # DDP / ZeRO / TP: global rank 0 sends everything
        ([0, 1], [0, 1]),  # PP=2
        ([0, None, 1, None], [0, 2]),  # PP=2 x TP=2: each stage's tensor-parallel rank 0
        ([None, 1, None, 0], [3, 1]),
    ],
)
def test_stage_senders_in_stage_order(sync_stages, senders):
    assert stage_senders(sync_stages) == senders


@pytest.mark.parametrize(
    ("sync_stages", "message"),
    [
        ([0, 0], "trainers 0 and 1 both claim to send pipeline stage 0"),
        ([None, 1], "none missing"),
        ([None], r"sender: \[\]"),
    ],
)
def test_stage_senders_refuse_a_broken_assignment(sync_stages, message):
    with pytest.raises(RuntimeError, match=message):
        stage_senders(sync_stages)


def test_receive_stages_merges_every_stage_received_concurrently():
    """Two pipeline stages each send their part over their own group to one producer (three processes)."""
    full = mixed_state_dict(seed=7)
    names = list(full)
    parts = [{n: full[n] for n in names[:3]}, {n: full[n] for n in names[3:]}]
    ports = [find_free_port(), find_free_port()]
    results: dict[str, object] = {}

    def stage_sender(stage: int, versions: tuple[int, ...]) -> None:
        group = create_standalone_group("gloo", 0, 2, "127.0.0.1", ports[stage], 20.0, name=stage_group_name(stage))
        sender = WeightSender(group, WeightLayout.from_state_dict(parts[stage]), bucket_bytes=256)
        for version in versions:
            sender.send(parts[stage], version)
        quiesce(group)

    def producer() -> dict:
        receivers = []
        for stage, part in enumerate(parts):
            group = create_standalone_group("gloo", 1, 2, "127.0.0.1", ports[stage], 20.0, name=stage_group_name(stage))
            receivers.append(WeightReceiver(group, WeightLayout.from_state_dict(part), bucket_bytes=256))
        version, tensors = receive_stages(receivers)
        results["first"] = version, {n: t.clone() for n, t in tensors.items()}
        with pytest.raises(RuntimeError, match=r"different weight versions: \[2, 3\]"):
            receive_stages(receivers)
        results["mismatch refused"] = True
        for receiver in receivers:
            quiesce(receiver.group)
        return results

    outcomes = run_members([lambda: stage_sender(0, (1, 2)), lambda: stage_sender(1, (1, 3)), producer], timeout_s=30)
    assert not any(isinstance(outcome, BaseException) for outcome in outcomes), outcomes
    results = outcomes[2]
    version, tensors = results["first"]
    assert version == 1
    assert_bit_identical(tensors, full)  # merged in stage order: the full dict's order
    assert results["mismatch refused"]
