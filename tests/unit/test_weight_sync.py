"""Weight layout, bucket planning and pack/unpack, in one process; plus the send/receive protocol over
a two-member gloo group run in two threads (no extra processes)."""

from __future__ import annotations

import threading

import pytest
import torch

from colossal_rl.comm.process_group import create_standalone_group, find_free_port
from colossal_rl.comm.weight_sync import (
    ALIGNMENT_BYTES,
    WeightLayout,
    WeightReceiver,
    WeightSender,
    chunk_ranges,
    merge_stage_parts,
    pack_bucket,
    plan_buckets,
    plan_checksum,
    unpack_bucket,
)


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


@pytest.mark.parametrize("bucket_bytes", [64, 256, 1024, 1 << 20])
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
    assert len(buckets) == 5  # 8 small tensors fit in 512 bytes at 64-byte alignment: 8 + 8 + 4, big, after


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


def run_pair(sender_fn, receiver_fn, timeout_s: float = 20.0):
    """Run ``sender_fn(group)`` and ``receiver_fn(group)`` on a two-member gloo group, in two threads."""
    port = find_free_port()
    results: dict[int, object] = {}

    def member(rank: int, fn) -> None:
        try:
            group = create_standalone_group("gloo", rank, 2, "127.0.0.1", port, timeout_s=timeout_s)
            results[rank] = fn(group)
            group.destroy()
        except BaseException as error:  # noqa: BLE001 - reported to the test thread below
            results[rank] = error

    threads = [threading.Thread(target=member, args=(r, fn)) for r, fn in enumerate((sender_fn, receiver_fn))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout_s + 10)
    assert not any(thread.is_alive() for thread in threads), "a member hung"
    return results[0], results[1]


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
        assert arrived == [[slot.spec.name for slot in bucket.slots] for bucket in buckets]


def test_receiver_refuses_a_sender_with_another_bucket_size():
    layout = WeightLayout.from_state_dict(mixed_state_dict())

    def send(group):
        sender = WeightSender(group, layout, bucket_bytes=512)
        header_only = torch.tensor([1, sender.checksum], dtype=torch.int64)
        group.broadcast(header_only, 0)  # the receiver must stop right after the header

    def receive(group):
        with pytest.raises(RuntimeError, match="differs from this receiver's"):
            WeightReceiver(group, layout, bucket_bytes=1024).receive()

    assert run_pair(send, receive) == (None, None)


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
