"""Bucketed broadcast of a full state dict from one trainer rank to every producer.

Setup, once per run: the sender (rank 0 of a ``StandaloneGroup``) describes its state dict as a
``WeightLayout`` — ordered (name, shape, dtype) — and broadcasts it with the bucket size
(``exchange_layout``). Both sides then cut the layout into the same buckets: contiguous byte
buffers of at most ``bucket_bytes`` holding many tensors each; a larger tensor gets a bucket of
its own, broadcast in ``bucket_bytes`` pieces. Tensors travel as raw bytes, so one bucket mixes
dtypes and bf16 is never converted. Constructing a ``WeightSender`` / ``WeightReceiver`` is
collective: every member checks that all cut identical buckets (``agree_on_plan``), and all of
them raise a clear error otherwise — a size mismatch inside gloo would abort the process.

Each sync is one broadcast per bucket (piece) and nothing else: the int64 header
``[version, plan checksum]`` rides in the first 16 bytes of bucket 0, so receivers post every
bucket at once instead of waiting for a separate header first. The sender packs bucket ``i + 1``
while bucket ``i`` is on the wire (two staging buffers) and sends a lone contiguous tensor without
copying it; receivers receive straight into buffers allocated once, and return ``name -> tensor``
views into them.

With pipeline parallelism each stage's sender sends its own keys over its own group
(``stages.stage_group_name``); producers hold one receiver per stage and ``receive_stages`` receives all
parts (at once over gloo, one stage after the other over NCCL) and merges them. Nothing here knows about models or Ray.

Every line is shared by the CPU and the GPU path and by both transports: the group is any
``Collective`` (``transports.py``: torch's standalone gloo/NCCL group, or Ray's cupy NCCL group on
GPUs), and its wire backend follows the device the weights travel on (gloo for ``cpu``, NCCL for ``cuda``).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from colossal_rl.comm.process_group import Collective, PendingCollective, device_for_backend
from colossal_rl.comm.weight_sync.transports import create_group

logger = logging.getLogger(__name__)

# On gloo over loopback 16 MiB did at least as well as 64 MiB (benchmarks/weight_sync.py): more buckets
# overlap more packing with sending and pipeline gloo's tree broadcast. NCCL may prefer bigger ones.
DEFAULT_BUCKET_BYTES = 16 * 2**20
ALIGNMENT_BYTES = 64  # every tensor starts at a multiple of this inside its bucket, so dtype views are legal
SENDER_RANK = 0
HEADER_BYTES = 16  # int64 [version, plan checksum] at offset 0 of bucket 0


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return _numel(self.shape) * _element_size(self.dtype)


@dataclass(frozen=True)
class WeightLayout:
    """The ordered (name, shape, dtype) of every tensor one sender sends; fixed for a run."""

    tensors: tuple[TensorSpec, ...]

    @classmethod
    def from_state_dict(cls, state_dict: Mapping[str, torch.Tensor]) -> WeightLayout:
        if not state_dict:
            raise ValueError("cannot build a weight layout from an empty state dict")
        return cls(tuple(TensorSpec(name, tuple(t.shape), t.dtype) for name, t in state_dict.items()))

    @property
    def total_bytes(self) -> int:
        return sum(spec.nbytes for spec in self.tensors)

    @property
    def largest_tensor_bytes(self) -> int:
        return max(spec.nbytes for spec in self.tensors)

    def to_json(self) -> str:
        return json.dumps([[s.name, list(s.shape), str(s.dtype).removeprefix("torch.")] for s in self.tensors])

    @classmethod
    def from_json(cls, text: str) -> WeightLayout:
        return cls(tuple(TensorSpec(name, tuple(shape), _dtype(dtype)) for name, shape, dtype in json.loads(text)))

    def check(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Raise ``ValueError`` naming the first key where ``state_dict`` differs from the layout."""
        for spec in self.tensors:
            tensor = state_dict.get(spec.name)
            if tensor is None:
                raise ValueError(f"state dict lacks {spec.name!r}, which the weight layout expects")
            if tuple(tensor.shape) != spec.shape or tensor.dtype != spec.dtype:
                raise ValueError(
                    f"{spec.name!r} is {tuple(tensor.shape)} {tensor.dtype} but the weight layout expects "
                    f"{spec.shape} {spec.dtype}"
                )
        if len(state_dict) != len(self.tensors):
            known = {spec.name for spec in self.tensors}
            extra = next(name for name in state_dict if name not in known)
            raise ValueError(f"state dict has {extra!r}, which is not in the weight layout")


@dataclass(frozen=True)
class Slot:
    spec: TensorSpec
    offset: int  # bytes from the start of the bucket


@dataclass(frozen=True)
class Bucket:
    slots: tuple[Slot, ...]
    nbytes: int
    carries_header: bool = False  # the sync header sits at offset 0, before the slots (bucket 0 only)


def plan_buckets(layout: WeightLayout, bucket_bytes: int) -> list[Bucket]:
    """Cut the layout, in order, into buckets of at most ``bucket_bytes`` (bigger tensors: one bucket each).

    Bucket 0 starts with the sync header; if the first tensor does not fit beside it, the header is
    bucket 0 on its own.
    """
    if bucket_bytes < ALIGNMENT_BYTES + HEADER_BYTES:
        raise ValueError(f"bucket_bytes must be at least {ALIGNMENT_BYTES + HEADER_BYTES}, got {bucket_bytes}")
    buckets: list[Bucket] = []
    slots: list[Slot] = []
    end = HEADER_BYTES  # bucket 0 opens with the header
    for spec in layout.tensors:
        offset = _align(end)
        if (slots or not buckets) and offset + spec.nbytes > bucket_bytes:
            buckets.append(Bucket(tuple(slots), end, carries_header=not buckets))
            slots, offset = [], 0
        slots.append(Slot(spec, offset))
        end = offset + spec.nbytes
    buckets.append(Bucket(tuple(slots), end, carries_header=not buckets))
    return buckets


def receive_buffer_bytes(layout: WeightLayout, bucket_bytes: int) -> int:
    """What a ``WeightReceiver`` allocates once, on its device: every bucket of the layout, header and padding
    included (an unsharded copy of the weights)."""
    return sum(bucket.nbytes for bucket in plan_buckets(layout, bucket_bytes))


def chunk_ranges(nbytes: int, bucket_bytes: int) -> list[tuple[int, int]]:
    """Byte ranges of one collective each: a bucket holding an oversized tensor goes in several pieces."""
    return [(start, min(start + bucket_bytes, nbytes)) for start in range(0, nbytes, bucket_bytes)]


def plan_checksum(layout: WeightLayout, bucket_bytes: int) -> int:
    """63-bit digest of layout and bucket size: both ends of a sync must cut identical buckets."""
    digest = hashlib.sha256(f"{bucket_bytes}/{ALIGNMENT_BYTES}/{layout.to_json()}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def agree_on_plan(group: Collective, checksum: int, device: torch.device) -> None:
    """Collective, once per sender/receiver: raise on every member unless all cut identical buckets.

    Broadcasting buckets of different sizes would not raise: gloo aborts the process in its IO thread.
    """
    senders = torch.tensor([checksum], dtype=torch.int64, device=device)
    group.broadcast(senders, SENDER_RANK)
    theirs = int(senders.item())
    disagreement = torch.tensor([int(theirs != checksum)], dtype=torch.int64, device=device)
    group.all_reduce_max(disagreement)
    if group.rank != SENDER_RANK and theirs != checksum:
        raise RuntimeError(
            f"{group!r}: the sender's weight layout or bucket size differs from this receiver's "
            f"(plan checksum {theirs} != {checksum}); build receivers with the layout from exchange_layout"
        )
    if disagreement.item():
        raise RuntimeError(
            f"{group!r}: a member's weight layout or bucket size differs (plan checksum mismatch); "
            "build receivers with the layout from exchange_layout"
        )


def pack_bucket(
    bucket: Bucket, state_dict: Mapping[str, torch.Tensor], out: torch.Tensor, views: list[torch.Tensor] | None = None
) -> None:
    """Copy the bucket's tensors into the uint8 buffer ``out`` (at least ``bucket.nbytes`` long).

    ``views``: the bucket's typed views into ``out``, if the caller keeps them (making them costs
    about as much as copying a few MB).
    """
    views = views if views is not None else _views(bucket, out)
    if views:  # one dispatch for all copies (a third faster than a copy_ loop on a 51-tensor bucket)
        torch._foreach_copy_(views, [state_dict[slot.spec.name] for slot in bucket.slots], non_blocking=True)


def unpack_bucket(bucket: Bucket, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
    """``name -> tensor`` views into the uint8 ``buffer`` (no copy)."""
    return {slot.spec.name: view for slot, view in zip(bucket.slots, _views(bucket, buffer), strict=True)}


def merge_stage_parts(parts: list[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Union of the state-dict parts of several pipeline stages; a key sent by two stages is an error."""
    merged: dict[str, torch.Tensor] = {}
    owner: dict[str, int] = {}
    for stage, part in enumerate(parts):
        for name, tensor in part.items():
            if name in merged:
                raise ValueError(f"{name!r} was sent by pipeline stages {owner[name]} and {stage}")
            merged[name] = tensor
            owner[name] = stage
    return merged


def receive_stages(receivers: Sequence[WeightReceiver]) -> tuple[int, dict[str, torch.Tensor]]:
    """One sync from every pipeline stage's group; the version and the merged dict.

    The stages' senders send at the same time. Over gloo the parts are received in parallel threads (a
    receive waits inside the collective library, without the GIL). Over NCCL they are received one stage
    after the other, in stage order: NCCL documents that collectives issued concurrently on several
    communicators by one process can deadlock (each sender then waits for its turn, within its timeout).
    Every part must carry the same version. Each receive is bounded by its group's timeout.
    """
    if not receivers:
        raise ValueError("receive_stages needs at least one receiver")
    if len(receivers) == 1:
        return receivers[0].receive()
    if any(receiver.group.backend == "nccl" for receiver in receivers):
        parts = [receiver.receive() for receiver in receivers]
    else:
        with ThreadPoolExecutor(max_workers=len(receivers), thread_name_prefix="weight-sync-stage") as pool:
            futures = [pool.submit(receiver.receive) for receiver in receivers]
            parts = [future.result() for future in futures]
    versions = [version for version, _ in parts]
    if len(set(versions)) != 1:
        raise RuntimeError(f"pipeline stages sent different weight versions: {versions} (stage order)")
    return versions[0], merge_stage_parts([tensors for _, tensors in parts])


def receive_version(receivers: Sequence[WeightReceiver], policy_version: int, *, who: str) -> dict[str, torch.Tensor]:
    """:func:`receive_stages`, refusing a sync that is not ``policy_version`` (``who`` names the receiver)."""
    received_version, tensors = receive_stages(receivers)
    if received_version != policy_version:
        raise RuntimeError(f"{who}: expected weights version {policy_version}, got {received_version}")
    return tensors


class WeightSender:
    """Rank 0 of ``group``: broadcasts state dicts matching ``layout`` to every other member."""

    def __init__(
        self,
        group: Collective,
        layout: WeightLayout,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        device: torch.device | str = "cpu",
        pin_memory: bool | None = None,
    ):
        if group.rank != SENDER_RANK:
            raise ValueError(f"the sender must be rank {SENDER_RANK} of {group!r}")
        self.group = group
        self.layout = layout
        self.buckets = plan_buckets(layout, bucket_bytes)
        self.checksum = plan_checksum(layout, bucket_bytes)
        self.device = _resolve_device(device)
        agree_on_plan(group, self.checksum, self.device)
        self.pin_memory = _default_pin_memory(self.device) if pin_memory is None else pin_memory
        self._staging: list[torch.Tensor | None] = [None, None]  # packed bucket i+1 while bucket i is sent
        self._staging_bytes = max((b.nbytes for b in self.buckets if len(b.slots) > 1 or b.carries_header), default=0)
        self._staging_views: dict[tuple[int, int], list[torch.Tensor]] = {}  # (bucket, staging) -> views
        self._chunks = [chunk_ranges(bucket.nbytes, bucket_bytes) for bucket in self.buckets]
        self.last_policy_version: int | None = None
        logger.info(
            "%r sends %d tensors, %.1f MB in %d buckets",
            group, len(layout.tensors), layout.total_bytes / 1e6, len(self.buckets),
        )  # fmt: skip

    def send(self, state_dict: Mapping[str, torch.Tensor], policy_version: int) -> None:
        """Broadcast ``state_dict`` as ``policy_version``; returns once every bucket has left this process."""
        if self.last_policy_version is not None and policy_version <= self.last_policy_version:
            raise ValueError(
                f"weight versions must increase: sent {self.last_policy_version}, now asked to send {policy_version}"
            )
        self.layout.check(state_dict)  # before anything is sent, so a bad call leaves the group usable
        header = torch.tensor([policy_version, self.checksum], dtype=torch.int64)
        in_flight: deque[tuple[int | None, PendingCollective]] = deque()
        packed = 0
        with torch.no_grad():
            for bucket_index, (bucket, chunks) in enumerate(zip(self.buckets, self._chunks, strict=True)):
                payload, staging_index = self._direct_payload(bucket, state_dict), None
                if payload is None:
                    staging_index = packed % len(self._staging)
                    while any(index == staging_index for index, _ in in_flight):
                        in_flight.popleft()[1].wait()
                    payload = self._pack(bucket_index, state_dict, staging_index)
                    if bucket.carries_header:
                        payload[:HEADER_BYTES].view(torch.int64).copy_(header)
                    packed += 1
                in_flight.extend(
                    (staging_index, self.group.broadcast_async(payload[start:end], SENDER_RANK))
                    for start, end in chunks
                )
            while in_flight:
                in_flight.popleft()[1].wait()
        self.last_policy_version = policy_version

    def _direct_payload(self, bucket: Bucket, state_dict: Mapping[str, torch.Tensor]) -> torch.Tensor | None:
        """A lone contiguous tensor already on the device is sent as it is, without a copy."""
        if len(bucket.slots) != 1 or bucket.carries_header:
            return None
        tensor = state_dict[bucket.slots[0].spec.name]
        if tensor.numel() == 0 or not tensor.is_contiguous() or tensor.device != self.device:
            return None
        return tensor.detach().reshape(-1).view(torch.uint8)

    def _pack(self, bucket_index: int, state_dict: Mapping[str, torch.Tensor], staging_index: int) -> torch.Tensor:
        bucket = self.buckets[bucket_index]
        staging = self._staging[staging_index]
        if staging is None or staging.numel() < bucket.nbytes:
            staging = _empty_bytes(max(self._staging_bytes, bucket.nbytes), self.device, self.pin_memory)
            self._staging[staging_index] = staging
            self._staging_views = {key: v for key, v in self._staging_views.items() if key[1] != staging_index}
        views = self._staging_views.get((bucket_index, staging_index))
        if views is None:
            views = self._staging_views[(bucket_index, staging_index)] = _views(bucket, staging)
        pack_bucket(bucket, state_dict, staging, views)
        if self.device.type == "cpu" and any(state_dict[s.spec.name].is_cuda for s in bucket.slots):
            torch.cuda.current_stream().synchronize()  # the non-blocking device-to-host copies must land first
        return staging[: bucket.nbytes]

    def close(self) -> None:
        self.group.close()


class WeightReceiver:
    """A non-zero member of ``group``: receives the state dicts the sender broadcasts."""

    def __init__(
        self,
        group: Collective,
        layout: WeightLayout,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        device: torch.device | str = "cpu",
        pin_memory: bool | None = None,
    ):
        if group.rank == SENDER_RANK:
            raise ValueError(f"rank {SENDER_RANK} of {group!r} is the sender, not a receiver")
        self.group = group
        self.layout = layout
        self.buckets = plan_buckets(layout, bucket_bytes)
        self.checksum = plan_checksum(layout, bucket_bytes)
        self.device = _resolve_device(device)
        agree_on_plan(group, self.checksum, self.device)
        pin = _default_pin_memory(self.device) if pin_memory is None else pin_memory
        # Received into these buffers every sync; the returned tensors are views into them.
        self._buffers = [_empty_bytes(bucket.nbytes, self.device, pin) for bucket in self.buckets]
        self._header = self._buffers[0][:HEADER_BYTES].view(torch.int64)
        self._bucket_views = [unpack_bucket(b, buf) for b, buf in zip(self.buckets, self._buffers, strict=True)]
        self._chunks = [chunk_ranges(bucket.nbytes, bucket_bytes) for bucket in self.buckets]
        self.last_policy_version: int | None = None

    def receive(
        self, on_bucket: Callable[[dict[str, torch.Tensor]], None] | None = None
    ) -> tuple[int, dict[str, torch.Tensor]]:
        """Wait for the next sync; return its policy version and ``name -> tensor`` in layout order.

        The tensors are views into buffers the next ``receive`` overwrites: load or copy them first.
        ``on_bucket`` is called with each bucket's tensors as soon as that bucket has arrived.
        """
        pending = [self._post(index) for index in range(len(self.buckets))]  # all at once: one round trip
        _wait_all(pending[0])
        policy_version, checksum = self._header.tolist()
        problem = None
        if checksum != self.checksum:
            problem = f"the sync header's plan checksum is {checksum}, not {self.checksum}"
        elif self.last_policy_version is not None and policy_version <= self.last_policy_version:
            problem = f"weight version went from {self.last_policy_version} to {policy_version}; versions must increase"
        if problem is not None:
            for chunks_pending in pending[1:]:  # stay in step with the sender before refusing the sync
                _wait_all(chunks_pending)
            raise RuntimeError(f"{self.group!r}: {problem}")
        received: dict[str, torch.Tensor] = {}
        for index, (chunks_pending, views) in enumerate(zip(pending, self._bucket_views, strict=True)):
            if index > 0:
                _wait_all(chunks_pending)
            if on_bucket is not None and views:
                on_bucket(views)
            received.update(views)
        self.last_policy_version = policy_version
        return policy_version, received

    def _post(self, bucket_index: int) -> list[PendingCollective]:
        buffer = self._buffers[bucket_index]
        return [self.group.broadcast_async(buffer[start:end], SENDER_RANK) for start, end in self._chunks[bucket_index]]

    def close(self) -> None:
        self.group.close()


def exchange_layout(
    group: Collective, layout: WeightLayout | None, bucket_bytes: int | None = None
) -> tuple[WeightLayout, int]:
    """Once per run: the sender passes its layout and bucket size, receivers pass ``None`` and get them."""
    is_sender = group.rank == SENDER_RANK
    if is_sender != (layout is not None):
        raise ValueError("the sender must pass its layout; receivers must pass None")
    device = device_for_backend(group.backend)
    message = torch.empty(0, dtype=torch.uint8)
    if is_sender:
        assert layout is not None
        text = json.dumps({"bucket_bytes": bucket_bytes or DEFAULT_BUCKET_BYTES, "layout": layout.to_json()})
        message = torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8).to(device)
    length = torch.tensor([message.numel()], dtype=torch.int64, device=device)
    group.broadcast(length, SENDER_RANK)
    if not is_sender:
        message = torch.empty(int(length.item()), dtype=torch.uint8, device=device)
    group.broadcast(message, SENDER_RANK)
    received = json.loads(message.cpu().numpy().tobytes().decode())
    return WeightLayout.from_json(received["layout"]), int(received["bucket_bytes"])


def host_as_sender(
    *,
    host: str,
    port: int,
    world_size: int,
    state_dict: Mapping[str, torch.Tensor],
    timeout_s: float,
    transport: str = "torch",
    name: str = "weight_sync",
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    device: torch.device | str = "cpu",
) -> WeightSender:
    """Form the group at ``host:port`` as rank 0 and send ``state_dict``'s layout to the receivers.

    Every receiver calls ``join_as_receiver`` with the same address and ``transport`` at the same
    time. ``transport`` (``--weight-sync-backend``) picks the group; the wire backend follows from
    ``device`` (``transports.py``).
    """
    group = create_group(
        transport,
        rank=SENDER_RANK,
        world_size=world_size,
        host=host,
        port=port,
        timeout_s=timeout_s,
        name=name,
        device=device,
    )
    layout = WeightLayout.from_state_dict(state_dict)
    exchange_layout(group, layout, bucket_bytes)
    return WeightSender(group, layout, bucket_bytes, device)


def join_as_receiver(
    *,
    host: str,
    port: int,
    rank: int,
    world_size: int,
    timeout_s: float,
    transport: str = "torch",
    name: str = "weight_sync",
    device: torch.device | str = "cpu",
    before_allocating: Callable[[int, int], None] | None = None,
) -> WeightReceiver:
    """Join the group hosted by ``host_as_sender`` as ``rank`` (1 .. world_size - 1) and get the layout.

    ``before_allocating`` gets the receive buffers' bytes (``receive_buffer_bytes``) and the largest tensor's bytes
    (``WeightLayout.largest_tensor_bytes``) once the layout is known and before they are allocated on ``device``; it
    may raise to refuse (a vLLM worker whose GPU has no room for them
    outside vLLM's budget): this member then leaves the group, and the sender's next collective fails."""
    group = create_group(
        transport, rank=rank, world_size=world_size, host=host, port=port, timeout_s=timeout_s, name=name, device=device
    )
    layout, bucket_bytes = exchange_layout(group, None)
    if before_allocating is not None:
        try:
            before_allocating(receive_buffer_bytes(layout, bucket_bytes), layout.largest_tensor_bytes)
        except Exception:
            group.close()
            raise
    return WeightReceiver(group, layout, bucket_bytes, device)


def _wait_all(pending: list[PendingCollective]) -> None:
    for collective in pending:
        collective.wait()


def _views(bucket: Bucket, buffer: torch.Tensor) -> list[torch.Tensor]:
    return [
        buffer[slot.offset : slot.offset + slot.spec.nbytes].view(slot.spec.dtype).view(slot.spec.shape)
        for slot in bucket.slots
    ]


def _empty_bytes(nbytes: int, device: torch.device, pin_memory: bool) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, device=device, pin_memory=pin_memory)


def _resolve_device(device: torch.device | str) -> torch.device:
    """``cuda`` becomes ``cuda:<current>``, so it compares equal to the weights' own device."""
    resolved = torch.device(device)
    if resolved.type == "cuda" and resolved.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return resolved


def _default_pin_memory(device: torch.device) -> bool:
    """Pinned host buffers only pay off when the weights come from or go to a GPU."""
    return device.type == "cpu" and torch.cuda.is_available()


def _align(offset: int) -> int:
    return -(-offset // ALIGNMENT_BYTES) * ALIGNMENT_BYTES


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def _element_size(dtype: torch.dtype) -> int:
    return dtype.itemsize


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in weight layout")
    return dtype
