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
timeout — see ``StandaloneGroup.wait``). It needs no named Ray actor for rendezvous and no cupy
(``cupy-cuda12x``, in the ``gpu`` extra, serves the Ray transport only), and it is as independent of the
default process group as Ray's NCCL groups (it is never registered with ``init_process_group``), so
it lives next to ColossalAI's group in a trainer and next to vLLM's own tensor-parallel group in a
producer.

NCCL timeouts, in order. Every NCCL collective has two clocks, both counting from when it was enqueued:
1. ours, ``timeout_s``: ``wait`` polls the ``Work`` and at the deadline aborts the communicator (its kernels
   return) and raises ``CollectiveTimeoutError``, which the driver's recovery handles (a new group);
2. NCCL's watchdog, ``timeout_s + WATCHDOG_GRACE_S``: the backstop for a collective nobody waits on. With
   torch's default ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` it tears the whole process down, so it must never fire
   first: its grace covers the poll pause, the abort itself and an interpreter busy elsewhere.
The communicator itself forms under the same deadline: NCCL creates it lazily inside the first collective,
blocking and with no ``Work`` to poll, so a stalled bootstrap would wedge the caller (a vLLM worker's RPC loop).
``create_standalone_group`` therefore runs a one-element all-reduce in a daemon thread right away and waits for it
with the deadline (``_form_communicator``). torch's nonblocking init (``TORCH_NCCL_USE_COMM_NONBLOCKING``) is not
used: it is a process-wide switch that would also change ColossalAI's and vLLM's own groups. Before any of that,
every member reports its NCCL release through the group's store and a mismatch ends the run in one line
(``nccl_release.check_one_release``) instead of NCCL's hang or abort.

Aborting an NCCL communicator is spelled differently per torch: 2.5 (the trainers') has
``ProcessGroupNCCL._shutdown()``, 2.13 (the producers', inside vLLM workers) has ``abort()`` and ``shutdown()``.
``ABORT_METHODS`` lists them by preference (``abort`` first: ``shutdown`` may wait for the stuck kernel); a torch
offering none is refused when the group is created. The NCCL branch is written for GPU machines; CPU tests drive
it with fake process groups that have the real signatures.

This module holds no model or weight logic (that is ``weight_sync/``) and imports no Ray.
"""

from __future__ import annotations

import contextlib
import contextvars
import datetime
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Literal, Protocol

import torch
import torch.distributed as dist

from colossal_rl.comm.nccl_release import check_one_release, exchange_releases, loaded_nccl_version

logger = logging.getLogger(__name__)

Backend = Literal["gloo", "nccl"]
_POLL_PAUSE_S = 0.01
"""Longest pause between two polls of an NCCL collective's completion."""
WATCHDOG_GRACE_S = 60.0
"""How much later than our deadline NCCL's watchdog fires: it must never fire first (it ends the process), so it
covers the last poll pause, the abort (``ncclCommAbort`` of a wedged communicator can take seconds) and a Python
thread kept from the GIL (a vLLM worker busy elsewhere)."""
ABORT_METHODS = ("abort", "_shutdown", "shutdown")
"""How a torch ``ProcessGroupNCCL`` is aborted, by preference: torch 2.13 ``abort``; torch 2.5 ``_shutdown`` (which
aborts); ``shutdown`` last, since in torch 2.13 it may first wait for the stuck kernel."""
Clock = Callable[[], float]
MEMBERS_KEY = "colossal_rl/members"
"""The counter in a group's store that every member adds itself to on joining (``gather_members``)."""
MEMBERS_POLL_S = 0.1
"""Pause between two looks at the member count while a group forms."""


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


class FormationAbandoned(CollectiveError):
    """This member stopped waiting for the others to join: its caller gave the formation up (a member died)."""


_formation_abandoned: contextvars.ContextVar[Callable[[], bool]] = contextvars.ContextVar(
    "formation_abandoned", default=lambda: False
)


@contextlib.contextmanager
def formations_abandoned_when(abandoned: Callable[[], bool]) -> Iterator[None]:
    """Groups formed inside this block (this thread) stop waiting for missing members once ``abandoned()`` is
    true, raising ``FormationAbandoned``. A Ray actor passes "my call was cancelled": the driver cancels a
    formation a member died in, and the members already waiting (the trainer hosting the group) are free for the
    next one at once, instead of after ``--timeout``."""
    token = _formation_abandoned.set(abandoned)
    try:
        yield
    finally:
        _formation_abandoned.reset(token)


def gather_members(
    store: dist.Store,
    *,
    rank: int,
    world_size: int,
    timeout_s: float,
    name: str,
    clock: Clock = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> None:
    """Add this member to the group's count in ``store`` and wait until all ``world_size`` have joined: at most
    ``timeout_s`` (``CollectiveTimeoutError``), and only while the formation is not abandoned
    (``formations_abandoned_when``; ``FormationAbandoned``). With every member present, the process group's own
    rendezvous after this does not wait on an absent one."""
    abandoned = _formation_abandoned.get()
    deadline = clock() + timeout_s
    joined = store.add(MEMBERS_KEY, 1)
    while joined < world_size:
        if abandoned():
            raise FormationAbandoned(
                f"group {name!r}: rank {rank} stopped waiting with {joined} of {world_size} members joined: the "
                "formation was abandoned (a member died)"
            )
        if clock() >= deadline:
            raise CollectiveTimeoutError(
                f"group {name!r}: rank {rank} could not gather all {world_size} members within {timeout_s:.1f}s "
                f"({joined} joined)"
            )
        sleep(MEMBERS_POLL_S)
        joined = store.add(MEMBERS_KEY, 0)


def abort_method_name(process_group: Any) -> str | None:
    """The name of the first of ``ABORT_METHODS`` that ``process_group`` (an instance or a class) offers; None if
    it offers none (then a collective stuck on it could never be ended)."""
    for name in ABORT_METHODS:
        if callable(getattr(process_group, name, None)):
            return name
    return None


def abort_nccl(process_group: Any, owner: str) -> None:
    """Abort ``process_group``'s communicators so that kernels stuck in a collective return; failures are logged
    (a communicator already broken has nothing left to release), and a torch offering no way to abort is logged
    as an error: that process's GPU stays busy until it exits."""
    name = abort_method_name(process_group)
    if name is None:
        logger.error(
            "%s: cannot abort the NCCL communicator: torch %s's %s offers none of %s; its kernels keep the GPU busy "
            "until this process exits",
            owner, torch.__version__, type(process_group).__name__, ", ".join(ABORT_METHODS),
        )  # fmt: skip
        return
    try:
        getattr(process_group, name)()
    except Exception as error:  # already broken: nothing more to release
        logger.warning("%s: aborting the NCCL communicator (%s) failed: %s", owner, name, error)


def completes_by(work: dist.Work, deadline: float, clock: Clock) -> bool:
    """Poll an NCCL ``work`` (whose ``wait`` does not block) until it completes or ``clock()`` reaches ``deadline``."""
    pause = 1e-4
    while not work.is_completed():
        if clock() >= deadline:
            return False
        time.sleep(pause)
        pause = min(pause * 2, _POLL_PAUSE_S)
    return True


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

    def __init__(self, work: dist.Work, group: StandaloneGroup, what: str, enqueued: float):
        self._work = work
        self._group = group
        self._what = what
        self._enqueued = enqueued  # the deadline counts from here, as NCCL's watchdog does

    def wait(self) -> None:
        self._group.wait(self._work, self._what, enqueued=self._enqueued)


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
        clock: Clock = time.monotonic,
    ):
        self._process_group: dist.ProcessGroup | None = process_group
        self.store = store  # prefixed with the group's name; usable for small one-off exchanges
        self.backend = backend
        self.name = name
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        self._clock = clock

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
        enqueued = self._clock()
        work = self.process_group.broadcast([tensor], options)
        return PendingWork(work, self, f"broadcast of {tensor.numel()} x {tensor.dtype} from {src}", enqueued)

    def all_reduce_max(self, tensor: torch.Tensor) -> None:
        """Replace ``tensor`` in place by its element-wise maximum over all members (with the timeout)."""
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MAX
        enqueued = self._clock()
        work = self.process_group.allreduce([tensor], options)
        self.wait(work, f"all-reduce (max) of {tensor.numel()} x {tensor.dtype}", enqueued=enqueued)

    def barrier(self) -> None:
        enqueued = self._clock()
        if self.backend == "gloo":
            work = self.process_group.barrier()
        else:  # NCCL's barrier picks a device from global state; an all-reduce of one element needs none.
            work = self.process_group.allreduce([torch.zeros(1, device="cuda")])
        self.wait(work, "barrier", enqueued=enqueued)

    def wait(self, work: dist.Work, what: str, *, enqueued: float | None = None) -> None:
        """Wait for ``work`` at most the group's timeout; raise ``CollectiveTimeoutError`` / ``CollectiveError``.

        gloo: ``Work.wait(timeout)`` blocks and raises on the timeout. NCCL: it does not — without blocking wait
        it only makes the current CUDA stream wait for NCCL's, returning at once, and any later CUDA work of this
        process would then queue behind a broadcast that may never finish. So on NCCL the work is polled
        (``is_completed``) against the deadline, waited on only once complete, and on timeout the communicator
        is aborted (its kernels return) before the error is raised. The NCCL deadline counts from ``enqueued`` (the
        ``clock()`` before the collective was enqueued; default now), as the watchdog's does, so that ours always
        fires first (module docstring) even for a pipelined broadcast waited on long after it was enqueued."""
        if self.backend == "nccl":
            self._poll(work, what, self._clock() if enqueued is None else enqueued)
        try:
            work.wait(datetime.timedelta(seconds=self.timeout_s))
        except RuntimeError as error:
            if "timed out" in str(error).lower() or "timeout" in str(error).lower():
                raise self._timed_out(what) from error
            self._release_members()
            raise CollectiveError(f"{self!r}: {what} failed ({error}); a member probably died") from error

    def _poll(self, work: dist.Work, what: str, enqueued: float) -> None:
        if not completes_by(work, enqueued + self.timeout_s, self._clock):
            self._abort()
            raise self._timed_out(what)

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
        if process_group is not None:
            abort_nccl(process_group, repr(self))

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
    device: torch.device | str | None = None,
) -> StandaloneGroup:
    """Form a group of ``world_size`` members; every member calls this concurrently.

    Rank 0 hosts a ``TCPStore`` on ``port`` (its ``host`` is the address the others connect to);
    pass ``store`` instead to share one store among several groups, which then need distinct
    ``name``s. Blocks until all members have joined (``gather_members``), at most ``timeout_s`` seconds and
    only while the formation is not abandoned (``formations_abandoned_when``). For nccl the
    caller must have set the CUDA device first (or pass ``device``); the members' NCCL releases are
    compared and the communicator is formed here, each within ``timeout_s`` (module docstring).
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        if store is None:  # rank 0 does not wait for the others here: gather_members does, and can be abandoned
            store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout, wait_for_workers=False)
        group_store = group_store_for(store, name)
        gather_members(group_store, rank=rank, world_size=world_size, timeout_s=timeout_s, name=name)
        if backend == "nccl":
            _check_nccl_releases(
                group_store, rank=rank, world_size=world_size, group=name, timeout_s=timeout_s,
                release=loaded_nccl_version(),
            )  # fmt: skip
        process_group = _make_process_group(backend, group_store, rank, world_size, timeout, name=name, device=device)
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


def group_store_for(store: dist.Store, name: str) -> dist.Store:
    """The part of ``store`` that group ``name`` uses (several groups may share one store)."""
    return dist.PrefixStore(f"colossal_rl/{name}", store)


def _check_nccl_releases(
    store: dist.Store, *, rank: int, world_size: int, group: str, timeout_s: float, release: str | None
) -> None:
    """Before an NCCL communicator forms: every member publishes its NCCL ``release`` in the group's ``store`` and
    a mismatch raises ``NcclVersionMismatchError`` in one line naming both members, on every member (NCCL itself
    would refuse or hang)."""
    who = f"{socket.gethostname()} pid {os.getpid()} torch {torch.__version__}"
    reports = exchange_releases(store, rank=rank, world_size=world_size, who=who, release=release, timeout_s=timeout_s)
    check_one_release(reports, group=group)


def _make_process_group(
    backend: Backend,
    store: dist.Store,
    rank: int,
    world_size: int,
    timeout: datetime.timedelta,
    *,
    name: str = "weight_sync",
    device: torch.device | str | None = None,
    nccl_factory: Any = None,
    clock: Clock = time.monotonic,
) -> dist.ProcessGroup:
    """The torch process group of one member. For nccl, ``nccl_factory`` (default torch's ``ProcessGroupNCCL``)
    builds it with the watchdog ``WATCHDOG_GRACE_S`` behind our deadline, and its communicator is formed within
    ``timeout`` on ``device`` (default the current CUDA device) by ``clock``."""
    if backend == "gloo":
        # gloo enforces this timeout on every operation itself, independently of Work.wait's.
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)
    if backend != "nccl":
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    factory = dist.ProcessGroupNCCL if nccl_factory is None else nccl_factory
    if abort_method_name(factory) is None:  # a timed-out collective could never be ended: refuse now, not then
        raise CollectiveError(
            f"group {name!r}: torch {torch.__version__}'s {factory.__name__} offers none of {', '.join(ABORT_METHODS)}"
        )
    options = factory.Options()
    options._timeout = timeout + datetime.timedelta(seconds=WATCHDOG_GRACE_S)  # ours first, then the watchdog's
    process_group = factory(store, rank, world_size, options)
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device())  # explicit: the warm-up runs in another thread
    _form_communicator(process_group, device=device, timeout_s=timeout.total_seconds(), name=name, clock=clock)
    return process_group


def _form_communicator(
    process_group: Any, *, device: torch.device | str, timeout_s: float, name: str, clock: Clock
) -> None:
    """Create ``process_group``'s NCCL communicator now, within ``timeout_s``: NCCL forms it lazily inside the first
    collective, blocking, with no ``Work`` to poll. A one-element all-reduce in a daemon thread forms it; on timeout
    the process group is aborted and ``CollectiveTimeoutError`` raised (a bootstrap stuck in NCCL's socket calls
    may keep that thread, which does not keep the process alive)."""
    deadline = clock() + timeout_s
    outcome: dict[str, Any] = {}

    def warm_up() -> None:
        try:
            outcome["work"] = process_group.allreduce([torch.zeros(1, device=device)])
        except Exception as error:  # noqa: BLE001 - handed to the waiting thread
            outcome["error"] = error

    thread = threading.Thread(target=warm_up, name=f"nccl-init-{name}", daemon=True)
    thread.start()
    while thread.is_alive() and clock() < deadline:
        thread.join(_POLL_PAUSE_S)
    if "error" in outcome:
        abort_nccl(process_group, f"group {name!r}")
        raise CollectiveError(f"group {name!r}: forming the NCCL communicator failed: {outcome['error']}")
    if "work" not in outcome or not completes_by(outcome["work"], deadline, clock):
        abort_nccl(process_group, f"group {name!r}")
        raise CollectiveTimeoutError(
            f"group {name!r}: the NCCL communicator did not form within {timeout_s:.1f}s (a member is dead, slow, "
            "or cannot reach the others); destroy this group"
        )
