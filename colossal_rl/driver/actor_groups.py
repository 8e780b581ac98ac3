"""The driver's view of its actors: one group of producers, one of trainers, and creating them.

A group's methods are the remote calls the driver makes, each named once here, and each returns
:data:`~colossal_rl.driver.calls.Calls`: ``(who, ref)`` pairs that ``calls.gather`` waits for. Torch-free: the
driver imports it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import ray

from colossal_rl.driver.calls import ActorId, Call, Calls


class ActorGroup:
    """Actors of one kind, by rank."""

    kind = "actor"

    def __init__(self, actors: Sequence[Any]):
        self.actors = list(actors)

    def __len__(self) -> int:
        return len(self.actors)

    def __iter__(self) -> Iterator[Any]:
        return iter(self.actors)

    def __getitem__(self, rank: int) -> Any:
        return self.actors[rank]

    @property
    def names(self) -> list[str]:
        return [f"{self.kind} {rank}" for rank in range(len(self.actors))]

    def _each(self, label: str, call: Callable[[Any], ray.ObjectRef], ranks: Sequence[int] | None = None) -> Calls:
        """``call(actor)`` on every actor (or on ``ranks``), each named for messages."""
        ranks = range(len(self.actors)) if ranks is None else ranks
        return [
            Call(ActorId(self.kind, rank), label, call(self.actors[rank]), lambda rank=rank: call(self.actors[rank]))
            for rank in ranks
        ]

    def drain_phases(self) -> Calls:
        return self._each("drain_phases", lambda actor: actor.drain_phases.remote())

    def shutdown(self) -> list[ray.ObjectRef]:
        return [actor.shutdown.remote() for actor in self.actors]


class ProducerGroup(ActorGroup):
    kind = "producer"

    def ready(self, ranks: Sequence[int] | None = None) -> Calls:
        return self._each("ready", lambda actor: actor.ready.remote(), ranks)

    def restore_weights(self, ranks: Sequence[int], policy_version: int, stage_weights: list) -> Calls:
        """Give restarted producers the weights of ``policy_version`` (each sync stage's retained object)."""
        return self._each(
            "restore_weights", lambda actor: actor.restore_weights.remote(policy_version, *stage_weights), ranks
        )

    def join_weight_sync(self, routes_by_producer: list) -> Calls:
        """``routes_by_producer[rank]``: that producer's ``ReceiveRoute`` of every stage (``comm/weight_sync/modes.py``)."""
        return self._each("join_weight_sync", lambda actor: actor.join_weight_sync.remote(routes_by_producer))

    def produce_chunk(self, order, buffer) -> Calls:
        """Order ``order`` (``schedule/events.ChunkOrder``) on its producer."""
        chunk = (order.chunk_id, list(order.rows), buffer, order.policy_version, order.sampling_seed_index)
        return self._each("produce_chunk", lambda actor: actor.produce_chunk.remote(*chunk), [order.producer_rank])

    def receive_weights(self, policy_version: int) -> Calls:
        return self._each("receive_weights", lambda actor: actor.receive_weights.remote(policy_version))

    def evaluate(self, min_version: int = 0) -> Calls:
        return self._each("evaluate", lambda actor: actor.evaluate.remote(min_version))


class TrainerGroup(ActorGroup):
    kind = "trainer"

    def setup(self) -> Calls:
        """Trainer 0 opens the rendezvous store first (binding its port); every rank's setup waits for that port
        (an object ref argument) and starts the process group on it."""
        port = self.actors[0].host_rendezvous.remote()
        return self._each("setup", lambda actor: actor.setup.remote(port))

    def weight_sync_address(self, ranks: Sequence[int]) -> Calls:
        return self._each("weight_sync_address", lambda actor: actor.weight_sync_address.remote(), ranks)

    def setup_weight_sync(self, routes: list, retain: bool) -> Calls:
        """``routes[stage]``: the ``SendRoute`` of each pipeline stage (``comm/weight_sync/modes.py``)."""
        return self._each("setup_weight_sync", lambda actor: actor.setup_weight_sync.remote(routes, retain))

    def set_total_steps(self, total_steps: int) -> Calls:
        return self._each("set_total_steps", lambda actor: actor.set_total_steps.remote(total_steps))

    def train_steps(self, first_step: int, trainer_version: int, shares: list, sample_step: int | None) -> Calls:
        """``shares[step][dp_rank]``: the ``GroupRef``s that data-parallel rank trains in that step (the same list
        goes to every rank)."""
        train = (first_step, trainer_version, shares, sample_step)
        return self._each("train_steps", lambda actor: actor.train_steps.remote(*train))

    def push_weights(self, policy_version: int) -> Calls:
        return self._each("push_weights", lambda actor: actor.push_weights.remote(policy_version))

    def save_checkpoint(self, directory: str) -> Calls:
        return self._each("save_checkpoint", lambda actor: actor.save_checkpoint.remote(directory))

    def load_checkpoint(self, directory: str, policy_version: int) -> Calls:
        return self._each("load_checkpoint", lambda actor: actor.load_checkpoint.remote(directory, policy_version))

    def export_model(self, directory: str) -> Calls:
        return self._each("export_model", lambda actor: actor.export_model.remote(directory))


def chunks_in_flight(config) -> int:
    """Chunks the stream loop orders to one producer at a time: one running and one queued; with continuous
    batching (one prompt a chunk) twice the engine's prompt slots, so a freed slot always finds a prompt waiting."""
    return 2 * config.generation.microbatch_size if config.generation.continuous_batching else 2


def producer_concurrency(config) -> int:
    """Calls a producer runs at once: 1 (in order) unless continuous batching, whose chunks (up to
    :func:`chunks_in_flight`) feed one shared engine, beside a sync, an eval and small calls."""
    if not config.generation.continuous_batching:
        return 1
    return chunks_in_flight(config) + 4


def actor_environments(backend: str, *, on_gpu: bool, trainer_backend: str = "colossalai") -> tuple[dict, dict]:
    """Extra Ray options of the trainers and of the producers: the environment each runs in.

    ``-b vllm`` producers run in the producers' environment (its interpreter). With ``--trainer-backend fsdp2`` every
    actor does (trainers, transformers-backend producers, reward actors): it is the environment whose transformers
    loads the model, and one torch with one NCCL serves every collective. Otherwise the rest runs in the trainers'
    environment, which on GPU machines preloads the producers' NCCL release (``trainer_nccl.py``) — the trainers, and
    transformers-backend producers too, since they share the trainers' weight-sync groups. vLLM producers never get
    that preload: it is the CUDA 12 build, and their torch is CUDA 13 with the same release of its own."""
    from colossal_rl.producer_env import producer_runtime_env, producers_environment
    from colossal_rl.trainer_nccl import trainer_runtime_env

    if trainer_backend == "fsdp2":
        everywhere = producers_environment()
        return everywhere, everywhere
    trainer_env = trainer_runtime_env(on_gpu)
    producer_env = producer_runtime_env(backend)
    return trainer_env, (producer_env if backend == "vllm" else trainer_env)


def spawn_actors(config) -> tuple[Any, ProducerGroup, TrainerGroup, list]:
    """Create the run's buffer, producers, trainers and reward actors (``-rt model``, a local judge) where the
    placement puts them (not waiting for them)."""
    from colossal_rl.driver.actors import BufferActor, ProducerActor, RewardModelActor, TrainerActor
    from colossal_rl.driver.placement import actor_options, threads_per_actor, trainer_master_port, trainers_use_gpus
    from colossal_rl.producer_env import check_interpreter_on_nodes

    sched, par = config.schedule, config.parallel
    producer_threads, trainer_threads = threads_per_actor(
        os.cpu_count() or 1, sched.num_producers, par.num_trainers, config.run.producer_threads,
        config.run.trainer_threads,
    )  # fmt: skip
    buffer = BufferActor.remote()
    master_port = trainer_master_port(config.run.master_port, joins_cluster=config.run.master_address is not None)
    ray_nodes = ray.nodes()
    placement = actor_options(
        ray_nodes,
        num_producers=sched.num_producers,
        producer_gpus=config.generation.tensor_parallel_size,
        num_trainers=par.num_trainers,
        num_reward_actors=config.reward.num_reward_actors,
    )
    # vLLM producers run in their own Python environment (colossal_rl/producer_env.py); a restart reuses it.
    trainer_env, producer_env = actor_environments(
        config.generation.backend,
        on_gpu=trainers_use_gpus(ray_nodes),
        trainer_backend=config.parallel.trainer_backend,
    )
    if producer_env.get("runtime_env", {}).get("py_executable") and config.run.master_address:  # on every node?
        nodes = placement.producer_nodes
        if trainer_env is producer_env:  # fsdp2: the trainers' nodes need that interpreter too
            nodes = list(dict.fromkeys(nodes + [(node["NodeID"], node["NodeManagerAddress"]) for node in ray_nodes
                                                if node.get("Alive")]))  # fmt: skip
        check_interpreter_on_nodes(producer_env["runtime_env"]["py_executable"], nodes, config.run.timeout_s)
    trainers = TrainerGroup(
        TrainerActor.options(**placement.trainers[rank], **trainer_env).remote(
            rank, par.num_trainers, config, placement.trainer_master_address, master_port, trainer_threads
        )
        for rank in range(par.num_trainers)
    )
    reward_actors = [  # in the trainers' environment (transformers); restarted by Ray, asked again by producers
        RewardModelActor.options(
            **placement.reward_actors[index],
            max_restarts=config.run.max_actor_restarts,
            max_task_retries=0,
            **trainer_env,
        ).remote(index, config, trainer_threads)  # fmt: skip
        for index in range(config.reward.num_reward_actors)
    ]
    producers = ProducerGroup(
        # A producer that dies is restarted by Ray (constructor again, same arguments); its calls in flight fail
        # and the driver re-issues them once it has its weights back (``producer_restarts.py``).
        ProducerActor.options(
            **placement.producers[rank],
            max_restarts=config.run.max_actor_restarts,
            max_task_retries=0,
            max_concurrency=producer_concurrency(config),
            **producer_env,
        ).remote(rank, config, producer_threads, reward_actors)  # fmt: skip
        for rank in range(sched.num_producers)
    )
    return buffer, producers, trainers, reward_actors
