"""Which node each producer and trainer runs on, decided from the cluster's nodes by pure functions.

On GPUs: a producer takes ``-ptp`` GPUs of one node (its vLLM tensor-parallel workers must share a
node) and a trainer takes one GPU. GPUs are handed out in node order — the head node first, then
the others by address — producers first, so producers fill the lower nodes and trainers the
higher ones (on one node, Ray picks which GPU ids each actor gets). Each actor is pinned
to its node with a hard ``NodeAffinitySchedulingStrategy`` and asks Ray for its GPUs, which makes
Ray set ``CUDA_VISIBLE_DEVICES`` for it. Ray placement groups are not used: inside one, vLLM would
switch to its Ray executor and ask Ray for GPUs the producer already holds.

On a cluster without GPUs the same order is applied to CPUs, as a soft preference: actors ask for no
GPUs and Ray may place them elsewhere rather than wait (a CPU actor only needs a CPU to start).

``plan_placement`` is plain data in, plain data out; ``ActorPlacement.ray_options`` builds the
``.options(...)`` keyword arguments (importing Ray only then).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from colossal_rl.comm.weight_sync.stages import GPU_ONLY_TRANSPORTS
from colossal_rl.node_probes import Node, RunOnNodes, describe, run_on_nodes, unique_nodes

if TYPE_CHECKING:
    from colossal_rl.config import RLConfig

logger = logging.getLogger(__name__)

HEAD_NODE_RESOURCE = "node:__internal_head__"
LOCAL_ADDRESS = "127.0.0.1"


class PlacementError(ValueError):
    """The cluster cannot hold the requested producers and trainers; the message gives the numbers."""


@dataclass(frozen=True)
class NodeInfo:
    node_id: str
    address: str
    num_cpus: int
    num_gpus: int
    is_head: bool


@dataclass(frozen=True)
class ActorPlacement:
    node_id: str
    address: str
    num_gpus: int
    hard: bool
    """True: the actor runs on ``node_id`` or not at all (GPUs); False: a preference (CPUs)."""

    def ray_options(self) -> dict[str, Any]:
        """Keyword arguments for ``ActorClass.options(...)``."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        return {
            "num_gpus": self.num_gpus,
            "scheduling_strategy": NodeAffinitySchedulingStrategy(node_id=self.node_id, soft=not self.hard),
        }


@dataclass(frozen=True)
class Placement:
    producers: tuple[ActorPlacement, ...]
    trainers: tuple[ActorPlacement, ...]
    uses_gpus: bool
    reward_actors: tuple[ActorPlacement, ...] = ()
    """``-rt model``: the reward-model actors (``--reward-actors``), one GPU each where there are GPUs."""

    @property
    def trainer_master_address(self) -> str:
        """Where the trainers' process group meets: loopback if they share a node, else trainer 0's node."""
        if len({trainer.node_id for trainer in self.trainers}) <= 1:
            return LOCAL_ADDRESS
        return self.trainers[0].address


CLUSTER_MASTER_PORT = 29506
"""The trainers' rendezvous port on a cluster when ``--master_port`` is not given (ColossalChat's default)."""


ANY_FREE_PORT = 0
"""``trainer_master_port`` on a local run: trainer 0 binds a free port itself when it opens the rendezvous store
(``Trainer.host_rendezvous``) and the others learn it from that call. A port chosen free by the driver and bound
seconds later by trainer 0 could be taken in between (CI once saw another process's listener answer there)."""


def trainer_master_port(master_port: int | None, *, joins_cluster: bool) -> int:
    """The trainers' rendezvous port: ``master_port`` when given; else ``ANY_FREE_PORT`` when Ray runs locally
    (every actor is on this machine, and runs side by side never collide), or ``CLUSTER_MASTER_PORT`` on a
    cluster (ColossalChat's fixed port, for clusters whose firewalls open known ports only)."""
    if master_port is not None:
        return master_port
    return CLUSTER_MASTER_PORT if joins_cluster else ANY_FREE_PORT


def threads_per_actor(
    cpu_count: int,
    num_producers: int,
    num_trainers: int,
    producer_threads: int | None = None,
    trainer_threads: int | None = None,
) -> tuple[int, int]:
    """(producer, trainer) torch intra-op threads: the given counts, else ``cpu_count`` split evenly (>= 1).

    On a small CPU machine every actor shares the same cores, and more threads than cores slows all of
    them (spinning OpenMP workers), so the default never oversubscribes.
    """
    even = max(1, cpu_count // (num_producers + num_trainers))
    return producer_threads or even, trainer_threads or even


def alive_nodes(ray_nodes: Iterable[Mapping[str, Any]]) -> list[NodeInfo]:
    """Alive nodes of ``ray.nodes()`` in placement order: the head node first, then by address and id."""
    nodes = [
        NodeInfo(
            node_id=node["NodeID"],
            address=node.get("NodeManagerAddress", LOCAL_ADDRESS),
            num_cpus=int(node.get("Resources", {}).get("CPU", 0)),
            num_gpus=int(node.get("Resources", {}).get("GPU", 0)),
            is_head=HEAD_NODE_RESOURCE in node.get("Resources", {}),
        )
        for node in ray_nodes
        if node.get("Alive", False)
    ]
    return sorted(nodes, key=lambda n: (not n.is_head, n.address, n.node_id))


def trainers_use_gpus(ray_nodes: Iterable[Mapping[str, Any]]) -> bool:
    """Whether the actors get GPUs: some alive node has one (``plan_placement`` then places every actor on GPUs)."""
    return any(node.num_gpus > 0 for node in alive_nodes(ray_nodes))


def resolve_precision_for_cluster(config: RLConfig, ray_nodes: Iterable[Mapping[str, Any]]) -> RLConfig:
    """``config`` with ``--precision auto`` resolved for the trainers' device on this cluster (bf16 on GPUs, fp32
    on CPUs); a precision the layout cannot train in is a :class:`PlacementError` naming the flag."""
    from colossal_rl.config import ConfigError, with_device_precision
    from colossal_rl.flags import flag_for

    try:
        return with_device_precision(config, on_gpu=trainers_use_gpus(ray_nodes))
    except ConfigError as error:
        raise PlacementError(f"{flag_for(error.field_path)}: {error.message}") from None


def resolve_sync_mode_for_cluster(
    config: RLConfig, ray_nodes: Iterable[Mapping[str, Any]], run: RunOnNodes = run_on_nodes
) -> RLConfig:
    """``config`` with ``--weight-sync-mode auto`` resolved for this cluster (``config.resolve_weight_sync_mode``):
    ``shm`` on GPUs only where the shared-memory region fits every trainer node's ``/dev/shm``
    (:func:`shm_shortfall`, asked of the nodes through ``run``), else the broadcast, said in one warning line."""
    from colossal_rl.config import resolve_weight_sync_mode

    ray_nodes = list(ray_nodes)
    mode = resolve_weight_sync_mode(config.run.weight_sync_mode, on_gpu=trainers_use_gpus(ray_nodes))
    if mode == "shm" and config.run.weight_sync_mode == "auto":
        shortfall = shm_shortfall(config, ray_nodes, run)
        if shortfall is not None:
            logger.warning("--weight-sync-mode auto takes the broadcast, not shm: %s", shortfall)
            mode = "broadcast"
    if mode == config.run.weight_sync_mode:
        return config
    return dataclasses.replace(config, run=dataclasses.replace(config.run, weight_sync_mode=mode))


def shm_shortfall(config: RLConfig, ray_nodes: Iterable[Mapping[str, Any]], run: RunOnNodes) -> str | None:
    """Where the shared-memory region (two copies of the weights in the training precision: an upper bound for
    any one node, which holds one region per pipeline stage it sends) would not fit ``/dev/shm``, in one line; None
    where it fits on every trainer node, or where the checkpoint's size cannot be read here (the sender still
    reserves its region up front and refuses in one line)."""
    from colossal_rl.comm.weight_sync.shared_memory import NUM_SLOTS, SHM_ROOT, free_bytes, more_shared_memory
    from colossal_rl.config import resolve_precision
    from colossal_rl.model_size import checkpoint_parameter_count

    parameters = checkpoint_parameter_count(config.model.path)
    if parameters is None:
        logger.info("the size of %s is not known here: shm's room is checked by the sender", config.model.path)
        return None
    precision = resolve_precision(config.parallel.precision, on_gpu=True)
    needed = NUM_SLOTS * parameters * (4 if precision == "fp32" else 2)
    nodes = trainer_nodes(config, ray_nodes)
    free = run(free_bytes, nodes, (str(SHM_ROOT),), config.run.timeout_s)
    short = [
        f"{describe(node)} has {room / 1e9:.2f} GB" for node, room in zip(nodes, free, strict=True) if room < needed
    ]
    if not short:
        return None
    return (
        f"the region needs {needed / 1e9:.2f} GB of {SHM_ROOT} (two copies of the weights) and {'; '.join(short)} "
        f"free; for shm give the trainers' containers more shared memory ({more_shared_memory(needed)})"
    )


def placement_for(config: RLConfig, ray_nodes: Iterable[Mapping[str, Any]]) -> Placement:
    """Where ``config``'s actors go on this cluster (what ``actor_options`` gives ``spawn_actors``)."""
    return plan_placement(
        alive_nodes(ray_nodes), num_producers=config.schedule.num_producers,
        producer_gpus=config.generation.tensor_parallel_size, num_trainers=config.parallel.num_trainers,
        num_reward_actors=config.reward.num_reward_actors,
    )  # fmt: skip


def nodes_of(actors: Iterable[ActorPlacement]) -> list[Node]:
    """(node id, address) of the nodes ``actors`` are placed on, each once, in order."""
    return unique_nodes([(actor.node_id, actor.address) for actor in actors])


def trainer_nodes(config: RLConfig, ray_nodes: Iterable[Mapping[str, Any]]) -> list[Node]:
    """(node id, address) of the nodes the trainers are placed on, each once, in order."""
    return nodes_of(placement_for(config, ray_nodes).trainers)


def check_transport_for_cluster(transport: str, ray_nodes: Iterable[Mapping[str, Any]]) -> None:
    """Before any actor starts: a GPU-only transport needs GPU placement (some alive node has GPUs)."""
    if transport in GPU_ONLY_TRANSPORTS and not trainers_use_gpus(ray_nodes):
        raise PlacementError(
            f"--weight-sync-backend {transport} needs GPUs (it carries CUDA tensors only); the Ray cluster has "
            "none: use --weight-sync-backend torch"
        )


def plan_placement(
    nodes: list[NodeInfo], *, num_producers: int, producer_gpus: int, num_trainers: int, num_reward_actors: int = 0
) -> Placement:
    """Producers (``producer_gpus`` GPUs each, on one node), trainers (1 GPU each), then reward-model actors (1 GPU
    each), first fit in node order."""
    if not nodes:
        raise PlacementError("the Ray cluster has no alive nodes")
    if any(node.num_gpus > 0 for node in nodes):
        return _plan_gpus(nodes, num_producers, producer_gpus, num_trainers, num_reward_actors)
    if producer_gpus > 1:
        raise PlacementError(f"-ptp {producer_gpus}: tensor-parallel producers need GPUs; the cluster has none")
    return _plan_cpus(nodes, num_producers, num_trainers, num_reward_actors)


def _plan_gpus(
    nodes: list[NodeInfo], num_producers: int, producer_gpus: int, num_trainers: int, num_reward_actors: int = 0
) -> Placement:
    free = [node.num_gpus for node in nodes]

    def take(count: int, what: str) -> ActorPlacement:
        for index, node in enumerate(nodes):
            if free[index] >= count:
                free[index] -= count
                return ActorPlacement(node.node_id, node.address, count, hard=True)
        wanted = num_producers * producer_gpus + num_trainers + num_reward_actors
        rewards = f" + {num_reward_actors} reward actors x 1 GPU" if num_reward_actors else ""
        raise PlacementError(
            f"no node has {count} free GPU(s) for {what}: {num_producers} producers x {producer_gpus} GPUs "
            f"(one node each) + {num_trainers} trainers x 1 GPU{rewards} = {wanted} "
            f"GPUs wanted; the nodes have {[node.num_gpus for node in nodes]} GPUs"
        )

    producers = tuple(take(producer_gpus, f"producer {rank}") for rank in range(num_producers))
    trainers = tuple(take(1, f"trainer {rank}") for rank in range(num_trainers))
    rewards = tuple(take(1, f"reward actor {index}") for index in range(num_reward_actors))
    return Placement(producers, trainers, uses_gpus=True, reward_actors=rewards)


def _plan_cpus(nodes: list[NodeInfo], num_producers: int, num_trainers: int, num_reward_actors: int = 0) -> Placement:
    """One CPU per actor in node order; past the cluster's CPUs the rest prefer the last node."""
    slots = [node for node in nodes for _ in range(max(node.num_cpus, 0))]
    wanted = num_producers + num_trainers + num_reward_actors
    slots += [nodes[-1]] * max(0, wanted - len(slots))
    chosen = [ActorPlacement(node.node_id, node.address, 0, hard=False) for node in slots[:wanted]]
    trainers_end = num_producers + num_trainers
    return Placement(
        tuple(chosen[:num_producers]), tuple(chosen[num_producers:trainers_end]), uses_gpus=False,
        reward_actors=tuple(chosen[trainers_end:]),
    )  # fmt: skip


@dataclass(frozen=True)
class ActorOptions:
    """``.options(...)`` keyword arguments per producer and per trainer rank, and the trainers' meeting address."""

    producers: list[dict[str, Any]]
    trainers: list[dict[str, Any]]
    trainer_master_address: str
    producer_nodes: list[tuple[str, str]]
    """(node id, address) of the nodes the producers are placed on (preferred, on CPUs), each once, in order."""
    reward_actors: list[dict[str, Any]] = field(default_factory=list)


def actor_options(
    ray_nodes: Iterable[Mapping[str, Any]],
    *,
    num_producers: int,
    producer_gpus: int,
    num_trainers: int,
    num_reward_actors: int = 0,
) -> ActorOptions:
    """From ``ray.nodes()`` to the options every actor is created with."""
    placement = plan_placement(
        alive_nodes(ray_nodes), num_producers=num_producers, producer_gpus=producer_gpus, num_trainers=num_trainers,
        num_reward_actors=num_reward_actors,
    )  # fmt: skip
    return ActorOptions(
        producers=[p.ray_options() for p in placement.producers],
        trainers=[t.ray_options() for t in placement.trainers],
        trainer_master_address=placement.trainer_master_address,
        producer_nodes=list(dict.fromkeys((p.node_id, p.address) for p in placement.producers)),
        reward_actors=[r.ray_options() for r in placement.reward_actors],
    )
