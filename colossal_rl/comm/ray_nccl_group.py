"""Ray's cupy-based NCCL collective group as a weight-sync ``Collective`` (``--weight-sync-backend ray_nccl``).

The alternative to the torch ``StandaloneGroup`` (``process_group.py``); ``weight_sync/transports.py`` chooses
between them. Written for GPU machines, not run on a GPU: everything up to the calls into
``ray.util.collective`` and the CUDA runtime is unit-tested on CPU with fakes of those two.

What the pinned Ray offers (read in ``ray/util/collective/`` of the installed wheel):

- Built on cupy, independent of torch.distributed. ``collective_group/nccl_collective_group.py``
  ``NCCLGroup`` drives ``cupy.cuda.nccl.NcclCommunicator`` (``nccl_util.create_nccl_communicator``);
  nothing under ``ray/util/collective/`` calls torch.distributed — torch only lends a tensor's pointer,
  element count, dtype and device (``nccl_util.get_tensor_ptr`` and neighbours). So the group lives
  beside ColossalAI's default process group in a trainer and beside vLLM's own groups in a producer.
  (Ray 2.40's *gloo* group, ``gloo_collective_group.py`` ``GLOOGroup``, is built on ``pygloo``, which
  ``ray[default]`` does not install; FACTS.md's "Ray's gloo group rides on torch's default group" was
  measured on Ray 2.60.) Importing ``ray.util.collective`` without cupy only logs "NCCL seems
  unavailable" and makes ``nccl_available()`` false (``collective.py``), hence the lazy import here.
- Rendezvous. Every member calls ``init_collective_group(world_size, rank, backend="nccl",
  group_name=...)`` (``collective.py``; inside a Ray actor, ``_check_inside_actor``), which only
  registers the group. The NCCL communicator is made on the first collective
  (``NCCLGroup._get_nccl_collective_communicator``): rank 0 stores a fresh NCCL unique id in a
  *detached named actor* (``_generate_nccl_uid``, ``util.NCCLUniqueIDStore``, named
  ``sha1("<gpu index>@<group name>")`` by ``const.get_store_name``); the others poll for that actor and
  its id (``Rendezvous.meet`` / ``get_nccl_id``: once a second, at most 180 s each, not settable through
  the public API), then all construct ``NcclCommunicator``, which blocks until every member has.
  ``destroy_collective_group`` on rank 0 kills the store actor (``_destroy_store``). The driver-side
  ``create_collective_group(actors, world_size, ranks, ...)`` instead leaves the ranks in another
  detached actor (``info_<group name>``) that members read on their first collective; we do not use
  it: each member already gets its rank and the world size from the driver's call, exactly as for
  the torch group. Store actors are named after the group, so our group name carries the sender's
  ``host:port`` (fresh per run): a store left behind by a crashed run is never met by a new one.
- Timeouts: none for collectives. ``NCCLGroup`` never reads the ``timeout_ms`` fields of
  ``types.BroadcastOptions`` / ``types.AllReduceOptions``, and ``NcclCommunicator`` construction has no
  deadline.
- Asynchrony: ``broadcast``/``allreduce`` return once the NCCL kernel is enqueued on a stream of Ray's
  pool (``cuda_stream.StreamPool``: cupy streams created *blocking*, ``non_blocking=False``); before it,
  Ray makes that stream wait for cupy's current stream (``NCCLGroup._sync_streams``), after it nothing.
  No work handle is returned.
- Operations our ``Collective`` needs: ``broadcast(tensor, src_rank, group_name)``,
  ``allreduce(tensor, group_name, op=ReduceOp.MAX)``, ``destroy_collective_group(group_name)`` (a
  barrier is our one-element all-reduce, as for the torch NCCL group). uint8 and int64 — all the weight
  sync sends — are in ``nccl_util.TORCH_NCCL_DTYPE_MAP``. Ray checks neither that a tensor is contiguous
  (it sends ``numel`` elements from ``data_ptr()``) nor that it is on the device the group already
  uses (another device silently gets another communicator): we check both.

How every wait gets a deadline here. Each group has one daemon worker thread that makes its Ray
calls in submission order (collectives must be issued in the same order on every member); after
each call returns, the worker records a CUDA event on the device's default stream. torch's default
stream is CUDA's legacy default stream, which synchronises with every blocking stream, so the event
completes only after Ray's NCCL kernel — and our earlier copies on that stream complete before the
kernel starts. ``wait()`` waits for the worker with the time left, then polls the event until the
deadline (``timeout_s`` from the call to ``wait``) and raises ``CollectiveTimeoutError`` past it.
That bounds the first collective (rendezvous and communicator construction, run inside
``create_ray_nccl_group`` like ``create_standalone_group`` gathers its members) and every transfer.
Callers must issue work on torch's default stream (checked on every call), or the ordering above
does not hold. After a timeout or failure the group is unusable: later calls raise at once, and
``close()`` leaves Ray's communicator alone (its kernel may still hold the GPU stream until the
process ends; after a failed wait the driver kills every actor).

NCCL releases are not compared member against member here, unlike the torch group
(``process_group._check_nccl_releases``): Ray's rendezvous passes only NCCL's unique id through its store actor,
and the group has no store of ours to publish releases in (a ``TCPStore`` on the sender's address would be a
second rendezvous beside Ray's, for this check alone). cupy-cuda12x bundles no NCCL: it calls the
``libnccl.so.2`` its process loaded, torch's, so each side's release is its environment's, checked before the
actors start: the trainers' nodes run their preload and report ``NCCL_RELEASE``
(``trainer_nccl.check_trainer_nccl_on_nodes``), and a GPU producers' environment whose torch runs another
release fails its build's self-check (``producer_env.torch_build_problem``). A producer interpreter given by
``COLOSSAL_RL_PRODUCER_PYTHON`` is not checked that way; NCCL then refuses a mismatch itself ("Mismatched NCCL
version detected"), without our one-line message.

This module holds no weight logic and imports neither Ray nor cupy at import time.
"""

from __future__ import annotations

import importlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeoutError
from types import ModuleType
from typing import Any, Protocol

import torch

from colossal_rl.comm.process_group import Backend, CollectiveError, CollectiveTimeoutError

logger = logging.getLogger(__name__)

# The dtypes ray.util.collective maps to NCCL types (nccl_util.TORCH_NCCL_DTYPE_MAP; bf16 only if cupy's nccl has it).
NCCL_DTYPES = frozenset(
    {
        torch.bool,
        torch.uint8,
        torch.int8,
        torch.int32,
        torch.int64,
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
    }
)
_FIRST_POLL_S = 50e-6
_MAX_POLL_S = 5e-3


def ray_group_name(name: str, host: str, port: int) -> str:
    """The name of the Ray collective group (and, hashed, of its store actor): unique per sender address."""
    return f"colossal_rl/{name}@{host}:{port}"


def import_ray_collective() -> ModuleType:
    """``ray.util.collective``, imported when first needed (it tries to import cupy)."""
    return importlib.import_module("ray.util.collective")


class Completion(Protocol):
    def query(self) -> bool:
        """True once all work recorded before this point has finished on the device."""
        ...


class CudaEvents:
    """The CUDA runtime calls of a ``RayNcclGroup``: stream discipline and completion events."""

    def check_default_stream(self, device: torch.device) -> None:
        if torch.cuda.current_stream(device) != torch.cuda.default_stream(device):
            raise RuntimeError(
                f"Ray's NCCL weight sync needs work on {device}'s default stream (its ordering with Ray's "
                "NCCL streams relies on the legacy default stream); this call runs inside torch.cuda.stream(...)"
            )

    def record(self, device: torch.device) -> Completion:
        event = torch.cuda.Event()
        event.record(torch.cuda.default_stream(device))
        return event


DEFAULT_CUDA = CudaEvents()


class OrderedWorker:
    """One daemon thread running submitted calls in order; a stuck call never blocks interpreter exit."""

    def __init__(self, name: str):
        self._calls: queue.SimpleQueue[tuple[Callable[[], Any], Future] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, call: Callable[[], Any]) -> Future:
        future: Future = Future()
        self._calls.put((call, future))
        return future

    def stop(self) -> None:
        """Let the thread end after the calls already submitted (returns at once)."""
        self._calls.put(None)

    def _run(self) -> None:
        while (item := self._calls.get()) is not None:
            call, future = item
            try:
                future.set_result(call())
            except BaseException as error:  # noqa: BLE001 - handed to whoever waits on the future
                future.set_exception(error)


class PendingRayCollective:
    """A collective submitted to a ``RayNcclGroup``; ``wait()`` blocks at most the group's timeout."""

    def __init__(self, future: Future, group: RayNcclGroup, what: str, tensor: torch.Tensor):
        self._future = future
        self._group = group
        self._what = what
        self._tensor = tensor  # Ray does not record it on its stream: keep it alive until the kernel is done

    def wait(self) -> None:
        self._group.wait(self._future, self._what)
        self._tensor = None  # type: ignore[assignment]


class RayNcclGroup:
    """A ``Collective`` over a ``ray.util.collective`` NCCL group; see the module docstring.

    ``collective`` is the ``ray.util.collective`` module and ``cuda`` the CUDA runtime calls, both
    replaceable so that everything up to them runs without a GPU.
    """

    backend: Backend = "nccl"

    def __init__(
        self,
        *,
        name: str,
        group_name: str,
        rank: int,
        world_size: int,
        device: torch.device,
        timeout_s: float,
        collective: ModuleType | Any,
        cuda: CudaEvents = DEFAULT_CUDA,
    ):
        if device.type != "cuda" or device.index is None:
            raise ValueError(f"a Ray NCCL group needs a CUDA device with an index, got {device}")
        self.name = name
        self.group_name = group_name
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.timeout_s = timeout_s
        self._collective = collective
        self._cuda = cuda
        self._worker = OrderedWorker(f"ray-nccl-{name}")
        self._problem: str | None = None  # set once the group is unusable
        self._closed = False

    def __repr__(self) -> str:
        return f"RayNcclGroup({self.name!r}, rank={self.rank}/{self.world_size}, {self.device})"

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        """Broadcast ``tensor`` in place from member ``src``, waiting at most the group's timeout."""
        self.broadcast_async(tensor, src).wait()

    def broadcast_async(self, tensor: torch.Tensor, src: int) -> PendingRayCollective:
        """Start a broadcast; keep ``tensor`` untouched until the returned handle's ``wait()``."""
        if not 0 <= src < self.world_size:
            raise ValueError(f"{self!r}: broadcast source {src} is not a member")
        what = f"broadcast of {tensor.numel()} x {tensor.dtype} from {src}"
        return self._submit(
            tensor, what, lambda: self._collective.broadcast(tensor, src_rank=src, group_name=self.group_name)
        )

    def all_reduce_max(self, tensor: torch.Tensor) -> None:
        """Replace ``tensor`` in place by its element-wise maximum over all members (with the timeout)."""
        maximum = self._collective.types.ReduceOp.MAX
        what = f"all-reduce (max) of {tensor.numel()} x {tensor.dtype}"
        self._submit(
            tensor, what, lambda: self._collective.allreduce(tensor, group_name=self.group_name, op=maximum)
        ).wait()

    def barrier(self) -> None:
        self.all_reduce_max(torch.zeros(1, dtype=torch.int32, device=self.device))

    def close(self) -> None:
        """Destroy Ray's group (rank 0 also removes the store actor), at most ``timeout_s``. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._problem is None:
            future = self._worker.submit(lambda: self._collective.destroy_collective_group(group_name=self.group_name))
            try:
                future.result(timeout=self.timeout_s)
            except FutureTimeoutError:
                logger.warning("%r: destroying Ray's NCCL group took over %.1fs; left behind", self, self.timeout_s)
            except Exception as error:  # closing is best effort: the process may be going away
                logger.warning("%r: destroying Ray's NCCL group failed: %s", self, error)
        else:
            logger.warning("%r: unusable (%s); Ray's communicator is left to the process's exit", self, self._problem)
        self._problem = self._problem or "closed"
        self._worker.stop()

    def wait(self, future: Future, what: str) -> None:
        """Wait for a submitted call and then its CUDA completion, together at most ``timeout_s``."""
        deadline = time.monotonic() + self.timeout_s
        try:
            completion = future.result(timeout=self.timeout_s)
        except FutureTimeoutError:
            raise self._timed_out(what, "Ray's call did not return") from None
        except Exception as error:
            self._problem = f"{what} failed: {error}"
            raise CollectiveError(f"{self!r}: {what} failed ({error}); destroy this group") from error
        pause = _FIRST_POLL_S
        while not completion.query():
            if time.monotonic() >= deadline:
                raise self._timed_out(what, "the NCCL kernel did not finish")
            time.sleep(pause)
            pause = min(2 * pause, _MAX_POLL_S)

    def _submit(self, tensor: torch.Tensor, what: str, call: Callable[[], None]) -> PendingRayCollective:
        if self._problem is not None:
            raise CollectiveError(f"{self!r} is unusable ({self._problem}); destroy it and build a new one")
        self._check_tensor(tensor)
        self._cuda.check_default_stream(self.device)

        def call_and_record() -> Completion:
            call()
            return self._cuda.record(self.device)

        return PendingRayCollective(self._worker.submit(call_and_record), self, what, tensor)

    def _check_tensor(self, tensor: torch.Tensor) -> None:
        if tensor.device != self.device:
            raise ValueError(
                f"{self!r}: Ray's NCCL collectives take tensors on the group's device {self.device}, got one on "
                f"{tensor.device}"
            )
        if not tensor.is_contiguous():
            raise ValueError(f"{self!r}: Ray's NCCL collectives send data_ptr() .. numel(): pass a contiguous tensor")
        if tensor.dtype not in NCCL_DTYPES:
            raise ValueError(f"{self!r}: ray.util.collective has no NCCL type for {tensor.dtype}")

    def _timed_out(self, what: str, stage: str) -> CollectiveTimeoutError:
        self._problem = f"{what} timed out"
        return CollectiveTimeoutError(
            f"{self!r}: {what} did not finish within {self.timeout_s:.1f}s ({stage}: a member is dead, slow, or "
            "not calling the same collective); destroy this group"
        )


def create_ray_nccl_group(
    rank: int,
    world_size: int,
    host: str,
    port: int,
    timeout_s: float,
    *,
    name: str,
    device: torch.device | str,
    collective: ModuleType | Any | None = None,
    cuda: CudaEvents | None = None,
) -> RayNcclGroup:
    """Form a Ray NCCL group of ``world_size`` members; every member calls this concurrently in its actor.

    ``host:port`` is the sender's weight-sync address: here it only makes the group's name unique.
    Blocks until all members have built the communicator, at most ``timeout_s`` seconds. ``device``
    is this member's GPU (``cuda`` means the current one).
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    collective = collective if collective is not None else import_ray_collective()
    if not collective.nccl_available():
        raise CollectiveError(
            "--weight-sync-backend ray_nccl: ray.util.collective reports NCCL unavailable (it needs cupy: "
            'pip install -e ".[gpu]" installs cupy-cuda12x)'
        )
    group_name = ray_group_name(name, host, port)
    collective.init_collective_group(world_size, rank, backend="nccl", group_name=group_name)
    group = RayNcclGroup(
        name=name,
        group_name=group_name,
        rank=rank,
        world_size=world_size,
        device=device,
        timeout_s=timeout_s,
        collective=collective,
        cuda=cuda or DEFAULT_CUDA,
    )
    try:
        group.barrier()  # makes the NCCL communicator now, under the deadline, instead of in the first sync
    except CollectiveTimeoutError as error:
        raise CollectiveTimeoutError(
            f"Ray NCCL group {group_name!r}: rank {rank} could not gather all {world_size} members within "
            f"{timeout_s:.1f}s"
        ) from error
    logger.info("joined Ray NCCL group %r as rank %d/%d on %s", group_name, rank, world_size, device)
    return group
