"""Standalone collective groups that never touch torch.distributed's default process group.

A trainer already runs ColossalAI on the default group; a weight-sync group with the producers
must not join, replace or split that group (Ray's gloo collectives do, silently giving the group
the wrong members). So a ``StandaloneGroup`` is a torch ``ProcessGroup`` built directly over its
own ``TCPStore`` — rank 0 hosts the store, every other member connects to ``host:port`` — and is
never registered with ``init_process_group``/``new_group``. Several such groups (for example one
per pipeline stage) can live in one process, each with its own store or a shared store under
different names.

Every collective waits at most ``timeout_s``: a member that never joins or never enters a
collective makes the others raise ``CollectiveTimeoutError`` rather than hang; a member that dies
makes them raise ``CollectiveError``: the first member that sees the death leaves the group at once,
so members waiting on it fail too rather than wait out the timeout. After either, the group is
unusable: destroy it and build a new one.

Backends. ``Collective`` is the small interface the weight sync is written against; a
``StandaloneGroup`` implements it for both backends, which differ in one constructor call
(``_make_process_group``) and in how a barrier is spelled. gloo carries CPU tensors; NCCL carries
CUDA tensors and is chosen whenever the weights live on a GPU (``backend_for_device``). For NCCL the
default weight-sync transport is torch's own ``ProcessGroupNCCL`` over the same standalone
``TCPStore``; Ray's cupy NCCL collectives are the opt-in alternative (``ray_nccl_group.py``, chosen
in ``weight_sync/transports.py``). torch's is the default because it shares everything but those two lines
with gloo: the same rendezvous (rank 0's store, ``host:port`` handed out through a Ray call), and
the same per-operation timeout (every broadcast is an asynchronous ``Work``, which the bucketed sender
pipelines on: gloo's ``wait(timeout)`` raises instead of hanging; NCCL's ``wait`` only orders CUDA streams,
so an NCCL ``Work`` is polled with ``is_completed`` against the deadline and the communicator aborted on
timeout — see ``StandaloneGroup.wait``; NCCL's watchdog gets the same timeout). It needs no named Ray actor for rendezvous and no cupy (``cupy-cuda12x``, in the ``gpu``
extra, serves the Ray transport only), and it is as independent of the
default process group as Ray's NCCL groups (it is never registered with ``init_process_group``), so
it lives next to ColossalAI's group in a trainer and next to vLLM's own tensor-parallel group in a
producer. The NCCL branch is written for GPU machines and has not run on the CPU-only CI.

This module holds no model or weight logic (that is ``weight_sync/``) and imports no Ray.
"""

from __future__ import annotations

import datetime
import logging
import socket
import time
from typing import Literal, Protocol

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

Backend = Literal["gloo", "nccl"]
_POLL_PAUSE_S = 0.01
"""Longest pause between two polls of an NCCL collective's completion."""


def backend_for_device(device: torch.device | str) -> Backend:
    """NCCL for CUDA tensors, gloo for everything else: the one place the backend is chosen."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def device_for_backend(backend: Backend) -> str:
    """Where tensors must live to travel over ``backend`` (``cuda`` is the current CUDA device)."""
    return "cuda" if backend == "nccl" else "cpu"


def default_device() -> str:
    """The device every weight-sync member uses: its GPU if it has one (Ray gives GPU actors their GPUs).

    The one place that decides it, for the sender (a trainer, or a test's in-process sender) and every receiver (a
    producer, or each vLLM worker): the wire backend follows the device (``backend_for_device``), so a sender on
    ``cpu`` (gloo) and a receiver on ``cuda`` (NCCL) would join one group with two backends and wait out the
    timeout. Take the device from here on both sides rather than passing ``"cpu"`` or relying on a default."""
    return "cuda" if torch.cuda.is_available() else "cpu"


class CollectiveError(RuntimeError):
    """A collective of a standalone group failed (typically a member died); the group is unusable."""


class CollectiveTimeoutError(CollectiveError, TimeoutError):
    """A standalone group could not form, or one of its collectives did not finish, in time."""


def find_free_port() -> int:
    """A TCP port that was free a moment ago (another process may still take it before we bind)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


class PendingCollective(Protocol):
    """An asynchronous collective of any ``Collective``; ``wait()`` blocks at most the group's timeout."""

    def wait(self) -> None: ...


class PendingWork:
    """A ``StandaloneGroup``'s asynchronous collective: a torch ``Work`` waited on with the group's timeout."""

    def __init__(self, work: dist.Work, group: StandaloneGroup, what: str):
        self._work = work
        self._group = group
        self._what = what

    def wait(self) -> None:
        self._group.wait(self._work, self._what)


class Collective(Protocol):
    """What the weight sync needs from a group: broadcasts and a max all-reduce with a timeout, a barrier, closing."""

    backend: Backend
    rank: int
    world_size: int

    def broadcast(self, tensor: torch.Tensor, src: int) -> None: ...

    def broadcast_async(self, tensor: torch.Tensor, src: int) -> PendingCollective: ...

    def all_reduce_max(self, tensor: torch.Tensor) -> None: ...

    def barrier(self) -> None: ...

    def close(self) -> None: ...


class StandaloneGroup:
    """A process group of ``world_size`` members identified by ``name``; see the module docstring."""

    def __init__(
        self,
        process_group: dist.ProcessGroup,
        store: dist.Store,
        *,
        backend: Backend,
        name: str,
        rank: int,
        world_size: int,
        timeout_s: float,
    ):
        self._process_group: dist.ProcessGroup | None = process_group
        self.store = store  # prefixed with the group's name; usable for small one-off exchanges
        self.backend = backend
        self.name = name
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s

    def __repr__(self) -> str:
        return f"StandaloneGroup({self.name!r}, backend={self.backend}, rank={self.rank}/{self.world_size})"

    @property
    def process_group(self) -> dist.ProcessGroup:
        if self._process_group is None:
            raise RuntimeError(f"{self!r} was destroyed")
        return self._process_group

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        """Broadcast ``tensor`` in place from member ``src``, waiting at most the group's timeout."""
        self.broadcast_async(tensor, src).wait()

    def broadcast_async(self, tensor: torch.Tensor, src: int) -> PendingWork:
        """Start a broadcast; keep ``tensor`` untouched until the returned handle's ``wait()``."""
        options = dist.BroadcastOptions()
        options.rootRank = src
        options.rootTensor = 0
        work = self.process_group.broadcast([tensor], options)
        return PendingWork(work, self, f"broadcast of {tensor.numel()} x {tensor.dtype} from {src}")

    def all_reduce_max(self, tensor: torch.Tensor) -> None:
        """Replace ``tensor`` in place by its element-wise maximum over all members (with the timeout)."""
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MAX
        work = self.process_group.allreduce([tensor], options)
        self.wait(work, f"all-reduce (max) of {tensor.numel()} x {tensor.dtype}")

    def barrier(self) -> None:
        if self.backend == "gloo":
            work = self.process_group.barrier()
        else:  # NCCL's barrier picks a device from global state; an all-reduce of one element needs none.
            work = self.process_group.allreduce([torch.zeros(1, device="cuda")])
        self.wait(work, "barrier")

    def wait(self, work: dist.Work, what: str) -> None:
        """Wait for ``work`` at most the group's timeout; raise ``CollectiveTimeoutError`` / ``CollectiveError``.

        gloo: ``Work.wait(timeout)`` blocks and raises on the timeout. NCCL: it does not — without blocking wait
        it only makes the current CUDA stream wait for NCCL's, returning at once, and any later CUDA work of this
        process would then queue behind a broadcast that may never finish. So on NCCL the work is polled
        (``is_completed``) against the deadline, waited on only once complete, and on timeout the communicator
        is aborted (its kernels return) before the error is raised."""
        if self.backend == "nccl":
            self._poll(work, what)
        try:
            work.wait(datetime.timedelta(seconds=self.timeout_s))
        except RuntimeError as error:
            if "timed out" in str(error).lower() or "timeout" in str(error).lower():
                raise self._timed_out(what) from error
            self._release_members()
            raise CollectiveError(f"{self!r}: {what} failed ({error}); a member probably died") from error

    def _poll(self, work: dist.Work, what: str) -> None:
        deadline = time.monotonic() + self.timeout_s
        pause = 1e-4
        while not work.is_completed():
            if time.monotonic() >= deadline:
                self._abort()
                raise self._timed_out(what)
            time.sleep(pause)
            pause = min(pause * 2, _POLL_PAUSE_S)

    def _release_members(self) -> None:
        """After a failed collective (a member died), leave the group at once: gloo closes this member's
        connections, so members still waiting on it (a broadcast tree's subtree below the dead member) fail now
        instead of waiting out the timeout (``--timeout``, 600 s by default); NCCL aborts its communicator."""
        if self.backend == "nccl":
            self._abort()
        else:
            self._process_group = None

    def _timed_out(self, what: str) -> CollectiveTimeoutError:
        return CollectiveTimeoutError(
            f"{self!r}: {what} did not finish within {self.timeout_s:.1f}s "
            "(a member is dead, slow, or not calling the same collective); destroy this group"
        )

    def _abort(self) -> None:
        """Abort an NCCL communicator stuck in a collective (its kernels return; the group is unusable after)."""
        process_group, self._process_group = self._process_group, None
        if process_group is None:
            return
        try:
            process_group._shutdown()  # torch 2.5's ProcessGroupNCCL: aborts its communicators
        except Exception as error:  # already broken: nothing more to release
            logger.warning("%r: aborting the NCCL communicator failed: %s", self, error)

    def destroy(self) -> None:
        """Drop the process group and the store (rank 0 closes the store's server). Idempotent."""
        self._process_group = None
        self.store = None  # type: ignore[assignment]

    def close(self) -> None:
        """Same as ``destroy``: the name the ``Collective`` interface uses."""
        self.destroy()


def create_standalone_group(
    backend: Backend,
    rank: int,
    world_size: int,
    host: str,
    port: int,
    timeout_s: float,
    *,
    name: str = "weight_sync",
    store: dist.Store | None = None,
) -> StandaloneGroup:
    """Form a group of ``world_size`` members; every member calls this concurrently.

    Rank 0 hosts a ``TCPStore`` on ``port`` (its ``host`` is the address the others connect to);
    pass ``store`` instead to share one store among several groups, which then need distinct
    ``name``s. Blocks until all members have joined, at most ``timeout_s`` seconds. For nccl the
    caller must have set the CUDA device first.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        if store is None:
            store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout)
        group_store = dist.PrefixStore(f"colossal_rl/{name}", store)
        process_group = _make_process_group(backend, group_store, rank, world_size, timeout)
    except dist.DistStoreError as error:
        raise CollectiveTimeoutError(
            f"group {name!r} ({backend}, {host}:{port}): rank {rank} could not gather all {world_size} members "
            f"within {timeout_s:.1f}s"
        ) from error
    logger.info("joined standalone %s group %r as rank %d/%d via %s:%d", backend, name, rank, world_size, host, port)
    return StandaloneGroup(
        process_group,
        group_store,
        backend=backend,
        name=name,
        rank=rank,
        world_size=world_size,
        timeout_s=timeout_s,
    )


def _make_process_group(
    backend: Backend, store: dist.Store, rank: int, world_size: int, timeout: datetime.timedelta
) -> dist.ProcessGroup:
    if backend == "gloo":
        # gloo enforces this timeout on every operation itself, independently of Work.wait's.
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)
    if backend == "nccl":  # Written for GPU machines; cannot run on the CPU-only CI.
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world_size, options)
    raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
