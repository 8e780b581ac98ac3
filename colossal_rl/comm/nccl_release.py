"""The one NCCL release both environments run, and the check that every weight-sync member runs it.

Why this exists: the trainers' torch 2.5.1 (CUDA 12.4) brings NCCL 2.21.5; the GPU producers' torch 2.13 (the one
``vllm`` 0.32 resolves to on the public index, a CUDA 13 build) brings NCCL 2.29.7. NCCL compares every peer's
version when a communicator forms and refuses a mismatch ("Mismatched NCCL version detected"), and its bootstrap
differs between those releases, so a weight-sync group mixing them fails or hangs at the first sync. The producers'
release cannot go down (there is no CUDA 13 build of 2.21.5), so the trainers' side goes up: their GPU actors preload
the CUDA 12 build of the producers' release (``trainer_nccl.py``), and both sides then run ``NCCL_RELEASE``.
``tests/contract/test_nccl_release_wheels.py`` holds the resolved metadata of both environments to it.

Before a torch NCCL group forms (``process_group.create_standalone_group``: the ``torch`` weight-sync transport),
every member reports the release its process has loaded through the group's store and a mismatch ends the run in one
line naming both (``check_one_release``), instead of NCCL's hang or abort. The ``ray_nccl`` transport has no store to
exchange them through; there each side is held to ``NCCL_RELEASE`` before the actors start instead (the trainers'
nodes by ``trainer_nccl.check_trainer_nccl_on_nodes``, the vLLM producers' environment by its build's self-check):
``comm/ray_nccl_group.py`` says why.

Importing this module needs no torch; ``loaded_nccl_version`` imports it when called.
"""

from __future__ import annotations

import ctypes
import datetime
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

NCCL_RELEASE = "2.29.7"
"""The NCCL release every NCCL weight-sync member runs: what ``vllm`` 0.32.0's torch 2.13 (CUDA 13) pins."""
PRODUCER_NCCL_PACKAGE = "nvidia-nccl-cu13"
"""The producers' NCCL wheel (pinned by their torch; ``producer_env_constraints_gpu.txt`` holds the resolved set)."""
TRAINER_NCCL_PACKAGE = "nvidia-nccl-cu12"
"""The trainers' NCCL wheel: the CUDA 12 build (their torch 2.5.1 is CUDA 12.4) of the same release."""
NCCL_SONAME = "libnccl.so.2"
TRAINER_BASE_NCCL = "2.21.5"
"""What torch 2.5.1 itself pins (``nvidia-nccl-cu12==2.21.5``): the release the preload replaces."""


class NcclVersionMismatchError(RuntimeError):
    """Members of one NCCL group run different NCCL releases: the communicator would fail or hang."""


def version_string(version: int | tuple[int, ...] | str) -> str:
    """``2.29.7`` from ``(2, 29, 7)``, from NCCL's version code (``22907``; ``2907`` before 2.9) or from a string."""
    if isinstance(version, str):
        return version
    if isinstance(version, tuple):
        return ".".join(str(part) for part in version)
    if version >= 10000:  # NCCL_VERSION(X, Y, Z) = X * 10000 + Y * 100 + Z since 2.9
        return f"{version // 10000}.{version % 10000 // 100}.{version % 100}"
    return f"{version // 1000}.{version % 1000 // 100}.{version % 100}"


def loaded_nccl_version() -> str | None:
    """The NCCL release this process runs: ``ncclGetVersion`` of the ``libnccl.so.2`` it has loaded (no GPU needed);
    None for a torch built without NCCL (CPU builds).

    Not ``torch.cuda.nccl.version()``: in torch 2.5.1 that is the release torch was *compiled* against (2.21.5), even
    when the trainers' preload (``trainer_nccl.py``) replaced the library the process actually calls."""
    import torch

    if not torch.distributed.is_nccl_available():
        return None
    try:  # torch's CUDA library has loaded libnccl.so.2 by now; RTLD_NOLOAD finds that one, never another
        library = ctypes.CDLL(NCCL_SONAME, mode=os.RTLD_NOLOAD)
    except OSError:  # linked statically (some source builds): the compiled-in release is the one that runs
        return version_string(torch.cuda.nccl.version())
    return _ask_version(library, NCCL_SONAME)


def loaded_nccl_library() -> str | None:
    """The file of the ``libnccl.so.2`` mapped into this process (Linux), for messages; None if none is."""
    try:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            for line in maps:
                if NCCL_SONAME in line:
                    return line.split()[-1]
    except OSError:
        return None
    return None


def library_version(path: str | Path) -> str:
    """The release of the NCCL library at ``path``, asked of the library itself (``ncclGetVersion``; no GPU)."""
    return _ask_version(ctypes.CDLL(str(path), mode=ctypes.RTLD_LOCAL), str(path))


def _ask_version(library: ctypes.CDLL, where: str) -> str:
    code = ctypes.c_int()
    if library.ncclGetVersion(ctypes.byref(code)) != 0:
        raise RuntimeError(f"ncclGetVersion failed in {where}")
    return version_string(code.value)


def check_one_release(reports: Mapping[int, tuple[str, str | None]], *, group: str) -> None:
    """``reports[rank] = (who, release)`` of every member of NCCL group ``group``: raise
    ``NcclVersionMismatchError`` in one line naming the first two members that differ (or a member without NCCL)."""
    ranks = sorted(reports)
    first_who, first_release = reports[ranks[0]]
    for rank in ranks:
        who, release = reports[rank]
        if release is None:
            raise NcclVersionMismatchError(
                f"weight-sync group {group!r}: rank {rank} ({who}) has no NCCL (a CPU torch) but the group is NCCL; "
                f"every member needs NCCL {NCCL_RELEASE}"
            )
        if release != first_release:
            raise NcclVersionMismatchError(
                f"weight-sync group {group!r}: NCCL {first_release} on rank {ranks[0]} ({first_who}) but NCCL "
                f"{release} on rank {rank} ({who}); both sides must run NCCL {NCCL_RELEASE} (docs/gpu.md, 'NCCL')"
            )


def exchange_releases(
    store: Any, *, rank: int, world_size: int, who: str, release: str | None, timeout_s: float
) -> dict[int, tuple[str, str | None]]:
    """Publish this member's ``(who, release)`` in the group's ``store`` and read every member's (each waits at
    most ``timeout_s`` for the others' keys, and returns only once every member has read); the reports, by rank."""
    store.set(f"nccl_release/{rank}", json.dumps([who, release]))
    keys = [f"nccl_release/{member}" for member in range(world_size)]
    store.wait(keys, datetime.timedelta(seconds=timeout_s))
    reports = {}
    for member, key in enumerate(keys):
        member_who, member_release = json.loads(store.get(key))
        reports[member] = (member_who, member_release)
    # Everyone has read before anyone goes on: rank 0 hosts the store, and a mismatch makes it raise and drop the
    # store, which would turn the others' reads into connection errors instead of the one-line mismatch.
    store.set(f"nccl_release_read/{rank}", "1")
    try:
        store.wait(
            [f"nccl_release_read/{member}" for member in range(world_size)], datetime.timedelta(seconds=timeout_s)
        )
    except _store_connection_lost() as error:
        if rank == 0:
            raise error
        # The host (rank 0) saw every read and went on, dropping the store (a mismatch makes it raise at once)
        # before this member's wait heard back. Every report was read above: the check below needs nothing more.
    return reports


def _store_connection_lost() -> type[Exception]:
    """torch's error for a store whose host went away (imported here: importing this module needs no torch)."""
    from torch.distributed import DistNetworkError

    return DistNetworkError
