"""Weight sync through a double-buffered shared-memory region (``--weight-sync-mode shm``), one host only.

The sender owns one file under ``/dev/shm`` per pipeline stage: two slots, each laid out like the broadcast's
single bucket (``bucketed.plan_buckets`` with no size limit): a 16-byte stamp ``[version, plan checksum]``
then every tensor, aligned. Beside it, ``<region>.layout.json`` (the ``WeightLayout``, written atomically) and
one lock file per slot.

A slot is written only under an exclusive ``flock`` on its lock file; its stamp is set to -1 first and to the
version last. A receiver takes a shared lock on the slot it reads and holds it until its next ``receive``, so
the returned tensors are zero-copy views into the slot that the sender cannot overwrite meanwhile (the sender
writes the other slot, then waits for the readers to move on). A reader therefore sees version v or v + 1
whole, never a torn mix. Every wait is bounded by ``timeout_s`` and its error names the region.

The data file's space is reserved up front (``os.posix_fallocate``): on a small ``/dev/shm`` (Docker and Kubernetes
give containers 64 MB) a truncated file maps fine and the first write into a page the tmpfs cannot back kills the
process with SIGBUS, without a word. A region that does not fit is refused in one line naming the size it needs and
``--shm-size`` (``SharedMemorySpaceError``); ``--weight-sync-mode auto`` checks the trainers' nodes first and takes
the broadcast where it would not fit (``driver/placement.py``).

Nothing here forms a collective or knows about Ray; producers on other hosts use the broadcast
(``modes.py`` decides who reads what).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import math
import os
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from colossal_rl.comm.weight_sync.bucketed import (
    ALIGNMENT_BYTES,
    HEADER_BYTES,
    Bucket,
    WeightLayout,
    plan_buckets,
    plan_checksum,
    unpack_bucket,
)

logger = logging.getLogger(__name__)

SHM_ROOT = Path("/dev/shm")
NUM_SLOTS = 2
POLL_INTERVAL_S = 0.002
UNWRITTEN = -1  # a slot's stamp while it is being written (and before its first write)
COPY_PIECE_BYTES = 32 * 2**20
# Two threads copy ~1.4x faster than one on the 2-core test VM (988 MB: 0.13 s vs 0.18 s); more gave nothing there.
DEFAULT_COPY_THREADS = min(2, os.cpu_count() or 1)


class SharedMemorySpaceError(OSError):
    """The file system under a shared-memory region has no room for it; the message says how much it needs."""


def free_bytes(directory: str | Path) -> int:
    """Bytes an unprivileged process can still allocate in ``directory``'s file system (``/dev/shm``: a tmpfs)."""
    stats = os.statvfs(directory)
    return stats.f_bavail * stats.f_frsize


def region_bytes(layout: WeightLayout) -> int:
    """The data file's size for ``layout``: every slot, each the whole layout plus its stamp, aligned."""
    return NUM_SLOTS * single_bucket(layout)[1]


def more_shared_memory(needed_bytes: int) -> str:
    """How to give a container ``needed_bytes`` of ``/dev/shm`` (with a margin for its other users)."""
    size_gib = max(1, math.ceil(needed_bytes * 1.1 / 2**30))
    return f"docker run --shm-size={size_gib}g, or a memory-backed emptyDir at /dev/shm on Kubernetes"


def space_refusal(where: str | Path, needed_bytes: int, free: int) -> str:
    """The one line refusing a region of ``needed_bytes`` in ``where``, which has ``free`` bytes."""
    return (
        f"shared-memory weight sync: {where} has {free / 1e9:.2f} GB free but the region needs {needed_bytes / 1e9:.2f} "
        f"GB (two copies of the stage's weights); give the trainers' containers more shared memory "
        f"({more_shared_memory(needed_bytes)}) or use --weight-sync-mode broadcast"
    )


def reserve(path: Path, size: int) -> None:
    """Create ``path`` with ``size`` bytes actually allocated, or raise ``SharedMemorySpaceError`` (nothing left)."""
    available = free_bytes(path.parent)
    if available < size:
        raise SharedMemorySpaceError(errno.ENOSPC, space_refusal(path.parent, size, available))
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as error:
        path.unlink(missing_ok=True)
        if error.errno not in (errno.ENOSPC, errno.EFBIG):
            raise
        raise SharedMemorySpaceError(errno.ENOSPC, space_refusal(path.parent, size, free_bytes(path.parent))) from None
    finally:
        os.close(fd)


def region_paths(region: str | Path) -> tuple[Path, Path, list[Path]]:
    """The data file, the layout file and the per-slot lock files of ``region`` (a path without suffix)."""
    base = Path(region)
    return (
        base.with_name(base.name + ".data"),
        base.with_name(base.name + ".layout.json"),
        [base.with_name(f"{base.name}.slot{slot}.lock") for slot in range(NUM_SLOTS)],
    )


def single_bucket(layout: WeightLayout) -> tuple[Bucket, int]:
    """The whole layout as one bucket (stamp first) and the slot size in bytes, rounded up to the alignment."""
    (bucket,) = plan_buckets(layout, max(layout.total_bytes * 2, 1) + ALIGNMENT_BYTES * (len(layout.tensors) + 2))
    return bucket, -(-bucket.nbytes // ALIGNMENT_BYTES) * ALIGNMENT_BYTES


def _slot_stamp(data: torch.Tensor, slot: int, slot_bytes: int) -> torch.Tensor:
    return data[slot * slot_bytes : slot * slot_bytes + HEADER_BYTES].view(torch.int64)


def copy_pieces(
    destinations: list[torch.Tensor], sources: list[torch.Tensor]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(destination, source) pairs of at most ``COPY_PIECE_BYTES`` each, so several threads can share one big copy.

    A source that is not a contiguous host tensor (a GPU or strided one) stays one whole-tensor pair."""
    pieces = []
    for destination, source in zip(destinations, sources, strict=True):
        source = source.detach()
        if source.device.type != "cpu" or not source.is_contiguous() or source.numel() == 0:
            pieces.append((destination, source))
            continue
        flat_destination, flat_source = destination.view(-1).view(torch.uint8), source.reshape(-1).view(torch.uint8)
        for start in range(0, flat_source.numel(), COPY_PIECE_BYTES):
            end = start + COPY_PIECE_BYTES
            pieces.append((flat_destination[start:end], flat_source[start:end]))
    return pieces


def _lock(fd: int, mode: int, deadline: float, what: str) -> None:
    """``flock`` without blocking past ``deadline`` (flock itself has no timeout)."""
    while True:
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise TimeoutError(what) from None
            time.sleep(POLL_INTERVAL_S)


class SharedMemorySender:
    """Writes every sync into the slot not holding the newest version; removes the region on ``close``."""

    def __init__(
        self, region: str | Path, layout: WeightLayout, timeout_s: float, copy_threads: int = DEFAULT_COPY_THREADS
    ):
        self.region = str(region)
        self._pool = ThreadPoolExecutor(copy_threads, thread_name_prefix="shm-sync-copy") if copy_threads > 1 else None
        self.layout = layout
        self.timeout_s = timeout_s
        self.bucket, self.slot_bytes = single_bucket(layout)
        self.checksum = plan_checksum(layout, self.slot_bytes)
        data_path, layout_path, lock_paths = region_paths(region)
        self._paths = [data_path, layout_path, *lock_paths]
        size = NUM_SLOTS * self.slot_bytes
        reserve(data_path, size)  # first: a region that does not fit leaves nothing behind
        self._lock_fds = [os.open(path, os.O_RDWR | os.O_CREAT, 0o600) for path in lock_paths]
        self._data = torch.from_file(str(data_path), shared=True, size=size, dtype=torch.uint8)
        self._slots = [self._data[s * self.slot_bytes : s * self.slot_bytes + self.bucket.nbytes] for s in range(2)]
        self._views = [unpack_bucket(self.bucket, slot).values() for slot in self._slots]
        for slot in range(NUM_SLOTS):
            _slot_stamp(self._data, slot, self.slot_bytes).copy_(torch.tensor([UNWRITTEN, self.checksum]))
        temporary = layout_path.with_name(layout_path.name + f".tmp{os.getpid()}")
        temporary.write_text(layout.to_json(), encoding="utf-8")
        os.replace(temporary, layout_path)  # last: a receiver that sees the layout finds the data file complete
        self.last_policy_version: int | None = None
        self._next_slot = 0
        logger.info("shared-memory weight sync %s: %.1f MB per slot", self.region, self.bucket.nbytes / 1e6)

    def send(self, state_dict: Mapping[str, torch.Tensor], policy_version: int) -> None:
        """Write ``state_dict`` as ``policy_version``; waits (bounded) for readers of that slot's old version."""
        if self.last_policy_version is not None and policy_version <= self.last_policy_version:
            raise ValueError(
                f"weight versions must increase: sent {self.last_policy_version}, now asked to send {policy_version}"
            )
        self.layout.check(state_dict)
        slot = self._next_slot
        stamp = _slot_stamp(self._data, slot, self.slot_bytes)
        deadline = time.monotonic() + self.timeout_s
        _lock(
            self._lock_fds[slot],
            fcntl.LOCK_EX,
            deadline,
            f"shared-memory weight sync {self.region}: a reader still holds version {int(stamp[0])} in slot {slot} "
            f"after {self.timeout_s:.0f}s; cannot write version {policy_version}",
        )
        try:
            stamp[0] = UNWRITTEN
            self._copy(list(self._views[slot]), [state_dict[s.spec.name] for s in self.bucket.slots])
            stamp[0] = policy_version  # last: the slot is whole from here on
        finally:
            fcntl.flock(self._lock_fds[slot], fcntl.LOCK_UN)
        self._next_slot = 1 - slot
        self.last_policy_version = policy_version

    def _copy(self, destinations: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
        with torch.no_grad():
            if self._pool is None:
                torch._foreach_copy_(destinations, sources)
                return
            # copy_ releases the GIL; list() re-raises a failed piece's error here.
            list(self._pool.map(lambda pair: pair[0].copy_(pair[1]), copy_pieces(destinations, sources)))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
        for fd in self._lock_fds:
            os.close(fd)
        self._lock_fds = []
        for path in self._paths:
            path.unlink(missing_ok=True)


class SharedMemoryReceiver:
    """Reads the newest whole version from the sender's region; holds a shared lock on it until the next receive."""

    def __init__(self, region: str | Path, timeout_s: float):
        self.region = str(region)
        self.timeout_s = timeout_s
        data_path, layout_path, lock_paths = region_paths(region)
        deadline = time.monotonic() + timeout_s
        while not layout_path.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"shared-memory weight sync {self.region}: no sender created it in {timeout_s:.0f}s")
            time.sleep(POLL_INTERVAL_S * 10)
        self.layout = WeightLayout.from_json(layout_path.read_text(encoding="utf-8"))
        self.bucket, self.slot_bytes = single_bucket(self.layout)
        self.checksum = plan_checksum(self.layout, self.slot_bytes)
        self._lock_fds = [os.open(path, os.O_RDWR) for path in lock_paths]
        self._data = torch.from_file(str(data_path), shared=True, size=NUM_SLOTS * self.slot_bytes, dtype=torch.uint8)
        self._views = [
            unpack_bucket(self.bucket, self._data[s * self.slot_bytes : s * self.slot_bytes + self.bucket.nbytes])
            for s in range(NUM_SLOTS)
        ]
        self._held: int | None = None  # the slot this receiver holds a shared lock on
        self.last_policy_version: int | None = None

    def receive(self) -> tuple[int, dict[str, torch.Tensor]]:
        """Wait (bounded) for a version newer than the last received; return it as views valid until the next call."""
        self._release()
        deadline = time.monotonic() + self.timeout_s
        while True:
            slot = self._newest_slot()
            if slot is not None:
                try:
                    _lock(self._lock_fds[slot], fcntl.LOCK_SH, time.monotonic(), "")
                except TimeoutError:  # the sender is writing it right now
                    slot = None
            if slot is not None:
                version, checksum = _slot_stamp(self._data, slot, self.slot_bytes).tolist()
                if checksum != self.checksum:
                    fcntl.flock(self._lock_fds[slot], fcntl.LOCK_UN)
                    raise RuntimeError(f"shared-memory weight sync {self.region}: plan checksum {checksum} differs")
                if version != UNWRITTEN and self._is_new(version):
                    self._held = slot
                    self.last_policy_version = version
                    return version, dict(self._views[slot])
                fcntl.flock(self._lock_fds[slot], fcntl.LOCK_UN)
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"shared-memory weight sync {self.region}: no version newer than {self.last_policy_version} "
                    f"within {self.timeout_s:.0f}s"
                )
            time.sleep(POLL_INTERVAL_S)

    def _newest_slot(self) -> int | None:
        """The slot whose stamp (read without a lock: a hint, checked again under the lock) is newest and new."""
        versions = [int(_slot_stamp(self._data, slot, self.slot_bytes)[0]) for slot in range(NUM_SLOTS)]
        newest = max(range(NUM_SLOTS), key=lambda slot: versions[slot])
        return newest if versions[newest] != UNWRITTEN and self._is_new(versions[newest]) else None

    def _is_new(self, version: int) -> bool:
        return self.last_policy_version is None or version > self.last_policy_version

    def _release(self) -> None:
        if self._held is not None:
            fcntl.flock(self._lock_fds[self._held], fcntl.LOCK_UN)
            self._held = None

    def close(self) -> None:
        self._release()
        for fd in self._lock_fds:
            os.close(fd)
        self._lock_fds = []


def host_shared_memory(region: str | Path, state_dict: Mapping[str, torch.Tensor], timeout_s: float):
    """The sender of ``region`` for state dicts shaped like ``state_dict``."""
    return SharedMemorySender(region, WeightLayout.from_state_dict(state_dict), timeout_s)
